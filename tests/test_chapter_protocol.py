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
