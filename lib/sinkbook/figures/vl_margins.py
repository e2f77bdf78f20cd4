"""Figures of the VL-margins chapter: the trajectories of Table 14, VL adaptation against text-only training of
the same backbone."""
from __future__ import annotations

import pandas as pd


def trajectory_figure(t14: pd.DataFrame):
    """Table 14 (step, vl_s, vl_ifeval, text_s, text_ifeval): S and IFEval by step for both runs, and IFEval
    against S after step 0."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    fig = make_subplots(rows=1, cols=3, subplot_titles=("Sink Strength by step", "IFEval by step",
                                                        "IFEval against S (after step 0)"))
    after = t14[t14.step > 0]
    for run, s_col, ifeval_col, colour in (("VL adaptation", "vl_s", "vl_ifeval", "#d95f02"),
                                           ("Tulu (text-only)", "text_s", "text_ifeval", "#1b9e77")):
        fig.add_trace(go.Scatter(x=t14.step, y=t14[s_col], mode="lines+markers", name=run, legendgroup=run,
                                 line=dict(color=colour)), row=1, col=1)
        fig.add_trace(go.Scatter(x=t14.step, y=t14[ifeval_col], mode="lines+markers", name=run, legendgroup=run,
                                 line=dict(color=colour), showlegend=False), row=1, col=2)
        fig.add_trace(go.Scatter(x=after[s_col], y=after[ifeval_col], mode="markers", name=run, legendgroup=run,
                                 marker=dict(color=colour), showlegend=False, customdata=after.step,
                                 hovertemplate="step %{customdata}<br>S = %{x:.2f}<br>IFEval = %{y:.1f}<extra></extra>"),
                      row=1, col=3)
    fig.update_xaxes(title_text="step", row=1, col=1)
    fig.update_xaxes(title_text="step", row=1, col=2)
    fig.update_xaxes(title_text="S", row=1, col=3)
    fig.update_layout(height=360, legend=dict(orientation="h", y=-0.25))
    return fig
