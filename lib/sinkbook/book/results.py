"""The results file each chapter writes, and the claims summary the book assembles from them.

Schema of ``results/<chapter>.json``::

    {"chapter": str, "parameters": {...}, "models": [{"spec", "id", "files": {name: sha256}}],
     "packages": {name: version}, "git_commit": str, "created": iso-time,
     "claims": [Claim, ...], "extra": {...}}

Claims follow ``sinkbook.core.claims.Claim``; the summary counts them per chapter *and per kind*, so
measurements on models, recomputations of published tables and checks of mathematics are never added up, and
per verdict: holds, does not hold, inconclusive (a statistical claim whose interval neither lies on the paper's
side of zero nor excludes the effect of interest) and not comparable. A statistical claim keeps its ``effect``
and ``interest`` as numbers (book/results_schema.md).
"""
from __future__ import annotations

import datetime as _dt
import json
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Iterable

from ..core.claims import (INCONCLUSIVE, KINDS, NOT_COMPARABLE, VERDICTS, Claim, MissingEffect, MustHoldFailed,
                           failed_must_hold, items_for_power, label, missing_effects)
from ..core.paths import REPO_ROOT, jsonable, results_dir, staging

_PACKAGES = ("torch", "transformers", "accelerate", "peft", "numpy", "scipy", "pandas", "gguf", "papermill",
             "lm-eval", "sinkbook")
OUTCOMES = VERDICTS          # holds, does not hold, inconclusive, not comparable


def package_versions(names: Iterable[str] = _PACKAGES) -> dict[str, str]:
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_results(chapter: str, parameters: dict, claims: list[Claim], models: list[dict] | None = None,
                  extra: dict | None = None, directory: str | Path | None = None) -> Path:
    """Write ``results/<chapter>.json``, then raise ``MustHoldFailed`` if a must-hold check failed, or
    ``MissingEffect`` if a claim decided by a paired test carries no effect and effect of interest.

    The file is written first, so a failing check never loses what the chapter computed."""
    out_dir = Path(directory) if directory else results_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    ids = [c.id for c in claims]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ValueError(f"duplicate claim ids in chapter {chapter!r}: {dupes}")
    doc = {
        "chapter": chapter,
        "parameters": parameters,
        "models": models or [],
        "packages": package_versions(),
        "git_commit": git_commit(),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "claims": [c.as_dict() for c in claims],
    }
    if extra:
        doc["extra"] = extra
    path = out_dir / f"{chapter}.json"
    tmp = staging(path)         # a build and a reader's papermill run of the same chapter never share it
    tmp.write_text(json.dumps(jsonable(doc), indent=1))
    tmp.replace(path)  # atomic, so a crash never leaves a half-written results file
    failed = failed_must_hold(claims)
    if failed:
        raise MustHoldFailed(f"{chapter}: {len(failed)} check(s) that must hold failed (the code is wrong): "
                             + "; ".join(c.verdict() for c in failed))
    bare = missing_effects(claims)
    if bare:
        raise MissingEffect(f"{chapter}: claim(s) {', '.join(c.id for c in bare)} are decided by a paired test but "
                            "carry no effect and effect of interest: build them with core.claims.statistical "
                            f"(the results are in {path})")
    return path


def load_all_results(directory: str | Path | None = None) -> list[dict]:
    out_dir = Path(directory) if directory else results_dir()
    return [json.loads(p.read_text()) for p in sorted(out_dir.glob("*.json"))]


def claim_id_clashes(results: list[dict]) -> dict[str, list[str]]:
    """Claim ids that appear in more than one results file, each with the chapters that claim it: a number is
    claimed once, and other chapters refer to it."""
    where: dict[str, list[str]] = {}
    for doc in results:
        for cid in dict.fromkeys(c["id"] for c in doc["claims"]):
            where.setdefault(cid, []).append(doc["chapter"])
    return {cid: chapters for cid, chapters in sorted(where.items()) if len(chapters) > 1}


