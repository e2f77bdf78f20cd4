"""Figures of the vision-language adaptation chapter: text capability after vision and text-only training, the
sink and text skill along training, Theorem 1's bound against the actual updates, erosion against loss."""
from __future__ import annotations

import pandas as pd

from .panels import model_panels

RUN_COLOURS = {"vision": "#d62728", "text": "#1f77b4"}


def capability_figure(table: pd.DataFrame, models: list):
    """Per model: each task's change after the vision and the text-only run (rows model, task, run, "change (pt)",
    low, high), with its paired 95% interval."""
    fig = model_panels(models, shared_yaxes=True)
    for col, model in enumerate(models, start=1):
        for modality, colour in RUN_COLOURS.items():
            t = table[(table.model == model) & (table.run == modality)]
            fig.add_bar(x=t.task, y=t["change (pt)"], name=f"{modality} run", marker_color=colour,
                        error_y=dict(type="data", symmetric=False, array=t.high - t["change (pt)"],
                                     arrayminus=t["change (pt)"] - t.low), showlegend=col == 1, row=1, col=col)
    fig.update_yaxes(title_text="change after training (pt), paired 95% interval", row=1, col=1)
    fig.update_layout(height=380, barmode="group", title="Text capability after vision vs text-only training")
    return fig


def erosion_figure(traj: pd.DataFrame, models: list):
    """One row of panels per model, one panel per probed quantity, one line per run and seed (``trajectory_table``)."""
    from plotly.subplots import make_subplots
    panels = [("S", "Sink Strength S"), ("pos0_mass", "attention on the first token"),
              ("margin_G_minus_B", "median G - median B"), ("arithmetic_strict", "arithmetic, strict (probe)"),
              ("arithmetic_flexible", "arithmetic, flexible (probe)"), ("heldout_loss", "held-out text loss")]
    panels = [(c, t) for c, t in panels if c in traj]
    fig = make_subplots(rows=len(models), cols=len(panels), subplot_titles=[t for _ in models for _, t in panels])
    for r, model in enumerate(models, start=1):
        for c, (column, _) in enumerate(panels, start=1):
            for (modality, seed), t in traj[traj.model == model].groupby(["run", "seed"]):
                t = t.sort_values("step")
                fig.add_scatter(x=t.step, y=t[column], mode="lines+markers", line_color=RUN_COLOURS[modality],
                                name=f"{modality} run", legendgroup=modality, showlegend=(r, c, seed) == (1, 1, min(traj.seed)),
                                row=r, col=c)
    fig.update_layout(height=300 * len(models), title="Along training (probes; one line per seed)")
    fig.update_xaxes(title_text="stage-2 step")
    return fig


def theorem1_figure(points: dict[str, tuple[list, list]]):
    """Per run ("model modality sSEED"): (Theorem 1's bound, projection-only B_gap) per (layer, head, query)."""
    import plotly.graph_objects as go
    fig = go.Figure()
    for name, (bound, b_gap) in points.items():
        fig.add_scatter(x=bound, y=b_gap, mode="markers", marker=dict(size=4, opacity=0.5), name=name)
    fig.add_scatter(x=[1e-4, 1e4], y=[1e-4, 1e4], mode="lines", line=dict(color="black", dash="dash"), name="B = bound")
    fig.update_layout(height=420, title="Projection-only B_gap against Theorem 1's bound",
                      xaxis=dict(title="bound", type="log"), yaxis=dict(title="B_gap (W_q, W_k of the run)", type="log"))
    return fig


def dose_figure(pts: pd.DataFrame, model: str, metric: str):
    """Every probe of every run of ``model``: sink erosion against the loss of ``metric`` (``dose_points``)."""
    import plotly.express as px
    fig = px.scatter(pts, x="erosion", y="text loss", color="modality", symbol="run", hover_data=["step"],
                     title=f"{model}: S_0 - S_t against the loss of {metric} (probe)")
    fig.update_layout(height=360)
    return fig
