"""Chapter: OutRo on small vision-language models -- the paper's claims tested where the paper makes them.

The OutRo paper (arXiv 2603.14337) studies attention sinks in omni and vision-language models and proposes OutRo
(rotation of non-sink head outputs toward the sink value, and a one-time relaxation of the causal mask for the
sink rows). The text chapter (``chapters.outro``) can only use text models. This one runs on the vision-language
models the adaptation chapter produces (``chapters.vl_adaptation``: SmolLM2-135M-Instruct and Gemma 3 270M with a
frozen digit encoder and an MLP projector, trained on the 8x8 digits) and answers held-out digit questions under
each intervention:

1. OutRo, rotation alone and relaxation alone against no intervention, gamma chosen on validation questions per
   run (Tables 4, 5, 6 and B.6; App. B.5, Fig. B.2);
2. where the attention freed by rotation goes, image against text tokens (Fig. 7, Table B.4);
3. pruning image tokens by the sink query's attention, against random and mean-query pruning (Fig. 9, Table 9);
4. sink identification: removing the sink dimensions at the Phi_LLM sink or at Phi_VLM tokens (Table A.2), and
   rotating toward Phi_VLM tokens instead (Table B.7);
5. Zero-K: attention to the sink and accuracy (Figs. 4-5, Table 3);
6. the geometry of sink keys and values (Fig. 3);
7. what mask relaxation does to the sink's representation, and to accuracy (Fig. 6, Table 4).

Every model is measured on the vision runs of each of the profile's ``seeds`` (the adaptation chapter trains them);
the runs of one model answer the same questions. Formulas: the book's methods page (book/methods.md), sections on
Phi_LLM, Phi_VLM, Zero-K, OutRo and paired tests. Accuracy comparisons are statistical claims
(``core.claims.statistical``): each question's outcome is averaged over the seeds, and the percentile interval of a
paired bootstrap over the questions (level 1 - ``ALPHA``) is set against an effect of interest written beside each
rule with its source; holds when the interval lies on the paper's side of zero, does not hold when it excludes the
effect of interest, inconclusive otherwise (the book's methods page, "The verdict rule"). The other measurements
are averaged over the seeds before their rule is applied (see the finding functions). Zero-K's effect on the
attention to the sink is claimed once, in the sink-criteria chapter (``zero_k_*``); this chapter measures it on the
adapted models and shows it beside its own claim about accuracy. Every claim is gated: Phi_LLM must find a sink in
every seed's model, and every seed's vision run must answer the held-out questions above chance (the adaptation
chapter's rule); otherwise it is "not comparable" and says why. Measurements run one (model, seed) per worker
process; the finding functions below are pure.
"""
from __future__ import annotations

import functools

import numpy as np
import pandas as pd

from ..core.claims import (INCONCLUSIVE, Claim, Effect, Finding, Interest, Rule, check, claim, decide, slug,
                           statistical)
from ..core.models import GEMMA3, SMOLLM2, resolve_device
from ..core.profiles import NON_EMPTY, POSITIVE, Profiles, SettingsError, above, between, each
from ..figures.outro_multimodal import (norms_figure, pruning_figure, relaxation_figure, rotation_strength_figure,
                                        sink_attention_figure)
from ..measures.stats import PairedTest, min_pairs_to_decide, paired_effect, paired_runs
from ..runs import adaptation as adaptation_jobs
from ..runs.adaptation_records import interval_pt, vision_learned
from ..runs.multimodal import GROUPS, IMAGE, PRUNE_METHODS, SINK, TEXT, measure_adapted, select_gamma
from .base import Chapter, all_of, finding_of


NAME = "outro_multimodal"
PAPER = "OutRo paper"

PROFILES = Profiles({
    # quick: CI; the adaptation chapter's 6-step run does not learn the digits, so every claim is gated off
    "quick": dict(models=[SMOLLM2], seeds=[0], n_test=12, n_val=4, gammas=[1.0],
                  prune_keep=[0.5], analysis_items=4, batch_size=16, workers=1, adaptation={}),
    # default: the book; the adaptation chapter's three seeds and its 100 held-out questions, one run per core
    "default": dict(models=[SMOLLM2, GEMMA3], seeds=[0, 1, 2], n_test=100, n_val=30,
                    gammas=[0.5, 1.0, 2.0, 3.0, 4.0], prune_keep=[0.5], analysis_items=24, batch_size=16,
                    workers=2, adaptation={}),
    "gpu": dict(models=["Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen3-1.7B"], seeds=[0], n_test=300, n_val=100,
                gammas=[0.5, 1.0, 1.5, 2.0, 3.0, 4.0], prune_keep=[0.5, 0.75, 0.25], analysis_items=64,
                batch_size=32, workers=1, adaptation={}),
}, limits=dict(models=NON_EMPTY, seeds=NON_EMPTY, n_test=POSITIVE, n_val=POSITIVE, gammas=each(above(0)),
               prune_keep=each(between(1e-9, 1)), analysis_items=POSITIVE, batch_size=POSITIVE, workers=POSITIVE),
   local=dict(models=[SMOLLM2, GEMMA3]))

# ---- constants and rules, each written once --------------------------------------------------------------------

ALPHA = 0.05              # ours: level of every paired test (the paper reports means, some with standard deviations)
MIN_QUESTIONS = min_pairs_to_decide(ALPHA)   # ours: no fewer test questions than an exact paired test needs to
                                             # decide at all (6): a bootstrap over fewer understates its uncertainty
LITTLE_EFFECT_PT = 2.0    # ours: Table A.2's largest overall drop when Phi_VLM tokens lose D_sink is 1.73 pt
NEARLY_IDENTICAL = 0.99   # ours: "nearly identical" representations (Fig. 6) as a cosine
CACHE_TOLERANCE = 1e-4    # ours: float32 rounding between one pass and prefill + cached decoding, relative

# Effects of interest, in accuracy points on the held-out questions, positive in the paper's direction, fixed before
# any result is read. Accuracy on held-out questions is what the paper scores too, so its points transfer as points;
# where the paper states a size we take the smallest it counts, since any larger threshold would call one of its own
# results a failure.
OUTRO_INTEREST = Interest(0.11, "paper: Table B.6, the smallest VLM gain it counts (Qwen3-VL, VideoHolmes, "
                                "46.65 -> 46.76)", "pt")
ROTATION_INTEREST = Interest(0.39, "paper: Table B.7, the smallest gain of rotation alone (Qwen2.5-Omni 3B, AVHBench, "
                                   "64.39 -> 64.78)", "pt")
