"""Chapter: protecting text capability during adaptation -- the VL paper's proposed interventions, tested.

Every intervention changes one thing of the adaptation chapter's vision recipe (``training.remedies``): the
head-selective sink protection derived from Theorem 1 and the per-head QK-norm frozen to a fixed scale (the two
experiments the paper proposes and leaves open), the QK-norm injected after pretraining (its negative control),
the known remedies (frozen language model, LoRA, text-only steps re-blended), and, after training, merging the
adapted language model with its base (the paper's second negative control). Plain runs are the adaptation
chapter's own (same configuration, same cache), so each intervention has a matched control with the same seeds,
data order and evaluation items.

Text capability is measured on the adaptation chapter's suite without IFEval-style compliance: plain vision
training did not lower it significantly on SmolLM2 and Gemma 3 is a base model, so it cannot show a protection
and would cost a third of every evaluation. The format-sensitive task each claim reads is the one with headroom
on which plain adaptation hurts (``FORMAT_TASK``).
"""
from __future__ import annotations

import functools
import time

import numpy as np
import pandas as pd

from ..core.claims import Finding, Rule, check, claim, slug
from ..core.models import GEMMA3, SMOLLM2, resolve_device
from ..core.profiles import NON_EMPTY, POSITIVE, Profiles, SettingsError, subset_of
from ..measures.stats import paired_bootstrap
from ..runs import adaptation as jobs
from ..runs.adaptation_records import (arm_items, arm_vision_items, has_headroom, interval_pt, items, probe_change,
                                      probe_metric, seeds_of, vision_learned)
from ..training.remedies import INTERVENTIONS
from .base import Chapter, all_of, finding


NAME = "vl_protection"
SOURCE = "VL paper"
ALPHA = 0.05                             # every paired test of the chapter
FORMAT_TASK = "arithmetic_flexible"      # headroom on both unadapted models; plain VL lowers it on both
TEXT_TASKS = (FORMAT_TASK, "knowledge_mc")
PLAIN = "none"
MERGES = ("mix_95_5", "uniform", "task_arithmetic", "ties", "dare")
MILD_MERGES, SPARSE_MERGES = ("mix_95_5", "uniform"), ("ties", "dare")
LABELS = {"none": "plain VL", "protection": "head-selective protection", "fix_qk_norm": "QK-norm fixed scale",
          "inject_qk_norm": "QK-norm injected", "frozen_llm": "frozen LLM", "lora": "LoRA",
          "text_blend": "text re-blended", **{f"merge:{m}": f"merge {m}" for m in MERGES}}

PROFILES = Profiles({
    "quick": dict(interventions={SMOLLM2: ["protection"]}, seeds=[0], merges=["uniform"],
                  merge_models=[SMOLLM2], merge_seeds=[0], workers=2),
    # The default fits 30 minutes on two cores (measured): the interventions on the model whose text skill plain
    # adaptation damages (Gemma 3), the injection control on the model without QK-norm (SmolLM2), and every merge
    # but task arithmetic (with the adapted model's own base it is the adapted model itself; its claim says so),
    # of both seeds. Frozen LLM, LoRA and text re-blending are the gpu profile's (and one command away here).
    "default": dict(interventions={SMOLLM2: ["inject_qk_norm"],
                                   GEMMA3: ["protection", "fix_qk_norm"]},
                    seeds=[0, 1], merges=["mix_95_5", "uniform", "ties", "dare"], merge_models=[GEMMA3],
                    merge_seeds=[0, 1],
                    workers=2),
    "gpu": dict(interventions={"Qwen/Qwen2.5-1.5B-Instruct": ["protection", "inject_qk_norm", "frozen_llm", "lora",
                                                             "text_blend"],
                               "Qwen/Qwen3-1.7B": ["protection", "fix_qk_norm", "frozen_llm", "lora", "text_blend"]},
                seeds=[0, 1, 2], merges=list(MERGES), merge_models=["Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen3-1.7B"],
                merge_seeds=[0, 1, 2], workers=1),
}, limits=dict(seeds=NON_EMPTY, merges=subset_of(MERGES), workers=POSITIVE))

