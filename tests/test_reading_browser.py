"""Reading the built book, in headless Chromium: the intro's findings summary says what the results files say;
verdict boxes, tables and other outputs keep WCAG AA contrast (4.5:1) in the theme's light and dark modes; no page
is wider than a 1280 px window; every executed chapter offers its executed notebook for download.

Runs on the book that SINKBOOK_BOOK_HTML names, like the other browser tests. The dark-mode test leaves its
screenshot in artifacts/dark-mode.png (book/_static/screenshots/dark-mode.png is a copy of one, for the docs).
"""
from __future__ import annotations

import base64
import json
import time
import urllib.request

import pytest

from sinkbook.book.summary import PAPERS, headline_claims
from sinkbook.chapters import chapter_names
from sinkbook.core.claims import label, signed

from test_book_pages import RESULTS, _executed, _open, browser  # noqa: F401
from test_explorer_browser import ARTIFACTS, BOOK, served_book  # noqa: F401

pytestmark = pytest.mark.browser
AA = 4.5            # WCAG 2.x level AA, normal-size text
VIEWPORT = 1280

# Every visible piece of text under the selected elements, with its colour, the colour it is drawn on (the
# backgrounds of its ancestors composited, as the page paints them) and their contrast ratio (WCAG 2.x).
# Text inside SVG (plotly, matplotlib) is skipped: it is drawn on the figure's own background, not the page's.
CONTRAST = r"""
(function(selector){
  function parse(s){
    var m = s.match(/^rgba?\(([^)]*)\)$/);
    if (m) { var p = m[1].split(/[\s,\/]+/).filter(Boolean).map(parseFloat);
             return [p[0], p[1], p[2], p.length > 3 ? p[3] : 1]; }
    m = s.match(/^color\(srgb ([^)]*)\)$/);
    if (m) { var q = m[1].split(/[\s\/]+/).filter(Boolean).map(parseFloat);
             return [q[0] * 255, q[1] * 255, q[2] * 255, q.length > 3 ? q[3] : 1]; }
    throw new Error('unparsed colour ' + s);
  }
  function over(top, base){
    var a = top[3];
    return [top[0] * a + base[0] * (1 - a), top[1] * a + base[1] * (1 - a), top[2] * a + base[2] * (1 - a), 1];
  }
  function background(el){
    var chain = [];
    for (var e = el; e; e = e.parentElement) chain.push(parse(getComputedStyle(e).backgroundColor));
    var base = [255, 255, 255, 1];                       // the canvas under the root
    for (var i = chain.length - 1; i >= 0; i--) base = over(chain[i], base);
    return base;
  }
  function lum(c){
    var v = c.slice(0, 3).map(function(x){ x = x / 255; return x <= 0.04045 ? x / 12.92 : Math.pow((x + 0.055) / 1.055, 2.4); });
    return 0.2126 * v[0] + 0.7152 * v[1] + 0.0722 * v[2];
  }
  var out = [];
  document.querySelectorAll(selector).forEach(function(root){
    [root].concat(Array.from(root.querySelectorAll('*'))).forEach(function(el){
      if (el.closest('svg')) return;
      var text = Array.from(el.childNodes).filter(function(n){ return n.nodeType === 3; })
                      .map(function(n){ return n.textContent; }).join('').trim();
      if (!text || !el.checkVisibility({opacityProperty: true, visibilityProperty: true})) return;
      if (el.getBoundingClientRect().width === 0) return;
      var bg = background(el), fg = over(parse(getComputedStyle(el).color), bg);
      var a = lum(fg), b = lum(bg);
      out.push([(Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05), text.slice(0, 60), el.tagName,
                el.className.toString().slice(0, 40), getComputedStyle(el).color, getComputedStyle(el).backgroundColor]);
    });
  });
  return JSON.stringify(out);
})
"""
READ = ".sinkbook-verdict, .sinkbook-table-box, .cell_output, .sinkbook-findings"


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url) as response:
        return response.read()


def _executed_chapters():
    return [name for name in chapter_names() if _executed(name)]


