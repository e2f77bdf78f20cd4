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