# Tables 3, 4 and 9 and Fig. 9 are images our copy of the paper lacks: their sizes are not known to us, so these are
# ours, at 1 pt, the order of the gains the paper states in numbers (+0.11 to +2.18 pt, Tables 6 and B.6).
UNSTATED_INTEREST = Interest(1.0, "ours: the paper's table is an image without numbers in our copy; 1 pt, the order "
                                  "of its stated OutRo effects (+0.11 to +2.18 pt, Tables 6 and B.6)", "pt")
# Table B.7: Phi_LLM rotation beats the top Phi_VLM token by at least 0.74 pt (Qwen2.5-Omni 7B, AVUT, 64.44 vs 63.70)
# and the top 1% by at least 1.12 pt (7B, AVUT, 64.44 vs 63.32).
TOP1_INTEREST = Interest(0.74, "paper: Table B.7, the smallest gap to the top Phi_VLM token (Qwen2.5-Omni 7B, AVUT, "
                               "64.44 vs 63.70)", "pt")
TOP_PERCENT_INTEREST = Interest(1.12, "paper: Table B.7, the smallest gap to the top 1% of Phi_VLM tokens "
                                      "(Qwen2.5-Omni 7B, AVUT, 64.44 vs 63.32)", "pt")
# Table A.2: "has little effect" for drops of 1.73 and 0.54 pt: a loss within LITTLE_EFFECT_PT is "little".
LITTLE_INTEREST = Interest(LITTLE_EFFECT_PT, f"ours: Table A.2's largest drop it calls little is 1.73 pt; "
                                             f"{LITTLE_EFFECT_PT:g} pt rounds it up", "pt", non_inferiority=True)
# Table A.2: the Phi_LLM sink's removal takes accuracy to 0.00, i.e. to nothing: at our scale, down to chance.
COLLAPSES = (f"holds if the {1 - ALPHA:.0%} interval of the fall (paired bootstrap over questions, seed means) lies "
             f"above 0 and the accuracy left (seed mean) is at or below chance; does not hold if the interval excludes "
             f"a fall to chance (the effect of interest: the baseline's margin over chance, ours: the paper's "
             f"71.60 -> 0.00 is a fall to nothing); else inconclusive")
# App. B.5 / Fig. B.2: "Optimal gamma values vary across models". Each run chooses its own gamma for the test
# questions; a model's choice, for this claim, is the gamma of highest validation accuracy averaged over its seeds.
# A choice on a few validation questions differs by noise alone, so each model's own gamma must beat the other
# model's choice on its validation questions. Those are the questions the choice was made on, which favours the
# claim (the paper's own choice is made the same way); an interval above 0 on them still needs a clear winner, not a
# tie broken by one question.
GAMMA_INTEREST = Interest(1.0, "ours: a gamma that wins by less than 1 pt of validation accuracy is not a different "
                               "optimum", "pt")
GAMMA_VARIES = (f"with different choices, each model's own gamma against the other's on its validation questions "
                f"({1 - ALPHA:.0%} paired bootstrap interval over the questions' seed means, the weakest comparison): "
                f"holds above 0, does not hold below the effect of interest, else inconclusive; with one choice for "
                f"all, does not hold if it beats every other gamma on each model's questions, else inconclusive")
# The rules below read measurements that are not accuracies (attention, norms, cosines). Each is applied once, to the
# seed means: every per-layer (and per-head) measurement is averaged over the seeds' runs first, since each seed is
# one draw of the same adapted model and the paper states these of the model, not of every training run. The tables
# show each seed's value beside the mean.
# Fig. 7 / Table B.4: "rotation consistently reduces attention to sink tokens": a fall at every layer compared.
LOWERS_SINK_ATTENTION = Rule.true("the attention to the sink falls at every layer compared (Table B.4: 'consistently "
                                  "reduces')")
LESS_ATTENDED_GAINS = Rule.true("the modality attended less per token before rotation gains more attention mass")
SMALLER_NORM = Rule.true("the sink's norm is below the median norm of the other tokens at more than half of the "
                         "(layer, KV head) pairs with a sink")
STRUCTURED = Rule.true("the sink key's largest coordinate holds a larger share of its squared norm than the "
                       "other keys' largest coordinate (median), at more than half of the (layer, KV head) pairs")
ALIGNED = Rule.true("queries have a higher mean cosine with the sink key than with the other keys they see, at "
                    "more than half of the (layer, head) pairs")
IDENTICAL_RULE = Rule.at_least(NEARLY_IDENTICAL, "lowest mean cosine over the layers after relaxation")
CACHE_RULE = Rule.at_most(CACHE_TOLERANCE, "max |logit difference| / max |logit|")


# ---- finding functions: measurements in, table / figures / claims out ------------------------------------------
# ``measured[spec][seed]`` is what ``runs.multimodal.measure_model`` returned for that seed's adapted ``spec``. The
# runs of one model answer the same questions, so an accuracy comparison averages each question's outcome over the
# seeds and bootstraps those means over the questions (``_paired``); the interval then holds the seeds' variance as
# well as the questions'. When few answers change, it is widened to the exact interval of the pooled (seed,
# question) pairs, so that no change at all reads "no effect this sample could see", not a zero-width interval.
# With one seed it is the same code on that seed's outcomes.

def _seeds_text(seeds) -> str:
    seeds = list(seeds)
    return f"seed{'s' if len(seeds) != 1 else ''} {', '.join(str(s) for s in seeds)}"


def _gate(spec: str, runs: dict[int, dict]) -> tuple[bool, str]:
    """The precondition of every claim: a Phi_LLM sink in every seed's model, every seed's vision run learned the
    digits (the adaptation chapter's rule, on our test questions) and at least ``MIN_QUESTIONS`` test questions."""
    if not runs:
        return False, f"no vision run of {spec} was measured"
    without = [s for s in sorted(runs) if not runs[s]["sink"]["has_sink"]]
    if without:
        return False, (f"Phi_LLM finds no sink in the adapted {spec} ({_seeds_text(without)}) on these prompts, so "
                       f"OutRo has nothing to rotate toward and there is no sink to prune by, remove or zero")
    ok, text, _ = vision_learned({s: {"vision": r["vision"]} for s, r in runs.items()})
    if not ok:
        return False, (f"the adapted {spec} does not answer the held-out questions above chance in every seed "
                       f"({text or 'no test'})")
    n = min(r["vision"]["n"] for r in runs.values())
    if n < MIN_QUESTIONS:
        return False, f"{n} test questions; the paired test needs at least {MIN_QUESTIONS} to reach alpha = {ALPHA:g}"
    return True, ""


def _hits(runs: dict[int, dict], name: str, part: str = "test") -> np.ndarray:
    """Per question of ``part`` ("test" or "val"), the outcome under setting ``name`` averaged over the seeds."""
    return np.mean([np.asarray(runs[s][part][name], dtype=float) for s in sorted(runs)], axis=0)


