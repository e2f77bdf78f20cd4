"""Figures of the protection chapter: text capability per intervention, the trade-off against image accuracy, the
sink along training per intervention."""
from __future__ import annotations

import pandas as pd

from .panels import model_panels


def capability_figure(table: pd.DataFrame, models: list, tasks: tuple, colours=("#d62728", "#1f77b4")):
    """Per model: each arm's change of every task from the unadapted model (column ``_TASK_change``, pt)."""
    fig = model_panels(models, shared_yaxes=True)
    for col, model in enumerate(models, start=1):
        t = table[table.model == model]
        for task, colour in zip(tasks, colours):
            if f"_{task}_change" in t:
                fig.add_bar(x=t.arm, y=t[f"_{task}_change"], name=task, marker_color=colour,
                            showlegend=col == 1, row=1, col=col)
    fig.update_yaxes(title_text="change from the unadapted model (pt)", row=1, col=1)
    fig.update_layout(height=400, barmode="group", title="Text capability after each intervention (seed means)")
    return fig


def tradeoff_figure(table: pd.DataFrame, task: str):
    """One point per arm and seed: share of the unadapted ``task`` score kept against image accuracy."""
    import plotly.express as px
    fig = px.scatter(table, x="image accuracy", y="text kept", color="arm", symbol="model", hover_data=["seed"],
                     title=f"Trade-off: {task} kept (share of the unadapted score) against image accuracy")
    fig.add_hline(y=1.0, line_dash="dash", annotation_text="unadapted")
    fig.update_layout(height=420)
    return fig


def sink_figure(probes: dict[str, list[tuple[str, list[dict]]]]):
    """Per model: (run name, its probes with ``step`` and ``S``) for each run; runs without probes draw nothing."""
    fig = model_panels(list(probes))
    for col, runs in enumerate(probes.values(), start=1):
        for name, run_probes in runs:
            steps = sorted(run_probes, key=lambda p: p["step"])
            if steps:
                fig.add_scatter(x=[p["step"] for p in steps], y=[p["S"] for p in steps], mode="lines+markers",
                                name=name, row=1, col=col)
    fig.update_layout(height=380, title="Sink Strength along stage 2 (probes)")
    return fig


def recovery_figure(curve: pd.DataFrame):
    """The fixed-scale model's recovery phase: relative logit error against the unchanged model per step, a line
    per model and seed (columns model, seed, step, relative logit error)."""
    import plotly.express as px
    curve = curve.assign(run=curve.model + ", seed " + curve.seed.astype(str))
    fig = px.line(curve, x="step", y="relative logit error", color="run", markers=True,
                  title="Recovery phase: the fixed-scale model's logits against the unchanged model's (held-out text)")
    fig.update_yaxes(rangemode="tozero")
    fig.update_layout(height=380)
    return fig
