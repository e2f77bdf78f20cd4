"""Figures of the predictor chapter: bootstrap distributions of rho, S against the IFEval change with the six-pair
fit (VL paper, Table 11), the six held-out residuals, our models placed on the fit (an extrapolation)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..measures import regression as R

QK_COLOURS = {"per-head": "#1b9e77", "per-head (MoE)": "#66a61e", "none": "#d95f02", "layerwise": "#7570b3",
              "layerwise (MoE)": "#e7298a"}


def bootstrap_figure(samples: dict, names, n_bootstrap: int):
    """Kernel density of the bootstrap rho of the main panels (plotly, so it stays interactive in the book)."""
    import plotly.graph_objects as go
    from scipy.stats import gaussian_kde
    fig = go.Figure()
    grid = np.linspace(-1, 1, 201)
    for name in names:
        values = np.asarray(samples.get(name, []), float)
        if len(values) < 2 or np.ptp(values) == 0:
            continue
        fig.add_trace(go.Scatter(x=grid, y=gaussian_kde(values)(grid), mode="lines", name=name))
    fig.update_layout(title=f"Bootstrap distributions of rho ({n_bootstrap} resamples)",
                      xaxis_title="bootstrap Spearman rho", yaxis_title="density", height=360)
    return fig


def s_scatter_figure(frame: pd.DataFrame, fit: tuple[float, float]):
    """Table 11's pairs (s, delta_ifeval, pair, reference_llm, qk_class, "in six", the held-out predictions
    heldout17 and heldout6) by QK-norm class, and the six-pair fit line ``fit`` = (intercept, slope)."""
    import plotly.graph_objects as go
    fig = go.Figure()
    for qk, grp in frame.groupby("qk_class"):
        fig.add_trace(go.Scatter(
            x=grp.s, y=grp.delta_ifeval, mode="markers", name=qk,
            marker=dict(size=np.where(grp["in six"], 14, 10), color=QK_COLOURS.get(qk, "grey"),
                        symbol=np.where(grp["in six"], "circle", "diamond"), line=dict(width=1, color="black")),
            customdata=np.stack([grp.pair, grp.reference_llm, grp.qk_class, grp.heldout17.round(2),
                                 grp.heldout6.round(2).astype(object).where(grp["in six"], "-")], axis=1),
            hovertemplate="<b>%{customdata[0]}</b><br>reference: %{customdata[1]}<br>QK: %{customdata[2]}<br>"
                          "S = %{x:.2f}, Delta IFEval = %{y:.1f} pt<br>held-out prediction (17-pair fit): "
                          "%{customdata[3]} pt<br>held-out prediction (six-pair fit): %{customdata[4]} pt<extra></extra>"))
    xs = np.linspace(min(-0.4, frame.s.min()), max(2.5, frame.s.max()), 50)
    fig.add_trace(go.Scatter(x=xs, y=fit[0] + fit[1] * xs, mode="lines", name="six-pair fit",
                             line=dict(dash="dash", color="grey"), hoverinfo="skip"))
    fig.update_layout(title="S of the reference LLM against the VLM's IFEval change (VL paper, Table 11)",
                      xaxis_title="S (reference LLM)", yaxis_title="Delta IFEval (pt)", height=480,
                      legend_title="QK-norm class")
    return fig


def residual_figure(pairs, residuals):
    """Per pair of the six: observed minus held-out prediction, in points."""
    import plotly.graph_objects as go
    bars = go.Figure(go.Bar(x=pairs, y=residuals, marker_color="#7570b3",
                            hovertemplate="%{x}: %{y:+.2f} pt<extra></extra>"))
    bars.update_layout(title="Six pairs: observed minus held-out prediction", yaxis_title="pt", height=340)
    return bars


def placement_figure(placement: pd.DataFrame, six: pd.DataFrame, level: float):
    """Our models' predictions on the six-pair fit (``placement`` rows of fit "six pairs") with the fit's
    prediction band at ``level``, over the six pairs themselves."""
    import plotly.graph_objects as go
    mine = placement[placement.fit == "six pairs"]
    xs = np.linspace(min(-0.4, mine.S.min() - 0.2), max(2.5, mine.S.max() + 0.2), 60)
    band = R.predict_with_interval(six.s, six.delta_ifeval_counts, xs, level)
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=six.s, y=six.delta_ifeval_counts, mode="markers", name="six pairs (paper)",
                             marker=dict(size=11, color="#7570b3"), customdata=six.pair,
                             hovertemplate="%{customdata}<br>S = %{x:.2f}<br>Delta = %{y:.2f} pt<extra></extra>"))
    fig.add_trace(go.Scatter(x=np.r_[xs, xs[::-1]], y=np.r_[band.pi_high, band.pi_low[::-1]], fill="toself",
                             fillcolor="rgba(120,120,120,0.2)", line=dict(width=0), name=f"{level:.0%} prediction band",
                             hoverinfo="skip"))
    fig.add_trace(go.Scatter(x=xs, y=band.predicted_delta, mode="lines", name="six-pair fit",
                             line=dict(dash="dash", color="grey"), hoverinfo="skip"))
    fig.add_trace(go.Scatter(x=mine.S, y=mine.predicted_delta, mode="markers", name="our models (extrapolation)",
                             marker=dict(size=14, symbol="star", color="#d95f02"),
                             error_y=dict(type="data", symmetric=False, array=mine.pi_high - mine.predicted_delta,
                                          arrayminus=mine.predicted_delta - mine.pi_low),
                             customdata=mine.model, hovertemplate="%{customdata} (extrapolation)<br>S = %{x:.2f}<br>"
                             "predicted Delta = %{y:.1f} pt<extra></extra>"))
    fig.update_layout(title="Our models on the six-pair fit: an extrapolation", xaxis_title="S",
                      yaxis_title="Delta IFEval (pt)", height=430)
    return fig