# ---- rules, each written once ----------------------------------------------------------------------------------
KEEPS_MORE = Rule.true(f"paired test (items, seed means) of the intervention against plain VL training says it "
                       f"scores higher on {FORMAT_TASK} (alpha {ALPHA}), and its image accuracy is not lower by "
                       f"the same test")
MARGIN_KEPT = Rule.true("final median G_base - B_gap larger than plain VL's, in every seed")
LOSES_MORE = Rule.true(f"the per-item change from its own start (fixed norm: the fixed-scale model before training) "
                       f"is lower than the native model's change from the unadapted model (paired test, alpha {ALPHA})")
ERODES_MORE = Rule.true("S changes less upward, or falls more, from the first to the last probe than with the native "
                        "norm, in every seed")
LAGS = Rule.true(f"below plain VL at every probe after the start (seed means) and lower at the end by a paired "
                 f"test (alpha {ALPHA})")
NO_EXTRA_DAMAGE = Rule.true(f"each mild merge: a paired test against the adapted model does not say 'hurts' (alpha {ALPHA})")
TENS_OF_POINTS = Rule.at_least(10.0, "drop below the adapted model (pt)")
SPARSE_WORST = Rule.true("the two sparsified merges (TIES, DARE) score below every other merge")
UNCHANGED = Rule.at_most(0, "items (over seeds and text tasks) whose outcome differs from the unadapted model's")
NOT_RECOVERED = Rule.true(f"every merge still scores below the unadapted model by a paired test (alpha {ALPHA})")


# ---- finding functions ------------------------------------------------------------------------------------------
# ``base[model]``: the unadapted model's evaluation (the adaptation chapter's); ``runs[(model, arm, seed)]``: an
# evaluation, where ``arm`` is "none" (plain VL), an intervention, or "merge:<name>"; ``starts[(model, arm)]``: a
# changed model before training.

def _arms(runs: dict, model: str) -> list:
    order = [PLAIN, "protection", "fix_qk_norm", "inject_qk_norm", "frozen_llm", "lora", "text_blend",
             *(f"merge:{m}" for m in MERGES)]
    present = {arm for (m, arm, _) in runs if m == model}
    return [a for a in order if a in present]


def _comparable(base: dict, runs: dict, model: str, task: str = FORMAT_TASK) -> tuple[bool, str]:
    """The plain runs learned the images (it is VL adaptation) and ``task`` has headroom on the unadapted model."""
    if not seeds_of(runs, model, PLAIN) or model not in base:
        return False, "no plain VL run or no unadapted evaluation"
    if not has_headroom(base[model], task):
        return False, f"{task} is at its floor on the unadapted model"
    if not vision_learned({s: runs[(model, PLAIN, s)] for s in seeds_of(runs, model, PLAIN)})[0]:
        return False, "the plain VL runs did not learn the image task"
    return True, ""


def _plain_hurts(base: dict, runs: dict, model: str, task: str = FORMAT_TASK) -> tuple[bool, str]:
    ok, why = _comparable(base, runs, model, task)
    if not ok:
        return ok, why
    if paired_bootstrap(items(base[model], task), arm_items(runs, model, PLAIN, task), ALPHA).outcome != "hurts":
        return False, f"plain VL training does not lower {task}: there is no loss to protect against"
    return True, ""


