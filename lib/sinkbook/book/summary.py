"""What we found, first: the intro's summary per paper, generated from the results files when the book is built.

For each of the three papers the summary gives its **headline claims**, grouped by verdict (holds, does not hold,
inconclusive, not comparable), one line each with our number and the paper's, a link to the chapter and one to
the results file the line was read from. Nothing in it is typed: the build writes it from ``results/*.json``.

Which claims are headline is decided once, here, by ``PAPERS``: for each paper, the claims its abstract and
introduction put forward, named as ``(chapter, id pattern)``. A pattern is the claim id with ``*`` where the id
carries a model or task (``vl_lowers_*`` matches ``vl_lowers_ifeval_smollm2_135m_instruct``), so the same rule
selects one line per model that a profile runs. The list was written from the papers, not from our verdicts, and
it selects claims whatever their verdict; checks of our own code (``must_hold``) are never headline claims. A
test checks that every pattern still names an id its chapter module writes, so a renamed claim fails a test
instead of leaving the summary.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import html
import math

from ..core.claims import INCONCLUSIVE, NOT_COMPARABLE, label, signed

# The four printed verdicts, in the order the summary lists them.
ORDER = ("holds", "does not hold", INCONCLUSIVE, NOT_COMPARABLE)
LONGEST = 160       # characters of one number before it is cut (some chapters write a value per seed or per merge)


@dataclasses.dataclass(frozen=True)
class Paper:
    name: str                               # how the book calls the paper
    cite: str                               # its key in book/references.bib
    headline: tuple[tuple[str, str], ...]   # (chapter, claim-id pattern), in the order the paper makes them


PAPERS = (
    Paper("Sink Strength", "choi2026sinkstrength", (
        # VL fine-tuning erodes format-sensitive text skill, much less so for a matched text-only run
        ("vl_adaptation", "vl_lowers_*"),
        ("vl_adaptation", "text_only_loses_less_*"),
        # the erosion of the sink carries the loss
        ("vl_adaptation", "erosion_tracks_loss_*"),
        # Sink Strength, measured on the base model, ranks the loss across the released pairs
        ("predictor", "rho_six_*"),
        ("predictor", "headline_split"),
        ("predictor", "rule_s_ge_2_within_5_4"),
        # Theorem 1 bounds how far the margin moves
        ("vl_adaptation", "theorem1_*"),
        # negative results: injected QK-norm does not protect, merges do not recover
        ("vl_protection", "injection_lags_vanilla_*"),
        ("vl_protection", "merge_does_not_recover_*"),
    )),
    Paper("OutRo", "yoo2026outro", (
        # which tokens are sinks: Phi_LLM sparse, Phi_VLM over-identifies
        ("sink_criteria", "phi_llm_sparse_*"),
        ("sink_criteria", "phi_vlm_overidentifies_*"),
        # a high-sink head is not simply redundant; the sink value acts as a shared bias
        ("outro", "head_ablation_mixed_*"),
        ("outro", "alignment_pearson_*"),
        # removing the sink (Zero-K) hurts
        ("sink_criteria", "zero_k_*"),
        ("outro_multimodal", "vlm_zero_k_accuracy_*"),
        # OutRo improves accuracy at little decoding cost
        ("outro_multimodal", "vlm_outro_accuracy_*"),
        ("outro", "ifeval_*"),
        ("outro", "overhead_*"),
    )),
    Paper("Gradient sinks", "chen2026gradientsinks", (
        # attention sinks come with gradient sinks
        ("gradient_sinks", "baseline_gradient_sink"),
        ("gradient_sinks_with_sink", "bb_baseline_gradient_sink"),
        # massive activations damp the gradient through RMSNorm
        ("gradient_sinks_with_sink", "bb_compress_falls_with_norm"),
        # V-scale removes the massive activation and the gradient sink, keeps the sink, costs no loss
        ("gradient_sinks", "vscale_lowers_token0_norm"),
        ("gradient_sinks_with_sink", "bb_vscale_lowers_token0_norm"),
        ("gradient_sinks", "vscale_lowers_rgs"),
        ("gradient_sinks_with_sink", "bb_vscale_lowers_rgs"),
        ("gradient_sinks", "vscale_keeps_sink"),
        ("gradient_sinks_with_sink", "bb_vscale_keeps_sink"),
        ("gradient_sinks", "vscale_loss_parity"),
        ("gradient_sinks_with_sink", "bb_vscale_loss_parity"),
    )),
)


def headline_claims(paper: Paper, results: list[dict]) -> list[tuple[str, dict]]:
    """(chapter, claim) for every headline claim of ``paper`` in ``results``, in the declared order, each once."""
    by_chapter = {doc["chapter"]: doc for doc in results}
    out, seen = [], set()
    for chapter, pattern in paper.headline:
        for c in by_chapter.get(chapter, {}).get("claims", []):
            if c.get("must_hold") or (chapter, c["id"]) in seen or not fnmatch.fnmatchcase(c["id"], pattern):
                continue
            seen.add((chapter, c["id"]))
            out.append((chapter, c))
    return out


def verdict(c: dict) -> str:
    """The printed verdict of a claim in a results file (JSON keeps True / False / the two words)."""
    return label(c["holds"])


def _num(v) -> str:
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_num(x) for x in v) + "]"
    return str(v)


def _cut(text: str) -> str:
    return text if len(text) <= LONGEST else text[:LONGEST - 1].rstrip() + "…"


def effect_text(effect: dict) -> str:
    """A statistical claim's number: the estimate and its interval, oriented so that positive is the paper's way."""
    units = f" {effect['units']}" if effect.get("units") else ""
    level = effect.get("level")
    at = f", {level:.0%} interval" if isinstance(level, (int, float)) else ""
    return f"{signed(effect['estimate'])}{units} [{signed(effect['low'])}, {signed(effect['high'])}]{at}"


def number(c: dict) -> str:
    """Our number, then the paper's: the effect and its interval for a statistical claim, else the values."""
    ours = effect_text(c["effect"]) if c.get("effect") else _num(c["our_value"])
    return f"ours {_cut(ours)}; paper {_cut(_num(c['paper_value']))}"


