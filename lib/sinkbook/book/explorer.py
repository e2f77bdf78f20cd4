"""Per-head attention explorer: pick a prompt, a layer and a head; see the attention heatmap and its G.

Two front ends on the same data:
- ``widget_explorer``: ipywidgets for a live Jupyter kernel (recomputes nothing: it reads the arrays);
- ``static_explorer_html``: a self-contained HTML/JS block for the built book. The attention patterns
  are embedded as base64 uint8 (probability * 255, lower triangle only) and redrawn client-side with the
  page's global ``Plotly`` object, which the book serves from its own ``_static``; nothing is fetched.
"""
from __future__ import annotations

import base64
import html
import json
import uuid

import numpy as np

from ..measures.attention_maps import explorer_data, explorer_datasets  # noqa: F401  (the explorer's data)


def _pack(prompt: dict) -> dict:
    L, H, T, _ = prompt["pattern"].shape
    rows, cols = np.tril_indices(T)
    lower = prompt["pattern"][:, :, rows, cols]                                    # (L, H, T(T+1)/2)
    return {"tokens": prompt["tokens"], "text": prompt["text"], "T": T,
            "pattern": base64.b64encode(np.ascontiguousarray(lower).tobytes()).decode("ascii"),
            "gap": np.round(prompt["gap"], 3).tolist(), "sink": prompt["sink"].tolist()}


def static_explorer_html(datasets: list[dict], div_id: str | None = None, height: int = 620) -> str:
    """One HTML block with model / prompt / layer / head dropdowns over ``datasets`` (from ``explorer_data``).

    The heatmap is drawn by ``Plotly.react`` on the page's global ``Plotly`` (served by the book); the
    chosen (model, prompt, layer, head) is written to the plot div's ``data-state`` for tests.
    """
    div_id = div_id or f"sink-explorer-{uuid.uuid4().hex[:8]}"
    payload = [{"model": d["model"], "layers": d["layers"], "heads": d["heads"],
                "prompts": [_pack(p) for p in d["prompts"]]} for d in datasets]
    data_json = json.dumps(payload, separators=(",", ":")).replace("</", "<\\/")
    return _TEMPLATE.replace("@ID@", html.escape(div_id)).replace("@HEIGHT@", str(int(height))) \
                    .replace("@DATA@", data_json)


def explorer_page(datasets: list[dict], title: str) -> str:
    """A whole HTML page around ``static_explorer_html``, with plotly.js inlined: it opens from a file, offline."""
    from plotly.offline import get_plotlyjs
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>\n'
            f'<script>{get_plotlyjs()}</script></head>\n<body style="max-width:1100px;margin:1em auto">\n'
            f'<h1 style="font-family:sans-serif;font-size:20px">{html.escape(title)}</h1>\n'
            f'{static_explorer_html(datasets)}\n</body></html>\n')