def capability_finding(base: dict, runs: dict, models: list) -> Finding:
    """Every arm's text score and image accuracy: change from the unadapted model and difference from plain VL,
    paired over items (seed means), with 95% bootstrap intervals."""
    from plotly.subplots import make_subplots

    rows = []
    for model in models:
        for arm in _arms(runs, model):
            row = {"model": model, "arm": LABELS.get(arm, arm), "seeds": len(seeds_of(runs, model, arm))}
            for task in TEXT_TASKS:
                seeds = seeds_of(runs, model, arm)
                b, a = items(base[model], task), arm_items(runs, model, arm, task)
                p = arm_items(runs, model, PLAIN, task, seeds) if set(seeds) <= set(seeds_of(runs, model, PLAIN)) else None
                if b is None or a is None:
                    continue
                change = paired_bootstrap(b, a, ALPHA)
                row[f"{task}"] = float(a.mean())
                row[f"{task} vs base (pt)"] = interval_pt(change)
                row[f"_{task}_change"] = 100 * change.effect
                if p is not None and arm != PLAIN:
                    row[f"{task} vs plain (pt)"] = interval_pt(paired_bootstrap(p, a, ALPHA))
            v = arm_vision_items(runs, model, arm)
            row["image accuracy"] = float(v.mean()) if v is not None else float("nan")
            rows.append(row)
    claims = []
    for model in models:
        seeds = seeds_of(runs, model, "frozen_llm")
        if seeds:
            differ = sum(int(np.sum(items(runs[(model, "frozen_llm", s)], t) != items(base[model], t)))
                         for s in seeds for t in TEXT_TASKS)
            claims.append(check(f"frozen_llm_text_unchanged_{slug(model)}",
                                f"{model}: with the language model frozen, every text item scores as on the unadapted "
                                f"model (the pipeline changes nothing else)", f"{differ} items differ", UNCHANGED,
                                value=differ))
    table = pd.DataFrame(rows)
    figures = []
    if not table.empty:
        fig = make_subplots(rows=1, cols=len(models), subplot_titles=models, shared_yaxes=True)
        for col, model in enumerate(models, start=1):
            t = table[table.model == model]
            for task, colour in zip(TEXT_TASKS, ("#d62728", "#1f77b4")):
                if f"_{task}_change" in t:
                    fig.add_bar(x=t.arm, y=t[f"_{task}_change"], name=task, marker_color=colour,
                                showlegend=col == 1, row=1, col=col)
        fig.update_yaxes(title_text="change from the unadapted model (pt)", row=1, col=1)
        fig.update_layout(height=400, barmode="group", title="Text capability after each intervention (seed means)")
        figures.append(fig)
        table = table.drop(columns=[c for c in table if c.startswith("_")]).set_index(["model", "arm"])
    return Finding("Text capability and image accuracy per intervention", claims=claims, table=table, figures=figures)


def tradeoff_finding(base: dict, runs: dict, models: list) -> Finding:
    """One point per arm and seed: share of the unadapted format-sensitive score kept against image accuracy."""
    import plotly.express as px
    rows = []
    for (model, arm, seed), doc in runs.items():
        if model not in models:
            continue
        b = base[model]["tasks"].get(FORMAT_TASK, {}).get("score")
        score = doc["tasks"].get(FORMAT_TASK, {}).get("score")
        if b and score is not None and doc.get("vision"):
            rows.append({"model": model, "arm": LABELS.get(arm, arm), "seed": seed,
                         "text kept": score / b, "image accuracy": doc["vision"]["accuracy"]})
    table = pd.DataFrame(rows)
    figures = []
    if not table.empty:
        fig = px.scatter(table, x="image accuracy", y="text kept", color="arm", symbol="model", hover_data=["seed"],
                         title=f"Trade-off: {FORMAT_TASK} kept (share of the unadapted score) against image accuracy")
        fig.add_hline(y=1.0, line_dash="dash", annotation_text="unadapted")
        fig.update_layout(height=420)
        figures.append(fig)
    return Finding("The trade-off", table=table.set_index(["model", "arm", "seed"]) if not table.empty else None,
                   figures=figures)


