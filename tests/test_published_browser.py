"""In the built book: every executed chapter links, under its claims, a results file that is the one the chapter
wrote and its executed notebook; the intro links every results file; the footer names the commit; the references
and API pages are there. Runs on the book that SINKBOOK_BOOK_HTML names, like the other browser tests."""
from __future__ import annotations

import json
import subprocess
import urllib.request

import pytest

from sinkbook.chapters import chapter_names

from test_book_pages import RESULTS, _executed, _open, browser  # noqa: F401
from test_explorer_browser import REPO, served_book  # noqa: F401

pytestmark = pytest.mark.browser
LINKS = ("JSON.stringify(Array.from(document.querySelectorAll('a')).map(function(a){"
         "return [a.className, a.href, a.innerText];}))")


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url) as response:
        return response.read()


@pytest.mark.parametrize("name", chapter_names())
def test_chapter_links_its_results_file_and_executed_notebook(name, browser, served_book):
    if not _executed(name):
        pytest.skip(f"{name} was not executed in this build")
    js = _open(browser, f"{served_book}/chapters/{name}.html")
    links = json.loads(js(LINKS))
    results = [href for css, href, _ in links if "sinkbook-results-link" in css]
    assert results == [f"{served_book}/results/{name}.json"], results
    assert json.loads(_get(results[0])) == json.loads((RESULTS / f"{name}.json").read_text())
    notebook = [href for _, href, _ in links if href.endswith(f"/_sources/chapters/{name}.ipynb")]
    assert notebook, "no link to the executed notebook"
    cells = json.loads(_get(notebook[0]))["cells"]
    assert any(c.get("outputs") for c in cells if c["cell_type"] == "code"), "the linked notebook has no outputs"


def test_intro_links_every_results_file_and_the_footer_names_the_commit(browser, served_book):
    js = _open(browser, f"{served_book}/book/intro.html")
    written = sorted(p.stem for p in RESULTS.glob("*.json"))
    if not written:
        pytest.skip("no results files in this build")
    linked = sorted(href.rsplit("/", 1)[1].removesuffix(".json") for css, href, _ in json.loads(js(LINKS))
                    if "sinkbook-results-link" in css)
    assert linked == written
    for name in linked:
        assert json.loads(_get(f"{served_book}/results/{name}.json"))["chapter"] == name
    footer = js("document.querySelector('.sinkbook-build') ? document.querySelector('.sinkbook-build').innerText : ''")
    built_from = json.loads((RESULTS / f"{written[0]}.json").read_text())["git_commit"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert "sinkbook " in footer and (head[:12] in footer or built_from[:12] in footer), footer


def test_references_and_api_pages(browser, served_book):
    js = _open(browser, f"{served_book}/book/references.html")
    text = js("document.body.innerText")
    for arxiv in ("2609.00746", "2603.14337", "2603.17771", "2309.17453"):
        assert arxiv in text, f"the references page does not list arXiv {arxiv}"
    js = _open(browser, f"{served_book}/book/api/core.html")
    assert js("!!document.getElementById('sinkbook.core.hooks.capture')"), "the API page does not document capture"
    assert not js("document.querySelectorAll('.problematic, .system-message').length"), "reST errors on the API page"
