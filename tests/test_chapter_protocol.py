"""The chapter protocol (chapters/base.py) on a toy chapter: order, memoisation, and the one-line findings."""
import pytest

from sinkbook.chapters.base import Chapter, finding, finding_of
from sinkbook.core.claims import Finding
from sinkbook.core.profiles import PROFILE_NAMES, Profiles

calls = []


def counted_finding(values, scale):
    """Sum times scale."""
    calls.append("counted")
    return Finding(f"sum {sum(values) * scale}")


class Toy(Chapter):
    NAME = "toy"
    PROFILES = Profiles({name: {"scale": 2} for name in PROFILE_NAMES})

    @property
    def values(self):
        return [1, 2, 3]

    @finding
    def first(self) -> Finding:
        calls.append("first")
        return Finding("first")

    counted = finding_of(counted_finding, "values", "settings.scale")

    @finding
    def last(self) -> Finding:
        return Finding("last")


def test_one_line_findings_take_their_place_and_their_inputs():
    assert Toy.FINDINGS == ("first", "counted", "last")
    chapter = Toy.from_parameters("default", scale=5)
    calls.clear()
    assert chapter.counted().title == "sum 30"            # values from the property, scale from the settings
    assert chapter.counted() is chapter.counted() and calls == ["counted"]
    assert Toy.counted.__name__ == "counted" and Toy.counted.__doc__ == "Sum times scale."
    assert list(chapter.findings()) == ["first", "counted", "last"] and calls == ["counted", "first"]
    assert set(chapter.timings) == {"first", "counted", "last"}


def test_a_finding_that_returns_something_else_is_refused():
    class Broken(Toy):
        wrong = finding_of(lambda: "not a finding")
    with pytest.raises(TypeError, match="Broken.wrong returned str"):
        Broken.from_parameters("default").wrong()


def test_gpu_local_is_the_gpu_profile_with_the_local_settings():
    profiles = Profiles({"quick": {"models": ["tiny-llama"], "steps": 1}, "default": {"models": ["m"], "steps": 10},
                         "gpu": {"models": ["Org/Big"], "steps": 1000}}, local={"models": ["m"]})
    assert profiles.names == ("quick", "default", "gpu", "gpu-local")
    assert profiles.resolve("gpu-local").values == {"models": ["m"], "steps": 1000}
    with pytest.raises(ValueError, match="local settings no profile has"):
        Profiles({"quick": {"a": 1}, "default": {"a": 1}, "gpu": {"a": 1}}, local={"b": 2})


def test_every_chapter_runs_gpu_local_on_the_shipped_models_at_the_gpu_budgets():
    import importlib

    from sinkbook.chapters import chapter_names
    from sinkbook.core.models import BUILTIN_MODELS

    def specs(value):                   # model specs: list items, or the keys of a per-model mapping
        if isinstance(value, dict):
            return list(value)
        if isinstance(value, (list, tuple)):
            return [s for v in value for s in specs(v)]
        return [value] if isinstance(value, str) else []

    for name in chapter_names():
        profiles = importlib.import_module(f"sinkbook.chapters.{name}").PROFILES
        gpu, local = profiles.table["gpu"], profiles.table["gpu-local"]
        hub = [s for s in specs(local) if "/" in s]
        assert not hub, f"{name}: gpu-local names hub models {hub}"
        changed = {k for k in gpu if gpu[k] != local[k]}
        assert all(set(specs(local[k])) <= set(BUILTIN_MODELS) for k in changed), (name, changed)