def sink_finding(base: dict, runs: dict, models: list) -> Finding:
    """The sink at the end of training (evaluation) and its change along training (probes), per arm and seed."""
    from plotly.subplots import make_subplots
    rows = []
    for (model, arm, seed), doc in sorted(runs.items()):
        if model not in models:
            continue
        sink = doc.get("sink", {})
        rows.append({"model": model, "arm": LABELS.get(arm, arm), "seed": seed, "S": sink.get("S"),
                     "S change (probes)": probe_change(doc, "S"), "median G - B": sink.get("margin_G_minus_B"),
                     "first-token attention": sink.get("pos0_mass")})
    table = pd.DataFrame(rows)
    fig = make_subplots(rows=1, cols=max(1, len(models)), subplot_titles=models)
    for col, model in enumerate(models, start=1):
        for (m, arm, seed), doc in sorted(runs.items()):
            probes = sorted(doc.get("probes") or [], key=lambda p: p["step"])
            if m != model or not probes:
                continue
            fig.add_scatter(x=[p["step"] for p in probes], y=[p["S"] for p in probes], mode="lines+markers",
                            name=f"{LABELS.get(arm, arm)} s{seed}", row=1, col=col)
    fig.update_layout(height=380, title="Sink Strength along stage 2 (probes)")
    notes = [f"{model}: unadapted S {base[model]['sink']['S']:.3f}." for model in models if model in base]
    return Finding("The sink per intervention", table=table.set_index(["model", "arm", "seed"]) if not table.empty
                   else None, figures=[fig], notes=notes)


def protection_finding(base: dict, runs: dict, models: list) -> Finding:
    """Ours: does head-selective protection keep text capability at equal image accuracy, and the margin?"""
    claims, notes = [], []
    for model in models:
        seeds = sorted(set(seeds_of(runs, model, "protection")) & set(seeds_of(runs, model, PLAIN)))
        if not seeds:
            continue
        record = runs[(model, "protection", seeds[0])].get("intervention", {})
        notes.append(f"{model}: {record.get('protection', 'no record')}.")
        active = bool(record.get("sink_heads")) or bool(record.get("first_sink_layer"))
        gate = all_of(_plain_hurts(base, runs, model), (active, "no sink layer or head to protect on this model"))
        text = paired_bootstrap(arm_items(runs, model, PLAIN, FORMAT_TASK, seeds),
                                arm_items(runs, model, "protection", FORMAT_TASK, seeds), ALPHA)
        image = paired_bootstrap(arm_vision_items(runs, model, PLAIN, seeds), arm_vision_items(runs, model, "protection", seeds),
                                 ALPHA)
        claims.append(claim(
            f"protection_keeps_text_{slug(model)}", "measured", f"{SOURCE}, Limitations (the open question; test ours)",
            f"{model}: head-selective protection keeps more format-sensitive skill than plain VL at equal image accuracy",
            "proposed, not run", f"{FORMAT_TASK} {interval_pt(text)}; image accuracy {interval_pt(image)} (vs plain)",
            KEEPS_MORE, value=text.outcome == "improves" and image.outcome != "hurts", precondition=gate, origin="ours"))
        margins = {s: (runs[(model, "protection", s)]["sink"].get("margin_G_minus_B", float("nan")),
                       runs[(model, PLAIN, s)]["sink"].get("margin_G_minus_B", float("nan"))) for s in seeds}
        claims.append(claim(
            f"protection_keeps_margin_{slug(model)}", "measured", f"{SOURCE}, Limitations",
            f"{model}: protection closes the G_base - B_gap margin more slowly than plain VL",
            "should slow how fast VL training closes the margin",
            ", ".join(f"seed {s}: {p:+.3f} vs plain {q:+.3f}" for s, (p, q) in margins.items()), MARGIN_KEPT,
            value=all(p > q for p, q in margins.values()), precondition=(active, "no sink head to protect"), origin="ours"))
    return Finding("Head-selective protection", claims=claims, notes=notes)


