"""``sinkbook explore MODEL --prompt ... --out page.html`` writes the per-head explorer for any model and prompt as
one page with plotly.js inlined: in headless Chromium with the network off it draws the heatmap of the reader's
own prompt and redraws it for another head."""
from __future__ import annotations

import shutil
import tempfile

import pytest

from sinkbook.book.cli import main

from test_explorer_browser import CHROMIUM, DevTools, _evaluate, _wait_for

PROMPTS = ["Name three rivers.", "Sinks sit on the first token"]


def test_explore_rejects_a_wrong_output_name(tmp_path, capsys):
    assert main(["explore", "tiny-llama", "--prompt", "x", "--out", str(tmp_path / "page.png")]) == 2
    assert "--out must name an .html file" in capsys.readouterr().err


@pytest.mark.browser
def test_explore_page_draws_the_readers_prompt_offline(tmp_path):
    from pathlib import Path
    if not Path(CHROMIUM).is_file():
        pytest.skip("chromium is not installed")
    page = tmp_path / "page.html"
    args = ["explore", "tiny-llama", "--out", str(page), "--device", "cpu"]
    for prompt in PROMPTS:
        args += ["--prompt", prompt]
    assert main(args) == 0
    profile = tempfile.mkdtemp(prefix="sinkbook-chromium-")
    tools = DevTools(["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                      "--no-first-run", f"--user-data-dir={profile}", "--proxy-server=127.0.0.1:9",
                      "--host-resolver-rules=MAP * ~NOTFOUND", "--window-size=1200,1400", "about:blank"])
    try:
        target = tools.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = tools.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        tools.send("Runtime.enable", session=session)
        tools.send("Page.enable", session=session)
        tools.send("Page.navigate", {"url": page.as_uri()}, session)
        _wait_for(tools, session, "document.readyState === 'complete'")
        assert _wait_for(tools, session, "typeof Plotly !== 'undefined'", timeout=20), "plotly.js is not in the page"
        box = _wait_for(tools, session, "(document.querySelector('.sink-explorer [data-state]') || {}).id || ''")
        state = f"document.getElementById('{box}').getAttribute('data-state')"
        assert _wait_for(tools, session, f"{state} === '0,0,0,0'")
        prompts = _evaluate(tools, session, f"Array.from(document.getElementById('{box}-prompt').options)"
                                            ".map(function(o){return o.text;}).join('|')")
        assert all(p[:15] in prompts for p in PROMPTS), prompts
        z = f"JSON.stringify(document.getElementById('{box}').data[0].z)"
        first = _evaluate(tools, session, z)
        _evaluate(tools, session, f"(function(){{var s=document.getElementById('{box}-head'); s.value='1';"
                                  "s.dispatchEvent(new Event('change'));})()")
        assert _wait_for(tools, session, f"{state} === '0,0,0,1'")
        assert _evaluate(tools, session, z) != first, "the heatmap did not change for another head"
    finally:
        tools.close()
        shutil.rmtree(profile, ignore_errors=True)
