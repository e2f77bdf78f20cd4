"""The numbers behind the book are published with it: each chapter page links its results file and its executed
notebook under the claims, the intro links every results file, a page documents every field a results file has,
and the footer says which version and commit the book was built from."""
from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import tomllib

import nbformat
import yaml

from sinkbook.book import build
from sinkbook.book.results import claims_markdown, write_results
from sinkbook.core.claims import Claim
from sinkbook.core.paths import REPO_ROOT

CLAIM = Claim("toy_gap", "measured", "VL paper, Table 5", "a toy gap", 1.0, 1.1, "within 0.2", True)


def _notebook(path, sources):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# Title")] + [nbformat.v4.new_code_cell(s) for s in sources]
    nbformat.write(nb, str(path))


def test_the_results_link_goes_under_the_claims_once(tmp_path):
    path = tmp_path / "outro.ipynb"
    _notebook(path, ["x = 1", "show_claims(chapter.claims)", "write_results(**chapter.results())"])
    build.present_for_reading(path)
    build.present_for_reading(path)                 # a rebuild of the same notebook adds no second link
    cells = nbformat.read(str(path), as_version=4).cells
    links = [i for i, c in enumerate(cells) if build.RESULTS_LINK_TAG in c.metadata.get("tags", [])]
    assert links == [3], "one link, right under the cell that shows the claims"
    assert 'href="../results/outro.json"' in cells[3].source and "../_sources/chapters/outro.ipynb" in cells[3].source


def test_a_notebook_without_a_claims_cell_gets_the_link_at_the_end(tmp_path):
    path = tmp_path / "theorems.ipynb"
    _notebook(path, ["x = 1"])
    build.present_for_reading(path)
    assert build.RESULTS_LINK_TAG in nbformat.read(str(path), as_version=4).cells[-1].metadata["tags"]


def test_the_intro_links_every_chapter_results_file(tmp_path):
    for chapter in ("outro", "theorems"):
        write_results(chapter, {"profile": "quick"}, [CLAIM], directory=tmp_path)
    docs = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*.json"))]
    text = claims_markdown(docs, results_href="../results/")
    assert re.findall(r'href="\.\./results/(\w+)\.json"', text) == ["outro", "theorems"]
    assert "results/" not in claims_markdown(docs), "no link unless the page says where the files are"


def test_the_schema_page_documents_every_key_a_results_file_has(tmp_path):
    path = write_results("outro", {"profile": "quick"}, [CLAIM], extra={"timings": {}}, directory=tmp_path)
    doc = json.loads(path.read_text())
    page = (REPO_ROOT / "book" / "results_schema.md").read_text()
    documented = set(re.findall(r"^\| `(\w+)` \|", page, flags=re.M))
    assert set(doc) <= documented, f"undocumented results keys: {sorted(set(doc) - documented)}"
    fields = {f.name for f in dataclasses.fields(Claim)}
    assert fields <= documented, f"undocumented claim fields: {sorted(fields - documented)}"
    assert "file: book/results_schema" in build.toc_yaml()


def test_the_footer_names_the_version_and_the_commit(tmp_path):
    (tmp_path / "_config.yml").write_text((REPO_ROOT / "_config.yml").read_text())
    build.set_footer(tmp_path, "quick")
    footer = yaml.safe_load((tmp_path / "_config.yml").read_text())["html"]["extra_footer"]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True).stdout
    version = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert f"sinkbook {version}," in footer and commit.strip()[:12] in footer and "<code>quick</code>" in footer


def test_published_results_are_copied_where_the_links_point(tmp_path):
    results = tmp_path / "results"
    write_results("outro", {"profile": "quick"}, [CLAIM], directory=results)
    stage = tmp_path / "stage"
    build.publish_results(stage, results)
    extra = yaml.safe_load((REPO_ROOT / "_config.yml").read_text())["sphinx"]["config"]["html_extra_path"]
    assert (stage / extra[0] / "results" / "outro.json").read_text() == (results / "outro.json").read_text()