def _paired(runs: dict[int, dict], first: str, second: str, part: str = "test") -> PairedTest:
    """Setting ``second`` against ``first`` over the questions of ``part``, paired by question and seed
    (``measures.stats.paired_runs``: the bootstrap of the seed means, never narrower than the pooled pairs allow;
    'improves': second better)."""
    outcomes = lambda name: [np.asarray(runs[s][part][name], dtype=float) for s in sorted(runs)]
    return paired_runs(outcomes(first), outcomes(second), ALPHA)


def _points(test: PairedTest, runs: dict, paper_direction: int = +1) -> Effect:
    return paired_effect(test, seeds=len(runs), paper_direction=paper_direction, scale=100, units="pt")


def _describe(test: PairedTest) -> str:
    d = test.detail
    return f"{d['mean_first']:.3f} -> {d['mean_second']:.3f} ({interval_pt(test)}; {test.n} questions)"


def _accuracy(runs: dict[int, dict], name: str) -> float:
    return float(_hits(runs, name).mean())


def _seed_mean(runs: dict[int, dict], get) -> np.ndarray:
    """``get(record)`` as an array, averaged over the seeds (a NaN in any seed stays NaN)."""
    return np.mean([np.asarray(get(runs[s]), dtype=float) for s in sorted(runs)], axis=0)


def _columns(spec: str, runs: dict[int, dict], values) -> dict:
    """One model's table entries: ``values(runs)`` for each seed alone and, with several seeds, for all of them
    (the seed mean, what the claims read), keyed (spec, "seed 0") ... (spec, "mean")."""
    out = {(spec, f"seed {s}"): values({s: runs[s]}) for s in sorted(runs)}
    if len(runs) > 1:
        out[(spec, "mean")] = values(runs)
    return out


def _gammas(runs: dict[int, dict]) -> str:
    return ", ".join(f"{runs[s]['gamma']:g}" for s in sorted(runs))


def models_finding(measured: dict[str, dict[int, dict]], adaptation: dict[str, dict] | None = None) -> Finding:
    """The adapted models, one row per seed: sinks, baseline accuracy against chance (the gate of every claim), and
    the check that OutRo's cached decoding on image prompts equals one pass over prompt and answer.
    ``adaptation[spec][seed]``: the adaptation chapter's evaluation of the same run ({"accuracy", "n"}), shown for
    comparison."""
    rows, claims, notes = {}, [], []
    for spec, runs in measured.items():
        ok, why = _gate(spec, runs)
        for seed, m in sorted(runs.items()):
            v, sink = m["vision"], m["sink"]
            rows[(spec, seed)] = {"layers": m["layers"], "first layer with a Phi_LLM sink": sink["first_layer"]
                                  if sink["first_layer"] is not None else "none",
                                  "sink = first real token": sink["is_first_real"] if sink["has_sink"] else "-",
                                  "test questions": v["n"], "accuracy": round(v["accuracy"], 3),
                                  "chance": round(v["chance"], 3),
                                  "above chance": vision_learned({seed: {"vision": v}})[0], "claims tested": ok}
        seen = (adaptation or {}).get(spec) or {}
        each = "; ".join(f"seed {s} {m['vision']['accuracy']:.3f}"
                         + (f" (the adaptation chapter's evaluation: {seen[s]['accuracy']:.3f} on {seen[s]['n']} "
                            f"questions)" if s in seen else "") for s, m in sorted(runs.items()))
        chance = float(np.mean([m["vision"]["chance"] for m in runs.values()]))
        by_task = {}
        for m in runs.values():
            for t, a in m["vision"]["by_task"].items():
                by_task.setdefault(t, []).append(a)
        notes.append(f"{spec}: held-out accuracy {each}, against chance {chance:.3f}; by task (seed mean) "
                     + ", ".join(f"{t} {np.mean(a):.2f}" for t, a in by_task.items()) + "."
                     + ("" if ok else f" Claims are not tested: {why}."))
        relative = max(m["check"]["max_abs_diff"] / max(m["check"]["max_abs_logit"], 1e-12) for m in runs.values())
        rotated = sum(m["check"]["rotated_decode_rows"] for m in runs.values())
        claims.append(check(f"vlm_outro_cache_{slug(spec)}",
                            f"{spec}: prefill and cached decoding under OutRo on image prompts give the logits of one "
                            f"pass over prompt and answer, in every seed's model ({rotated} decode rows rotated, "
                            f"{_seeds_text(sorted(runs))})", f"{relative:.2g}", CACHE_RULE,
                            expected=f"<= {CACHE_TOLERANCE:g}", value=relative))
    table = pd.DataFrame(rows).T if rows else None
    if table is not None:
        table.index.names = ["model", "seed"]
    return Finding("The adapted models", claims=claims, table=table, notes=notes)


def _model_gamma(runs: dict[int, dict], gammas: list[float]) -> float:
    """A model's rotation strength for the gamma claim: highest validation accuracy averaged over its seeds (one
    seed: the run's own choice)."""
    return select_gamma({g: _hits(runs, f"{g:g}", "val") for g in gammas})


def _val_gammas(runs: dict[int, dict]) -> list[float]:
    return sorted(float(g) for g in next(iter(runs.values()))["val"] if g != "baseline")


def rotation_strength_finding(measured: dict[str, dict[int, dict]]) -> Finding:
    """App. B.5 / Fig. B.2: validation accuracy of OutRo at each gamma; the gamma each run chose (per seed) and the
    model's choice on the seed means."""
    table, notes, gains, usable = {}, [], {}, {}
    for spec, runs in measured.items():
        gammas = _val_gammas(runs)

        def values(r):
            return {"no OutRo": float(_hits(r, "baseline", "val").mean()),
                    **{f"gamma {g:g}": float(_hits(r, f"{g:g}", "val").mean()) for g in gammas},
                    "chosen gamma": next(iter(r.values()))["gamma"] if len(r) == 1 else _model_gamma(r, gammas)}
        table.update(_columns(spec, runs, values))
        accuracy = {g: float(_hits(runs, f"{g:g}", "val").mean()) for g in gammas}
        base = float(_hits(runs, "baseline", "val").mean())
        gains[spec] = {g: a - base for g, a in accuracy.items()}
        flat = len(set(accuracy.values())) == 1
        chosen = _model_gamma(runs, gammas)
        n_val = len(next(iter(runs.values()))["val"]["baseline"])
        notes.append(f"{spec}: each run chooses the gamma of highest accuracy on {n_val} validation questions ("
                     + ", ".join(f"seed {s}: {m['gamma']:g}" for s, m in sorted(runs.items()))
                     + f"); averaged over the seeds gamma {chosen:g} is best ({accuracy.get(chosen, float('nan')):.3f}, "
                       f"against {base:.3f} without OutRo)"
                     + ("; every gamma scores the same, so the choice is the smallest." if flat else "."))
        ok, _ = _gate(spec, runs)
        if ok and not flat:
            usable[spec] = chosen
    claims = [gamma_claim(measured, usable)]
    return Finding("Rotation strength on validation questions", claims=claims,
                   table=pd.DataFrame(table) if table else None, figures=[rotation_strength_figure(gains)], notes=notes)


