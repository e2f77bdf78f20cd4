"""The ipywidgets explorer in a live IPython kernel: moving a slider redraws the heatmap.

A kernel is started with jupyter_client, the explorer is built on a tiny random model, and a slider is
moved by setting its value, as a front-end would through the widget's comm. The Output widget routes
whatever is displayed while it is active to the front-end by the parent message id, so the test reads
the kernel's IOPub messages: after the change, a plotly figure titled with the new layer and head must
be displayed.
"""
from __future__ import annotations

import queue

import pytest

jupyter_client = pytest.importorskip("jupyter_client")

SETUP = """
from sinkbook.core.models import load_model
from sinkbook.book.explorer import explorer_data, widget_explorer
data = explorer_data(load_model("tiny-llama"), ["one two three four", "a b c"], chat=False)
box = widget_explorer(data)
prompt, layer, head = box.children[0].children
print("layers", data["layers"], "heads", data["heads"])
"""


def _execute(client, code: str, timeout: float = 120) -> list[dict]:
    """Run ``code``; return the IOPub messages it caused, failing on an error reply."""
    msg_id = client.execute(code)
    messages = []
    while True:
        try:
            msg = client.get_iopub_msg(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"kernel sent nothing for {timeout} s while running:\n{code}")
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        messages.append(msg)
        if msg["msg_type"] == "error":
            pytest.fail("kernel error:\n" + "\n".join(msg["content"]["traceback"]))
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return messages


def _figure_titles(messages: list[dict]) -> list[str]:
    titles = []
    for msg in messages:
        if msg["msg_type"] == "display_data":
            fig = msg["content"]["data"].get("application/vnd.plotly.v1+json")
            if fig:
                titles.append(fig["layout"]["title"]["text"])
    return titles


@pytest.fixture(scope="module")
def kernel():
    manager = jupyter_client.KernelManager(kernel_name="python3")
    manager.start_kernel(extra_arguments=["--HistoryManager.enabled=False"])
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
        yield client
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def test_widget_explorer_redraws_on_slider_change(kernel):
    first = _execute(kernel, SETUP)
    assert any("layer 0 | head 0" in t for t in _figure_titles(first)), "no initial heatmap was displayed"
    printed = "".join(m["content"].get("text", "") for m in first if m["msg_type"] == "stream")
    assert "layers" in printed

    moved = _execute(kernel, "layer.value = 1\nhead.value = 2")
    titles = _figure_titles(moved)
    assert any("layer 1 | head 0" in t for t in titles) and any("layer 1 | head 2" in t for t in titles), titles
    # the widget's state travels over its comm: the Output widget is told which message's output is its own
    comm_updates = [m for m in moved if m["msg_type"] == "comm_msg"]
    assert comm_updates, "no widget state was sent to the front-end"

    other_prompt = _execute(kernel, "prompt.value = 1")
    assert any("layer 1 | head 2" in t for t in _figure_titles(other_prompt))
    # no figure is drawn for a value that does not change
    assert _figure_titles(_execute(kernel, "prompt.value = 1")) == []