def _theme(js, mode: str) -> None:
    # what the theme's switch does: the attribute on <html> selects the palette (and localStorage keeps it)
    js(f"localStorage.setItem('mode', '{mode}'); localStorage.setItem('theme', '{mode}');"
       f"document.documentElement.dataset.mode = '{mode}'; document.documentElement.dataset.theme = '{mode}';")
    time.sleep(0.3)


def _worst(js, selector=READ):
    found = json.loads(js(f"{CONTRAST}({json.dumps(selector)})"))
    return sorted(found)[:5], len(found)


@pytest.mark.parametrize("mode", ["dark", "light"])
def test_outputs_and_verdicts_keep_aa_contrast(mode, browser, served_book):
    pages = [f"chapters/{name}.html" for name in _executed_chapters()] + ["book/intro.html"]
    if len(pages) == 1:
        pytest.skip("no chapter was executed in this build")
    checked, low = 0, []
    for page in pages:
        js = _open(browser, f"{served_book}/{page}")
        _theme(js, mode)
        assert js("document.documentElement.dataset.theme") == mode
        worst, n = _worst(js)
        checked += n
        low += [(page, *w) for w in worst if w[0] < AA]
    assert checked > 50, f"only {checked} pieces of output text found: the selectors miss the page"
    assert not low, f"text under {AA}:1 in {mode} mode:\n" + "\n".join(map(str, low))


def test_dark_mode_screenshot_of_a_chapter(browser, served_book):
    """The first executed chapter with a table and verdict boxes, in dark mode: its verdict text and table text
    pass AA, and the screenshot (artifacts/dark-mode.png) shows them."""
    tools, session = browser
    for name in _executed_chapters():
        js = _open(browser, f"{served_book}/chapters/{name}.html")
        if js("!!document.querySelector('.sinkbook-table') && !!document.querySelector('.sinkbook-verdict')"):
            break
    else:
        pytest.skip("no executed chapter with a table and a verdict box")
    _theme(js, "dark")
    verdicts, n_verdicts = _worst(js, ".sinkbook-verdict")
    tables, n_tables = _worst(js, ".sinkbook-table")
    assert n_verdicts and n_tables
    assert verdicts[0][0] >= AA, verdicts
    assert tables[0][0] >= AA, tables
    # a screen with a table followed by its verdict boxes
    js("(function(){var t=document.querySelector('.sinkbook-verdict').closest('.cell') ||"
       " document.querySelector('.sinkbook-verdict'); var prev=t.previousElementSibling || t;"
       " prev.scrollIntoView();})()")
    time.sleep(0.5)
    shot = tools.send("Page.captureScreenshot", {"format": "png"}, session)
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "dark-mode.png").write_bytes(base64.b64decode(shot["data"]))
    _theme(js, "light")


def _pages():
    return sorted(str(p.relative_to(BOOK)) for p in BOOK.rglob("*.html")
                  if not {"_static", "_sources", "_images"} & set(p.relative_to(BOOK).parts))


def test_no_page_is_wider_than_a_1280_px_window(browser, served_book):
    tools, session = browser
    tools.send("Emulation.setDeviceMetricsOverride", {"width": VIEWPORT, "height": 900, "deviceScaleFactor": 1,
                                                      "mobile": False}, session)
    try:
        pages = _pages()
        assert "book/intro.html" in pages and "book/api/core.html" in pages, pages
        wide = {}
        for page in pages:
            js = _open(browser, f"{served_book}/{page}")
            width = js("document.documentElement.scrollWidth")
            if width > VIEWPORT:
                wide[page] = width
        assert not wide, f"pages wider than {VIEWPORT} px: {wide}"
    finally:
        tools.send("Emulation.clearDeviceMetricsOverride", {}, session)