def fixed_norm_finding(base: dict, runs: dict, starts: dict, models: list) -> Finding:
    """Ours: with the per-head QK-norm frozen to a fixed scale, does text skill fall further and the sink erode more?"""
    claims, notes = [], []
    for model in models:
        seeds = sorted(set(seeds_of(runs, model, "fix_qk_norm")) & set(seeds_of(runs, model, PLAIN)))
        start = starts.get((model, "fix_qk_norm"))
        if not seeds or start is None:
            continue
        b, s0 = items(base[model], FORMAT_TASK), items(start, FORMAT_TASK)
        native = arm_items(runs, model, PLAIN, FORMAT_TASK, seeds) - b
        fixed = arm_items(runs, model, "fix_qk_norm", FORMAT_TASK, seeds) - s0
        test = paired_bootstrap(native, fixed, ALPHA)
        notes.append(f"{model}: {FORMAT_TASK} unadapted {b.mean():.3f}, with the fixed scale before training "
                     f"{s0.mean():.3f} (the fixed scale is not the same function: see the methods); after VL training "
                     f"native {(arm_items(runs, model, PLAIN, FORMAT_TASK, seeds)).mean():.3f}, fixed "
                     f"{arm_items(runs, model, 'fix_qk_norm', FORMAT_TASK, seeds).mean():.3f}.")
        room = start["tasks"].get(FORMAT_TASK)
        room_ok = bool(room) and has_headroom(start, FORMAT_TASK)
        gate = all_of(_plain_hurts(base, runs, model),
                        (room_ok, f"the fixed-scale model starts at the floor of {FORMAT_TASK}: nothing left to lose"))
        claims.append(claim(
            f"fixed_norm_loses_more_{slug(model)}", "measured", f"{SOURCE}, Limitations (the proposed causal test)",
            f"{model}: with per-head QK-norm fixed to a scale, VL training costs more format-sensitive skill",
            "proposed, not run (expected: IFEval collapses)",
            f"change fixed minus change native {interval_pt(test)}", LOSES_MORE, value=test.outcome == "hurts",
            precondition=gate, origin="ours"))
        erosion = {s: (probe_change(runs[(model, "fix_qk_norm", s)], "S"), probe_change(runs[(model, PLAIN, s)], "S"))
                   for s in seeds}
        claims.append(claim(
            f"fixed_norm_erodes_more_{slug(model)}", "measured", f"{SOURCE}, Limitations",
            f"{model}: with the norm fixed, VL training leaves the sink weaker relative to its start than with the "
            f"native norm",
            "proposed, not run",
            ", ".join(f"seed {s}: S change {f:+.3f} vs native {n:+.3f}" for s, (f, n) in erosion.items()), ERODES_MORE,
            value=all(f < n for f, n in erosion.values()), origin="ours",
            precondition=all_of(_comparable(base, runs, model),
                                  (base[model]["model"]["qk_norm"] == "per-head", "the model has no per-head QK-norm"),
                                  (all(np.isfinite(x) for pair in erosion.values() for x in pair), "no probes"))))
    return Finding("Per-head QK-norm fixed during VL training", claims=claims, notes=notes)


def injection_finding(base: dict, runs: dict, models: list, metric: str | None = None) -> Finding:
    """The paper's negative control: per-head QK-norm injected after pretraining lags vanilla VL training."""
    claims = []
    for model in models:
        seeds = sorted(set(seeds_of(runs, model, "inject_qk_norm")) & set(seeds_of(runs, model, PLAIN)))
        if not seeds:
            continue
        metric_read = metric or probe_metric(base[model])
        curves = {}
        for arm in (PLAIN, "inject_qk_norm"):
            steps = {}
            for s in seeds:
                for p in runs[(model, arm, s)].get("probes") or []:
                    steps.setdefault(p["step"], []).append(p.get(metric_read, float("nan")))
            curves[arm] = {k: float(np.mean(v)) for k, v in sorted(steps.items())}
        later = [k for k in curves[PLAIN] if k > 0 and k in curves["inject_qk_norm"]]
        below = all(curves["inject_qk_norm"][k] < curves[PLAIN][k] for k in later) and bool(later)
        end = paired_bootstrap(arm_items(runs, model, PLAIN, FORMAT_TASK, seeds),
                               arm_items(runs, model, "inject_qk_norm", FORMAT_TASK, seeds), ALPHA)
        trace = ", ".join(f"step {k}: {curves['inject_qk_norm'][k]:.2f} vs {curves[PLAIN][k]:.2f}" for k in later)
        claims.append(claim(
            f"injection_lags_vanilla_{slug(model)}", "measured", f"{SOURCE}, Sec. 5 / App. F.3 (Fig. 6)",
            f"{model}: per-head QK-norm injected after pretraining lags vanilla VL training throughout",
            "IFEval 11 (injected) vs vanilla throughout; base 59.9",
            f"probe {metric_read}: {trace}; end {FORMAT_TASK} {interval_pt(end)}", LAGS,
            value=below and end.outcome == "hurts",
            precondition=all_of(_comparable(base, runs, model),
                                  (base[model]["model"]["qk_norm"] == "none", "the model already has a QK-norm"))))
    return Finding("QK-norm injected after pretraining", claims=claims)


