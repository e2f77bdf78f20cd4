"""Figures of the sink-criteria chapter: sink tokens per layer under Phi_LLM and Phi_VLM (OutRo Fig. 1a / A.2
analog), Zero-K (Figs. 4-5 analog), median G per head and G by layer, the head fraction and column mass."""
from __future__ import annotations

import itertools
import math

import pandas as pd

from ..measures.strength import STRONG_SINK_G


def _grid(n: int) -> tuple[int, int]:
    cols = min(n, 3)
    return math.ceil(n / cols), cols


def grid_panels(titles, **kwargs):
    """One panel per title, at most three to a row: (figure, (row, col) of each panel, number of rows)."""
    from plotly.subplots import make_subplots
    rows, cols = _grid(len(titles))
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=list(titles), **kwargs)
    places = [(i // cols + 1, i % cols + 1) for i in range(len(titles))]
    return fig, places, rows


def census_figure(per_layer: dict[str, tuple[pd.DataFrame, int]], taus: list[float]):
    """Per model: (``sink_census`` layer table, tokens counted); Phi_LLM's share per layer as bars and Phi_VLM's at
    each tau as lines."""
    specs = list(per_layer)
    fig, places, n_rows = grid_panels(specs, shared_yaxes=True)
    colours = ["#d62728", "#ff7f0e", "#2ca02c", "#9467bd"]
    for i, (spec, (row, col)) in enumerate(zip(specs, places)):
        layers, n_tokens = per_layer[spec]
        fig.add_bar(x=layers.layer, y=layers.phi_llm_sinks / n_tokens, name="Phi_LLM", row=row, col=col,
                    marker_color="black", showlegend=i == 0)
        for t, colour in zip(taus, itertools.cycle(colours)):
            fig.add_scatter(x=layers.layer, y=layers[f"phi_vlm_{t:g}"] / n_tokens, mode="lines+markers",
                            name=f"Phi_VLM tau={t:g}", line_color=colour, row=row, col=col, showlegend=i == 0)
    fig.update_yaxes(title_text="share of tokens flagged", col=1)
    fig.update_xaxes(title_text="layer")
    fig.update_layout(height=380 * n_rows + 40, title="Sink tokens per layer (OutRo Fig. 1a / A.2 analog)")
    return fig


def zero_k_figure(zero_k: dict[str, pd.DataFrame]):
    """Per model: attention to token 0 per layer (layer, before, after) without and with Zero-K."""
    specs = list(zero_k)
    fig, places, n_rows = grid_panels(specs, shared_yaxes=True)
    for i, (spec, (row, col)) in enumerate(zip(specs, places)):
        z = zero_k[spec]
        fig.add_scatter(x=z.layer, y=z.before, name="baseline", line_color="black", row=row, col=col,
                        showlegend=i == 0)
        fig.add_scatter(x=z.layer, y=z.after, name="Zero-K top-1", line_color="#d62728", row=row, col=col,
                        showlegend=i == 0)
    fig.update_yaxes(title_text="attention to token 0", range=[0, 1], col=1)
    fig.update_xaxes(title_text="layer")
    fig.update_layout(height=360 * n_rows + 40, title="Zero-K (OutRo Fig. 4/5 analog)")
    return fig


def head_heatmaps(heads: dict[str, pd.DataFrame]):
    """Per model: median G per (layer, head) from its ``head_table``."""
    specs = list(heads)
    fig, places, n_rows = grid_panels([f"{s}: median G per (layer, head)" for s in specs])
    for spec, (row, col) in zip(specs, places):
        grid = heads[spec].pivot(index="head", columns="layer", values="median_G")
        fig.add_heatmap(z=grid.values, x=grid.columns, y=grid.index, coloraxis="coloraxis", row=row, col=col)
    fig.update_layout(height=340 * n_rows + 40, coloraxis=dict(colorscale="RdBu", cmid=0, colorbar_title="median G"))
    fig.update_xaxes(title_text="layer")
    fig.update_yaxes(title_text="head", col=1)
    return fig


def layer_boxes(boxes: dict[str, tuple[pd.DataFrame, int]]):
    """Per model: (``layer_quantiles`` of G, the window of last layers). Box plots drawn from precomputed quartiles,
    so the page does not carry every gap."""
    import plotly.graph_objects as go
    specs = list(boxes)
    fig, places, n_rows = grid_panels([f"{s}: G by layer (last {boxes[s][1]})" for s in specs], shared_yaxes=True)
    for spec, (row, col) in zip(specs, places):
        b = boxes[spec][0]
        fig.add_trace(go.Box(x=b["layer"].astype(str), q1=b["q1"], median=b["median"], q3=b["q3"],
                             lowerfence=b["lowerfence"], upperfence=b["upperfence"], marker_color="#1f77b4",
                             showlegend=False), row=row, col=col)
    fig.add_hline(y=STRONG_SINK_G, line_dash="dot", annotation_text=f"G = {STRONG_SINK_G:g}")
    fig.update_layout(height=340 * n_rows + 40)
    fig.update_xaxes(title_text="layer")
    fig.update_yaxes(title_text="G", col=1)
    return fig


def head_fraction_figure(per_layer: dict[str, pd.DataFrame]):
    """Per model: Sink^eps of token 0, its column mass M_0 and S_0, per layer (``sink_census`` layer table)."""
    from plotly.subplots import make_subplots
    fig = make_subplots(rows=1, cols=2, subplot_titles=["Sink^eps of token 0 per layer", "column mass M_0 per layer"])
    for spec, layers in per_layer.items():
        fig.add_scatter(x=layers.layer, y=layers.sink_eps, name=spec, row=1, col=1)
        fig.add_scatter(x=layers.layer, y=layers.M_s, name=f"{spec} M_0", row=1, col=2)
        fig.add_scatter(x=layers.layer, y=layers.S_s, name=f"{spec} S_0", line_dash="dot", row=1, col=2)
    fig.update_xaxes(title_text="layer")
    fig.update_layout(height=400, legend=dict(orientation="h", y=-0.25))
    return fig