def gamma_claim(measured: dict[str, dict[int, dict]], usable: dict[str, float]) -> Claim:
    """App. B.5: the best rotation strength differs between models. ``usable``: spec -> the model's gamma (seed
    means), for the models whose claims are tested and whose validation accuracy depends on gamma."""
    source, statement = f"{PAPER}, App. B.5, Fig. B.2", "the best rotation strength differs between models"
    paper = "3.0 (Qwen2.5-Omni), 0.5 (Qwen3-VL, video-SALMONN2+), 1.5 (VideoLLaMA3)"
    our = ", ".join(f"{spec}: {_model_gamma(runs, _val_gammas(runs)):g}"
                    + (f" (per seed {_gammas(runs)})" if len(runs) > 1 else "") for spec, runs in measured.items())
    if len(usable) < 2:
        return Claim("vlm_gamma_varies_across_models", "measured", source, statement, paper, our, GAMMA_VARIES,
                     "not comparable", why_not_comparable="needs two models whose claims are tested and whose "
                                                          "validation accuracy depends on gamma",
                     interest=GAMMA_INTEREST.as_dict())
    choices = sorted(set(usable.values()))

    def effect(spec, first, second):
        runs = measured[spec]
        return _points(_paired(runs, f"{first:g}", f"{second:g}", "val"), runs)
    if len(choices) > 1:      # own choice (second) against each other model's choice (first), per model
        effects = [effect(spec, other, own) for spec, own in usable.items() for other in choices if other != own]
        weakest = min(effects, key=lambda e: e.low)
        holds, caveat = decide(weakest, GAMMA_INTEREST)
    else:                     # one choice for all: refuted only if it wins against every other gamma on each model
        effects = [effect(spec, g, own) for spec, own in usable.items() for g in _val_gammas(measured[spec])
                   if g != own]
        weakest = min(effects, key=lambda e: e.low) if effects else None
        if weakest is None:
            return Claim("vlm_gamma_varies_across_models", "measured", source, statement, paper, our, GAMMA_VARIES,
                         "not comparable", why_not_comparable="one gamma was swept", interest=GAMMA_INTEREST.as_dict())
        holds = False if weakest.low > 0 else INCONCLUSIVE
        caveat = ("" if holds is False else f"every model chose {choices[0]:g}, but not by an interval above 0 "
                  f"against every other gamma; the sample could detect about {weakest.detectable:.3g} pt")
    return Claim("vlm_gamma_varies_across_models", "measured", source, statement, paper,
                 f"{our}; weakest comparison {weakest.text()}", GAMMA_VARIES, holds, effect=weakest.as_dict(),
                 interest=GAMMA_INTEREST.as_dict(), caveat=caveat)


def accuracy_finding(measured: dict[str, dict[int, dict]]) -> Finding:
    """Tables 5, 6 and B.6: test accuracy without intervention, with OutRo, and with rotation alone (relaxation
    alone is claimed with the relaxation analysis), each run at the gamma it chose on validation questions."""
    table, claims, notes = {}, [], []
    names = {"baseline": "no intervention", "outro": "OutRo", "rotate": "rotation alone", "relax": "relaxation alone"}
    for spec, runs in measured.items():
        gate = _gate(spec, runs)
        table.update(_columns(spec, runs, lambda r: {label: _accuracy(r, name) for name, label in names.items()}))
        tests = {name: _paired(runs, "baseline", name) for name in ("outro", "rotate", "relax")}
        notes.append(f"{spec}, gamma {_gammas(runs)} ({_seeds_text(sorted(runs))}), seed means: OutRo "
                     f"{_describe(tests['outro'])}; rotation alone {_describe(tests['rotate'])}; relaxation alone "
                     f"{_describe(tests['relax'])}.")
        claims.append(statistical(f"vlm_outro_accuracy_{slug(spec)}", f"{PAPER}, Tables 6 and B.6",
                                  f"OutRo (rotation and relaxation) improves accuracy on held-out visual questions: "
                                  f"{spec}", "+0.11 to +1.47 pt on 8 of 9 VLM benchmarks, one -0.15 (Table B.6)",
                                  _points(tests["outro"], runs), OUTRO_INTEREST, precondition=gate))
        claims.append(statistical(f"vlm_rotation_accuracy_{slug(spec)}", f"{PAPER}, Table 5 and Table B.7",
                                  f"rotation alone improves accuracy on held-out visual questions: {spec}",
                                  "consistent gains; +0.39 to +0.88 pt on Qwen2.5-Omni 3B (Table B.7)",
                                  _points(tests["rotate"], runs), ROTATION_INTEREST, precondition=gate))
    return Finding("OutRo on the test questions", claims=claims, table=pd.DataFrame(table) if table else None,
                   notes=notes)


def _first_sink_layer(runs: dict[int, dict]) -> int | None:
    """The first layer with a Phi_LLM sink in every seed's model (None if some seed's has none)."""
    firsts = [m["sink"]["first_layer"] for m in runs.values()]
    return None if any(f is None for f in firsts) else max(firsts)


def _after_first_sink(runs: dict[int, dict]) -> list[int]:
    first = _first_sink_layer(runs)
    return [] if first is None else list(range(first + 1, next(iter(runs.values()))["layers"]))


def _redistribution(runs: dict[int, dict]) -> dict:
    """The redistribution statistics on the seed means of the per-layer attention, at the layers after the first
    one with a sink (in every seed)."""
    layers = _after_first_sink(runs)
    base = _seed_mean(runs, lambda m: m["attention"]["base"])
    rotated = _seed_mean(runs, lambda m: m["attention"]["rotated"])
    counts = np.maximum(_seed_mean(runs, lambda m: m["attention"]["counts"]), 1e-12)
    if not layers:
        return {"layers": [], "base": base, "rotated": rotated, "per_token": np.full(3, np.nan),
                "delta": np.full(3, np.nan), "share_down": float("nan"), "less": "-", "gained": "-"}
    per_token = (base[layers] / counts).mean(0)
    delta = (rotated[layers] - base[layers]).mean(0)
    return {"layers": layers, "base": base, "rotated": rotated, "per_token": per_token, "delta": delta,
            "share_down": float((rotated[layers, SINK] < base[layers, SINK]).mean()),
            "less": GROUPS[IMAGE] if per_token[IMAGE] < per_token[TEXT] else GROUPS[TEXT],
            "gained": GROUPS[IMAGE] if delta[IMAGE] > delta[TEXT] else GROUPS[TEXT]}