def merging_finding(base: dict, runs: dict, models: list) -> Finding:
    """The paper's second negative control: merging the adapted language model back toward its base."""
    claims, rows, notes = [], [], []
    for model in models:
        present = [m for m in MERGES if seeds_of(runs, model, f"merge:{m}")]
        if not present:
            continue
        seeds = sorted(set.intersection(*(set(seeds_of(runs, model, f"merge:{m}")) for m in present)))
        adapted = arm_items(runs, model, PLAIN, FORMAT_TASK, seeds)
        b = items(base[model], FORMAT_TASK)
        scores, tests = {}, {}
        for m in present:
            merged = arm_items(runs, model, f"merge:{m}", FORMAT_TASK, seeds)
            scores[m] = float(merged.mean())
            tests[m] = (paired_bootstrap(adapted, merged, ALPHA), paired_bootstrap(b, merged, ALPHA))
            rows.append({"model": model, "merge": m, FORMAT_TASK: scores[m], "vs adapted": interval_pt(tests[m][0]),
                         "vs unadapted": interval_pt(tests[m][1])})
        gate = _plain_hurts(base, runs, model)
        mild = [m for m in MILD_MERGES if m in present]
        if mild:
            claims.append(claim(
                f"mild_merges_no_extra_damage_{slug(model)}", "measured", f"{SOURCE}, App. F.4",
                f"{model}: the mild mixes (95/5, uniform) do not damage the adapted model further",
                "avoid substantial additional degradation", "; ".join(f"{m} {interval_pt(tests[m][0])}" for m in mild),
                NO_EXTRA_DAMAGE, value=all(tests[m][0].outcome != "hurts" for m in mild), precondition=gate))
        if "task_arithmetic" in present:
            drop = 100 * (float(adapted.mean()) - scores["task_arithmetic"])
        if present:
            claims.append(claim(
                f"full_strength_drops_{slug(model)}", "measured", f"{SOURCE}, App. F.4",
                f"{model}: full task arithmetic drops the unprotected model by tens of points", "tens of points",
                f"{drop:+.1f} pt" if "task_arithmetic" in present else "not run (it is the adapted model)",
                TENS_OF_POINTS, value=drop if "task_arithmetic" in present else 0.0,
                precondition=(False, "with one adapted model and its base as the only ancestor, task arithmetic at "
                                     "lambda 1 returns the adapted model itself (the paper's released VLMs merge with "
                                     "a reference that is not their ancestor)")))
        sparse = [m for m in SPARSE_MERGES if m in present]
        others = [m for m in present if m not in SPARSE_MERGES]
        if sparse and others:
            claims.append(claim(
                f"sparsified_merges_worst_{slug(model)}", "measured", f"{SOURCE}, App. F.4",
                f"{model}: the sparsified merges (TIES, DARE) are the most damaging",
                "most damaging across both pairs", ", ".join(f"{m} {scores[m]:.3f}" for m in present), SPARSE_WORST,
                value=max(scores[m] for m in sparse) < min(scores[m] for m in others), precondition=gate))
        claims.append(claim(
            f"merging_does_not_recover_{slug(model)}", "measured", f"{SOURCE}, Sec. 5 / Fig. 5",
            f"{model}: no merge recovers the format-sensitive skill lost in VL training",
            "fail to recover IFEval on the low-S side", "; ".join(f"{m} {interval_pt(tests[m][1])}" for m in present),
            NOT_RECOVERED, value=all(tests[m][1].outcome == "hurts" for m in present), precondition=gate))
        notes.append(f"{model}: unadapted {b.mean():.3f}, adapted {adapted.mean():.3f} ({FORMAT_TASK}, seeds {seeds}).")
    table = pd.DataFrame(rows).set_index(["model", "merge"]) if rows else None
    return Finding("Merging after VL training", claims=claims, table=table, notes=notes)