@pytest.mark.parametrize("name", chapter_names())
def test_the_theme_offers_the_executed_notebook(name, browser, served_book):
    if not _executed(name):
        pytest.skip(f"{name} was not executed in this build")
    js = _open(browser, f"{served_book}/chapters/{name}.html")
    links = json.loads(js("JSON.stringify(Array.from(document.querySelectorAll('.dropdown-download-buttons a'))"
                          ".map(function(a){return a.href;}))"))
    notebook = [href for href in links if href.endswith(f"/_sources/chapters/{name}.ipynb")]
    assert notebook, f"the download menu offers {links}"
    cells = json.loads(_get(notebook[0]))["cells"]
    assert any(c.get("outputs") for c in cells if c["cell_type"] == "code"), "the offered notebook has no outputs"


FINDINGS = ("JSON.stringify(Array.from(document.querySelectorAll('li.sinkbook-finding-line')).map(function(li){"
            "return [li.closest('ul').dataset.paper, li.dataset.chapter, li.dataset.claim, "
            "li.querySelector('.sinkbook-finding-verdict').innerText, li.innerText, "
            "li.querySelector('a.sinkbook-finding-chapter').href, li.querySelector('a.sinkbook-finding-results').href];}))")


def _shown_number(c: dict) -> list[str]:
    """Pieces of the claim's number that the line must show, formatted here from the results file."""
    if c.get("effect"):
        e = c["effect"]
        return [signed(e["estimate"]), signed(e["low"]), signed(e["high"])]      # a rounded zero reads "+0"
    v = c["our_value"]
    if isinstance(v, list):
        v = v[0] if v else ""
    if isinstance(v, float):
        return [f"{v:.4g}"]
    return [str(v)[:40]]


def test_intro_opens_with_findings_that_match_the_results(browser, served_book):
    docs = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json"))]
    if not docs:
        pytest.skip("no results files in this build")
    js = _open(browser, f"{served_book}/book/intro.html")
    first = js("(document.querySelector('article h2') || {}).innerText || ''")
    assert first.startswith("What we found"), f"the intro's first section is {first!r}"
    lines = json.loads(js(FINDINGS))
    claims = {(doc["chapter"], c["id"]): c for doc in docs for c in doc["claims"]}
    heads = json.loads(js("JSON.stringify(Array.from(document.querySelectorAll('article p')).filter(function(p){"
                          "return p.innerText.includes('headline claims');}).map(function(p){return [p.innerText, "
                          "Array.from(p.querySelectorAll('a')).map(function(a){return a.href;})];}))"))
    for paper in PAPERS:
        expected = headline_claims(paper, docs)
        shown = [(chapter, claim_id) for cite, chapter, claim_id, *_ in lines if cite == paper.cite]
        assert sorted(shown) == sorted((ch, c["id"]) for ch, c in expected), paper.name
        (head,) = [(t, hrefs) for t, hrefs in heads if t.startswith(paper.name)]
        assert f"{len(expected)} headline claims" in head[0], head[0]
        assert any("references.html" in href for href in head[1]), f"{paper.name}: the citation is not a link"
    order = {word: i for i, word in enumerate(("holds", "does not hold", "inconclusive", "not comparable"))}
    for cite in {line[0] for line in lines}:
        words = [line[3] for line in lines if line[0] == cite]
        assert words == sorted(words, key=order.__getitem__), f"{cite}: lines not grouped by verdict: {words}"
    for cite, chapter, claim_id, word, line, chapter_href, results_href in lines:
        c = claims[(chapter, claim_id)]
        assert word == label(c["holds"]), f"{claim_id}: shown {word!r}, the results file says {c['holds']!r}"
        assert " ".join(c["statement"].split()) in line, line
        for piece in _shown_number(c):
            assert piece in line, f"{claim_id}: {piece!r} not in {line!r}"
        if c["holds"] == "not comparable" and c.get("why_not_comparable"):
            assert c["why_not_comparable"][:40] in line
        assert chapter_href == f"{served_book}/chapters/{chapter}.html"
        assert f"data-claim='{claim_id}'" in _get(chapter_href).decode(), f"{chapter} has no box for {claim_id}"
        assert results_href == f"{served_book}/results/{chapter}.json"
        assert json.loads(_get(results_href)) == json.loads((RESULTS / f"{chapter}.json").read_text())
