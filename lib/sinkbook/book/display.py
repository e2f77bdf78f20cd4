"""How a finding looks on the page: figures, a table that fits the page, and one verdict box per claim.

Figures stay interactive in the built book with no kernel and no internet: plotly.js is served once from the
book's ``_static`` (see ``_config.yml``), so each figure emits only its own div and data; in a live Jupyter
session the plotly mime bundle is offered as well. Verdict boxes carry inline styles, so they look the same in
Jupyter and in the book; their class names (``sinkbook-verdict holds`` ...) are what the browser test finds.
"""
from __future__ import annotations

import html

from IPython.display import display

from ..core.claims import INCONCLUSIVE, NOT_COMPARABLE, Claim, Finding

# (class, label, colour). Backgrounds are the colour at low opacity and the text inherits the page's, so a box
# reads the same on a light and on a dark theme; the label colours are mid-tones legible on both.
_BOX = {True: ("holds", "Holds", "#2e7d32"),
        False: ("fails", "Does not hold", "#c62828"),
        INCONCLUSIVE: ("inconclusive", "Inconclusive", "#b26a00"),
        NOT_COMPARABLE: ("not-comparable", "Not comparable", "#808080")}


def _tint(colour: str, alpha: float = 0.12) -> str:
    r, g, b = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    return f"rgba({r},{g},{b},{alpha})"


def plotly_html(fig, div_id: str | None = None) -> str:
    fig.update_layout(autosize=True, width=None)          # the page sets the width: never wider than it
    return fig.to_html(include_plotlyjs=False, full_html=False, div_id=div_id, default_width="100%",
                       config={"responsive": True, "displaylogo": False})


def show_plotly(fig, div_id: str | None = None) -> None:
    """Display a plotly figure so that it works both in Jupyter and in the offline built book."""
    display({"text/html": plotly_html(fig, div_id), "application/vnd.plotly.v1+json": fig.to_plotly_json()},
            raw=True)


def show_html(markup: str) -> None:
    """Raw HTML (e.g. a self-contained explorer) for the book; scripts must come from _static."""
    display({"text/html": markup}, raw=True)


def _value(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(_value(x) for x in v)
    return str(v)


def _interest_html(claim: Claim) -> str:
    """A statistical claim's effect of interest and where it comes from (its effect is shown as ``ours``)."""
    if not claim.interest:
        return ""
    i = claim.interest
    units = f" {i['units']}" if i.get("units") else ""
    what = "largest loss that still counts as preserved" if i.get("non_inferiority") else "effect of interest"
    return (f"<div style='margin-top:2px'>{what} <strong>{i['value']:g}{html.escape(units)}</strong> "
            f"<span style='opacity:0.75'>({html.escape(i['source'])})</span></div>")


def verdict_html(claim: Claim) -> str:
    """One short highlighted box: the verdict, the statement, ours against the paper's, the rule; for a statistical
    claim also its effect of interest and its caveat (smaller than the paper's effect, what the sample could
    detect)."""
    css, label, colour = _BOX[claim.holds]
    who = " (our question)" if claim.origin == "ours" and not claim.must_hold else ""
    why = (f"<div style='margin-top:2px'><em>{html.escape(claim.why_not_comparable)}</em></div>"
           if claim.holds == NOT_COMPARABLE and claim.why_not_comparable else "")
    caveat = (f"<div style='margin-top:2px'><em>{html.escape(claim.caveat)}</em></div>"
              if claim.caveat and claim.holds != NOT_COMPARABLE else "")
    return (f"<div class='sinkbook-verdict {css}' data-claim='{html.escape(claim.id)}' style='border-left:4px solid "
            f"{colour};background:{_tint(colour)};padding:6px 10px;margin:6px 0;border-radius:3px;font-size:0.92em;"
            f"overflow-wrap:anywhere;max-width:100%;box-sizing:border-box'>"
            f"<strong style='color:{colour}'>{label}</strong> &middot; {html.escape(claim.statement)}{who}"
            f"<div style='margin-top:2px'>ours <strong>{html.escape(_value(claim.our_value))}</strong> &middot; paper "
            f"{html.escape(_value(claim.paper_value))} &middot; <span style='opacity:0.75'>rule: "
            f"{html.escape(claim.rule)} &middot; {claim.kind} &middot; {html.escape(claim.source)}</span></div>"
            f"{_interest_html(claim)}{caveat}{why}</div>")


def table_html(table, precision: int = 3, index: bool = True) -> str:
    """A DataFrame as HTML in a box that scrolls inside itself, so the page never scrolls sideways."""
    import pandas as pd
    if isinstance(table, pd.Series):
        table = table.to_frame()
    with pd.option_context("display.precision", precision, "display.max_colwidth", 60):
        inner = table.to_html(classes="sinkbook-table", border=0, index=index,
                              float_format=lambda v: f"{v:.{precision}g}")
    return f"<div class='sinkbook-table-box' style='overflow-x:auto;max-width:100%;font-size:0.88em'>{inner}</div>"


def show_figure(fig) -> None:
    if hasattr(fig, "to_plotly_json"):
        show_plotly(fig)
        return
    import io

    import matplotlib.pyplot as plt
    from IPython.display import SVG
    # Rendered here rather than left to the inline backend, which papermill kernels may not have loaded.
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", bbox_inches="tight")
    plt.close(fig)
    display(SVG(buffer.getvalue()))


def show(finding: Finding, table: bool = True) -> None:
    """Figures, then the table, then notes and one verdict box per claim (must-hold checks listed apart)."""
    for fig in finding.figures:
        show_figure(fig)
    if table and finding.table is not None:
        show_html(table_html(finding.table))
    parts = [f"<p style='margin:4px 0'>{html.escape(note)}</p>" for note in finding.notes]
    checks = [c for c in finding.claims if c.must_hold]
    parts += [verdict_html(c) for c in finding.claims if not c.must_hold]
    if checks:
        passed = sum(c.holds is True for c in checks)
        parts.append(f"<details class='sinkbook-checks'><summary>{passed} of {len(checks)} checks of our own code "
                     f"pass</summary>{''.join(verdict_html(c) for c in checks)}</details>")
    if parts:
        show_html("<div class='sinkbook-finding'>" + "".join(parts) + "</div>")


def show_claims(claims: list[Claim]) -> None:
    """The closing table of a chapter: every claim, one row each (statement, ours, paper, verdict)."""
    import pandas as pd
    frame = pd.DataFrame([{"claim": c.statement, "kind": c.kind, "ours": _value(c.our_value),
                           "paper": _value(c.paper_value), "verdict": c.label} for c in claims])
    show_html(table_html(frame, index=False))