def outcome(c: dict) -> str:
    """The printed verdict of a claim as the results file holds it (``holds``: true, false or a verdict word)."""
    if c["holds"] not in (True, False, INCONCLUSIVE, NOT_COMPARABLE):
        raise ValueError(f"claim {c.get('id')!r}: unknown verdict {c['holds']!r}")
    return label(c["holds"])


def tally(results: list[dict]) -> list[dict]:
    """One row per (chapter, kind) with the number of claims of each outcome; must-hold checks apart."""
    rows = []
    for doc in results:
        for kind in KINDS:
            claims = [c for c in doc["claims"] if c.get("kind") == kind and not c.get("must_hold")]
            checks = [c for c in doc["claims"] if c.get("kind") == kind and c.get("must_hold")]
            if not claims and not checks:
                continue
            row = {"chapter": doc["chapter"], "kind": kind, **{o: sum(outcome(c) == o for c in claims) for o in OUTCOMES},
                   "checks passed": f"{sum(c['holds'] is True for c in checks)}/{len(checks)}"}
            rows.append(row)
    return rows


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        return ", ".join(_fmt(x) for x in v)
    return str(v)


def _cell(x) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")


def headline(results: list[dict]) -> str:
    """The headline sentence: measured claims on models first, then recomputations and mathematics apart."""
    by_kind = {kind: [c for doc in results for c in doc["claims"] if c.get("kind") == kind and not c.get("must_hold")]
               for kind in KINDS}

    def counts(claims):
        return ", ".join(f"{sum(outcome(c) == o for c in claims)} {o}" for o in OUTCOMES)
    checks = [c for doc in results for c in doc["claims"] if c.get("must_hold")]
    return (f"**Measured on models run here:** {len(by_kind['measured'])} claims ({counts(by_kind['measured'])}). "
            f"Separately, **recomputed from the papers' published tables:** {len(by_kind['recomputed'])} claims "
            f"({counts(by_kind['recomputed'])}); **mathematics checked numerically:** {len(by_kind['math'])} claims "
            f"({counts(by_kind['math'])}). Internal checks that must hold for the code to be right: "
            f"{sum(c['holds'] is True for c in checks)} of {len(checks)} pass.")


def claims_markdown(results: list[dict], order: list[str] | None = None, figure: str | None = None,
                    results_href: str | None = None) -> str:
    """The claims of every chapter as markdown: headline, summary by chapter and kind, then one table per chapter.
    With ``results_href`` (where the page finds the results files, e.g. ``../results/``) each chapter links its file."""
    if not results:
        return "*No results files yet: build the book to compute them.*\n"
    rank = {name: i for i, name in enumerate(order or [])}
    results = sorted(results, key=lambda doc: (rank.get(doc["chapter"], len(rank)), doc["chapter"]))
    out = [headline(results), ""]
    if figure:
        out += [f"![Verdicts by chapter and kind of claim]({figure})", ""]
    out += ["| chapter | kind | " + " | ".join(OUTCOMES) + " | must-hold checks passed |",
            "|---|---|" + "---|" * len(OUTCOMES) + "---|"]
    for row in tally(results):
        out.append("| " + " | ".join(_cell(row[k]) for k in ("chapter", "kind", *OUTCOMES, "checks passed")) + " |")
    for doc in results:
        models = ", ".join(m.get("spec", "?") for m in doc.get("models", [])) or "none (synthetic or published data)"
        profile = doc.get("parameters", {}).get("profile", "?")
        link = (f' Results file: <a class="sinkbook-results-link" href="{results_href}{doc["chapter"]}.json">'
                f'{doc["chapter"]}.json</a>.' if results_href is not None else "")
        out += ["", f"### {doc['chapter']}", "", f"Profile `{profile}`; models: {models}.{link}", "",
                "| claim | kind | source | paper | ours | rule | verdict |", "|---|---|---|---|---|---|---|"]
        for c in doc["claims"]:
            mark = {"does not hold": "**does not hold**", INCONCLUSIVE: "*inconclusive*"}.get(outcome(c), outcome(c))
            if c.get("must_hold"):
                mark += " (must hold)"
            source = c["source"] + (" (our question)" if c.get("origin") == "ours" and not c.get("must_hold") else "")
            rule = c["rule"] + (f"; {c['why_not_comparable']}" if c.get("why_not_comparable") else "")
            if c.get("interest"):
                i = c["interest"]
                rule += f"; effect of interest {i['value']:g}{' ' + i['units'] if i.get('units') else ''} ({i['source']})"
            if c.get("caveat") and outcome(c) != NOT_COMPARABLE:
                rule += f"; {c['caveat']}"
            cells = [c["statement"], c.get("kind", "?"), source, _fmt(c["paper_value"]), _fmt(c["our_value"]), rule,
                     mark]
            out.append("| " + " | ".join(_cell(x) for x in cells) + " |")
    return "\n".join(out) + "\n"