def why(c: dict) -> str:
    """What qualifies the verdict: why it is not comparable, or the caveat (what the sample could detect)."""
    if c["holds"] == NOT_COMPARABLE and c.get("why_not_comparable"):
        return c["why_not_comparable"]
    return c.get("caveat") or ""


def _css(word: str) -> str:
    return word.replace(" ", "-")


def line_html(chapter: str, c: dict, chapter_href: str, results_href: str) -> str:
    word = verdict(c)
    qualifier = f" <em>({html.escape(why(c))})</em>" if why(c) else ""
    return (f'<li class="sinkbook-finding-line {_css(word)}" data-chapter="{html.escape(chapter)}" '
            f'data-claim="{html.escape(c["id"])}" data-verdict="{html.escape(word)}">'
            f'<span class="sinkbook-finding-verdict">{html.escape(word)}</span> '
            f'{html.escape(c["statement"])}: <span class="sinkbook-finding-number">{html.escape(number(c))}</span>'
            f'{qualifier} <span class="sinkbook-finding-links">(<a class="sinkbook-finding-chapter" '
            f'href="{chapter_href}{chapter}.html">{html.escape(chapter.replace("_", " "))}</a>, '
            f'<a class="sinkbook-finding-results" href="{results_href}{chapter}.json">{chapter}.json</a>)'
            f'</span></li>')


def summary_markdown(results: list[dict], chapter_href: str = "../chapters/", results_href: str = "../results/",
                     papers: tuple[Paper, ...] = PAPERS) -> str:
    """The summary as MyST markdown: per paper a line with its counts, then its headline claims by verdict."""
    if not results:
        return "*No results files yet: build the book to compute them.*\n"
    present = {doc["chapter"] for doc in results}
    profiles = sorted({str(doc.get("parameters", {}).get("profile", "?")) for doc in results})
    out = [f"Read from the results files of this build (profile {', '.join(f'`{p}`' for p in profiles)}). Each line "
           "is one of the claims the paper puts forward, with our number and the paper's; the chapter has the "
           "measurement, the results file the numbers.", ""]
    for paper in papers:
        found = headline_claims(paper, results)
        counts = {word: sum(verdict(c) == word for _, c in found) for word in ORDER}
        missing = sorted({ch for ch, _ in paper.headline} - present)
        out.append(f"**{paper.name}** {{cite:p}}`{paper.cite}`: {len(found)} headline claims, "
                   + ", ".join(f"{n} {word}" for word, n in counts.items()) + "."
                   + (f" Not run in this build: {', '.join(m.replace('_', ' ') for m in missing)}." if missing else ""))
        out.append("")
        if not found:
            continue
        items = []
        for word in ORDER:
            items += [line_html(ch, c, chapter_href, results_href) for ch, c in found if verdict(c) == word]
        out += [f'<ul class="sinkbook-findings" data-paper="{html.escape(paper.cite)}">', *items, "</ul>", ""]
    return "\n".join(out) + "\n"
