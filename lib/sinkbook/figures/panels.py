"""What two chapters draw alike: one panel per model, a curve without and with an intervention, gradient paths."""
from __future__ import annotations

BEFORE, AFTER = "#4c78a8", "#e45756"       # without and with an intervention, the same colours in every chapter


def model_panels(specs: list[str], **kwargs):
    """One row of panels, one per model (at least one panel, so an empty run still draws a figure)."""
    from plotly.subplots import make_subplots
    return make_subplots(rows=1, cols=max(1, len(specs)), subplot_titles=specs, **kwargs)


def before_after(fig, col: int, before, after, names: tuple[str, str]) -> None:
    """Two curves in panel ``col``: without (blue) and with (red) the intervention; the legend names them once."""
    fig.add_scatter(y=before, name=names[0], line=dict(color=BEFORE), showlegend=col == 1, row=1, col=col)
    fig.add_scatter(y=after, name=names[1], line=dict(color=AFTER), showlegend=col == 1, row=1, col=col)


def path_figure(norms):
    """Token-wise gradient norms on the query, key and value paths (``measures.gradprobes.path_norms``), one
    panel per model."""
    import plotly.express as px
    fig = px.line(norms, x="token", y="grad norm", color="path", facet_col="model", log_y=True)
    return fig.update_layout(height=330).update_xaxes(title_text="token position")
