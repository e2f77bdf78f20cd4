"""Figures of the theorems chapter (VL paper): Theorem 1's B_gap against its bound over random draws, B_gap as
the inputs are scaled with and without QK-RMSNorm, the sink lead under layerwise QK-RMSNorm, Lemma 1."""
from __future__ import annotations

import numpy as np

MAX_DRAWS_PLOTTED = 1500      # a scatter of more points only slows the page; the histogram shows every draw


def theorem1_figure(ratio: np.ndarray, bound: np.ndarray, b_gap: np.ndarray, paper: dict):
    """Histogram of B_gap / bound over the draws and B_gap against the bound (a seeded sample of the draws);
    ``paper``: App. A.6's draw (``ratio``, ``bound``, ``B_gap``)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    n = len(ratio)
    fig = make_subplots(rows=1, cols=2, subplot_titles=("B_gap / specialised bound", "B_gap against the bound"))
    fig.add_trace(go.Histogram(x=ratio, nbinsx=60, name="ratio", showlegend=False), row=1, col=1)
    fig.add_vline(x=paper["ratio"], line_dash="dash", line_color="crimson", row=1, col=1,
                  annotation_text=f"paper's draw ({paper['ratio']})", annotation_position="top left")
    fig.add_vline(x=1.0, line_color="black", row=1, col=1)
    shown = np.random.default_rng(0).choice(n, size=min(MAX_DRAWS_PLOTTED, n), replace=False)
    fig.add_trace(go.Scattergl(x=bound[shown], y=b_gap[shown], mode="markers",
                               marker=dict(size=4, opacity=0.5), name="draws"), row=1, col=2)
    lim = [float(bound.min()) * 0.5, float(bound.max()) * 1.5]
    fig.add_trace(go.Scatter(x=lim, y=lim, mode="lines", line=dict(color="black"), name="B_gap = bound"),
                  row=1, col=2)
    fig.add_trace(go.Scatter(x=[paper["bound"]], y=[paper["B_gap"]], mode="markers",
                             marker=dict(symbol="x", size=12, color="crimson"), name="paper's draw"), row=1, col=2)
    fig.update_xaxes(title_text="ratio", row=1, col=1)
    fig.update_xaxes(title_text="specialised bound", type="log", row=1, col=2)
    fig.update_yaxes(title_text="draws", row=1, col=1)
    fig.update_yaxes(title_text="B_gap (exact)", type="log", row=1, col=2)
    fig.update_layout(height=420, legend=dict(orientation="h", y=-0.2))
    return fig


def qknorm_sweep_figure(scales: np.ndarray, sweep: dict, c: float):
    """Median B_gap and its bound, without and with per-head QK-RMSNorm (Eq. 5 with constant ``c``), per scale."""
    import plotly.graph_objects as go
    fig = go.Figure()
    for key, name, dash in [("B_gap_plain", "B_gap, no QK-norm", None), ("bound_plain", "bound, no QK-norm", "dash"),
                            ("B_gap_qknorm", "B_gap, per-head QK-norm", None),
                            ("bound_qknorm", f"Eq. 5 bound (c = {c:g}, ours)", "dash")]:
        fig.add_trace(go.Scatter(x=scales, y=sweep[key], mode="lines+markers", name=name, line=dict(dash=dash)))
    fig.update_layout(title="Median B_gap as every hidden state is scaled", xaxis=dict(title="input scale", type="log"),
                      yaxis=dict(title="nats", type="log"), height=420, legend=dict(orientation="h", y=-0.25))
    return fig


def compression_figure(compression: np.ndarray, lead_change: np.ndarray):
    """Per draw where head 0 is a sink head: G layerwise - G per-head against the largest compression factor."""
    import plotly.graph_objects as go
    fig = go.Figure()
    fig.add_trace(go.Scattergl(x=compression, y=lead_change, mode="markers",
                               marker=dict(size=4, opacity=0.5), name="head 0, one draw"))
    fig.add_vline(x=1.0, line_dash="dash")
    fig.add_hline(y=0.0, line_color="black")
    fig.update_layout(title="Sink lead under layerwise minus per-head QK-RMSNorm",
                      xaxis=dict(title="largest logit compression factor H rho_q rho_k", type="log"),
                      yaxis=dict(title="G layerwise - G per-head (nats)"), height=420)
    return fig


def lemma1_figure(random_cases: dict, paper_bound: float, paper_mass: float):
    """Non-sink mass after the worst perturbation against sigma(B - G): random instances (``bound``,
    ``non_sink_mass``) and the paper's worked case."""
    import plotly.graph_objects as go
    fig = go.Figure()
    fig.add_trace(go.Scattergl(x=random_cases["bound"], y=random_cases["non_sink_mass"], mode="markers",
                               marker=dict(size=4, opacity=0.5), name="random instances"))
    fig.add_trace(go.Scatter(x=[1e-6, 1], y=[1e-6, 1], mode="lines", line=dict(color="black"), name="equality"))
    fig.add_trace(go.Scatter(x=[paper_bound], y=[paper_mass], mode="markers",
                             marker=dict(symbol="x", size=12, color="crimson"), name="paper's case"))
    fig.update_layout(title="Lemma 1: non-sink mass after perturbation against sigma(B - G)",
                      xaxis=dict(title="sigma(B_gap - G)", type="log"), yaxis=dict(title="1 - a'_sink", type="log"),
                      height=420)
    return fig
