"""Figures of the OutRo text chapter: Phi_LLM's sinks per layer, attention to the sink with and without
rotation (Fig. 7 analog), sink score against alignment with the sink value (Fig. B.1 analog), the held-out loss
against the rotation strength."""
from __future__ import annotations

import numpy as np
import pandas as pd

from .panels import AFTER, BEFORE, before_after, model_panels


def _layer_panels(specs: list[str], title: str, y_title: str, height: int = 340):
    fig = model_panels(specs)
    for i in range(1, len(specs) + 1):
        fig.update_xaxes(title_text="layer", row=1, col=i)
    fig.update_yaxes(title_text=y_title, row=1, col=1)
    fig.update_layout(height=height, title=title)
    return fig


def sinks_figure(shares: dict[str, tuple[np.ndarray, np.ndarray]]):
    """Per model: (share of prompt tokens flagged at each layer, cumulative share: what OutRo excludes)."""
    import plotly.graph_objects as go
    fig = _layer_panels(list(shares), "Phi_LLM sinks per layer (calibration prompts)", "share of prompt tokens")
    for i, (flagged, cumulative) in enumerate(shares.values(), start=1):
        fig.add_trace(go.Bar(y=flagged, name="flagged at this layer", marker_color=BEFORE,
                             showlegend=i == 1), row=1, col=i)
        fig.add_trace(go.Scatter(y=cumulative, name="cumulative (what OutRo excludes)",
                                 line=dict(color=AFTER), showlegend=i == 1), row=1, col=i)
    return fig


def redistribution_figure(sink_attention: dict[str, tuple[np.ndarray, np.ndarray] | None], gamma: float):
    """Per model: (attention mass on the sink per layer at baseline, rotated), or None where nothing was measured
    (the panel stays empty)."""
    fig = _layer_panels(list(sink_attention), "Attention to the sink token per layer (Fig. 7 analog)",
                        "attention mass on the sink")
    for i, curves in enumerate(sink_attention.values(), start=1):
        if curves is not None:
            before_after(fig, i, *curves, names=("baseline", f"rotated (gamma={gamma:g})"))
    return fig


def alignment_figure(heads: dict[str, pd.DataFrame | None]):
    """Per model: one point per head (DataFrame: layer, head, sink_score, cosine), or None (empty panel)."""
    import plotly.graph_objects as go
    specs = list(heads)
    fig = model_panels(specs)
    for i, h in enumerate(heads.values(), start=1):
        if h is None:
            continue
        fig.add_trace(go.Scatter(x=h.cosine, y=h.sink_score, mode="markers",
                                 marker=dict(size=5, color=h.layer, colorscale="Viridis",
                                             showscale=i == len(specs), colorbar=dict(title="layer")),
                                 text=[f"L{l}H{k}" for l, k in zip(h.layer, h["head"])],
                                 showlegend=False), row=1, col=i)
        fig.update_xaxes(title_text="cos(head output, sink value)", row=1, col=i)
    fig.update_yaxes(title_text="sink score", row=1, col=1)
    fig.update_layout(height=360, title="Sink score vs alignment with the sink value, one point per head "
                                        "(Fig. B.1 analog)")
    return fig


def rotation_strength_figure(deltas: dict[str, dict[float, float]]):
    """Per model: {gamma: mean loss on the sweep windows - mean loss without rotation}."""
    import plotly.graph_objects as go
    fig = go.Figure()
    for spec, by_gamma in deltas.items():
        fig.add_trace(go.Scatter(x=sorted(by_gamma), y=[by_gamma[g] for g in sorted(by_gamma)],
                                 mode="lines+markers", name=spec))
    fig.add_hline(y=0, line_dash="dot")
    fig.update_layout(height=340, title="Held-out loss change with rotation strength (sweep windows)",
                      xaxis_title="gamma", yaxis_title="loss - no rotation (nats)")
    return fig