# ---- the chapter --------------------------------------------------------------------------------------------------

class VLProtectionChapter(Chapter):
    """The runs (``runs.adaptation``, cached; plain runs shared with the adaptation chapter), then one finding per
    notebook section."""
    NAME = NAME
    PROFILES = PROFILES

    def check(self, s) -> None:
        unknown = sorted({i for arms in s.interventions.values() for i in arms} - set(INTERVENTIONS[1:]))
        if unknown:
            raise SettingsError(f"unknown interventions {unknown}; choose from {', '.join(INTERVENTIONS[1:])}")

    @property
    def models(self) -> list:
        return sorted(set(self.settings.interventions) | set(self.settings.merge_models))

    @property
    def recipe(self):
        """The adaptation chapter's recipe and evaluation of the same profile, for these models and seeds."""
        s = self.settings
        return jobs.recipe(s.profile, device=s.device, models=self.models,
                           seeds=sorted(set(s.seeds) | set(s.merge_seeds)), workers=s.workers)

    @functools.cached_property
    def records(self) -> tuple[dict, dict, dict]:
        """(``base[model]``, ``runs[(model, arm, seed)]``, ``starts[(model, arm)]``), computed where missing."""
        start = time.perf_counter()
        s = self.settings
        listed = jobs.protection_jobs(self.recipe, s.interventions, s.seeds, s.merges, s.merge_models, s.merge_seeds)
        docs = jobs.run_adaptation_jobs(listed, s.workers, resolve_device(s.device))
        base, runs, starts = {}, {}, {}
        for job, doc in zip(listed, docs):
            if job["kind"] == "base":
                base[job["model"]] = doc
            elif job["kind"] == "start":
                starts[(job["model"], job["intervention"])] = doc
            else:
                runs[(job["config"]["model"], job["arm"], job["config"]["seed"])] = doc
        self.timings["records"] = round(time.perf_counter() - start, 1)
        return base, runs, starts

    @finding
    def run(self) -> Finding:
        runs = self.records[1]
        table = pd.DataFrame([{"model": m, "arm": LABELS.get(a, a), "seed": s, "training (s)": d.get("train_seconds"),
                               "evaluation (s)": d.get("seconds")} for (m, a, s), d in sorted(runs.items())])
        notes = [f"{len(runs)} runs and merges; training and evaluating them took {self.timings['records']:.0f} s "
                 f"(cached runs load in seconds).",
                 "Plain VL runs are the adaptation chapter's; merges reuse them, so they take no training."]
        return Finding("Runs", table=table, notes=notes)

    @finding
    def capability(self) -> Finding:
        return capability_finding(*self.records[:2], self.models)

    @finding
    def tradeoff(self) -> Finding:
        return tradeoff_finding(*self.records[:2], self.models)

    @finding
    def sink(self) -> Finding:
        return sink_finding(*self.records[:2], self.models)

    @finding
    def protection(self) -> Finding:
        return protection_finding(*self.records[:2], self.models)

    @finding
    def fixed_norm(self) -> Finding:
        base, runs, starts = self.records
        return fixed_norm_finding(base, runs, starts, self.models)

    @finding
    def injection(self) -> Finding:
        return injection_finding(*self.records[:2], self.models)

    @finding
    def merging(self) -> Finding:
        return merging_finding(*self.records[:2], self.models)

    def model_records(self) -> list[dict]:
        return [d["model"]["record"] for d in self.records[0].values()]

    def extra(self) -> dict:
        runs = {f"{m}|{a}|{s}": {"scores": {t: r["score"] for t, r in d["tasks"].items()},
                                 "vision_accuracy": (d.get("vision") or {}).get("accuracy"), "sink": d.get("sink"),
                                 "intervention": d.get("intervention"), "train_seconds": d.get("train_seconds")}
                for (m, a, s), d in self.records[1].items()}
        return {"runs": runs}