def redistribution_finding(measured: dict[str, dict[int, dict]]) -> Finding:
    """Fig. 7 / Table B.4: attention of the question's rows to the sink, the image and the text tokens, per layer,
    with and without rotation (the layers after the first one with a sink), averaged over the seeds."""
    rows, claims, notes, curves = {}, [], [], {}

    def values(runs):
        r = _redistribution(runs)
        return {"attention to an image token": r["per_token"][IMAGE], "attention to a text token":
                r["per_token"][TEXT], "change: sink": r["delta"][SINK], "change: image": r["delta"][IMAGE],
                "change: text": r["delta"][TEXT], "layers where the sink's falls": r["share_down"]}
    for spec, runs in measured.items():
        r = _redistribution(runs)
        layers, delta, less, gained = r["layers"], r["delta"], r["less"], r["gained"]
        gate = all_of(_gate(spec, runs), (bool(layers), "no layer follows the first layer with a sink"))
        curves[spec] = (r["base"][:, SINK], r["rotated"][:, SINK], ("no rotation", f"rotation (gamma {_gammas(runs)})"))
        fell = bool(r["share_down"] == 1.0)
        rows.update(_columns(spec, runs, values))
        if layers:
            notes.append(f"{spec}, layers {layers[0]}..{layers[-1]}, seed means: rotation changes the attention to the "
                         f"sink by {delta[SINK]:+.4f} (lower at {r['share_down']:.0%} of the layers); per token the "
                         f"{less} tokens got less attention before, and the larger gain goes to the {gained} tokens.")
        claims.append(claim(f"vlm_rotation_lowers_sink_attention_{slug(spec)}", "measured", f"{PAPER}, Fig. 7, Table B.4",
                            f"rotation lowers the attention paid to the sink: {spec}", "-0.0095 to -0.0234 (Table B.4)",
                            round(float(delta[SINK]), 5), LOWERS_SINK_ATTENTION, value=fell, precondition=gate))
        claims.append(claim(f"vlm_freed_attention_to_less_attended_{slug(spec)}", "measured", f"{PAPER}, Table B.4",
                            f"the freed attention goes mostly to the modality attended less per token (image or "
                            f"text): {spec}", "video +0.0127 vs audio +0.0022 when video got less per token "
                                              "(Qwen2.5-Omni); audio gains more in VideoLLaMA2",
                            f"less attended: {less}; change image {delta[IMAGE]:+.4f}, text {delta[TEXT]:+.4f}",
                            LESS_ATTENDED_GAINS, value=less == gained, precondition=gate))
    fig = sink_attention_figure(curves, "Attention of the question's rows to the sink, per layer, mean over seeds "
                                        "(Fig. 7)")
    return Finding("Where the freed attention goes", claims=claims, table=pd.DataFrame(rows).T if rows else None,
                   figures=[fig], notes=notes)


def pruning_finding(measured: dict[str, dict[int, dict]]) -> Finding:
    """Fig. 9 / Table 9: keep a share of the image tokens, chosen by the sink query's attention at the layer where
    OutRo relaxes the sink, by a random draw (each run's seed), or by the mean attention of the question's rows."""
    table, claims, notes, curves = {}, [], [], {}
    for spec, runs in measured.items():
        first = next(iter(runs.values()))
        keeps = first["prune"]["keep"]
        key = lambda method, keep: f"prune_{method}_{keep:g}"
        table.update(_columns(spec, runs, lambda r: {"all image tokens": _accuracy(r, "baseline"),
                                                     **{f"{method}, keep {keep:g}": _accuracy(r, key(method, keep))
                                                        for keep in keeps for method in PRUNE_METHODS}}))
        for method in PRUNE_METHODS:
            curves[f"{spec}: {method.replace('_', ' ')}"] = ([1.0, *keeps], [_accuracy(runs, "baseline")]
                                                            + [_accuracy(runs, key(method, k)) for k in keeps])
        keep = keeps[0]
        gate = _gate(spec, runs)
        sink = _paired(runs, "baseline", key("sink_query", keep))
        random = _paired(runs, "baseline", key("random", keep))
        versus = _paired(runs, key("mean_query", keep), key("sink_query", keep))
        layers = ", ".join(str(m["prune"]["layer"]) for _, m in sorted(runs.items()))
        notes.append(f"{spec}: scores at layer {layers} ({_seeds_text(sorted(runs))}; the sink's relaxation layer), "
                     f"{first['prune']['image_tokens']:.1f} image tokens per question; keeping {keep:g} of them by "
                     f"the sink query {_describe(sink)}; at random {_describe(random)} (seed means).")
        source = f"{PAPER}, Sec. 5.3, Fig. 9, Table 9"
        claims.append(statistical(f"vlm_sink_query_pruning_{slug(spec)}", source,
                                  f"pruning image tokens by the sink query's attention improves accuracy (keep "
                                  f"{keep:g}): {spec}", "improves at the relaxation layer (AVHBench)",
                                  _points(sink, runs), UNSTATED_INTEREST, precondition=gate))
        claims.append(statistical(f"vlm_random_pruning_hurts_{slug(spec)}", source,
                                  f"pruning image tokens at random lowers accuracy (keep {keep:g}): {spec}",
                                  "random pruning degrades performance", _points(random, runs, paper_direction=-1),
                                  UNSTATED_INTEREST, precondition=gate))
        claims.append(statistical(f"vlm_sink_query_beats_mean_query_{slug(spec)}",
                                  "ours (a control for the paper's Sec. 5.3)",
                                  f"the sink query picks better image tokens than the question's mean attention (keep "
                                  f"{keep:g}): {spec}", "not tested in the paper", _points(versus, runs),
                                  UNSTATED_INTEREST, precondition=gate, origin="ours"))
    return Finding("Pruning image tokens by the sink query", claims=claims,
                   table=pd.DataFrame(table) if table else None, figures=[pruning_figure(curves)], notes=notes)


