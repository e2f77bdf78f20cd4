"""Figures of the OutRo chapter on vision-language models: validation accuracy against the rotation strength
(Fig. B.2), attention to the sink with and without rotation (Fig. 7) and Zero-K (Fig. 4), pruning image tokens
(Fig. 9), sink norms (Fig. 3a) and the sink's residual stream under relaxation (Fig. 6). The chapter passes the
mean over its seeds of each curve."""
from __future__ import annotations

import numpy as np

from .panels import before_after, model_panels


def rotation_strength_figure(gains: dict[str, dict[float, float]]):
    """Per model: {gamma: validation accuracy with OutRo - without}."""
    import plotly.graph_objects as go
    fig = go.Figure()
    for spec, by_gamma in gains.items():
        fig.add_trace(go.Scatter(x=list(by_gamma), y=list(by_gamma.values()), mode="lines+markers", name=spec))
    fig.add_hline(y=0, line_dash="dot")
    fig.update_layout(height=340, title="Validation accuracy with OutRo against no OutRo, by rotation strength",
                      xaxis_title="gamma", yaxis_title="accuracy - no OutRo")
    return fig


def sink_attention_figure(curves: dict[str, tuple[np.ndarray, np.ndarray, tuple[str, str]]], title: str):
    """Per model: (attention to the sink per layer without, with the intervention, their two names)."""
    fig = model_panels(list(curves))
    for i, (before, after, names) in enumerate(curves.values(), start=1):
        before_after(fig, i, before, after, names)
    fig.update_yaxes(title_text="attention to the sink", row=1, col=1)
    fig.update_layout(height=340, title=title)
    return fig


def pruning_figure(curves: dict[str, tuple[list[float], list[float]]]):
    """Per curve name ("model: method"): (share of image tokens kept, accuracy)."""
    import plotly.graph_objects as go
    fig = go.Figure()
    for name, (kept, accuracy) in curves.items():
        fig.add_scatter(x=kept, y=accuracy, mode="lines+markers", name=name)
    fig.update_layout(height=340, title="Accuracy against the share of image tokens kept",
                      xaxis_title="share of image tokens kept", yaxis_title="accuracy")
    return fig


def norms_figure(ratios: dict[str, tuple[np.ndarray, np.ndarray]]):
    """Per model: (sink key norm / others' median, sink value norm / others' median) per layer, median over heads."""
    fig = model_panels(list(ratios))
    for i, (key, value) in enumerate(ratios.values(), start=1):
        before_after(fig, i, key, value, ("key", "value"))
    fig.add_hline(y=1, line_dash="dot")
    fig.update_yaxes(title_text="sink norm / others' median", type="log", row=1, col=1)
    fig.update_layout(height=340, title="Sink key and value norms against the other tokens', median over heads (Fig. 3a)")
    return fig


def relaxation_figure(cosines: dict[str, np.ndarray]):
    """Per model: cosine of the sink's residual stream with and without relaxation, per layer (NaN: not relaxed)."""
    import plotly.graph_objects as go
    fig = go.Figure()
    for spec, cosine in cosines.items():
        fig.add_scatter(y=cosine, mode="lines+markers", name=spec)
    fig.update_layout(height=320, title="Cosine of the sink's residual stream with and without relaxation",
                      xaxis_title="layer", yaxis_title="cosine")
    return fig
