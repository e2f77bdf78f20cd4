"""Figures of the chapter on gradient sinks where there is a sink: R_GS on pretrained models, and the synthetic
setting's seeds, baseline against V-scale."""
from __future__ import annotations

import numpy as np
import pandas as pd


def r_gs_box(r_gs: dict[str, np.ndarray]):
    """Per model: R_GS(0; 31) over layers as a box, against the paper's band of 10 to 100."""
    import plotly.graph_objects as go
    box = go.Figure()
    for spec, values in r_gs.items():
        box.add_trace(go.Box(y=values, name=spec, boxpoints="all"))
    box.add_hrect(y0=10, y1=100, fillcolor="gray", opacity=0.15, line_width=0)
    box.update_layout(yaxis_type="log", yaxis_title="R_GS(0; 31) over layers", height=380)
    return box


def setting_figure(rows: pd.DataFrame):
    """Per seed, baseline against V-scale: median R_GS, Sink^eps and validation loss."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    columns = ("median R_GS", "Sink^eps middle", "token-0 ratio", "val loss")
    fig = make_subplots(rows=1, cols=len(columns), subplot_titles=columns)
    for name, group in rows.groupby("model", sort=False):
        for j, col in enumerate(columns, start=1):
            fig.add_trace(go.Scatter(x=group.seed.astype(str), y=group[col], mode="markers", name=name,
                                     legendgroup=name, showlegend=j == 1, marker_size=10), 1, j)
    fig.update_xaxes(title_text="seed")
    fig.update_layout(height=320)
    return fig