def power_markdown(results: list[dict], order: list[str] | None = None) -> str:
    """Every statistical claim's reach: the smallest effect its sample could detect at 80% power against the
    effect of interest written before the run, and the items that would reach the interest at the same seeds."""
    rank = {name: i for i, name in enumerate(order or [])}
    rows, reached = [], 0
    for doc in sorted(results, key=lambda d: (rank.get(d["chapter"], len(rank)), d["chapter"])):
        for c in doc["claims"]:
            e, i = c.get("effect"), c.get("interest")
            if not e or not i or c.get("must_hold"):
                continue
            units = f" {i['units']}" if i.get("units") else ""
            if e["high"] == e["low"]:           # no pair differed: the sample says nothing about its own spread
                rows.append([doc["chapter"], c["statement"], outcome(c), f"{_fmt(i['value'])}{units}",
                             "not estimable", f"{e['items']} x {e['seeds']}", "not estimable: no pair differed"])
                continue
            enough = e["detectable"] <= i["value"]
            reached += enough
            needed = "reached" if enough else f"{items_for_power(e['items'], e['detectable'], i['value'])}"
            rows.append([doc["chapter"], c["statement"], outcome(c), f"{_fmt(i['value'])}{units}",
                         f"{e['detectable']:.3g}{units}", f"{e['items']} x {e['seeds']}", needed])
    if not rows:
        return "*No statistical claims in this build.*\n"
    out = [f"{reached} of {len(rows)} statistical claims could detect their effect of interest at 80% power with "
           f"the items and seeds of this build; for the others, the last column gives the items (at the same "
           f"seeds) that would, assuming the spread per item stays as measured.", "",
           "| chapter | claim | verdict | effect of interest | detectable at 80% power | items x seeds | items needed |",
           "|---|---|---|---|---|---|---|"]
    out += ["| " + " | ".join(_cell(x) for x in row) + " |" for row in rows]
    return "\n".join(out) + "\n"


def summary_figure(results: list[dict], path: str | Path, order: list[str] | None = None) -> Path:
    """A one-glance figure: for each chapter, stacked bars of verdicts per kind of claim (must-hold apart)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rank = {name: i for i, name in enumerate(order or [])}
    chapters = sorted({doc["chapter"] for doc in results}, key=lambda c: (rank.get(c, len(rank)), c))
    rows = tally(results)
    colours = {"holds": "#2e7d32", "does not hold": "#c62828", INCONCLUSIVE: "#f0a030", NOT_COMPARABLE: "#9e9e9e"}
    fig, axes = plt.subplots(1, len(KINDS), figsize=(10, 0.45 * max(3, len(chapters)) + 1.2), sharey=True)
    for ax, kind in zip(axes, KINDS):
        left = [0] * len(chapters)
        for o in OUTCOMES:
            values = [next((r[o] for r in rows if r["chapter"] == c and r["kind"] == kind), 0) for c in chapters]
            ax.barh(range(len(chapters)), values, left=left, color=colours[o], label=o)
            left = [a + b for a, b in zip(left, values)]
        ax.set_title(kind)
        ax.set_xlabel("claims")
        ax.set_yticks(range(len(chapters)), [c.replace("_", " ") for c in chapters])
        ax.invert_yaxis()
    axes[0].legend(loc="lower right", fontsize=8, frameon=False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format=path.suffix.lstrip(".") or "svg")
    plt.close(fig)
    return path
