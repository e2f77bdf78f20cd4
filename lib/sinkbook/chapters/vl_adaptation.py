"""Chapter: vision-language adaptation at small scale -- text capability loss and sink erosion, measured.

The VL paper's phenomenon, produced here: each language model is adapted into a small vision-language model on
the digit tasks (``training.adapt``: projector-only stage 1, then projector + language model), and, as a matched
control, fine-tuned on the same tasks with the image replaced by the digit words. Before, along and after training
we measure text capability (``measures.textsuite``: strictly parsed arithmetic and IFEval-style compliance, which
the paper calls format-sensitive; a multiple-choice knowledge set graded by log-likelihood and held-out text loss)
and the sink (``measures.margins``: S, attention on the first token, the margin G_base - B_gap against the
unadapted model, Theorem 1's bound on the actual weight updates). Formulas: the book's methods page.

The runs and their evaluations are ``runs.adaptation`` jobs, cached by configuration, so the book rebuilds in
minutes once they exist; the finding functions below read their records.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time

import numpy as np
import pandas as pd

from ..core.claims import NOT_COMPARABLE, Claim, Effect, Finding, Interest, Rule, check, claim, slug, statistical
from ..core.models import GEMMA3, SMOLLM2, resolve_device
from ..core.precision import PRECISIONS
from ..core.profiles import NON_EMPTY, POSITIVE, PROFILE_NAMES, Profiles, above, one_of, subset_of
from ..core.published import six_pairs
from ..figures.vl_adaptation import capability_figure, dose_figure, erosion_figure, theorem1_figure
from ..measures.regression import fit_line, spearman_rho
from ..measures.stats import paired_bootstrap, paired_effect, paired_runs
from ..runs import adaptation as jobs
from ..runs.adaptation_records import (arm_items, arm_runs, base_runs, dose_points, half_step, has_headroom,
                                       items, seeds_of, trajectory_table)
from ..runs.adaptation_records import probe_metric, vision_learned as learned_images
from ..training.digits import TASKS
from .base import Chapter, all_of, finding, finding_of


NAME = "vl_adaptation"
SOURCE = "VL paper"
ALPHA = 0.05                    # every paired test of the chapter
KNOWLEDGE_DROP_PT = 2.3         # App. C.1: MMLU / BoolQ drops never exceed 2.3 pt on the paper's six pairs
FORMAT_TASKS = ("ifeval", "arithmetic_strict", "arithmetic_flexible")
KNOWLEDGE_TASKS = ("knowledge_mc",)

_MODELS = {"quick": [SMOLLM2], "default": [SMOLLM2, GEMMA3],
           "gpu": ["Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen3-1.7B"], "gpu-local": [SMOLLM2, GEMMA3]}
# Three seeds: each run's seed also draws its digit encoder, so the spread includes that variance.
_SEEDS = {"quick": [0], "default": [0, 1, 2], "gpu": [0, 1, 2], "gpu-local": [0, 1, 2]}
_WORKERS = {"quick": 2, "default": 2, "gpu": 1, "gpu-local": 1}
PROFILES = Profiles({p: dict(models=_MODELS[p], seeds=_SEEDS[p], **jobs.RECIPE.table[p], workers=_WORKERS[p])
                     for p in PROFILE_NAMES},
                    limits=dict(models=NON_EMPTY, seeds=NON_EMPTY, tasks=subset_of(TASKS), steps=POSITIVE,
                                stage1_steps=POSITIVE, lr=above(0), stage1_lr=above(0), batch_size=POSITIVE,
                                probe_every=POSITIVE, arithmetic=POSITIVE, knowledge=POSITIVE, vision=POSITIVE,
                                heldout_windows=POSITIVE, window=POSITIVE, workers=POSITIVE,
                                precision=one_of(*PRECISIONS)))
# The task that compares the two models: a format-sensitive task both have headroom on (the paper's S ranks
# backbones on every format-sensitive task, Table 4); IFEval is measured on chat models only by default.
ACROSS_TASK = "arithmetic_flexible"

# ---- rules, each written once ----------------------------------------------------------------------------------
# Ours: every later claim needs vision runs that learned the images. The worst seed's held-out accuracy must lie
# above chance (its interval above 0); a run within 5 points of chance has not learned a ten-way digit task in any
# sense the VL claims could rest on.
LEARNED_OF_INTEREST = Interest(5.0, "ours: 5 pt above chance, the least a run that learned a ten-way digit task "
                                    "shows on held-out images", "pt")
# Statistical claims: the verdict is ``claims.decide`` on the paired effect (positive = the paper's direction) and
# the effect of interest written here, beside the claim, before any run was read.
# The paper's smallest loss on the task our task stands for, over the six pairs of its Table 6: a loss smaller than
# the smallest one it reports for any pair would not be the paper's effect. Our arithmetic is graded like its
# GSM8K-CoT (a parsed final answer; Table 6 reads GSM8K-CoT with flexible-extract).
LOSS_OF_INTEREST = {
    "ifeval": Interest(1.8, "paper: Table 6 / Sec. 3.1, the smallest IFEval loss of any pair (InternVL3.5, -1.8 pt)",
                       "pt"),
    "arithmetic_strict": Interest(1.5, "paper: Table 6, the smallest GSM8K-CoT loss of any pair (InternVL3.5, "
                                       "-1.5 pt)", "pt"),
    "arithmetic_flexible": Interest(1.5, "paper: Table 6, the smallest GSM8K-CoT loss of any pair (InternVL3.5, "
                                         "-1.5 pt)", "pt"),
}
# The paper's text-only advantages (Table 3: 9.6 pt IFEval, 19.8 pt GSM8K; Table 14: about 12 pt) are differences
# between 7B / 3B runs whose vision loss is 10-14 pt; they do not transfer to a loss of our size. Ours: the text-only
# run must avoid at least the smallest loss the paper counts for any pair on that task.
TEXT_ADVANTAGE_OF_INTEREST = {
    task: Interest(i.value, f"ours: the smallest loss the paper counts on this task ({i.value:g} pt, Table 6); the "
                            f"paper's own gaps (Table 3) belong to losses of another size", "pt")
    for task, i in LOSS_OF_INTEREST.items()}
# "Preserved" is a non-inferiority claim: the largest drop the paper still reports for a knowledge-like task.
PRESERVED_MARGIN = Interest(KNOWLEDGE_DROP_PT, f"paper: App. C.1 / Table 6, MMLU and BoolQ drops never exceed "
                                               f"{KNOWLEDGE_DROP_PT} pt over the six pairs", "pt", non_inferiority=True)
# The dose claim is ours (the paper's rho 0.97 is across six backbones, not along training within one).
DOSE_OF_INTEREST = Interest(0.3, "ours: a rank correlation below 0.3 (Cohen's 'medium') would leave erosion "
                                 "ordering under a tenth of the loss ordering, not 'carrying' it")
S_FALLS = Rule.true("S after training below S before, in every seed")
# The paper: the text-only run "holds S at +0.58 to +0.65" from a base of +0.41 (Sec. 5, Table 14), i.e. S never
# falls below the base at any checkpoint; "text-only optimization preserves the sink" (Sec. 5).
TEXT_KEEPS = Rule.true("S after text-only training at least S before, in every seed")
B_LARGER = Rule.true("median B_gap against the unadapted model larger after vision than after text-only training, in every seed")
EARLIER = Rule.true("the format-sensitive score reaches half of its final loss at an earlier probe than S reaches "
                    "half of its final drop (seed means)")
WITHIN = Rule.at_least(1.0, "share of (layer, head, query) within the bound")
# Theorem 1 holds "in the regime where the first-order Taylor expansion of q~, k~ near W_q, W_k is valid" (Sec. 4.2).
# Ours: the expansion's remainder is of relative size ||dW xi|| / ||W xi||; at most 0.1 keeps the O(eps^2) term
# under about a tenth of the first-order one.
FIRST_ORDER = Rule.at_most(0.1, "largest ||dW xi|| / ||W xi|| over heads and calibration tokens")
# "Higher S, smaller loss": paired over the task's items, the loss of the lower-S model minus that of the higher-S
# model. Ours: the difference must reach the smallest loss the paper counts on the task for any pair (Table 6); the
# paper's fit predicts a far larger gap for our S values, but on IFEval of 7B pairs, not on our task.
ORDER_OF_INTEREST = {task: Interest(i.value, f"ours: the smallest loss the paper counts on this task for any pair "
                                             f"({i.value:g} pt, Table 6)", "pt")
                     for task, i in LOSS_OF_INTEREST.items()}


def _statistical(id: str, source: str, statement: str, paper_value, effect: Effect | None, interest: Interest, *,
                 precondition: tuple[bool, str] | None = None, origin: str = "paper", why_none: str = "") -> Claim:
    """``statistical`` where the effect could be measured; otherwise a not-comparable claim that still carries its
    effect of interest and rule (``why_none`` says what was missing)."""
    if effect is not None:
        return statistical(id, source, statement, paper_value, effect, interest, precondition=precondition,
                           origin=origin)
    why = precondition[1] if precondition is not None and not precondition[0] else why_none
    return Claim(id, "measured", source, statement, paper_value, "not measured", interest.rule_text(1 - ALPHA),
                 NOT_COMPARABLE, origin=origin, why_not_comparable=why, interest=interest.as_dict())


# ---- finding functions: from the evaluations to tables, figures and claims ----------------------------------------
# ``base[model]`` is an unadapted model's evaluation, ``runs[(model, modality, seed)]`` an adapted one's.

def vision_learned(runs: dict, model: str) -> tuple[bool, str, dict]:
    """Whether every vision run of ``model`` answers held-out image questions above chance (bootstrap over items)."""
    return learned_images({s: runs[(model, "vision", s)] for s in seeds_of(runs, model, "vision")})



def worst_seed_above_chance(accuracies: dict) -> Effect | None:
    """The held-out image accuracy above chance (pt) of the seed whose interval reaches lowest: the claim that every
    seed learned holds only if that one did."""
    if not accuracies:
        return None
    effects = [paired_effect(test, len(accuracies), paper_direction=+1, scale=100, units="pt")
               for _, _, test in accuracies.values()]
    worst = min(effects, key=lambda e: e.low)
    return dataclasses.replace(worst, test=f"paired bootstrap over items against chance, worst of "
                                           f"{len(effects)} seed{'s' if len(effects) != 1 else ''}")


def adaptation_finding(base: dict, runs: dict, models: list) -> Finding:
    """Did the adaptation teach the image task? And where does each text task start (headroom)?"""
    rows, claims, notes = [], [], []
    for model in models:
        ok, text, accuracies = vision_learned(runs, model)
        claims.append(_statistical(f"vl_learns_images_{slug(model)}", "ours (precondition of every claim below)",
                                   f"{model}: the vision runs learn the digit tasks (held-out images, worst seed "
                                   f"against chance)", "not applicable", worst_seed_above_chance(accuracies),
                                   LEARNED_OF_INTEREST, origin="ours", why_none=text or "no vision run"))
        for task, r in base[model]["tasks"].items():
            rows.append({"model": model, "task": task, "kind": r["kind"], "base score": r["score"],
                         "floor": r["chance"], "items": r["n"], "headroom": has_headroom(base[model], task)})
        for seed, (acc, chance, _) in accuracies.items():
            by_task = runs[(model, "vision", seed)]["vision"]["by_task"]
            notes.append(f"{model}, seed {seed}: held-out image accuracy {acc:.2f} (chance {chance:.2f}); by task "
                         + ", ".join(f"{t} {a:.2f}" for t, a in by_task.items()) + ".")
    table = pd.DataFrame(rows).set_index(["model", "task"]) if rows else None
    dropped = [f"{m} / {t}" for (m, t), r in (table.iterrows() if table is not None else []) if not r["headroom"]]
    if dropped:
        notes.append("At the floor on the unadapted model, so no loss can show (dropped from the claims): "
                     + ", ".join(dropped) + ".")
    return Finding("The adaptation and the starting point", claims=claims, table=table, notes=notes)


def capability_finding(base: dict, runs: dict, models: list) -> Finding:
    """Analysis 1: the change of every text task after vision and after text-only training, paired over items
    and seeds (``measures.stats.paired_runs``: the bootstrap of per-item seed means, never narrower than the
    pooled pairs' exact interval for pass/fail scores)."""
    rows, claims = [], []
    for model in models:
        learned = vision_learned(runs, model)[0]
        gate_learned = (learned, "the vision runs did not learn the image task, so this is not VL adaptation")
        vision_seeds = seeds_of(runs, model, "vision")
        common = sorted(set(vision_seeds) & set(seeds_of(runs, model, "text")))
        for task in (*FORMAT_TASKS, *KNOWLEDGE_TASKS):
            b = items(base[model], task)
            if b is None or len(b) < 2:            # a paired test needs at least two items
                continue
            tests = {}
            for modality in ("vision", "text"):
                adapted = arm_runs(runs, model, modality, task)
                if adapted is not None:
                    tests[modality] = paired_runs(base_runs(base[model], task, len(adapted)), adapted, ALPHA)
                    rows.append({"model": model, "task": task, "run": modality, "base": float(b.mean()),
                                 "adapted": float(adapted.mean()), "change (pt)": 100 * tests[modality].effect,
                                 "low": 100 * tests[modality].detail["interval"][0],
                                 "high": 100 * tests[modality].detail["interval"][1],
                                 "outcome": tests[modality].outcome})
            if "vision" not in tests:
                continue
            room = (has_headroom(base[model], task), f"{task} is at its floor on the unadapted model")
            vl = tests["vision"]
            if task in FORMAT_TASKS:
                claims.append(statistical(
                    f"vl_lowers_{task}_{slug(model)}", f"{SOURCE}, Sec. 3.1 / App. C.1",
                    f"{model}: vision-language adaptation lowers the format-sensitive {task} score",
                    "format-sensitive scores drop (Table 6: IFEval -1.8 to -18.7 pt, GSM8K-CoT -1.5 to -42.7 pt)",
                    paired_effect(vl, len(vision_seeds), paper_direction=-1, scale=100, units="pt"),
                    LOSS_OF_INTEREST[task], precondition=all_of(gate_learned, room)))
                vis, txt = (arm_runs(runs, model, m, task, common) if common else None for m in ("vision", "text"))
                if vis is not None and txt is not None:
                    text_vs_vl = paired_runs(vis, txt, ALPHA)
                    claims.append(statistical(
                        f"text_only_loses_less_{task}_{slug(model)}", f"{SOURCE}, Table 3 / App. F.2",
                        f"{model}: the matched text-only run scores higher on {task} than the vision run (it loses "
                        f"less)", "text-only loses less (Table 3: IFEval 0.0 vs -9.6 pt; Table 14)",
                        paired_effect(text_vs_vl, len(common), paper_direction=+1, scale=100, units="pt"),
                        TEXT_ADVANTAGE_OF_INTEREST[task],
                        precondition=all_of(gate_learned, room,
                                            (vl.outcome == "hurts", "the vision run shows no loss to compare with"))))
            else:
                claims.append(statistical(
                    f"vl_preserves_{task}_{slug(model)}", f"{SOURCE}, App. C.1 / Table 6",
                    f"{model}: knowledge-like {task} is preserved by vision-language adaptation (a drop of at most "
                    f"{KNOWLEDGE_DROP_PT} pt)", f"drops of at most {KNOWLEDGE_DROP_PT} pt (MMLU, BoolQ)",
                    paired_effect(vl, len(vision_seeds), paper_direction=+1, scale=100, units="pt"),
                    PRESERVED_MARGIN, precondition=all_of(gate_learned, room)))
    table = pd.DataFrame(rows)
    figures = []
    if not table.empty:
        figures.append(capability_figure(table, models))
        table = table.set_index(["model", "task", "run"])
    return Finding("Text capability after adaptation", claims=claims, table=table, figures=figures)


def erosion_finding(base: dict, runs: dict, models: list) -> Finding:
    """Analysis 2: the sink and text skill along training, vision against text-only."""
    traj = trajectory_table(runs, models)
    claims, rows, notes = [], [], []
    if traj.empty:
        return Finding("Sink erosion along training", notes=["No probes were recorded."])
    for model in models:
        learned = vision_learned(runs, model)[0]
        gate = (learned, "the vision runs did not learn the image task")
        # The S change is read from the full evaluation (all calibration prompts) against the unadapted model's,
        # not from the probes, which see fewer prompts; the LLM at the first probe is the unadapted one.
        ds = {m: {seed: doc["sink"]["S"] - base[model]["sink"]["S"]
                  for (mm, modality, seed), doc in sorted(runs.items()) if mm == model and modality == m}
              for m in ("vision", "text")}
        for modality, seeds in ds.items():
            for seed, value in seeds.items():
                rows.append({"model": model, "run": modality, "seed": seed, "S change": value})
        if ds["vision"]:
            claims.append(claim(
                f"vl_lowers_s_{slug(model)}", "measured", f"{SOURCE}, Sec. 5 / Table 14",
                f"{model}: vision training weakens the sink (S falls)", "+0.41 -> +0.20 over 10k steps",
                ", ".join(f"seed {s}: {v:+.3f}" for s, v in ds["vision"].items()), S_FALLS,
                value=all(v < 0 for v in ds["vision"].values()), precondition=gate))
        common = sorted(set(ds["vision"]) & set(ds["text"]))
        if common:
            claims.append(claim(
                f"text_keeps_s_{slug(model)}", "measured", f"{SOURCE}, Sec. 5 / Table 14",
                f"{model}: text-only training preserves the sink (S does not fall)",
                "text-only run holds S at +0.58 to +0.65 from +0.41 ('preserves the sink')",
                ", ".join(f"seed {s}: text {ds['text'][s]:+.3f} (vision {ds['vision'][s]:+.3f})" for s in common),
                TEXT_KEEPS, value=all(ds["text"][s] >= 0 for s in common), precondition=gate))
            b_gap = {m: {s: runs[(model, m, s)]["sink"].get("margin_median_B", float("nan")) for s in common}
                     for m in ("vision", "text")}
            claims.append(claim(
                f"vl_larger_b_gap_{slug(model)}", "measured",
                "ours (the VL paper reports B_gap for released pairs only, Table 5; its text-only comparison is "
                "operator-norm displacement, Sec. 3.1)",
                f"{model}: vision training perturbs the sink logits more than text-only training (median B_gap)",
                "not reported (released pairs: B_gap 2.1-5.0; W_q / W_k displacement 4.44x / 3.65x text-only's)",
                ", ".join(f"seed {s}: vision {b_gap['vision'][s]:.2f} vs text {b_gap['text'][s]:.2f}" for s in common),
                B_LARGER, value=all(b_gap["vision"][s] > b_gap["text"][s] for s in common), precondition=gate,
                origin="ours"))
            eps = {m: [(runs[(model, m, s)].get("theorem1") or {}).get("median_eps", float("nan")) for s in common]
                   for m in ("vision", "text")}
            if all(np.isfinite(eps[m]).all() and min(eps[m]) > 0 for m in eps):
                notes.append(f"{model}: median per-head operator norm of the W_q / W_k update, vision over text-only: "
                             + ", ".join(f"seed {s} {v / t:.2f}x" for s, v, t in zip(common, eps["vision"], eps["text"]))
                             + " (the paper's released 7B endpoints: 4.44x on W_q, 3.65x on W_k, Sec. 3.1; ours is "
                               "the larger of the two per head, over the late-layer window).")
        vision = traj[(traj.model == model) & (traj.run == "vision")]
        metric = probe_metric(base[model])
        if not vision.empty and metric in vision:
            first_text, first_s = half_step(vision, metric), half_step(vision, "S")
            moved = math.isfinite(first_text) and math.isfinite(first_s)
            claims.append(claim(
                f"format_falls_before_s_{slug(model)}", "measured", f"{SOURCE}, Sec. 5 / App. F.2",
                f"{model}: format-sensitive skill falls before S does during vision training",
                "IFEval takes most of its loss by step 1k, before S falls",
                f"{metric}: half of the loss at step {first_text:g}, half of the S drop at step {first_s:g}", EARLIER,
                value=moved and first_text < first_s,
                precondition=all_of(gate, (moved, "the probe's arithmetic score or S did not fall during the vision runs"))))
    return Finding("Sink erosion along training", claims=claims, table=pd.DataFrame(rows),
                   figures=[erosion_figure(traj, models)], notes=notes)


def theorem1_finding(runs: dict, models: list) -> Finding:
    """Analysis 3: Theorem 1's bound against the logit-gap change the actual W_q / W_k updates cause."""
    rows, claims, points = [], [], {}
    for (model, modality, seed), doc in sorted(runs.items()):
        if model not in models or "theorem1" not in doc:
            continue
        t = doc["theorem1"]
        rows.append({"model": model, "run": modality, "seed": seed, "form": t["form"] or "none",
                     "median eps": t.get("median_eps", float("nan")), "share within": t["share_within"],
                     "median B / bound": t["median_ratio"], "max B / bound": t["max_ratio"],
                     "realised within": t["share_realised_within"],
                     "max relative change": t.get("max_relative_change", float("nan"))})
        pts = doc.get("theorem1_points") or {}
        if pts.get("bound") and t["form"]:
            points[f"{model} {modality} s{seed}"] = (pts["bound"], pts["B_projection"])
    table = pd.DataFrame(rows)
    for model in models:
        mine = table[table.model == model] if not table.empty else table
        if mine.empty:
            continue
        form = mine.form.iloc[0]
        share = float(mine["share within"].min())
        text = f"{share:.4f} of (layer, head, query) within; median B / bound {mine['median B / bound'].median():.3g}"
        if form == "eq4":
            claims.append(check(f"theorem1_eq4_holds_{slug(model)}",
                                f"{model}: Eq. 4 with its second-order term bounds every projection-only gap change "
                                f"(an inequality: a violation means our computation is wrong)", text, WITHIN,
                                source=f"{SOURCE}, Thm. 1 Eq. 4", value=share))
        elif form == "eq5":
            regime = mine["max relative change"].max() if "max relative change" in mine else float("nan")
            first_order = (bool(np.isfinite(regime) and FIRST_ORDER(regime)),
                           "outside the first-order regime Theorem 1 assumes: " + FIRST_ORDER.text + f" fails "
                           f"({regime:.3g})" if np.isfinite(regime) else
                           "the record does not carry ||dW xi|| / ||W xi||, so the first-order regime Theorem 1 "
                           "assumes cannot be checked")
            claims.append(claim(f"theorem1_eq5_holds_{slug(model)}", "measured", f"ours (c = 2 is ours; {SOURCE}, "
                                f"Thm. 1 Eq. 5 leaves c unspecified)",
                                f"{model}: Eq. 5 (first order, our c = 2) bounds every projection-only gap change",
                                "a bound up to O(eps^2), constant c not given", text, WITHIN, value=share,
                                precondition=first_order, origin="ours"))
        else:
            claims.append(claim(f"theorem1_holds_{slug(model)}", "measured", f"{SOURCE}, Thm. 1 / Remark 1",
                                f"{model}: Theorem 1 bounds the gap change", "a bound", "no bound for this QK-norm",
                                WITHIN, value=0.0, precondition=(False, "Theorem 1 covers no-QK-norm and per-head "
                                                                 "QK-norm; this model has neither")))
    notes = ["The realised B_gap (whole adapted model) also contains the drift of the hidden states, which the theorem "
             "holds fixed; it is shown for reference, not tested against the bound."]
    return Finding("Theorem 1 on the actual updates", claims=claims, table=table, figures=[theorem1_figure(points)],
                   notes=notes)


def dose_finding(base: dict, runs: dict, models: list, resamples: int = 2000) -> Finding:
    """Analysis 4: sink erosion against text-capability loss over every probe of every run, run-level bootstrap."""
    claims, tables, figures = [], [], []
    for model in models:
        metric = probe_metric(base[model])
        pts = dose_points(runs, model, metric)
        if pts.empty:
            continue
        rho = float(spearman_rho(pts.erosion, pts["text loss"]))
        groups = [g for _, g in pts.groupby("run")]
        rng = np.random.default_rng(0)
        boot = []
        for _ in range(resamples):
            sample = pd.concat([groups[i] for i in rng.integers(0, len(groups), len(groups))])
            boot.append(float(spearman_rho(sample.erosion, sample["text loss"])))
        boot = np.asarray(boot)
        boot = boot[np.isfinite(boot)]
        varied = pts.erosion.nunique() > 2 and pts["text loss"].nunique() > 2 and pts.step.nunique() >= 3
        seeds = len({seed for (m, _, seed) in runs if m == model})
        effect = None
        if np.isfinite(rho) and len(boot):
            low, high = np.quantile(boot, [ALPHA / 2, 1 - ALPHA / 2])
            effect = Effect(rho, float(low), float(high), 1 - ALPHA,
                            f"Spearman rho of erosion and {metric} loss, run-level bootstrap over {len(groups)} runs",
                            len(pts), seeds)
        claims.append(_statistical(
            f"erosion_tracks_loss_{slug(model)}", f"{SOURCE}, Secs. 1 and 4 (the mechanism); test design ours",
            f"{model}: the more a run erodes the sink, the more format-sensitive skill it loses ({metric}, probes)",
            "erosion carries the loss", effect, DOSE_OF_INTEREST, origin="ours",
            precondition=(varied, "fewer than three training strengths, or no variation in erosion or loss"),
            why_none="the rank correlation is undefined (a constant side)"))
        tables.append(pts.assign(model=model))
        figures.append(dose_figure(pts, model, metric))
    table = pd.concat(tables).groupby(["model", "modality", "step"])[["erosion", "text loss"]].mean() if tables else None
    return Finding("Dose and response", claims=claims, table=table, figures=figures)


def across_models_finding(base: dict, runs: dict, models: list, task: str = ACROSS_TASK) -> Finding:
    """Analysis 5: which model loses more under the same recipe, against what S (and the paper's fit) predicts."""
    six = six_pairs()
    intercept, slope = fit_line(six.s, six.delta_ifeval_counts)
    rows = []
    for model in models:
        vl = arm_items(runs, model, "vision", task)
        b = items(base[model], task)
        rows.append({"model": model, "QK-norm": base[model]["model"]["qk_norm"], "S (unadapted)": base[model]["sink"]["S"],
                     "paper's fit: predicted IFEval change (pt)": float(intercept + slope * base[model]["sink"]["S"]),
                     f"measured {task} change (pt)": 100 * float(vl.mean() - b.mean()) if vl is not None and b is not None
                     else float("nan"),
                     "headroom": has_headroom(base[model], task), "learned": vision_learned(runs, model)[0]})
    table = pd.DataFrame(rows).set_index("model")
    claims, notes = [], []
    usable = table[table.headroom & table.learned]
    if len(models) >= 2:
        order = list(usable.sort_values("S (unadapted)", ascending=False).index)
        losses = {m: (items(base[m], task) - arm_items(runs, m, "vision", task)) for m in order}
        same_items = len({len(v) for v in losses.values()}) == 1
        effect = None
        if len(order) >= 2 and same_items:
            # loss of the lower-S model minus that of the higher-S one, paired over items: positive = the paper's way
            test = paired_bootstrap(losses[order[0]], losses[order[-1]], ALPHA)
            seeds = min(len(seeds_of(runs, m, "vision")) for m in order)
            effect = paired_effect(test, seeds, paper_direction=+1, scale=100, units="pt")
        column = f"measured {task} change (pt)"
        claims.append(_statistical(
            "larger_s_loses_less", f"{SOURCE}, Sec. 3.2",
            f"under the same recipe, the model with the larger S loses less {task}",
            "higher S, smaller loss (rho 0.97 over six pairs)", effect, ORDER_OF_INTEREST[task],
            precondition=(len(order) >= 2, f"needs two models that learned the image task and have {task} headroom"),
            why_none=f"the models were scored on different {task} items" if len(order) >= 2 else ""))
        notes.append("Across models: " + "; ".join(f"{m}: S {r['S (unadapted)']:.2f}, change {r[column]:+.1f} pt"
                                                   for m, r in table.iterrows()) + ".")
    notes += [f"{m}: S {r['S (unadapted)']:.2f} on the unadapted model, QK-norm {r['QK-norm']}." for m, r in table.iterrows()]
    if len(table) >= 2:
        strongest = table["S (unadapted)"].idxmax()
        notes.append(f"{strongest} has the strongest sink of the {len(table)} models.")
    notes.append("Two models give a direction, not a correlation; they also differ in size, family and pretraining, "
                 "not only in S and QK-norm.")
    return Finding("Across models", claims=claims, table=table, notes=notes)


# ---- the chapter --------------------------------------------------------------------------------------------------

class VLAdaptationChapter(Chapter):
    """The runs (trained and evaluated by ``runs.adaptation``, cached), then one finding per notebook section."""
    NAME = NAME
    PROFILES = PROFILES

    @functools.cached_property
    def records(self) -> tuple[dict, dict]:
        """(``base[model]``, ``runs[(model, modality, seed)]``): every evaluation record, computed where missing."""
        start = time.perf_counter()
        listed = jobs.adaptation_jobs(self.settings)
        docs = jobs.run_adaptation_jobs(listed, self.settings.workers, resolve_device(self.settings.device))
        base = {j["model"]: d for j, d in zip(listed, docs) if j["kind"] == "base"}
        runs = {(j["config"]["model"], j["config"]["modality"], j["config"]["seed"]): d
                for j, d in zip(listed, docs) if j["kind"] == "run"}
        self.timings["records"] = round(time.perf_counter() - start, 1)
        return base, runs

    base = property(lambda self: self.records[0])
    runs = property(lambda self: self.records[1])

    @finding
    def run(self) -> Finding:
        base, runs = self.records
        table = pd.DataFrame([{"model": m, "run": mod, "seed": s, "training (s)": d.get("train_seconds"),
                               "evaluation (s)": d.get("seconds"), "steps": d["config"]["steps"]}
                              for (m, mod, s), d in runs.items()])
        st = self.settings
        notes = [f"{len(base) + len(runs)} jobs ({len(runs)} training runs); training and evaluating them took "
                 f"{self.timings['records']:.0f} s (cached runs load in seconds).",
                 f"Probes every {st.probe_every} stage-2 steps: S on {st.probe_prompts} calibration prompts, held-out "
                 f"loss on {st.probe_heldout_windows} window(s) of {st.probe_heldout_length} tokens, "
                 f"{st.probe_arithmetic} arithmetic items."]
        return Finding("Runs", table=table, notes=notes)

    adaptation = finding_of(adaptation_finding, "base", "runs", "settings.models")
    capability = finding_of(capability_finding, "base", "runs", "settings.models")
    erosion = finding_of(erosion_finding, "base", "runs", "settings.models")
    theorem1 = finding_of(theorem1_finding, "runs", "settings.models")
    dose_response = finding_of(dose_finding, "base", "runs", "settings.models")
    across_models = finding_of(across_models_finding, "base", "runs", "settings.models")
    def model_records(self) -> list[dict]:
        return [d["model"]["record"] for d in self.records[0].values()]

    def extra(self) -> dict:
        base, runs = self.records
        summaries = {f"{m}|{mod}|{s}": {"sink": d["sink"], "theorem1": d.get("theorem1"),
                                        "vision_accuracy": (d.get("vision") or {}).get("accuracy"),
                                        "scores": {t: r["score"] for t, r in d["tasks"].items()},
                                        "train_seconds": d.get("train_seconds"), "directory": d.get("directory")}
                     for (m, mod, s), d in runs.items()}
        base = {m: {"sink": d["sink"], "scores": {t: r["score"] for t, r in d["tasks"].items()}}
                for m, d in base.items()}
        return {"base": base, "runs": summaries}