_TEMPLATE = r"""<div class="sink-explorer" id="@ID@-box" style="font-family:sans-serif;font-size:14px">
<div style="display:flex;gap:12px;flex-wrap:wrap;align-items:center;margin-bottom:6px">
<label>model <select id="@ID@-model"></select></label>
<label>prompt <select id="@ID@-prompt"></select></label>
<label>layer <select id="@ID@-layer"></select></label>
<label>head <select id="@ID@-head"></select></label>
<span id="@ID@-info"></span>
</div>
<div id="@ID@" style="width:100%;height:@HEIGHT@px" data-state=""></div>
<script type="application/json" id="@ID@-data">@DATA@</script>
<script>
(function () {
  var id = "@ID@";
  var data = JSON.parse(document.getElementById(id + "-data").textContent);
  var el = function (s) { return document.getElementById(id + s); };
  var cache = {};
  function bytes(m, p) {
    var key = m + "/" + p;
    if (!cache[key]) {
      var raw = atob(data[m].prompts[p].pattern), out = new Uint8Array(raw.length);
      for (var i = 0; i < raw.length; i++) out[i] = raw.charCodeAt(i);
      cache[key] = out;
    }
    return cache[key];
  }
  function fill(select, labels, keep) {
    var old = select.value;
    select.innerHTML = "";
    labels.forEach(function (label, i) {
      var o = document.createElement("option"); o.value = i; o.textContent = label; select.appendChild(o);
    });
    if (keep && old !== "" && Number(old) < labels.length) select.value = old;
  }
  function range(n, prefix) { var a = []; for (var i = 0; i < n; i++) a.push(prefix + i); return a; }
  function refill(keep) {
    var d = data[Number(el("-model").value)];
    fill(el("-prompt"), d.prompts.map(function (p, i) { return i + ": " + p.text.slice(0, 50); }), keep);
    fill(el("-layer"), range(d.layers, ""), keep);
    fill(el("-head"), range(d.heads, ""), keep);
  }
  function draw() {
    if (typeof Plotly === "undefined") {
      el("-info").textContent = "plotly.js did not load (it is served from the book's _static).";
      return;
    }
    var m = Number(el("-model").value), p = Number(el("-prompt").value);
    var l = Number(el("-layer").value), h = Number(el("-head").value);
    var d = data[m], pr = d.prompts[p], T = pr.T, tri = T * (T + 1) / 2;
    var b = bytes(m, p), base = (l * d.heads + h) * tri, z = [], k = base;
    for (var q = 0; q < T; q++) {
      var row = new Array(T).fill(null);
      for (var j = 0; j <= q; j++) row[j] = b[k++] / 255;
      z.push(row);
    }
    var sink = pr.sink[l][h], gap = pr.gap[l][h];
    var ticks = range(T, "").map(Number);
    var labels = pr.tokens.map(function (t, i) { return i + " " + t; });
    Plotly.react(id, [{type: "heatmap", z: z, zmin: 0, zmax: 1, colorscale: "Viridis",
                      colorbar: {title: {text: "attention"}},
                      hovertemplate: "query %{y}<br>key %{x}<br>a = %{z:.3f}<extra></extra>"}],
      {title: {text: d.model + " | layer " + l + " | head " + h + " | median G = " + gap.toFixed(2), x: 0.02, xanchor: "left"},
       xaxis: {title: {text: "key"}, tickvals: ticks, ticktext: labels, tickangle: -60, tickfont: {size: 9}},
       yaxis: {title: {text: "query"}, tickvals: ticks, ticktext: labels, autorange: "reversed", tickfont: {size: 9}},
       margin: {l: 150, b: 150, t: 50, r: 20},
       shapes: [{type: "rect", xref: "x", yref: "paper", x0: sink - 0.5, x1: sink + 0.5, y0: 0, y1: 1,
                 line: {color: "red", width: 2}}]},
      {responsive: true, displaylogo: false});
    el("").setAttribute("data-state", [m, p, l, h].join(","));
    el("-info").textContent = "sink key (most frequent argmax, red box): " + sink + " " + pr.tokens[sink] +
      " | median G over queries: " + gap.toFixed(2);
  }
  fill(el("-model"), data.map(function (d) { return d.model; }), false);
  refill(false);
  el("-model").addEventListener("change", function () { refill(true); draw(); });
  ["-prompt", "-layer", "-head"].forEach(function (s) { el(s).addEventListener("change", draw); });
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", draw); else draw();
})();
</script>
</div>"""


# ---- ipywidgets for a live kernel -------------------------------------------------------------------------

def heatmap_figure(data: dict, prompt: int, layer: int, head: int):
    """plotly Figure of one head's pattern with token labels, the sink column boxed and G in the title."""
    import plotly.graph_objects as go
    pr = data["prompts"][prompt]
    T = len(pr["tokens"])
    z = pr["pattern"][layer, head].astype(np.float32) / 255
    z = np.where(np.tril(np.ones((T, T), dtype=bool)), z, np.nan)
    labels = [f"{i} {t}" for i, t in enumerate(pr["tokens"])]
    sink = int(pr["sink"][layer, head])
    fig = go.Figure(go.Heatmap(z=z, zmin=0, zmax=1, colorscale="Viridis",
                               hovertemplate="query %{y}<br>key %{x}<br>a = %{z:.3f}<extra></extra>"))
    fig.update_layout(title=f"{data['model']} | layer {layer} | head {head} | median G = {pr['gap'][layer, head]:.2f}",
                      height=600, margin=dict(l=150, b=150, t=50, r=20))
    fig.update_xaxes(title="key", tickvals=list(range(T)), ticktext=labels, tickangle=-60, tickfont=dict(size=9))
    fig.update_yaxes(title="query", tickvals=list(range(T)), ticktext=labels, autorange="reversed", tickfont=dict(size=9))
    fig.add_shape(type="rect", xref="x", yref="paper", x0=sink - 0.5, x1=sink + 0.5, y0=0, y1=1,
                  line=dict(color="red", width=2))
    return fig


def widget_explorer(data: dict):
    """ipywidgets: dropdowns for prompt, layer and head over one model's ``explorer_data``."""
    import ipywidgets as widgets
    prompt = widgets.Dropdown(options=[(f"{i}: {p['text'][:50]}", i) for i, p in enumerate(data["prompts"])],
                              description="prompt")
    layer = widgets.IntSlider(0, 0, data["layers"] - 1, description="layer")
    head = widgets.IntSlider(0, 0, data["heads"] - 1, description="head")
    # An Output area redrawn on change: plotly's FigureWidget would need the anywidget package.
    output = widgets.Output()

    def update(_=None):
        from .display import show_plotly
        output.clear_output(wait=True)
        with output:
            show_plotly(heatmap_figure(data, prompt.value, layer.value, head.value))
    for w in (prompt, layer, head):
        w.observe(update, names="value")
    update()
    return widgets.VBox([widgets.HBox([prompt, layer, head]), output])
