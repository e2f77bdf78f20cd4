"""Chapter pages read like a paper: in headless Chromium, no code is visible until its toggle is opened, every
claim's verdict box agrees with the chapter's results file, nothing is wider than the page, and the intro's
claims summary figure loads."""
from __future__ import annotations

import json
import shutil
import tempfile
import time
import pytest

from sinkbook.chapters import chapter_names

from test_explorer_browser import BOOK, REPO, DevTools, _evaluate, _require_page, _wait_for, served_book  # noqa: F401

pytestmark = pytest.mark.browser
RESULTS = BOOK.parent / "results" if BOOK.parent.name != "_build" else REPO / "results"
BOX_CLASS = {True: "holds", False: "fails", "inconclusive": "inconclusive", "not comparable": "not-comparable"}


@pytest.fixture(scope="module")
def browser():
    _require_page()
    profile = tempfile.mkdtemp(prefix="sinkbook-chromium-")
    tools = DevTools(["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                      "--no-first-run", f"--user-data-dir={profile}", "--proxy-server=127.0.0.1:9",
                      "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1", "--window-size=1280,1600",
                      "about:blank"])
    target = tools.send("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = tools.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    tools.send("Runtime.enable", session=session)
    tools.send("Page.enable", session=session)
    yield tools, session
    tools.close()
    shutil.rmtree(profile, ignore_errors=True)


# The page's size once every plotly figure has drawn (figures draw, and resize, after the load event); false before.
SETTLED = ("(function(){var p = document.querySelectorAll('.plotly-graph-div');"
           " for (var i = 0; i < p.length; i++) if (!p[i]._fullLayout) return false;"
           " var d = document.documentElement; return d.scrollWidth + 'x' + d.scrollHeight;})()")


def _open(browser, url, timeout=60.0):
    """Navigate and wait until the page has loaded and its layout has stopped changing: the same size on two
    polls 0.1 s apart, with every figure drawn (a fixed sleep here cost a second a page)."""
    tools, session = browser
    # a mark on the page being left tells it from the new one (a URL check would never pass on a redirect page)
    _evaluate(tools, session, "window.sinkbookLeaving = true")
    tools.send("Page.navigate", {"url": url}, session)
    _wait_for(tools, session, "!window.sinkbookLeaving && document.readyState === 'complete'", timeout=timeout,
              every=0.05)
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        size = _evaluate(tools, session, SETTLED)
        if size and size == last:
            return lambda expression: _evaluate(tools, session, expression)
        last = size
        time.sleep(0.1)
    raise AssertionError(f"{url}: the layout did not settle in {timeout} s")


def _executed(name):
    page = BOOK / "chapters" / f"{name}.html"
    return page.is_file() and "has not been executed in this build" not in page.read_text(errors="replace")


@pytest.mark.parametrize("name", chapter_names())
def test_chapter_page_hides_code_and_shows_verdicts(name, browser, served_book):
    if not _executed(name):
        pytest.skip(f"{name} was not executed in this build")
    js = _open(browser, f"{served_book}/chapters/{name}.html")
    shown = ("Array.from(document.querySelectorAll('.cell_input')).filter(function(e){"
             "return e.checkVisibility({contentVisibilityAuto: true, opacityProperty: true, visibilityProperty: true})"
             " && e.getBoundingClientRect().height > 0;}).length")
    visible_code = js(shown)
    assert js("document.querySelectorAll('.cell_input').length") > 0
    assert visible_code == 0, f"{visible_code} code cells are visible before their toggle is opened"
    # the toggle works: opening one shows its code (so the check above can fail)
    js("document.querySelector('details.hide > summary').click()")
    time.sleep(0.5)
    assert js(shown) >= 1
    boxes = json.loads(js("JSON.stringify(Array.from(document.querySelectorAll('.sinkbook-verdict')).map(function(e){"
                          "return [e.getAttribute('data-claim'), e.className];}))"))
    assert boxes, "no verdict box on the page"
    results = json.loads((RESULTS / f"{name}.json").read_text())
    holds = {c["id"]: c["holds"] for c in results["claims"]}
    for claim_id, css in boxes:
        assert claim_id in holds, f"a verdict box for {claim_id}, which the results file does not hold"
        assert BOX_CLASS[holds[claim_id]] in css.split(), f"{claim_id}: box {css!r} but holds={holds[claim_id]!r}"
    assert {c for c, _ in boxes} >= {c["id"] for c in results["claims"] if not c.get("must_hold")}
    width = json.loads(js("JSON.stringify([document.documentElement.scrollWidth, window.innerWidth])"))
    assert width[0] <= width[1], f"the page scrolls sideways ({width[0]} px content in a {width[1]} px window)"
    too_wide = js("(function(){var main=document.querySelector('main, article, .bd-article');"
                  "var right=main.getBoundingClientRect().right + 1; return Array.from(document.querySelectorAll("
                  "'.sinkbook-table-box, .plotly-graph-div, .cell_output img, .sinkbook-verdict')).filter(function(e){"
                  "return e.getBoundingClientRect().right > right;}).length;})()")
    assert too_wide == 0, f"{too_wide} tables, figures or verdict boxes reach past the page's text column"


def test_intro_shows_the_claims_summary_figure(browser, served_book):
    # the intro page itself: index.html only redirects to it, and the redirect may land after the page is read
    js = _open(browser, f"{served_book}/book/intro.html")
    if not js("document.body.innerText.includes('Measured on models run here')"):
        pytest.skip("no results files in this build")
    assert js("Array.from(document.images).some(function(i){return i.src.includes('claims_summary') "
              "&& i.complete && i.naturalWidth > 0;})"), "the claims summary figure does not load"
