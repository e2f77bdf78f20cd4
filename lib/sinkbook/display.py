"""Figures that stay interactive in the built book with no kernel and no internet.

plotly.js is served once from the book's ``_static`` (see ``_config.yml``), so each figure emits only
its own div and data. In a live Jupyter session the plotly mime bundle is offered as well.
"""
from __future__ import annotations

from IPython.display import display


def plotly_html(fig, div_id: str | None = None) -> str:
    return fig.to_html(include_plotlyjs=False, full_html=False, div_id=div_id,
                       config={"responsive": True, "displaylogo": False})


def show_plotly(fig, div_id: str | None = None) -> None:
    """Display a plotly figure so that it works both in Jupyter and in the offline built book."""
    bundle = {
        "text/html": plotly_html(fig, div_id),
        "application/vnd.plotly.v1+json": fig.to_plotly_json(),
    }
    display(bundle, raw=True)


def show_html(html: str) -> None:
    """Raw HTML (e.g. a self-contained explorer) for the book; scripts must come from _static."""
    display({"text/html": html}, raw=True)
