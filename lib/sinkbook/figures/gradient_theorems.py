"""Figures of the gradient-theorems chapter: per-token gradient norms in one head (Prop. 1), Theorem 1's
tightness under correlated token noise, the eigenvalues of the V-scale Jacobian (Prop. 8)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..measures import theory as th


def gradient_norms_figure(example_head: dict):
    """Per-token ||grad|| on the value, key and query paths of one head (``grad_v_norms``, ``grad_k_norms``,
    ``grad_q_norms``)."""
    import plotly.graph_objects as go
    fig = go.Figure()
    for key, name in [("grad_v_norms", "value"), ("grad_k_norms", "key"), ("grad_q_norms", "query")]:
        fig.add_trace(go.Scatter(y=example_head[key], mode="lines+markers", name=name))
    fig.update_layout(title="Per-token gradient norms in one head with a sink at token 0", xaxis_title="token",
                      yaxis=dict(title="||grad||", type="log"), height=380)
    return fig


def tightness_figure(tightness: pd.DataFrame):
    """Exact and lower bound as fractions of the upper bound, against the AR(1) correlation (``strength``)."""
    import plotly.graph_objects as go
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=tightness["strength"], y=tightness["exact_over_upper"], mode="lines+markers",
                             name="exact / upper bound"))
    fig.add_trace(go.Scatter(x=tightness["strength"], y=tightness["lower_over_upper"], mode="lines+markers",
                             name="lower / upper bound"))
    fig.update_layout(title="Theorem 1 tightness under AR(1) token noise", xaxis_title="AR(1) correlation",
                      yaxis_title="fraction of the upper bound", height=380)
    return fig


def vscale_eigen_figure(jacobians: pd.DataFrame):
    """The two eigenvalue formulas over r / C, with autograd's ||J|| at random v (``r_over_C``, ``op_norm``)."""
    import plotly.graph_objects as go
    grid = np.logspace(-4, 3, 400)
    perp, radial = th.vscale_eigen_formulas(grid, 1.0)
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=grid, y=perp, name="r/(r+C), across v"))
    fig.add_trace(go.Scatter(x=grid, y=radial, name="(r^2+3Cr)/(r+C)^2, along v"))
    fig.add_trace(go.Scatter(x=jacobians["r_over_C"], y=jacobians["op_norm"], mode="markers", marker=dict(size=5),
                             name="autograd ||J||, random v"))
    fig.add_hline(y=9 / 8, line_dash="dot", annotation_text="9/8")
    fig.add_vline(x=3.0, line_dash="dot", annotation_text="r = 3C")
    fig.update_layout(title="Eigenvalues of the V-scale Jacobian", xaxis=dict(title="r / C = ||v||^2 / C", type="log"),
                      yaxis_title="eigenvalue", height=420, legend=dict(orientation="h", y=-0.25))
    return fig