def identification_finding(measured: dict[str, dict[int, dict]]) -> Finding:
    """Table A.2 (D_sink removed at the Phi_LLM sink, at one random Phi_VLM token, at every other Phi_VLM token)
    and Table B.7 (rotation alone toward the Phi_LLM sinks against the top 1 / top 1% Phi_VLM tokens). Each run
    finds its own D_sink and Phi_VLM tokens; a precondition on them must hold in every seed's model."""
    names = {"baseline": "no intervention", "remove_llm_sink": "D_sink removed: Phi_LLM sink",
             "remove_vlm_random": "D_sink removed: one Phi_VLM token", "remove_vlm_others":
             "D_sink removed: all other Phi_VLM tokens", "rotate": "rotation toward Phi_LLM sinks",
             "rotate_vlm_top1": "rotation toward Phi_VLM top 1", "rotate_vlm_top_percent":
             "rotation toward Phi_VLM top 1%"}
    table, claims, notes = {}, [], []
    for spec, runs in measured.items():
        vlms, gate = {s: m["vlm_criterion"] for s, m in sorted(runs.items())}, _gate(spec, runs)
        tau = next(iter(vlms.values()))["tau"]
        lacking = lambda ok: [s for s, v in vlms.items() if not ok(v)]
        where = lambda ok: _seeds_text(lacking(ok))
        massive = (not lacking(lambda v: v["massive"]), f"no dimension holds a massive entry "
                                                         f"({where(lambda v: v['massive'])}), so D_sink is only a "
                                                         f"fallback of the two most outlying dimensions")
        has_others = lambda v: v["items_with_other_vlm_tokens"] > 0
        others = (not lacking(has_others), f"Phi_VLM (tau {tau:g}) flags no token besides the Phi_LLM sink "
                                           f"({where(has_others)})")
        has_any = lambda v: v["items_with_vlm_tokens"] > 0
        flagged = (not lacking(has_any), f"Phi_VLM (tau {tau:g}) flags no token ({where(has_any)})")
        table.update(_columns(spec, runs, lambda r: {label: _accuracy(r, name) for name, label in names.items()}))
        notes.append(f"{spec}: " + "; ".join(
            f"seed {s}: D_sink = {v['sink_dims']}{'' if v['massive'] else ' (fallback)'}, Phi_VLM flags "
            f"{v['vlm_tokens_per_item']:.1f} tokens per question besides the Phi_LLM sink (at any layer)"
            for s, v in vlms.items()) + ".")
        removed = _paired(runs, "baseline", "remove_llm_sink")
        acc = _accuracy(runs, "remove_llm_sink")
        chance = float(np.mean([m["vision"]["chance"] for m in runs.values()]))
        claims.append(collapse_claim(spec, removed, acc, chance, all_of(gate, massive), seeds=len(runs)))
        for name, what, paper in (("remove_vlm_random", "one random Phi_VLM token", "71.60 -> 69.87"),
                                  ("remove_vlm_others", "every Phi_VLM token but the Phi_LLM sink", "71.60 -> 71.06")):
            test = _paired(runs, "baseline", name)
            claims.append(statistical(f"vlm_{name}_little_effect_{slug(spec)}", f"{PAPER}, App. A.2, Table A.2",
                                      f"removing the sink dimensions at {what} barely changes accuracy: {spec}",
                                      f"{paper} (AVHBench)", _points(test, runs), LITTLE_INTEREST,
                                      precondition=all_of(gate, massive, others)))
        top1 = _paired(runs, "rotate_vlm_top1", "rotate")
        claims.append(statistical(f"vlm_rotation_llm_beats_vlm_top1_{slug(spec)}", f"{PAPER}, App. B.6, Table B.7",
                                  f"rotation toward the Phi_LLM sinks beats rotation toward the top Phi_VLM token: "
                                  f"{spec}", "better in 8 of 8 settings, e.g. AVHBench 64.78 vs 61.90 (Qwen2.5-Omni 3B)",
                                  _points(top1, runs), TOP1_INTEREST, precondition=all_of(gate, massive, flagged)))
        percent = _paired(runs, "rotate_vlm_top_percent", "rotate")
        same = (not any(v["top_percent_is_top1"] for v in vlms.values()),
                "every prompt has at most 100 tokens, so its top 1% is one token: the same setting as the top Phi_VLM "
                "token, claimed above")
        claims.append(statistical(f"vlm_rotation_llm_beats_vlm_top_percent_{slug(spec)}", f"{PAPER}, App. B.6, Table B.7",
                                  f"rotation toward the Phi_LLM sinks beats rotation toward the top 1% of Phi_VLM "
                                  f"tokens: {spec}",
                                  "better in 8 of 8 settings, e.g. AVHBench 64.78 vs 60.97 (Qwen2.5-Omni 3B)",
                                  _points(percent, runs), TOP_PERCENT_INTEREST,
                                  precondition=all_of(gate, massive, flagged, same)))
    return Finding("Which tokens are the sink", claims=claims, table=pd.DataFrame(table) if table else None,
                   notes=notes)


def collapse_claim(spec: str, removed: PairedTest, accuracy_left: float, chance: float, gate: tuple[bool, str],
                   seeds: int = 1) -> Claim:
    """Table A.2: removing D_sink at the Phi_LLM sink collapses accuracy (71.60 -> 0.00). At our scale a collapse is
    a fall to chance: the effect of interest is the baseline's margin over chance, in points. ``removed``: the
    paired test of the removal against no intervention over the questions' seed means; ``accuracy_left``: the seed
    mean with the sink removed."""
    fall = paired_effect(removed, seeds=seeds, paper_direction=-1, scale=100, units="pt")
    margin = 100 * (removed.detail["mean_first"] - chance)
    cid, source = f"vlm_remove_llm_sink_collapses_{slug(spec)}", f"{PAPER}, App. A.2, Table A.2"
    statement = f"removing the sink dimensions at the Phi_LLM sink collapses accuracy (to chance): {spec}"
    if not gate[0] or not margin > 0:
        why = gate[1] if not gate[0] else "the baseline is not above chance, so it has nothing to collapse from"
        return statistical(cid, source, statement, "71.60 -> 0.00 (AVHBench)", fall,
                           UNSTATED_INTEREST, precondition=(False, why))
    interest = Interest(round(margin, 2), "ours: a fall to chance, the baseline's margin over it (the paper's "
                                          "71.60 -> 0.00 is a fall to nothing)", "pt")
    if fall.low > 0 and accuracy_left <= chance:
        holds, caveat = True, ""
    elif fall.high < interest.value:
        holds, caveat = False, "the interval excludes a fall to chance"
    else:
        holds = INCONCLUSIVE
        where = (f"accuracy falls but the {accuracy_left:.3f} left is above chance ({chance:.3f})" if fall.low > 0
                 else "the interval spans 0")
        caveat = f"{where}, and a fall to chance is not excluded; the sample could detect about {fall.detectable:.3g} pt"
    return Claim(cid, "measured", source, statement, "71.60 -> 0.00 (AVHBench)",
                 f"{fall.text()}; accuracy left {accuracy_left:.3f}, chance {chance:.3f}", COLLAPSES, holds,
                 effect=fall.as_dict(), interest=interest.as_dict(), caveat=caveat)


