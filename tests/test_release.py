"""What a researcher needs to cite and reuse the project: the licences, a valid citation file whose version is the
package's, and a changelog that has a section for that version."""
from __future__ import annotations

import re
import tomllib

import yaml

from sinkbook.core.paths import REPO_ROOT

PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]


def _citation() -> dict:
    # YAML reads an unquoted date as a date object; CFF wants the string, so quote-free input would fail below
    return yaml.safe_load((REPO_ROOT / "CITATION.cff").read_text())


def test_citation_file_is_cff_1_2_with_the_package_version():
    cff = _citation()
    assert cff["cff-version"] == "1.2.0"
    for key in ("message", "title", "authors"):
        assert cff.get(key), f"CITATION.cff lacks the required key {key!r}"
    assert cff["version"] == VERSION, f"CITATION.cff says version {cff['version']}, pyproject.toml {VERSION}"
    assert isinstance(cff["date-released"], str) and re.fullmatch(r"\d{4}-\d{2}-\d{2}", cff["date-released"])
    for person in cff["authors"] + [a for ref in cff.get("references", []) for a in ref["authors"]]:
        assert person.get("name") or person.get("family-names"), f"an author without a name: {person}"


def test_licences_are_present_and_the_citation_names_the_code_licence():
    code = (REPO_ROOT / "LICENSE").read_text()
    prose = (REPO_ROOT / "LICENSE-docs").read_text()
    assert code.startswith("MIT License") and _citation()["license"] == "MIT"
    assert "creativecommons.org/licenses/by/4.0" in prose
    # the papers' tables are not ours to license: the prose licence must say whose they are
    assert "data/vl_paper" in prose and "remain the work of those papers' authors" in prose


def test_changelog_has_a_section_for_this_version():
    headings = re.findall(r"^## (\S+)", (REPO_ROOT / "CHANGELOG.md").read_text(), flags=re.M)
    assert VERSION in headings, f"CHANGELOG.md has no '## {VERSION}' section (it has {headings})"


CITE = re.compile(r"\{cite(?::\w+)?\}`([^`]+)`")


def _cited_keys() -> dict[str, str]:
    """key -> the first page that cites it, over the prose pages and the notebooks' markdown cells."""
    import json
    texts = {str(p.relative_to(REPO_ROOT)): p.read_text() for p in (REPO_ROOT / "book").glob("*.md")}
    for nb in (REPO_ROOT / "notebooks").glob("*.ipynb"):
        cells = json.loads(nb.read_text())["cells"]
        texts[str(nb.relative_to(REPO_ROOT))] = "\n".join("".join(c["source"]) for c in cells
                                                          if c["cell_type"] == "markdown")
    cited = {}
    for page, text in texts.items():
        for group in CITE.findall(text):
            for key in group.split(","):
                cited.setdefault(key.strip(), page)
    return cited


def test_every_citation_is_in_the_bibliography_and_every_entry_is_cited():
    from pybtex.database import parse_file
    entries = set(parse_file(str(REPO_ROOT / "book" / "references.bib")).entries)
    cited = _cited_keys()
    unknown = {key: page for key, page in cited.items() if key not in entries}
    assert not unknown, f"cited but not in book/references.bib: {unknown}"
    # the references page lists cited works only, so an entry nobody cites would silently vanish from the book
    assert not entries - set(cited), f"in book/references.bib but never cited: {sorted(entries - set(cited))}"
    intro = {key.strip() for group in CITE.findall((REPO_ROOT / "book" / "intro.md").read_text())
             for key in group.split(",")}
    missing = {"choi2026sinkstrength", "yoo2026outro", "chen2026gradientsinks"} - intro
    assert not missing, f"the intro does not cite {sorted(missing)}"


def test_the_references_page_is_in_the_table_of_contents():
    from sinkbook.book.build import toc_yaml
    assert "file: book/references" in toc_yaml()
    assert "{bibliography}" in (REPO_ROOT / "book" / "references.md").read_text()


def _requirements() -> list:
    """Every requirement pyproject.toml names, the core ones and each extra's (other than sinkbook itself)."""
    from packaging.requirements import Requirement
    project = PYPROJECT["project"]
    named = list(project["dependencies"]) + [r for extra in project["optional-dependencies"].values() for r in extra]
    return [req for req in map(Requirement, named) if req.name != "sinkbook"]


def _pins() -> dict:
    from packaging.utils import canonicalize_name
    pins = {}
    for line in (REPO_ROOT / "env" / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"env/constraints.txt: {line!r} is not an exact pin"
            pins[canonicalize_name(name)] = version
    return pins


def test_every_dependency_has_a_pin_inside_its_range():
    from packaging.utils import canonicalize_name
    pins = _pins()
    for req in _requirements():
        pin = pins.get(canonicalize_name(req.name))
        assert pin, f"{req.name} is a dependency in pyproject.toml but has no pin in env/constraints.txt"
        assert req.specifier.contains(pin, prereleases=True), \
            f"env/constraints.txt pins {req.name}=={pin}, outside pyproject.toml's range {req.specifier}"


def test_the_core_dependencies_are_ranges_and_the_book_stack_is_an_extra():
    core = [r for r in _requirements() if str(r) in PYPROJECT["project"]["dependencies"]]
    assert not [str(r) for r in core if any(s.operator == "==" for s in r.specifier)], "exact pins belong in env/constraints.txt"
    assert not {r.name for r in core} & {"jupyter-book", "sphinx", "papermill", "lm-eval", "accelerate", "peft"}
    setup = (REPO_ROOT / "scripts" / "setup.sh").read_text()
    assert "-e '.[book,eval,train,bench,test]' -c env/constraints.txt" in setup, \
        "scripts/setup.sh must install every extra the book and the tests use, under the pins"
