"""Figures of the gradient-sinks chapter: curves against their thresholds along training, the two models' losses
and per-layer probes, Bloat / Change / Compress against activation norm (Fig. 3 analog) and what V-scale learned
(Fig. 13 analog)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..interventions.vscale import valve_constant
from ..measures.gradprobes import RGS_T_E


def threshold_figure(curves: dict[str, pd.DataFrame], columns: tuple, titles: tuple, thresholds: tuple):
    """One panel per column: each curve (a table with ``step`` and the columns) against the step, and its
    threshold as a dashed line."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    fig = make_subplots(rows=1, cols=len(columns), subplot_titles=titles)
    for name, t in curves.items():
        for col, key in enumerate(columns, start=1):
            fig.add_trace(go.Scatter(x=t.step, y=t[key], name=name, legendgroup=name, showlegend=col == 1,
                                     mode="lines+markers"), 1, col)
    for col, y in enumerate(thresholds, start=1):
        fig.add_hline(y=y, line_dash="dash", row=1, col=col)
    fig.update_xaxes(title_text="step")
    fig.update_layout(height=330)
    return fig


def training_figure(losses: dict[str, tuple[pd.DataFrame, pd.DataFrame]]):
    """Per model: (training history with ``step``, ``loss``; evaluations with ``step``, ``val_loss``)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    fig = make_subplots(rows=1, cols=2, subplot_titles=("training loss (50-step mean)", "validation loss"))
    for name, (h, e) in losses.items():
        fig.add_trace(go.Scatter(x=h.step, y=h.loss.rolling(50, min_periods=1).mean(), name=f"{name} train"), 1, 1)
        fig.add_trace(go.Scatter(x=e.step, y=e.val_loss, name=f"{name} val", mode="lines+markers"), 1, 2)
    fig.update_layout(height=350, xaxis_title="step", xaxis2_title="step")
    return fig


def per_layer_figure(per_layer: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]):
    """Per model: (R_GS(0; 31), token 0's residual norm, Sink^eps(0)), each per layer."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    fig = make_subplots(rows=1, cols=3, subplot_titles=("R_GS(0; 31) per layer", "token-0 residual norm per layer",
                                                        "Sink^eps(0) per layer"))
    for name, curves in per_layer.items():
        x = list(range(len(curves[0])))
        for col, y in enumerate(curves, start=1):
            fig.add_trace(go.Scatter(x=x, y=y, name=name, mode="lines+markers", legendgroup=name,
                                     showlegend=col == 1), 1, col)
    fig.update_xaxes(title_text="layer")
    fig.update_layout(height=350)
    return fig


def ratio_scatter(input_norm: np.ndarray, attn_ratios: dict[str, np.ndarray], title: str):
    """Bloat, Change and Compress of the attention branch against the layer-input norm; token 0 in red."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(12, 3.2))
    axes = fig.subplots(1, 3)
    x = np.log10(input_norm)
    first = np.zeros_like(x, dtype=bool)
    first[:, :, 0] = True
    for ax, key in zip(axes, ("bloat", "change", "compress")):
        y = np.log10(attn_ratios[key])
        ax.scatter(x[~first], y[~first], s=2, alpha=0.25, color="tab:blue", label="tokens > 0")
        ax.scatter(x[first], y[first], s=10, color="tab:red", label="token 0")
        ax.set_xlabel("log10 ||h^l_t||")
        ax.set_ylabel(f"log10 {key} (attention)")
    axes[0].legend(loc="best", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def theta_figure(theta, value_norms, d_model: int, d_head: int):
    """Learned theta as a heatmap, and token 0's raw ||v||^2 against C per layer (median over heads)."""
    import seaborn as sns
    from matplotlib.figure import Figure
    theta = np.asarray(theta)
    c = valve_constant(theta, d_model, d_head)
    v0_sq = value_norms[:, :, 0] ** 2
    rest_sq = (value_norms[:, :, 1:RGS_T_E + 1] ** 2).mean(-1)
    fig = Figure(figsize=(11, 3.4))
    axes = fig.subplots(1, 2)
    sns.heatmap(theta, ax=axes[0], cmap="RdBu_r", center=0, annot=theta.size <= 64, fmt=".2f")
    axes[0].set_xlabel("head")
    axes[0].set_ylabel("layer")
    axes[0].set_title("learned theta")
    axes[1].semilogy(np.median(v0_sq / c, axis=1), "o-", label="token 0: ||v_0||^2 / C")
    axes[1].semilogy(np.median(rest_sq / c, axis=1), "s-", label=f"tokens 1-{RGS_T_E}: mean ||v_t||^2 / C")
    axes[1].axhline(1, color="gray", lw=0.8)
    axes[1].set_xlabel("layer")
    axes[1].legend(fontsize=8)
    axes[1].set_title("raw value norm against the valve constant (median over heads)")
    fig.tight_layout()
    return fig