def zero_k_finding(measured: dict[str, dict[int, dict]]) -> Finding:
    """Figs. 4-5 and Table 3: the top-1 dimension of the sink key zeroed at every layer and head."""
    rows, claims, notes, curves = {}, [], [], {}

    def values(runs):
        before = _seed_mean(runs, lambda m: m["zero_k"]["before"])
        after = _seed_mean(runs, lambda m: m["zero_k"]["after"])
        return {"attention to the sink": float(before.mean()), "with Zero-K": float(after.mean()),
                "layers where it falls": float((after < before).mean()), "accuracy": _accuracy(runs, "baseline"),
                "accuracy with Zero-K": _accuracy(runs, "zero_k")}
    for spec, runs in measured.items():
        before = _seed_mean(runs, lambda m: m["zero_k"]["before"])
        after = _seed_mean(runs, lambda m: m["zero_k"]["after"])
        curves[spec] = (before, after, ("baseline", "Zero-K top 1"))
        change, share_down = float((after - before).mean()), float((after < before).mean())
        test, gate = _paired(runs, "baseline", "zero_k"), _gate(spec, runs)
        rows.update(_columns(spec, runs, values))
        notes.append(f"{spec}, seed means: Zero-K changes the mean attention to the sink by {change:+.4f} over all "
                     f"layers (lower at {share_down:.0%} of them; that Zero-K removes the sink is claimed once, in the "
                     f"sink-criteria chapter, zero_k_*); accuracy {_describe(test)}.")
        claims.append(statistical(f"vlm_zero_k_accuracy_{slug(spec)}", f"{PAPER}, Sec. 3 (Q3), Table 3",
                                  f"zeroing the sink key's top dimension lowers accuracy: {spec}",
                                  "consistent degradation (Table 3)", _points(test, runs, paper_direction=-1),
                                  UNSTATED_INTEREST, precondition=gate))
    fig = sink_attention_figure(curves, "Mean attention to the sink key, per layer, mean over seeds (Fig. 4)")
    return Finding("Zero-K", claims=claims, table=pd.DataFrame(rows).T if rows else None, figures=[fig], notes=notes)


def _geometry(runs: dict[int, dict]) -> dict:
    """Fig. 3's statistics on the seed means of the per-(layer, head) measurements, at the layers from the first
    one with a sink (in every seed) on; all layers when some seed's model has none."""
    g = {k: _seed_mean(runs, lambda m, k=k: m["geometry"][k]) for k in next(iter(runs.values()))["geometry"]}
    first, n_layers = _first_sink_layer(runs), next(iter(runs.values()))["layers"]
    layers = list(range(first, n_layers)) if first is not None else []
    pick = (lambda x: x[layers]) if layers else (lambda x: x)
    key, value = pick(g["key_ratio"]), pick(g["value_ratio"])
    top_sink, top_other = pick(g["key_top_sink"]), pick(g["key_top_other"])
    cos_sink, cos_other = pick(g["cos_sink"]), pick(g["cos_other"])
    layer_pairs = [l - 1 for l in layers if l >= 1] if layers else list(range(len(g["value_layers_cos"])))
    return {"layers": layers, "n_layers": n_layers,
            "ratios": (np.median(g["key_ratio"], 1), np.median(g["value_ratio"], 1)),
            "shares": {"key": float((key < 1).mean()), "value": float((value < 1).mean()),
                       "top": float((top_sink > top_other).mean()), "cos": float((cos_sink > cos_other).mean())},
            "row": {"sink key norm / others' median": float(np.median(key)),
                    "sink value norm / others' median": float(np.median(value)),
                    "top-coordinate share, sink key": float(np.median(top_sink)),
                    "top-coordinate share, other keys": float(np.median(top_other)),
                    "cos(query, sink key)": float(cos_sink.mean()), "cos(query, other keys)": float(cos_other.mean()),
                    "sink value across heads (cos)": float(pick(g["value_heads_cos"]).mean()),
                    "sink value across layers (cos)": float(np.mean([g["value_layers_cos"][p] for p in layer_pairs]))
                    if layer_pairs else float("nan")}}


def geometry_finding(measured: dict[str, dict[int, dict]]) -> Finding:
    """Fig. 3: sink key and value norms against the other tokens', the sink key's top coordinate, the cosine of
    queries with the sink key, and (ours) how aligned the sink value is across heads and layers once written into
    the residual stream, at the layers with a sink; averaged over the seeds."""
    table, claims, notes, ratios = {}, [], [], {}
    for spec, runs in measured.items():
        g = _geometry(runs)
        layers, shares, row = g["layers"], g["shares"], g["row"]
        gate = all_of(_gate(spec, runs), (bool(layers), "no layer has a sink"))
        ratios[spec] = g["ratios"]
        table.update(_columns(spec, runs, lambda r: _geometry(r)["row"]))
        notes.append(f"{spec}, layers {layers[0] if layers else 0}..{g['n_layers'] - 1}, seed means: the sink key is "
                     f"shorter than the median other key at {shares['key']:.0%} of the (layer, KV head) pairs and the "
                     f"sink value at {shares['value']:.0%}; written into the residual stream (W_O v), the sink values "
                     f"of different heads have mean cosine {row['sink value across heads (cos)']:.2f} and those of "
                     f"consecutive layers {row['sink value across layers (cos)']:.2f} (ours, no claim).")
        source = f"{PAPER}, Sec. 3 (Q3), Fig. 3"
        for what, name, rule, statement, paper in (
                ("key", "vlm_sink_key_norm_smaller", SMALLER_NORM, "sink keys have smaller norms than other keys",
                 "smaller (Fig. 3a)"),
                ("value", "vlm_sink_value_norm_smaller", SMALLER_NORM, "sink values have smaller norms than other values",
                 "smaller (Fig. 3a)"),
                ("top", "vlm_sink_key_structured", STRUCTURED, "the sink key is structured, not uniformly small: a "
                 "few coordinates carry it", "structured (Fig. 3b)"),
                ("cos", "vlm_sink_key_aligned", ALIGNED, "queries are aligned with the sink key", "high cosine "
                 "(Figs. 3c, 3d)")):
            claims.append(claim(f"{name}_{slug(spec)}", "measured", source, f"{statement}: {spec}", paper,
                                f"{shares[what]:.0%} of the pairs", rule, value=shares[what] > 0.5, precondition=gate))
    frame = pd.DataFrame(table) if table else None
    return Finding("The sink's keys and values", claims=claims, table=frame, figures=[norms_figure(ratios)], notes=notes)


