"""The worked example of CONTRIBUTING.md, built from the file itself: the chapter module it shows imports and runs
over the chapter protocol, its parameters cell names exactly the profile's settings, its resolve cell makes the
chapter, and its registry row is a registry entry. If the guide drifts from the code, this fails."""
import ast
import importlib.util
import json
import re
import sys

import pytest

from sinkbook.chapters import ChapterEntry
from sinkbook.chapters.base import Chapter
from sinkbook.core.paths import REPO_ROOT
from sinkbook.core.profiles import SettingsError

GUIDE = REPO_ROOT / "CONTRIBUTING.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)


def _block(first_line: str) -> str:
    found = [b for b in _blocks() if b.startswith(first_line)]
    assert len(found) == 1, f"CONTRIBUTING.md has no single python block starting with {first_line!r}"
    return found[0]


@pytest.fixture
def example_module(monkeypatch):
    """The guide's chapter module, loaded as ``sinkbook.chapters.example`` without writing into the package."""
    source = _block('"""Chapter: an example')
    spec = importlib.util.spec_from_loader("sinkbook.chapters.example", loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "sinkbook.chapters"
    exec(compile(source, "CONTRIBUTING.md:example", "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, "sinkbook.chapters.example", module)
    return module


def test_the_worked_example_is_a_chapter_over_the_protocol(example_module, tmp_path):
    from sinkbook.book.results import write_results
    cls = example_module.ExampleChapter
    assert issubclass(cls, Chapter) and cls.NAME == example_module.NAME == "example"
    assert cls.FINDINGS == ("first_token",)
    namespace = {}
    exec(_block('profile = "default"       # quick for CI, default for the book\n'), namespace)
    assigned = [t.id for node in ast.parse(_block('profile = "default"       # quick for CI, default for the book\n')).body
                for t in node.targets]
    assert sorted(assigned) == sorted({"profile", "device", *example_module.PROFILES.keys})
    namespace["profile"] = "quick"
    resolve = _block("from sinkbook.book.display import show, show_claims\n").replace(
        "from sinkbook.chapters.example import ExampleChapter\n", "").replace("show(chapter.first_token())", "")
    namespace["ExampleChapter"] = cls
    exec(resolve, namespace)
    chapter = namespace["chapter"]
    results = chapter.results()
    assert [c.id for c in results["claims"]] == ["first_token_tiny_llama"]
    path = write_results(**results, directory=tmp_path)
    assert json.loads(path.read_text())["chapter"] == "example"


def test_the_worked_example_refuses_unknown_names(example_module):
    with pytest.raises(SettingsError, match=r"unknown parameter\(s\) \['census_prompt'\]"):
        example_module.ExampleChapter.from_notebook({"profile": "quick", "census_prompt": 3})


def test_the_registry_row_of_the_guide_is_a_registry_entry():
    row = eval(_block("ChapterEntry(").strip(), {"ChapterEntry": ChapterEntry})
    assert row == ChapterEntry("example", "An example chapter")


def test_the_guide_names_every_layer_and_intervention_module():
    text = GUIDE.read_text()
    package = REPO_ROOT / "lib" / "sinkbook"
    for layer in ("core", "measures", "interventions", "training", "runs", "figures", "chapters", "book"):
        assert f"`{layer}/`" in text, layer
    interventions = sorted(p.stem for p in (package / "interventions").glob("*.py") if p.stem != "__init__")
    named = {"outro": "OutRo", "vscale": "V-scale", "zero_k": "Zero-K", "qknorm": "QK-norm", "protection":
             "protection", "lora": "LoRA", "merging": "merging", "quantise": "quantisation"}
    assert sorted(named) == interventions, "a new intervention module: name it in CONTRIBUTING.md and here"
    assert all(word in text for word in named.values())
