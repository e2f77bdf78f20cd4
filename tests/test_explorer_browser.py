"""The built chapter page's attention explorer works in headless Chromium with the network off.

Chromium is driven over the DevTools protocol on a pipe (--remote-debugging-pipe), so no driver package
is needed. The book is served from 127.0.0.1 by a local http.server; every other host is unreachable
(--proxy-server to a dead port, host resolver mapped to nothing).
"""
from __future__ import annotations

import functools
import http.server
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BOOK = Path(os.environ.get("SINKBOOK_BOOK_HTML", REPO / "_build" / "html"))
# where the build puts the executed chapter (book.py stages executed notebooks under chapters/)
PAGES = ("chapters/sink_criteria.html", "_executed/sink_criteria.html")
ARTIFACTS = REPO / "artifacts"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"

pytestmark = pytest.mark.browser


def _page() -> str:
    return next((p for p in PAGES if (BOOK / p).is_file()), PAGES[0])


def _require_page() -> Path:
    page = BOOK / _page()
    if not page.is_file():
        message = (f"{page} is missing: build the book first (make book, or .venv/bin/python -m sinkbook.book "
                   f"build; set SINKBOOK_BOOK_HTML to test another build such as _build/quick/html)")
        if os.environ.get("SINKBOOK_REQUIRE_BOOK") == "1":
            pytest.fail(message)
        pytest.skip(message)
    if not Path(CHROMIUM).is_file():
        message = "chromium is not installed (apt-get install -y chromium)"
        if os.environ.get("SINKBOOK_REQUIRE_BOOK") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return page


class DevTools:
    """Minimal Chrome DevTools Protocol client over --remote-debugging-pipe (NUL-separated JSON)."""

    def __init__(self, args):
        self._to_browser_r, self._to_browser_w = os.pipe()
        self._from_browser_r, self._from_browser_w = os.pipe()
        # Chromium reads commands on fd 3 and writes replies on fd 4.
        def child_fds():
            os.dup2(self._to_browser_r, 3)
            os.dup2(self._from_browser_w, 4)
        self.proc = subprocess.Popen([CHROMIUM, *args, "--remote-debugging-pipe"], preexec_fn=child_fds,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(3, 4))
        os.close(self._to_browser_r)
        os.close(self._from_browser_w)
        self._writer = os.fdopen(self._to_browser_w, "wb", buffering=0)
        self._reader = os.fdopen(self._from_browser_r, "rb", buffering=0)
        self._buffer = b""
        self._next_id = 0
        self.events = []

    def _read_message(self, deadline):
        while b"\0" not in self._buffer:
            if time.monotonic() > deadline:
                raise TimeoutError("no reply from chromium")
            chunk = self._reader.read(65536)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def send(self, method, params=None, session=None, timeout=30.0):
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        self._writer.write(json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def close(self):
        try:
            self.send("Browser.close", timeout=5)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def served_book():
    _require_page()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(BOOK)))
    # a short poll, because shutdown waits for one
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _evaluate(tools, session, expression):
    result = tools.send("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session)
    return result.get("result", {}).get("value")


def _wait_for(tools, session, expression, timeout=60.0, every=0.25):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = _evaluate(tools, session, expression)
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for: {expression}")


def test_explorer_redraws_offline(served_book):
    ARTIFACTS.mkdir(exist_ok=True)
    profile = tempfile.mkdtemp(prefix="sinkbook-chromium-")
    tools = DevTools(["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                      "--disable-component-update", "--no-first-run", f"--user-data-dir={profile}",
                      "--proxy-server=127.0.0.1:9",
                      "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
                      "--window-size=1200,1600", "about:blank"])
    try:
        target = tools.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = tools.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        tools.send("Runtime.enable", session=session)
        tools.send("Page.enable", session=session)
        tools.send("Page.navigate", {"url": f"{served_book}/{_page()}"}, session)
        _wait_for(tools, session, "document.readyState === 'complete'")
        box = _wait_for(tools, session, "(document.querySelector('.sink-explorer [data-state]') || {}).id || ''")
        assert _wait_for(tools, session, "typeof Plotly !== 'undefined'", timeout=20), \
            "Plotly is not defined: plotly.js was not served from the book"
        state = f"document.getElementById('{box}').getAttribute('data-state')"
        z = f"JSON.stringify(document.getElementById('{box}').data[0].z)"
        _wait_for(tools, session, state)
        first_state, first_z = _evaluate(tools, session, state), _evaluate(tools, session, z)
        assert first_state == "0,0,0,0"
        # Pick the last layer and head 1: the heatmap must be redrawn with different numbers.
        change = ("(function(){var s=document.getElementById('%s-%s'); s.value=String(%s);"
                  " s.dispatchEvent(new Event('change')); return s.value;})()")
        n_layers = _evaluate(tools, session, f"document.getElementById('{box}-layer').options.length")
        assert n_layers and n_layers > 1
        _evaluate(tools, session, change % (box, "layer", n_layers - 1))
        _evaluate(tools, session, change % (box, "head", 1))
        _wait_for(tools, session, f"{state} === '0,0,{n_layers - 1},1'")
        second_z = _evaluate(tools, session, z)
        assert second_z != first_z, "the heatmap did not change after choosing another layer and head"
        title = _evaluate(tools, session, f"document.getElementById('{box}').layout.title.text")
        assert f"layer {n_layers - 1}" in title and "head 1" in title
        _evaluate(tools, session, f"document.getElementById('{box}-box').scrollIntoView()")
        time.sleep(0.5)
        shot = tools.send("Page.captureScreenshot", {"format": "png"}, session)
        import base64
        (ARTIFACTS / "sink_criteria_explorer.png").write_bytes(base64.b64decode(shot["data"]))
        failed = _evaluate(tools, session,
                           "performance.getEntriesByType('resource').filter(function(e){"
                           "return !e.name.startsWith(location.origin) && !e.name.startsWith('data:');})"
                           ".map(function(e){return e.name;})")
        # External requests cannot succeed (the network is off); the page must not need them for the explorer.
        print("requests outside the book (blocked):", failed)
    finally:
        tools.close()
        shutil.rmtree(profile, ignore_errors=True)