def _relaxation(runs: dict[int, dict]) -> dict:
    """The sink's residual stream with and without relaxation, seed means per layer (a layer counts where every
    seed relaxed the sink at or before it)."""
    cosine = _seed_mean(runs, lambda m: m["relaxation"]["cosine"])
    distance = _seed_mean(runs, lambda m: m["relaxation"]["distance"])
    measured_layers = np.isfinite(cosine)
    relaxed = [x for m in runs.values() for x in m["relaxation"]["relaxed_at"] if x >= 0]
    return {"cosine": cosine, "any": bool(measured_layers.any()), "relaxed_at": min(relaxed) if relaxed else "-",
            "lowest": float(cosine[measured_layers].min()) if measured_layers.any() else float("nan"),
            "farthest": float(np.nanmax(distance[measured_layers])) if measured_layers.any() else float("nan")}


def relaxation_finding(measured: dict[str, dict[int, dict]]) -> Finding:
    """Fig. 6 and Table 4: how far relaxation moves the sink's residual stream (seed means), and accuracy with
    relaxation alone."""
    table, claims, notes, cosines = {}, [], [], {}
    for spec, runs in measured.items():
        r = _relaxation(runs)
        gate = all_of(_gate(spec, runs), (r["any"], "no sink was relaxed"))
        cosines[spec] = r["cosine"]
        test = _paired(runs, "baseline", "relax")
        table.update(_columns(spec, runs, lambda x: {
            "relaxed at layer": _relaxation(x)["relaxed_at"], "lowest cosine": _relaxation(x)["lowest"],
            "largest relative distance": _relaxation(x)["farthest"], "accuracy": _accuracy(x, "baseline"),
            "accuracy, relaxation alone": _accuracy(x, "relax")}))
        notes.append(f"{spec}, seed means: the relaxed sink's residual stream keeps a cosine of at least "
                     f"{r['lowest']:.5f} with the original (relative distance at most {r['farthest']:.3g}); accuracy "
                     f"with relaxation alone {_describe(test)}.")
        claims.append(claim(f"vlm_relaxed_sink_nearly_identical_{slug(spec)}", "measured",
                            f"{PAPER}, Sec. 3 (Q3), Fig. 6 (the cosine threshold is ours)",
                            f"with the causal mask relaxed, the sink's representation stays nearly identical: {spec}",
                            "nearly identical to the original", round(r["lowest"], 5), IDENTICAL_RULE,
                            precondition=gate))
        claims.append(statistical(f"vlm_relaxation_accuracy_{slug(spec)}", f"{PAPER}, Sec. 3 (Q3), Table 4",
                                  f"relaxation alone improves accuracy on held-out visual questions: {spec}",
                                  "consistent gains (Table 4)", _points(test, runs), UNSTATED_INTEREST,
                                  precondition=gate))
    return Finding("Mask relaxation", claims=claims, table=pd.DataFrame(table).T if table else None,
                   figures=[relaxation_figure(cosines)], notes=notes)


# ---- the chapter ---------------------------------------------------------------------------------------------------

class OutRoMultimodalChapter(Chapter):
    """The adaptation chapter's vision runs of these models and seeds (its jobs, cached), each measured once
    (``runs.multimodal``, one worker process per model and seed), then one finding per notebook section."""
    NAME = NAME
    PROFILES = PROFILES

    def check(self, s) -> None:
        if s.analysis_items > s.n_test:
            raise SettingsError(f"analysis_items must lie in 1..n_test ({s.n_test})")
        if min(s.n_test, s.n_val) < 2:
            raise SettingsError("n_test and n_val must be at least 2: a paired bootstrap needs two questions")
        if len(set(s.seeds)) != len(s.seeds):
            raise SettingsError(f"seeds must differ from each other, got {list(s.seeds)}")
        self.recipe                     # the adaptation overrides are checked now, before any model is loaded

    @property
    def recipe(self):
        s = self.settings
        return adaptation_jobs.recipe(s.profile, device=s.device, **{**s.adaptation, "models": list(s.models),
                                                                      "seeds": list(s.seeds), "workers": s.workers})

    @functools.cached_property
    def measured(self) -> dict[str, dict[int, dict]]:
        """Per model spec and seed, the record of ``runs.multimodal.measure_model`` on that adapted vision run."""
        settings = {k: v for k, v in self.settings.values.items() if k not in ("adaptation", "seeds")}
        settings["tasks"] = list(self.recipe.tasks)
        s = self.settings
        self.adaptation, measured, seconds = measure_adapted(self.recipe, s.models, list(s.seeds), settings, s.workers,
                                                             resolve_device(s.device))
        self.timings.update(seconds)
        return measured

    models = finding_of(models_finding, "measured", "adaptation")
    rotation_strength = finding_of(rotation_strength_finding, "measured")
    accuracy = finding_of(accuracy_finding, "measured")
    redistribution = finding_of(redistribution_finding, "measured")
    pruning = finding_of(pruning_finding, "measured")
    identification = finding_of(identification_finding, "measured")
    zero_k = finding_of(zero_k_finding, "measured")
    geometry = finding_of(geometry_finding, "measured")
    relaxation = finding_of(relaxation_finding, "measured")

    def model_records(self) -> list[dict]:
        return [m["record"] for runs in self.measured.values() for _, m in sorted(runs.items())]

    def extra(self) -> dict:
        """Per model, per seed (keys are the seeds as text): everything a reader needs to redo a finding."""
        def run(m):
            return {"directory": m["directory"], "gamma": m["gamma"], "sink": m["sink"],
                    "vision": {k: v for k, v in m["vision"].items() if k != "per_item"},
                    "accuracy": {name: float(np.mean(hits)) for name, hits in m["test"].items()},
                    "validation": {name: float(np.mean(hits)) for name, hits in m["val"].items()},
                    "outcomes": m["test"], "validation_outcomes": m["val"], "prune": m["prune"],
                    "vlm_criterion": m["vlm_criterion"], "attention": m["attention"], "zero_k": m["zero_k"],
                    "geometry": m["geometry"], "relaxation": m["relaxation"], "check": m["check"],
                    "seconds": m["seconds"]}
        models = {spec: {"seeds": {str(seed): run(m) for seed, m in sorted(runs.items())}}
                  for spec, runs in self.measured.items()}
        adaptation = {spec: {str(seed): a for seed, a in sorted(by_seed.items())}
                      for spec, by_seed in self.adaptation.items()}
        return {"models": models, "adaptation": adaptation}
