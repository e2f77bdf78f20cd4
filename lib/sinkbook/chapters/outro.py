"""OutRo on two small text models: the sinks it rotates toward, what the rotation does, and whether it helps.

The OutRo paper (arXiv 2603.14337) argues that the value vector of a sink token is a bias direction every head
mixes into its output, and that handing that direction to the non-sink rows directly (gated rotation) and
letting the sinks read the whole prompt once (mask relaxation) improves an Omni-LLM at a small cost. We test
its analyses and claims on SmolLM2-135M-Instruct and Gemma 3 270M (base): the sink set Phi_LLM finds
(Sec. 3), the attention freed by rotation (Fig. 7, Table B.4), the alignment of head outputs with the sink
value (Fig. B.1), single-head ablations (Table 2), the rotation strength on a held-out loss (App. B.5, B.7),
instruction compliance of an instruct model (App. B.7, Table B.8), the direction controls (App. B.8,
Table B.9) and the decoding overhead (Table 7). Formulas: the book's methods page (book/methods.md), sections
on Phi_LLM, OutRo, its direction controls and overhead, IFEval grading and paired comparisons.

Comparisons of two settings on the same items are statistical claims (``core.claims.statistical``): the
interval of the paired comparison (``sinkbook.measures.stats``, level 1 - ``ALPHA``) against an effect of interest
written beside each rule with its source. Holds when the interval lies on the paper's side of zero, does not hold
when it excludes the effect of interest, inconclusive otherwise (the book's methods page, "The verdict rule"). A
claim is tested only where its precondition is met: Phi_LLM finds a sink (otherwise OutRo changes nothing), the
model is an instruct model whose baseline compliance is above the floor, enough items for the test to be able to
decide. Otherwise it is "not comparable" and says why. Any model the library supports runs, including tiny random
models without any sink. Phi_LLM's sparsity (Sec. 3) is claimed once, in the sink-criteria chapter
(``phi_llm_sparse_*``); this chapter shows its sink set and refers to it.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..core.claims import INCONCLUSIVE, Claim, Effect, Finding, Interest, Rule, check, claim, slug, statistical
from ..core.models import REAL_MODELS
from ..core.profiles import Limit, NON_EMPTY, NON_NEGATIVE, POSITIVE, Profiles, above, at_least, between, each
from ..figures.outro import alignment_figure, redistribution_figure, rotation_strength_figure, sinks_figure
from ..interventions.outro import default_layers
from ..measures.decoding import OUTRO_PAPER_OVERHEAD, OVERHEAD_TARGET
from ..measures.regression import pearson
from ..measures.stats import effect_in_points, mcnemar_exact, min_pairs_to_decide, paired_bootstrap, paired_effect
from ..runs.outro_text import CONTENT, CONTROLS, DELIMITER, N_PROMPTS, OutRoTextRuns, SINK, ifeval_options
from .base import Chapter, all_of, finding


NAME = "outro"
PAPER = "OutRo paper"
MODELS = list(REAL_MODELS)

PROFILES = Profiles({
    # quick: CI smoke run; few prompts and tokens, so the paired tests mostly cannot decide (not comparable)
    "quick": dict(models=MODELS, gamma=1.0, gammas=[1.0, 4.0], analysis_prompts=4, n_windows=2, window_length=64,
                  n_ablation_heads=2, n_prompts=4, screen_prompts=2, max_new_tokens=16, batch_size=4,
                  ifeval_extra=[], bench=[64, 6, 1], threads=1),
    # default: the book, single-threaded (about 15 minutes of CPU); the main claim on all 115 prompts
    "default": dict(models=MODELS, gamma=1.0, gammas=[0.5, 1.0, 2.0, 3.0, 4.0], analysis_prompts=15, n_windows=8,
                    window_length=128, n_ablation_heads=6, n_prompts=N_PROMPTS, screen_prompts=15,
                    max_new_tokens=48, batch_size=40, ifeval_extra=[], bench=[256, 24, 3], threads=1),
    "gpu": dict(models=MODELS, gamma=1.0, gammas=[0.5, 1.0, 2.0, 3.0, 4.0], analysis_prompts=15, n_windows=64,
                window_length=512, n_ablation_heads=16, n_prompts=N_PROMPTS, screen_prompts=N_PROMPTS,
                max_new_tokens=192, batch_size=40, ifeval_extra=["relax", "outro_gamma_0.5", "outro_gamma_3.0"],
                bench=[256, 24, 3], threads=0),
}, limits=dict(models=NON_EMPTY, gammas=each(above(0)), analysis_prompts=between(1, N_PROMPTS), n_windows=POSITIVE,
               window_length=at_least(8), n_ablation_heads=NON_NEGATIVE, n_prompts=between(1, N_PROMPTS),
               screen_prompts=between(1, N_PROMPTS), max_new_tokens=POSITIVE, batch_size=POSITIVE,
               bench=Limit("[prompt tokens, new tokens, repeats], each >= 1",
                           lambda v: isinstance(v, list) and len(v) == 3 and all(POSITIVE(x) for x in v)),
               threads=NON_NEGATIVE))

# ---- thresholds, each written once -------------------------------------------------------------------------

ALPHA = 0.05              # ours: level of every paired test (the paper reports means and standard deviations)
FLOOR = 0.05              # ours: baseline prompt-level strict compliance below this is the floor (no headroom)
MIN_WINDOWS = 8           # ours: a bootstrap over fewer text windows understates its own uncertainty

# Fig. 7: "Rotation consistently reduces the total attention allocated to sink tokens": a fall at every layer
# compared, not at most of them.
LOWERS_SINK_ATTENTION = Rule.true("sink attention falls at every layer after the first sink (Fig. 7: "
                                  "'consistently reduces')")
LESS_ATTENDED_GAINS = Rule.true("the group attended less per token before gains more attention")
# App. B.1: "an average Pearson correlation of approximately 0.7". Read to the paper's one decimal, that is at least
# 0.65; a stronger correlation only strengthens its point (alignment as a proxy for sink score), so no upper end.
ALIGNMENT = Rule.at_least(0.65, "mean Pearson per layer ('approximately 0.7' to one decimal)")

# Effects of interest, in the paper's direction, fixed before any result is read.
# The paper scores accuracy, never a loss, so no number of its transfers to a held-out loss: ours.
LOSS_INTEREST = Interest(0.01, "ours: the paper reports accuracy, not loss; a 1% change of perplexity (0.01 nats) "
                               "is the smallest loss change we would count as OutRo's effect", "nats")
# Table B.8: text-only gains +0.53 (Qwen2.5-Omni 3B, 73.92 -> 74.45), +2.38 and +1.60 pt on GSM8K. IFEval-style
# compliance is another task, so the number transfers only as the size of an effect the paper counts as a gain.
IFEVAL_INTEREST = Interest(0.53, "paper: Table B.8, the smallest text-only gain it reports (GSM8K, Qwen2.5-Omni 3B, "
                                 "73.92 -> 74.45); on another task, as the size of a gain it counts", "pt")
# Table B.9: the sink direction beats every random token by at least 3.03 pt (AVHBench, 64.78 vs 61.75) and the
# head mean by at least 9.56 pt (AVHBench, 64.78 vs 55.22); transferred as points of another task, like IFEVAL.
CONTROL_INTEREST = {"random_token": Interest(3.03, "paper: Table B.9, the smallest gap to a random token "
                                                   "(AVHBench, 64.78 vs 61.75), as the size of a gap it counts", "pt"),
                    "head_mean": Interest(9.56, "paper: Table B.9, the smallest gap to the head mean (AVHBench, "
                                                "64.78 vs 55.22), as the size of a gap it counts", "pt")}
# Table 2 / Sec. 3 (Q2): "removing certain sink heads leads to marked performance improvements, while removing others
# causes clear degradation". Its smallest such change is 0.70% accuracy; on a loss, ours like LOSS_INTEREST.
MARKED = Interest(0.01, "ours: the paper's smallest 'marked' change is +0.70% accuracy (Table 2), which has no loss "
                        "equivalent; 0.01 nats, as for the other losses", "nats")
MIXED_ABLATION = (f"holds if one ablated head lowers and another raises the loss, each with its {1 - ALPHA:.0%} "
                  f"paired-bootstrap interval over windows excluding 0; does not hold if in one direction every head's "
                  f"interval excludes a change of {MARKED.value:g} nats (the effect of interest); else inconclusive")
OVERHEAD = Rule.at_most(OUTRO_PAPER_OVERHEAD, "decode latency OutRo / plain SDPA")
IDENTICAL = Rule.true("logits bit-for-bit identical")
RAN = Rule.true("the rotation step stored a direction")


# ---- finding functions: measurements in, table / figures / claims out ------------------------------------------

def _no_sink(spec: str) -> str:
    return f"Phi_LLM finds no sink in {spec} on these prompts, so OutRo has nothing to rotate toward"


def sinks_finding(measured: dict[str, dict]) -> Finding:
    """Per model: Phi_LLM's sink set on the analysis prompts, and the checks that OutRo's hooks alone change
    nothing. ``measured[spec]`` holds layers, heads, kv_heads, share_flagged (per layer), share_cumulative (per
    layer), first_sink (layer or None), persistent_is_first_real, relax_layers, identical, rotation_ran,
    check_sinks ("Phi_LLM" or "fixed position")."""
    rows, claims, notes = {}, [], []
    for spec, m in measured.items():
        flagged, cumulative = np.asarray(m["share_flagged"]), np.asarray(m["share_cumulative"])
        rotated_layers, _ = default_layers(m["layers"])
        worst = round(float(flagged.max()), 3) if len(flagged) else 0.0
        last_rotated = round(float(cumulative[rotated_layers[-1]]), 3) if rotated_layers else float("nan")
        has_sink = m["first_sink"] is not None
        rows[spec] = {"layers": m["layers"], "heads / kv heads": f"{m['heads']} / {m['kv_heads']}",
                      "first layer with a sink": m["first_sink"] if has_sink else "none",
                      "layers with a sink": int((flagged > 0).sum()),
                      "max share flagged at one layer": worst,
                      "cumulative share at layer L-3": last_rotated,
                      "persistent sink = first real token": m["persistent_is_first_real"] if has_sink else "-",
                      "relaxation layers": ", ".join(map(str, m["relax_layers"]))}
        if has_sink:
            notes.append(f"{spec}: first sink at layer {m['first_sink']}; at most {worst:.0%} of the tokens are "
                         f"flagged at one layer, and the cumulative set at layer L-3 holds {last_rotated:.0%} of "
                         f"the prompt.")
        else:
            notes.append(f"{spec}: Phi_LLM flags no token at any layer (no massive activation), so OutRo is the "
                         f"identity on it and every claim about OutRo's effect is not comparable.")
        how = "the Phi_LLM sinks" if m["check_sinks"] == "Phi_LLM" else "a sink fixed at the last position"
        claims.append(check(f"gamma_zero_identical_{slug(spec)}",
                            f"OutRo with gamma = 0 and no relaxation leaves the logits bit-for-bit unchanged, "
                            f"rotating toward {how}: {spec}", m["identical"], IDENTICAL, expected=True))
        claims.append(check(f"rotation_ran_{slug(spec)}",
                            f"the rotation step ran in that comparison, so it tests something: {spec}",
                            m["rotation_ran"], RAN, expected=True))
    notes.append("Whether Phi_LLM's sink set is sparse, as the paper says (Sec. 3, Q1), is claimed once, in the "
                 "sink-criteria chapter (claims phi_llm_sparse_*); the table above is the same criterion on this "
                 "chapter's prompts.")
    fig = sinks_figure({spec: (np.asarray(m["share_flagged"]), np.asarray(m["share_cumulative"]))
                        for spec, m in measured.items()})
    return Finding("The models and their sinks", claims=claims, table=pd.DataFrame(rows), figures=[fig],
                   notes=notes, data={"sinks": {spec: {"share_flagged_per_layer": list(m["share_flagged"]),
                                                       "share_cumulative_per_layer": list(m["share_cumulative"])}
                                                for spec, m in measured.items()}})


def redistribution_finding(measured: dict[str, dict | None], gamma: float) -> Finding:
    """Fig. 7 / Table B.4 analog. ``measured[spec]`` is None (no sink) or holds ``base`` and ``rotated``
    (L, B, 3) attention mass per key category, ``counts`` (B, 3) tokens per category and ``first_sink``."""
    rows, claims, notes, sink_attention = {}, [], [], {}
    for spec, m in measured.items():
        affected = [] if m is None else list(range(m["first_sink"] + 1, np.asarray(m["base"]).shape[0]))
        ok = bool(affected)
        why = _no_sink(spec) if m is None else "no layer follows the first sink layer"
        fell, less, gained, delta, share_down = False, "-", "-", np.full(3, np.nan), float("nan")
        if ok:
            base, rotated, counts = np.asarray(m["base"]), np.asarray(m["rotated"]), np.asarray(m["counts"])
            per_token = (base[affected] / np.maximum(counts, 1)).mean((0, 1))
            delta = (rotated[affected] - base[affected]).mean((0, 1))
            share_down = float((rotated[affected, :, SINK].mean(1) < base[affected, :, SINK].mean(1)).mean())
            fell = bool(share_down == 1.0)
            less = "delimiter" if per_token[DELIMITER] < per_token[CONTENT] else "content"
            gained = "delimiter" if delta[DELIMITER] > delta[CONTENT] else "content"
            rows[spec] = {"layers compared": f"{affected[0]}..{affected[-1]}",
                          "attention to a delimiter / token": per_token[DELIMITER],
                          "attention to a content token": per_token[CONTENT],
                          "change: sink": delta[SINK], "change: delimiters": delta[DELIMITER],
                          "change: content": delta[CONTENT], "layers where sink attention fell": share_down}
            sink_attention[spec] = (base[:, :, SINK].mean(1), rotated[:, :, SINK].mean(1))
            notes.append(f"{spec}: sink attention changes by {delta[SINK]:+.4f} on average (paper, Qwen2.5-Omni: "
                         f"-0.0176) and falls at {share_down:.0%} of the layers compared; the group attended less "
                         f"per token before is '{less}', the larger gain goes to '{gained}'.")
        else:
            notes.append(f"{spec}: not measured ({why}).")
        claims.append(claim(f"rotation_lowers_sink_attention_{slug(spec)}", "measured",
                            f"{PAPER}, Fig. 7 and Table B.4",
                            f"rotation lowers the attention paid to sink tokens: {spec}", -0.0176,
                            round(float(delta[SINK]), 5), LOWERS_SINK_ATTENTION, value=fell, precondition=(ok, why)))
        claims.append(claim(f"freed_attention_to_less_attended_{slug(spec)}", "measured", f"{PAPER}, Table B.4",
                            f"freed attention goes mostly to the token group attended less per token (text "
                            f"analog: delimiters vs content): {spec}",
                            "video +0.0127 vs audio +0.0022 (Qwen2.5-Omni)",
                            f"delimiter {delta[DELIMITER]:+.4f}, content {delta[CONTENT]:+.4f}",
                            LESS_ATTENDED_GAINS, value=less == gained,
                            precondition=(False, "the paper's groups are modalities (video, audio); text has none, "
                                                 "and delimiters vs content is only an analog") if ok
                            else (False, why)))
    fig = redistribution_figure({spec: sink_attention.get(spec) for spec in measured}, gamma)
    return Finding("Attention to the sink with and without rotation", claims=claims,
                   table=pd.DataFrame(rows) if rows else None, figures=[fig], notes=notes, data={"rows": rows})


def alignment_finding(measured: dict[str, dict | None]) -> Finding:
    """Fig. B.1 analog. ``measured[spec]`` is None (no sink) or holds ``r_per_layer`` (Pearson r of sink score
    and cos(O, v_bar) over every (head, query) point of a layer) and ``heads`` (DataFrame: layer, head,
    sink_score, cosine: per-head means)."""
    rows, claims, notes, shown = {}, [], [], {}
    for spec, m in measured.items():
        r_layers = [] if m is None else [r for r in m["r_per_layer"] if np.isfinite(r)]
        ok = bool(r_layers)
        r = float(np.mean(r_layers)) if ok else float("nan")
        if ok:
            heads = m["heads"]
            over_heads = pearson(heads.sink_score.values, heads.cosine.values)
            rows[spec] = {"layers with sinks": len(m["r_per_layer"]), "mean Pearson per layer": r,
                          "Pearson over per-head means": over_heads}
            shown[spec] = heads
            notes.append(f"{spec}: average Pearson {r:.2f} per layer, {over_heads:.2f} over head means "
                         f"(paper about 0.7).")
        claims.append(claim(f"alignment_pearson_{slug(spec)}", "measured", f"{PAPER}, App. B.1 / Fig. B.1",
                            f"sink score correlates with cos(head output, sink value): {spec}", 0.7,
                            round(r, 3), ALIGNMENT, precondition=(ok, _no_sink(spec))))
    return Finding("Sink score and alignment with the sink value", claims=claims,
                   table=pd.DataFrame(rows) if rows else None, notes=notes, data={"rows": rows},
                   figures=[alignment_figure({spec: shown.get(spec) for spec in measured})])


def ablation_finding(measured: dict[str, dict], source: str = "") -> Finding:
    """Table 2 analog. ``measured[spec]`` holds ``baseline_loss`` (nats), ``baseline_windows`` (per-window loss
    with no head ablated) and ``rows``: one per ablated head {head, sink_score, delta (mean loss change, nats),
    windows (per-window loss with that head zeroed)}, the heads of highest mean sink score."""
    table, claims, notes = [], [], [source] if source else []
    for spec, m in measured.items():
        base, n = np.asarray(m.get("baseline_windows", []), dtype=float), len(m.get("baseline_windows", []))
        gate = all_of((bool(m["rows"]), _no_sink(spec)),
                      (n >= MIN_WINDOWS, f"{n} windows; the bootstrap needs at least {MIN_WINDOWS}"))
        # positive = ablating the head lowers the held-out loss (helps)
        effects = {r["head"]: paired_effect(paired_bootstrap(base, r["windows"], ALPHA, higher_is_better=False),
                                            seeds=1, units="nats") for r in m["rows"]} if gate[0] else {}
        helps = [h for h, e in effects.items() if e.low > 0]
        hurts = [h for h, e in effects.items() if e.high < 0]
        table += [{"model": spec, "head": r["head"], "sink score": r["sink_score"], "delta loss (nats)": r["delta"],
                   **({"interval (nats, - = lowers the loss)": f"[{-effects[r['head']].high:+.4f}, "
                                                               f"{-effects[r['head']].low:+.4f}]"} if effects else {})}
                  for r in m["rows"]]
        if not gate[0]:
            notes.append(f"{spec}: not tested ({gate[1]}).")
            claims.append(Claim(f"head_ablation_mixed_{slug(spec)}", "measured", f"{PAPER}, Sec. 3 (Q2), Table 2",
                                f"removing single high-sink heads can markedly help or clearly hurt: {spec}",
                                "3 of 6 heads help (+0.70% to +1.36%), 3 hurt (-1.76% to -3.91%) (AVHBench)",
                                f"{len(m['rows'])} heads, {n} windows", MIXED_ABLATION, "not comparable",
                                why_not_comparable=gate[1], interest=MARKED.as_dict()))
            continue
        # The verdict turns on the direction seen less clearly; the effect shown is that direction's strongest head.
        toward_help = max(effects, key=lambda h: effects[h].estimate)
        toward_hurt = min(effects, key=lambda h: effects[h].estimate)
        up, down = effects[toward_help], _flip(effects[toward_hurt])
        if helps and hurts:
            holds, caveat, head, shown = True, "", *min(((toward_help, up), (toward_hurt, down)),
                                                        key=lambda x: x[1].low)
        elif all(e.high < MARKED.value for e in effects.values()):
            holds, caveat, head, shown = False, "no head can lower the loss by the effect of interest", toward_help, up
        elif all(-e.low < MARKED.value for e in effects.values()):
            holds, caveat, head, shown = False, "no head can raise the loss by the effect of interest", toward_hurt, down
        else:
            head, shown = (toward_help, up) if not helps else (toward_hurt, down)
            holds = INCONCLUSIVE
            caveat = (f"no head {'lowers' if not helps else 'raises'} the loss with an interval excluding 0, nor is a "
                      f"change of {MARKED.value:g} nats excluded; the sample could detect about {shown.detectable:.3g} "
                      f"nats at that head at 80% power")
        what = "lowers" if shown is up else "raises"
        notes.append(f"{spec}: baseline loss {m['baseline_loss']:.4f} nats; of {len(effects)} high-sink heads, removing "
                     f"{len(helps)} lowers the loss and {len(hurts)} raise it (interval over {n} windows excluding 0).")
        claims.append(Claim(f"head_ablation_mixed_{slug(spec)}", "measured", f"{PAPER}, Sec. 3 (Q2), Table 2",
                            f"removing single high-sink heads can markedly help or clearly hurt: {spec}",
                            "3 of 6 heads help (+0.70% to +1.36%), 3 hurt (-1.76% to -3.91%) (AVHBench)",
                            f"{len(helps)} help, {len(hurts)} hurt of {len(effects)}; {head} {what} the loss by "
                            f"{shown.text()}", MIXED_ABLATION, holds, effect=shown.as_dict(),
                            interest=MARKED.as_dict(), caveat=caveat))
    frame = pd.DataFrame(table).set_index(["model", "head"]) if table else None
    return Finding("Ablating single high-sink heads", claims=claims, table=frame, notes=notes,
                   data={"rows": table})


def _flip(e: Effect) -> Effect:
    """The same effect seen from the other direction."""
    return Effect(-e.estimate, -e.high, -e.low, e.level, e.test, e.items, e.seeds, e.units)


def select_gamma(sweep: dict[float, np.ndarray]) -> float:
    """The rotation strength of lowest mean loss on the sweep windows (ties: the smaller gamma)."""
    return min(sorted(sweep), key=lambda g: float(np.mean(sweep[g])))


def rotation_strength_finding(measured: dict[str, dict]) -> Finding:
    """App. B.5 / B.7 on the held-out loss. ``measured[spec]`` holds ``baseline`` (per-window loss on the sweep
    windows), ``sweep`` {gamma: per-window loss}, ``rotated`` (whether rotation changed anything), and for the
    test: ``test_baseline`` and ``test_rotated`` (per-window losses on the test windows at the gamma
    ``select_gamma`` picks on the sweep windows)."""
    rows, claims, notes = [], [], []
    for spec, m in measured.items():
        base = float(np.mean(m["baseline"]))
        rows.append({"model": spec, "gamma": 0.0, "loss": base, "delta vs baseline": 0.0})
        rows += [{"model": spec, "gamma": g, "loss": float(np.mean(l)), "delta vs baseline": float(np.mean(l)) - base}
                 for g, l in sorted(m["sweep"].items())]
        chosen = select_gamma(m["sweep"])
        n_test = len(m["test_baseline"])
        ok = m["rotated"] and n_test >= MIN_WINDOWS
        why = (_no_sink(spec) if not m["rotated"] else
               f"{n_test} test windows; the bootstrap needs at least {MIN_WINDOWS}")
        test = paired_bootstrap(m["test_baseline"], m["test_rotated"], ALPHA, higher_is_better=False)
        sweep_delta = float(np.mean(m["sweep"][chosen])) - base
        test_delta = float(np.mean(m["test_rotated"]) - np.mean(m["test_baseline"]))
        if m["rotated"]:
            notes.append(f"{spec}: gamma {chosen:g} has the lowest loss on the sweep windows ({sweep_delta:+.4f} "
                         f"nats against no rotation); on the {n_test} test windows it changes the loss by "
                         f"{test_delta:+.4f} nats: {test.summary()}.")
        else:
            notes.append(f"{spec}: not tested ({why}).")
        claims.append(statistical(f"rotation_loss_{slug(spec)}",
                                  f"{PAPER}, App. B.5 and B.7, Table B.8 (gamma chosen on validation data, then "
                                  f"applied)",
                                  f"rotation toward the sink value, with gamma chosen on the sweep windows (here "
                                  f"{chosen:g}), lowers the held-out loss on other windows (rotation alone: relaxation "
                                  f"cannot be scored on a loss): {spec}",
                                  "gains at the gamma chosen on validation data (Fig. B.2, Table B.8)",
                                  paired_effect(test, seeds=1, units="nats"), LOSS_INTEREST, precondition=(ok, why)))
    fig = rotation_strength_figure({spec: {g: float(np.mean(l)) - float(np.mean(m["baseline"]))
                                           for g, l in m["sweep"].items()} for spec, m in measured.items()})
    table = (pd.DataFrame(rows).pivot(index="gamma", columns="model", values="delta vs baseline")
             .reindex(columns=list(measured)) if rows else None)
    return Finding("Rotation strength and the held-out loss", claims=claims, table=table, figures=[fig],
                   notes=notes, data={"rows": rows})


def _passes(settings: dict, name: str) -> np.ndarray:
    return np.array(settings[name]["passes"], dtype=object)


def _paired(settings: dict, first: str, second: str):
    """Exact McNemar on the prompts graded under both settings (all of them: exclusions depend on the prompt)."""
    a, b = _passes(settings, first), _passes(settings, second)
    graded = np.array([x is not None and y is not None for x, y in zip(a, b)], dtype=bool)
    return mcnemar_exact(a[graded].astype(bool), b[graded].astype(bool), ALPHA)


def _compliance_precondition(spec: str, m: dict) -> tuple[bool, str]:
    base = m["settings"]["baseline"]["summary"]
    rate, n = base["prompt_level_strict"], base["prompts_graded"]
    if not m["chat"]:
        return False, (f"{spec} is a base model without a chat template, not an instruct model (baseline "
                       f"prompt-level strict {rate:.3f} on {n} prompts)")
    if not m["has_sinks"]:
        return False, _no_sink(spec)
    if not rate >= FLOOR:
        return False, f"baseline compliance {rate:.3f} on {n} prompts is at the floor (< {FLOOR:g}): no headroom"
    if n < min_pairs_to_decide(ALPHA):
        return False, (f"{n} graded prompts; an exact McNemar test needs at least {min_pairs_to_decide(ALPHA)} "
                       f"to reach alpha = {ALPHA:g}")
    return True, ""


def _rates_table(measured: dict[str, dict]) -> pd.DataFrame | None:
    """Strict prompt-level compliance per setting (rows) and model (columns), as "rate on n prompts"."""
    table = {}
    for spec, m in measured.items():
        for name, s in m["settings"].items():
            summary = s["summary"]
            table.setdefault(spec, {})[name] = (f"{summary['prompt_level_strict']:.3f} on "
                                                f"{summary['prompts_graded']} prompts")
    return pd.DataFrame(table).fillna("-") if table else None       # "-": a setting a model did not run


def compliance_finding(measured: dict[str, dict], gamma: float, max_new_tokens: int) -> Finding:
    """App. B.7 on IFEval-style prompts. ``measured[spec]`` holds ``chat`` (has a chat template), ``has_sinks``
    and ``settings``: {name: {"passes": [bool or None per prompt (None: not graded)], "summary": Grades.summary()}}
    with at least "baseline"; "outro" when the precondition let it run."""
    claims, notes = [], []
    for spec, m in measured.items():
        ok, why = _compliance_precondition(spec, m)
        base = m["settings"]["baseline"]["summary"]
        statement = (f"OutRo improves an instruct model's task accuracy (here: IFEval-style strict prompt-level "
                     f"compliance): {spec}")
        source, paper = f"{PAPER}, App. B.7, Table B.8 (text-only gains)", \
            "GSM8K +0.53 (Qwen2.5-Omni 3B), +2.38 (Qwen2.5-7B-Instruct), +1.60 (Llama-3.1-8B-Instruct)"
        if ok:
            test = _paired(m["settings"], "baseline", "outro")
            our = (f"{test.detail['rate_first']:.3f} -> {test.detail['rate_second']:.3f} ({test.effect:+.3f}; "
                   f"{test.detail['only_first']} prompts lost, {test.detail['only_second']} gained, p = "
                   f"{test.p_value:.3g}; {test.n} prompts)")
            notes.append(f"{spec}: strict prompt-level compliance {our} with OutRo (gamma = {gamma:g}, rotation and "
                         f"relaxation), {max_new_tokens} new tokens.")
            claims.append(statistical(f"ifeval_{slug(spec)}", source, statement, paper, effect_in_points(test), IFEVAL_INTEREST))
        else:
            notes.append(f"{spec}: not tested ({why}).")
            # no second setting ran, so there is no effect: the claim states its interest and what is missing
            claims.append(Claim(f"ifeval_{slug(spec)}", "measured", source, statement, paper,
                                f"baseline {base['prompt_level_strict']:.3f} on {base['prompts_graded']} prompts",
                                IFEVAL_INTEREST.rule_text(1 - ALPHA), "not comparable", why_not_comparable=why,
                                interest=IFEVAL_INTEREST.as_dict()))
    return Finding("Instruction compliance with OutRo", claims=claims, table=_rates_table(measured), notes=notes)


def direction_controls_finding(losses: dict[str, dict], compliance: dict[str, dict], gamma: float) -> Finding:
    """Table B.9: the sink value against a random token's value and the head mean, rotation alone, at
    ``gamma``; one claim per control (the paper claims both). ``losses[spec]`` holds ``rotated`` and per-window
    losses ``sink``, ``random_token``, ``head_mean`` (sweep windows); ``compliance[spec]`` is what
    ``compliance_finding`` takes, with the settings of CONTROLS when they ran."""
    claims, notes, table = [], [], {}
    controls = {"random_token": "a random token's value", "head_mean": "the head mean"}
    for spec, m in losses.items():
        n = len(m["sink"])
        ok = m["rotated"] and n >= MIN_WINDOWS
        why = _no_sink(spec) if not m["rotated"] else f"{n} windows; the bootstrap needs at least {MIN_WINDOWS}"
        tests = {kind: paired_bootstrap(m[kind], m["sink"], ALPHA, higher_is_better=False) for kind in controls}
        means = {kind: float(np.mean(m[kind])) for kind in ("sink", "random_token", "head_mean")}
        table[f"{spec}: loss (nats)"] = means
        if m["rotated"]:
            notes.append(f"{spec}, held-out loss at gamma = {gamma:g}: sink against random token "
                         f"{tests['random_token'].summary()}; against head mean {tests['head_mean'].summary()} (a "
                         f"positive effect: the sink direction has the lower loss).")
        else:
            notes.append(f"{spec}, held-out loss: not tested ({why}).")
        for kind, what in controls.items():
            claims.append(statistical(f"direction_controls_loss_{kind}_{slug(spec)}", f"{PAPER}, App. B.8, Table B.9",
                                      f"the sink value is a better rotation direction than {what} (here: held-out "
                                      f"loss at gamma {gamma:g}): {spec}", "sink > random token > head mean (accuracy)",
                                      paired_effect(tests[kind], seeds=1, units="nats"), LOSS_INTEREST,
                                      precondition=(ok, why)))
    for spec, m in compliance.items():
        ok, why = _compliance_precondition(spec, m)
        ran = all(name in m["settings"] for name in CONTROLS)
        ok, why = (ok and ran), (why or "the controls did not run")
        tests = {}
        if ok:
            tests = {kind: _paired(m["settings"], f"rotate_{kind}", "rotate") for kind in controls}
            rate = {name: m["settings"][name]["summary"]["prompt_level_strict"] for name in CONTROLS}
            table[f"{spec}: prompt-level"] = {"sink": rate["rotate"], "random_token": rate["rotate_random_token"],
                                              "head_mean": rate["rotate_head_mean"]}
            notes.append(f"{spec}, IFEval-style compliance at gamma = {gamma:g}: sink against random token "
                         f"{tests['random_token'].summary()}; against head mean {tests['head_mean'].summary()}.")
        for kind, what in controls.items():
            cid, source = f"direction_controls_ifeval_{kind}_{slug(spec)}", f"{PAPER}, App. B.8, Table B.9"
            statement = (f"rotation toward the sink value beats rotation toward {what} (here: IFEval-style strict "
                         f"prompt-level compliance): {spec}")
            if ok:
                claims.append(statistical(cid, source, statement, "sink > random token > head mean",
                                          effect_in_points(tests[kind]), CONTROL_INTEREST[kind]))
            else:
                claims.append(Claim(cid, "measured", source, statement, "sink > random token > head mean", "not run",
                                    CONTROL_INTEREST[kind].rule_text(1 - ALPHA), "not comparable",
                                    why_not_comparable=why, interest=CONTROL_INTEREST[kind].as_dict()))
    return Finding("Direction controls", claims=claims, table=pd.DataFrame(table) if table else None, notes=notes)


def overhead_finding(measured: dict[str, dict]) -> Finding:
    """Table 7. ``measured[spec]`` holds ``ratios`` (``overhead_ratios``: per setting decode_s_per_token,
    latency_ratio, prefill_s, peak_memory_mib, rotated_decode_rows) and ``state_kib`` (what OutRo keeps per
    sequence between decode steps)."""
    table, claims, notes = [], [], []
    for spec, m in measured.items():
        ratios = m["ratios"]
        for name, v in ratios.items():
            table.append({"model": spec, "setting": name, "ms per token": 1000 * v["decode_s_per_token"],
                          "ratio to SDPA": v["latency_ratio"], "prefill s": v["prefill_s"],
                          "RSS growth MiB": v["peak_memory_mib"]})
        r, eager = ratios["outro"]["latency_ratio"], ratios["eager"]["latency_ratio"]
        acted = ratios["outro"]["rotated_decode_rows"] > 0
        notes.append(f"{spec}: OutRo {r:.3f}x plain SDPA per generated token, eager attention {eager:.3f}x (paper "
                     f"2.04x); OutRo keeps {m['state_kib']:.1f} KiB per sequence between steps. Our own benchmark "
                     f"target, at most {OVERHEAD_TARGET:g}x (scripts/bench_outro.py), is "
                     f"{'met' if r <= OVERHEAD_TARGET else 'missed'} in this run.")
        claims.append(claim(f"overhead_{slug(spec)}", "measured", f"{PAPER}, Table 7",
                            f"OutRo adds little decoding latency (CPU, against plain SDPA): {spec}", OUTRO_PAPER_OVERHEAD,
                            round(r, 3), OVERHEAD,
                            precondition=(acted, f"{_no_sink(spec)}; only the hooks were timed")))
    frame = pd.DataFrame(table).set_index(["model", "setting"]) if table else None
    return Finding("Decoding overhead", claims=claims, table=frame, notes=notes, data={"rows": table})


# ---- the chapter ---------------------------------------------------------------------------------------------

class OutRoChapter(Chapter):
    """One finding per notebook section, each reading the measurements of ``runs.outro_text`` (computed once)."""
    NAME = NAME
    PROFILES = PROFILES

    def check(self, s) -> None:
        for name in s.ifeval_extra:
            ifeval_options(name, s.gamma)

    def __init__(self, settings):
        super().__init__(settings)
        self.runs = OutRoTextRuns(settings)

    @finding
    def sinks(self) -> Finding:
        return sinks_finding({spec: self.runs.sink_facts(spec) for spec in self.settings.models})

    @finding
    def redistribution(self) -> Finding:
        return redistribution_finding({spec: self.runs.attention_by_category(spec) for spec in self.settings.models},
                                      self.settings.gamma)

    @finding
    def alignment(self) -> Finding:
        return alignment_finding({spec: self.runs.head_points(spec) for spec in self.settings.models})

    @finding
    def ablation(self) -> Finding:
        measured = {spec: self.runs.head_ablation(spec, self.settings.n_ablation_heads) for spec in self.settings.models}
        return ablation_finding(measured, f"Held-out text: {self.runs.windows_source}.")

    @finding
    def rotation_strength(self) -> Finding:
        measured = {}
        for spec in self.settings.models:
            m = self.runs.sweep(spec)
            m["sweep"] = {g: l for g, l in m["sweep"].items() if g in self.settings.gammas}
            chosen = select_gamma(m["sweep"])
            m["test_baseline"] = self.runs.losses(spec, "test")[0]
            m["test_rotated"] = self.runs.losses(spec, "test", dict(gamma=chosen, relax=False))[0]
            measured[spec] = m
        return rotation_strength_finding(measured)

    def _compliance_runs(self, with_controls: bool = False) -> dict:
        """Baseline for every model (screening prompts only for a base model), OutRo where the precondition
        holds, and the direction controls when asked."""
        s, out = self.settings, {}
        for spec in s.models:
            chat = bool(getattr(self.runs.loaded(spec).tokenizer, "chat_template", None))
            n = s.n_prompts if chat else min(s.screen_prompts, s.n_prompts)
            m = {"chat": chat, "has_sinks": self.runs.first_sink(spec) is not None,
                 "settings": {"baseline": self.runs.generations(spec, "baseline", n)}}
            if _compliance_precondition(spec, m)[0]:
                names = ["outro", *s.ifeval_extra] + (list(CONTROLS) if with_controls else [])
                m["settings"].update({name: self.runs.generations(spec, name, n) for name in names})
            out[spec] = m
        return out

    @finding
    def compliance(self) -> Finding:
        return compliance_finding(self._compliance_runs(), self.settings.gamma, self.settings.max_new_tokens)

    @finding
    def direction_controls(self) -> Finding:
        losses = {spec: self.runs.direction_losses(spec, self.settings.gamma) for spec in self.settings.models}
        return direction_controls_finding(losses, self._compliance_runs(with_controls=True), self.settings.gamma)

    @finding
    def overhead(self) -> Finding:
        return overhead_finding(self.runs.overhead())

    def model_records(self) -> list[dict]:
        return [lm.record() for lm in self.runs._loaded.values()]

    def extra(self) -> dict:
        f, generated = self._findings, self.runs._generations
        ifeval = [{"model": spec, "setting": name, **g["summary"], "seconds": g["seconds"]}
                  for (spec, name, _), g in generated.items()]
        return {"sinks": f["sinks"].data["sinks"], "redistribution": f["redistribution"].data["rows"],
                "alignment": f["alignment"].data["rows"], "ablation": f["ablation"].data["rows"],
                "losses": f["rotation_strength"].data["rows"], "ifeval": ifeval,
                "ifeval_examples": {f"{spec} | {name}": g["responses"][:3] for (spec, name, _), g in generated.items()},
                "bench": f["overhead"].data["rows"]}
