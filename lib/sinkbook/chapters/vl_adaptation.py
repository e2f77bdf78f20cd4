"""Chapter: vision-language adaptation at small scale -- text capability loss and sink erosion, measured.

The VL paper's phenomenon, produced here: each language model is adapted into a small vision-language model on
the digit tasks (``training.adapt``: projector-only stage 1, then projector + language model), and, as a matched
control, fine-tuned on the same tasks with the image replaced by the digit words. Before, along and after training
we measure text capability (``measures.textsuite``: strictly parsed arithmetic and IFEval-style compliance, which
the paper calls format-sensitive; a multiple-choice knowledge set graded by log-likelihood and held-out text loss)
and the sink (``measures.margins``: S, attention on the first token, the margin G_base - B_gap against the
unadapted model, Theorem 1's bound on the actual weight updates). Formulas: the book's methods page.

Runs are jobs (train, probe, evaluate) executed in worker processes and cached by configuration, so the book
rebuilds in minutes once they exist.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

import numpy as np
import pandas as pd

from ..core.claims import Finding, Rule, check, claim, slug
from ..core.paths import cache_root
from ..core.profiles import Profiles
from ..training.digits import TASKS

CHAPTER = "vl_adaptation"
SOURCE = "VL paper"
ALPHA = 0.05                    # every paired test of the chapter
KNOWLEDGE_DROP_PT = 2.3         # App. C.1: MMLU / BoolQ drops never exceed 2.3 pt on the paper's six pairs
HEADROOM_MARGIN = 0.05          # a task needs its base score 5 points above its floor to be able to show a loss
FORMAT_TASKS = ("ifeval", "arithmetic_strict", "arithmetic_flexible")
KNOWLEDGE_TASKS = ("knowledge_mc",)
EVAL_FORMAT = 1                 # bump when what a job evaluates changes
PROBE_FORMAT = 1                # bump when what a probe measures changes (it keys the cached training runs)
# Probe sizes: the default profile's probe costs at most a tenth of the training it watches in
# scripts/bench_adapt_probe.py, on both models: the first 8 calibration prompts, one 64-token held-out window and
# 8 arithmetic items whose shared prompt prefix (system prompt or worked examples) runs once.
# The default probe leaves image accuracy to the final evaluation (100 held-out questions): along training it cost
# as much as the rest of the probe, and no analysis reads it (scripts/bench_adapt_probe.py measures the overhead).

# Reading a row of 2-4 digits stays at zero accuracy within a CPU-sized run; the single-digit tasks are learned.
SINGLE_DIGIT = ("caption", "identify", "parity", "greater")

PROFILES = Profiles({
    "quick": dict(models=["smollm2-135m-instruct"], seeds=[0], tasks=list(SINGLE_DIGIT), steps=6, stage1_steps=4, lr=2e-4, stage1_lr=3e-4,
                  batch_size=4, probe_every=3, probe_arithmetic=8, probe_vision=0, probe_prompts=8, probe_heldout_windows=1, probe_heldout_length=64, arithmetic=12, knowledge=16,
                  ifeval=8, ifeval_tokens=32, ifeval_base_models=False, vision=20, heldout_windows=2, window=10,
                  workers=2),
    "default": dict(models=["smollm2-135m-instruct", "gemma3-270m"], seeds=[0, 1], tasks=list(SINGLE_DIGIT), steps=60, stage1_steps=20,
                    lr=2e-4, stage1_lr=3e-4, batch_size=4, probe_every=20, probe_arithmetic=8, probe_vision=0,
                    probe_prompts=8, probe_heldout_windows=1, probe_heldout_length=64,
                    arithmetic=60, knowledge=103, ifeval=115, ifeval_tokens=48, ifeval_base_models=False, vision=100,
                    heldout_windows=8, window=10, workers=2),
    "gpu": dict(models=["Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen3-1.7B"], seeds=[0, 1, 2], tasks=list(TASKS), steps=1000,
                stage1_steps=300, lr=2e-5, stage1_lr=1e-4, batch_size=32, probe_every=100, probe_arithmetic=60,
                probe_vision=60, probe_prompts=15, probe_heldout_windows=2, probe_heldout_length=128, arithmetic=200, knowledge=103, ifeval=115, ifeval_tokens=256, ifeval_base_models=True,
                vision=300, heldout_windows=32, window=10, workers=1),
})
# The task that compares the two models: a format-sensitive task both have headroom on (the paper's S ranks
# backbones on every format-sensitive task, Table 4); IFEval is measured on chat models only by default.
ACROSS_TASK = "arithmetic_flexible"

# ---- rules, each written once ----------------------------------------------------------------------------------
LEARNED = Rule.true(f"held-out image-task accuracy above its chance level (paired bootstrap over items, alpha {ALPHA})")
HURTS = Rule.true(f"paired test of adapted against unadapted on the same items says 'hurts' (alpha {ALPHA})")
PRESERVED = Rule.true(f"change >= -{KNOWLEDGE_DROP_PT} pt and the paired test does not say 'hurts'")
TEXT_LESS = Rule.true(f"paired test of the text-only run against the vision run on the same items says the "
                      f"text-only run scores higher (alpha {ALPHA})")
S_FALLS = Rule.true("S after training below S before, in every seed")
TEXT_KEEPS = Rule.true("S changes less (or rises more) under text-only training than under vision training, in every seed")
B_LARGER = Rule.true("median B_gap against the unadapted model larger after vision than after text-only training, in every seed")
EARLIER = Rule.true("the format-sensitive score reaches half of its final loss at an earlier probe than S reaches "
                    "half of its final drop (seed means)")
WITHIN = Rule.at_least(1.0, "share of (layer, head, query) within the bound")
DOSE = Rule.true(f"Spearman rho > 0 with the {1 - ALPHA:.0%} run-level bootstrap interval above 0")
ORDER = Rule.true("the model with the larger S loses less on the format-sensitive task")


# ---- jobs: train, probe, evaluate (run in worker processes, cached) --------------------------------------------

def eval_spec(s) -> dict:
    """What a job evaluates; its hash keys the cached evaluation (training is keyed by the run's configuration).
    IFEval-style compliance follows the paper's instruct protocol (chat template); on a base model it needs a
    few-shot format and costs minutes per evaluation, so ``ifeval_base_models`` decides."""
    return {"format": EVAL_FORMAT, "arithmetic": s.arithmetic, "knowledge": s.knowledge, "ifeval": s.ifeval,
            "ifeval_tokens": s.ifeval_tokens, "ifeval_base_models": s.ifeval_base_models, "vision": s.vision,
            "heldout_windows": s.heldout_windows, "window": s.window}


def probe_spec(s) -> dict:
    return {"format": PROBE_FORMAT, "arithmetic": s.probe_arithmetic, "vision": s.probe_vision, "window": s.window,
            "heldout_windows": s.probe_heldout_windows, "heldout_length": s.probe_heldout_length,
            "prompts": s.probe_prompts}


def _hash(d: dict) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


def adapt_configs(s) -> list:
    from ..training.adapt import AdaptConfig
    return [AdaptConfig(model, modality, steps=s.steps, lr=s.lr, stage1_steps=s.stage1_steps, stage1_lr=s.stage1_lr,
                        batch_size=s.batch_size, seed=seed, probe_every=s.probe_every, tasks=tuple(s.tasks))
            for model in s.models for modality in ("vision", "text") for seed in s.seeds]


def base_eval_path(model: str, spec: dict) -> Path:
    return cache_root() / "adapt" / f"base-{slug(Path(model).name)}-{_hash(spec)}.json"


def run_job(job: dict) -> str:
    """One job in a worker: evaluate an unadapted model (kind "base"), or train, probe and evaluate one run."""
    import torch

    from ..core.models import load_model
    torch.set_num_threads(job.get("threads", 1))
    spec, device = job["eval"], job.get("device", "cpu")
    if job["kind"] == "base":
        path = base_eval_path(job["model"], spec)
        if not path.exists():
            reference = load_model(job["model"], device=device)
            _write(path, evaluate(reference, None, None, spec, reference=None))
        return str(path)
    from ..training.adapt import AdaptConfig, adapt, run_dir
    from ..training.probes import AdaptationProbe
    cfg = AdaptConfig(**job["config"])
    tag = _hash(job["probe"])
    path = run_dir(cfg, tag) / f"eval-{_hash(spec)}.json"
    if path.exists():
        return str(path)
    reference = load_model(cfg.model, device=device)
    probe = AdaptationProbe(reference, window=job["probe"]["window"], arithmetic=job["probe"]["arithmetic"],
                            vision=job["probe"]["vision"], heldout_windows=job["probe"]["heldout_windows"],
                            heldout_length=job["probe"]["heldout_length"], prompts=job["probe"]["prompts"],
                            tasks=cfg.tasks)
    run = adapt(cfg, probe=probe, probe_tag=tag, device=device, progress=job.get("progress", False))
    from ..training.remedies import CHANGES_NORMS
    result = evaluate(run.loaded, run.vlm, run.fmt, spec, reference=reference, modality=cfg.modality, tasks=cfg.tasks,
                      theorem1=cfg.intervention not in CHANGES_NORMS)
    result.update({"config": cfg.record(), "probes": run.probes, "train_seconds": run.seconds,
                   "intervention": run.intervention,
                   "history": [{k: h[k] for k in ("stage", "step", "loss")} for h in run.history],
                   "directory": str(run.directory / "model")})
    _write(path, result)
    return str(path)


def evaluate(loaded, vlm, fmt, spec: dict, reference=None, modality: str | None = None, tasks=None,
             theorem1: bool = True) -> dict:
    """The full suite on one model (``vlm`` None: an unadapted model): text tasks with per-item outcomes,
    held-out loss, the sink on the calibration prompts, and for adapted models the margin against ``reference``,
    Theorem 1 on the weight update (``theorem1``: not for a model whose QK-norm was changed, whose attention is
    no longer the reference's with other weights) and (vision runs) held-out image-task accuracy."""
    import torch

    from ..core.models import encode
    from ..core.prompts import prompt_texts
    from ..measures.margins import sink_state, theorem1_on_update, theorem1_summary, window_layers
    from ..measures.textsuite import heldout_loss, run_suite
    from ..training.corpus import heldout_text_windows
    start = time.perf_counter()
    chat = bool(getattr(loaded.tokenizer, "chat_template", None))
    ifeval = spec["ifeval"] if (chat or spec["ifeval_base_models"]) else 0
    suite = run_suite(loaded, arithmetic=spec["arithmetic"], knowledge=spec["knowledge"], ifeval=ifeval,
                      ifeval_tokens=spec["ifeval_tokens"])
    windows = heldout_text_windows(loaded.tokenizer, spec["heldout_windows"], 128)[0]
    out = {"tasks": {name: r.to_dict() for name, r in suite.items()},
           "heldout_loss": heldout_loss(loaded, windows).per_window}
    for r in out["tasks"].values():
        r["details"] = {k: v for k, v in r["details"].items() if k != "responses"}
    batch = {k: v.to(loaded.device) for k, v in encode(loaded.tokenizer, prompt_texts()).items()}
    layers = window_layers(loaded.model, spec["window"])
    with torch.no_grad():
        if reference is None:
            out["sink"] = sink_state(loaded.model, batch, layers)[0]
        else:
            ref_logits = sink_state(reference.model, batch, layers)[1]
            out["sink"] = sink_state(loaded.model, batch, layers, ref_logits)[0]
        if reference is not None and theorem1:
            t1 = theorem1_on_update(reference.model, loaded.model, batch, layers)
            out["theorem1"] = theorem1_summary(t1)
            out["theorem1_why"] = t1["why"]
            out["theorem1_points"] = t1["rows"].sample(min(400, len(t1["rows"])), random_state=0).to_dict("list")
    if vlm is not None and modality == "vision":
        from ..training.probes import held_out_vision_examples, vision_scores
        examples = held_out_vision_examples(spec["vision"], tasks=tasks or TASKS)
        out["vision"] = vision_scores(vlm, loaded.tokenizer, examples, fmt)
    out["model"] = {"spec": loaded.spec, "record": loaded.record(), "qk_norm": _qk_norm(loaded.model)}
    out["seconds"] = time.perf_counter() - start
    return out


def _qk_norm(model) -> str:
    from ..core.arch import arch_for
    return arch_for(model).qk_norm


def _write(path: Path, doc: dict) -> None:
    from ..core.paths import write_json
    write_json(path, doc, strict=False)      # a cache for this chapter only: NaN stays a number


def run_jobs(jobs: list[dict], workers: int, job_fn=None) -> list[str]:
    """Run jobs (``job_fn``, default ``run_job``), ``workers`` at a time in separate processes (one torch thread
    each); results in order of submission."""
    job_fn = job_fn or run_job
    if workers <= 1:
        return [job_fn(job) for job in jobs]
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
        return list(pool.map(job_fn, jobs))


# ---- finding functions: from the evaluations to tables, figures and claims ----------------------------------------
# ``base[model]`` is an unadapted model's evaluation, ``runs[(model, modality, seed)]`` an adapted one's.

def _seeds(runs: dict, model: str, modality: str) -> list:
    return sorted(seed for (m, mod, seed) in runs if m == model and mod == modality)


def _items(doc: dict, task: str) -> np.ndarray | None:
    t = doc.get("tasks", {}).get(task)
    return None if t is None or not t["n"] else np.asarray(t["per_item"], dtype=float)


def _mean_over_seeds(runs: dict, model: str, modality: str, task: str) -> np.ndarray | None:
    rows = [_items(runs[(model, modality, s)], task) for s in _seeds(runs, model, modality)]
    rows = [r for r in rows if r is not None]
    return np.mean(rows, axis=0) if rows else None


def _interval(test) -> str:
    low, high = test.detail.get("interval", (float("nan"), float("nan")))
    return f"{100 * test.effect:+.1f} pt [{100 * low:+.1f}, {100 * high:+.1f}]"


def vision_learned(runs: dict, model: str) -> tuple[bool, str, dict]:
    """Whether every vision run of ``model`` answers held-out image questions above chance (bootstrap over items)."""
    from ..measures.stats import paired_bootstrap
    seeds = _seeds(runs, model, "vision")
    if not seeds:
        return False, "no vision run", {}
    accuracies, ok = {}, True
    for seed in seeds:
        v = runs[(model, "vision", seed)].get("vision")
        if not v:
            return False, "the vision run has no image-task evaluation", {}
        hits = np.asarray(v["per_item"], dtype=float)
        if len(hits) < 2:
            return False, "fewer than two held-out image questions were evaluated", {}
        test = paired_bootstrap(np.full_like(hits, v["chance"]), hits, ALPHA)
        accuracies[seed] = (v["accuracy"], v["chance"], test)
        ok &= test.outcome == "improves"
    text = "; ".join(f"seed {s}: {a:.2f} (chance {c:.2f}, {_interval(t)})" for s, (a, c, t) in accuracies.items())
    return ok, text, accuracies


def adaptation_finding(base: dict, runs: dict, models: list) -> Finding:
    """Did the adaptation teach the image task? And where does each text task start (headroom)?"""
    from ..measures.textsuite import TaskResult, headroom
    rows, claims, notes = [], [], []
    for model in models:
        ok, text, accuracies = vision_learned(runs, model)
        claims.append(claim(f"vl_learns_images_{slug(model)}", "measured", "ours (precondition of every claim below)",
                            f"{model}: the vision runs learn the digit tasks (held-out images)", "not applicable",
                            text or "no vision run", LEARNED, value=ok, origin="ours"))
        for task, r in base[model]["tasks"].items():
            result = TaskResult(**r)
            rows.append({"model": model, "task": task, "kind": r["kind"], "base score": r["score"],
                         "floor": r["chance"], "items": r["n"], "headroom": headroom(result, HEADROOM_MARGIN)})
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


def _has_headroom(base: dict, model: str, task: str) -> bool:
    from ..measures.textsuite import TaskResult, headroom
    r = base[model]["tasks"].get(task)
    return bool(r) and headroom(TaskResult(**r), HEADROOM_MARGIN)


def capability_finding(base: dict, runs: dict, models: list) -> Finding:
    """Analysis 1: the change of every text task after vision and after text-only training, paired over items."""
    from plotly.subplots import make_subplots

    from ..measures.stats import paired_bootstrap
    rows, claims = [], []
    for model in models:
        learned = vision_learned(runs, model)[0]
        gate_learned = (learned, "the vision runs did not learn the image task, so this is not VL adaptation")
        for task in (*FORMAT_TASKS, *KNOWLEDGE_TASKS):
            b = _items(base[model], task)
            if b is None or len(b) < 2:            # a paired test needs at least two items
                continue
            tests = {}
            for modality in ("vision", "text"):
                adapted = _mean_over_seeds(runs, model, modality, task)
                if adapted is not None:
                    tests[modality] = paired_bootstrap(b, adapted, ALPHA)
                    rows.append({"model": model, "task": task, "run": modality, "base": float(b.mean()),
                                 "adapted": float(adapted.mean()), "change (pt)": 100 * tests[modality].effect,
                                 "low": 100 * tests[modality].detail["interval"][0],
                                 "high": 100 * tests[modality].detail["interval"][1],
                                 "outcome": tests[modality].outcome})
            if "vision" not in tests:
                continue
            room = (_has_headroom(base, model, task), f"{task} is at its floor on the unadapted model")
            vl = tests["vision"]
            if task in FORMAT_TASKS:
                claims.append(claim(
                    f"vl_lowers_{task}_{slug(model)}", "measured", f"{SOURCE}, Sec. 3.1 / App. C.1",
                    f"{model}: vision-language adaptation lowers the format-sensitive {task} score",
                    "format-sensitive scores drop (e.g. IFEval -1.8 to -18.7 pt)", _interval(vl), HURTS,
                    value=vl.outcome == "hurts", precondition=_both(gate_learned, room)))
                if "text" in tests:
                    text_vs_vl = paired_bootstrap(_mean_over_seeds(runs, model, "vision", task),
                                                  _mean_over_seeds(runs, model, "text", task), ALPHA)
                    claims.append(claim(
                        f"text_only_loses_less_{task}_{slug(model)}", "measured", f"{SOURCE}, Table 3 / App. F.2",
                        f"{model}: the matched text-only run loses less {task} than the vision run",
                        "text-only loses less (IFEval 0.0 vs -9.6 pt)",
                        f"text minus vision {_interval(text_vs_vl)}", TEXT_LESS, value=text_vs_vl.outcome == "improves",
                        precondition=_both(gate_learned, room,
                                           (vl.outcome == "hurts", "the vision run shows no loss to compare with"))))
            else:
                claims.append(claim(
                    f"vl_preserves_{task}_{slug(model)}", "measured", f"{SOURCE}, App. C.1 / Table 6",
                    f"{model}: knowledge-like {task} is preserved by vision-language adaptation",
                    f"drops of at most {KNOWLEDGE_DROP_PT} pt (MMLU, BoolQ)", _interval(vl), PRESERVED,
                    value=100 * vl.effect >= -KNOWLEDGE_DROP_PT and vl.outcome != "hurts",
                    precondition=_both(gate_learned, room)))
    table = pd.DataFrame(rows)
    figures = []
    if not table.empty:
        fig = make_subplots(rows=1, cols=len(models), subplot_titles=models, shared_yaxes=True)
        for col, model in enumerate(models, start=1):
            for modality, colour in (("vision", "#d62728"), ("text", "#1f77b4")):
                t = table[(table.model == model) & (table.run == modality)]
                fig.add_bar(x=t.task, y=t["change (pt)"], name=f"{modality} run", marker_color=colour,
                            error_y=dict(type="data", symmetric=False, array=t.high - t["change (pt)"],
                                         arrayminus=t["change (pt)"] - t.low), showlegend=col == 1, row=1, col=col)
        fig.update_yaxes(title_text="change after training (pt), paired 95% interval", row=1, col=1)
        fig.update_layout(height=380, barmode="group", title="Text capability after vision vs text-only training")
        figures.append(fig)
        table = table.set_index(["model", "task", "run"])
    return Finding("Text capability after adaptation", claims=claims, table=table, figures=figures)


def _both(*conditions) -> tuple[bool, str]:
    for ok, why in conditions:
        if not ok:
            return False, why
    return True, ""


def trajectory_table(runs: dict, models: list) -> pd.DataFrame:
    rows = []
    for (model, modality, seed), doc in runs.items():
        if model not in models:
            continue
        for p in doc.get("probes", []):
            rows.append({"model": model, "run": modality, "seed": seed, **p})
    return pd.DataFrame(rows)


def _half_step(traj: pd.DataFrame, column: str, falling: bool = True) -> float:
    """The first probe step at which ``column`` has covered half of its total change (NaN if it did not move
    in the expected direction)."""
    t = traj.groupby("step")[column].mean().sort_index()
    total = t.iloc[-1] - t.iloc[0]
    if (falling and total >= 0) or (not falling and total <= 0):
        return float("nan")
    reached = t.index[((t - t.iloc[0]) / total) >= 0.5]
    return float(reached[0]) if len(reached) else float("nan")


def probe_metric(base: dict, model: str) -> str:
    """The probe's format-sensitive score for a model: strict arithmetic, or the flexible parse where strict sits
    at its floor on the unadapted model (a floored score cannot fall)."""
    return "arithmetic_strict" if _has_headroom(base, model, "arithmetic_strict") else "arithmetic_flexible"


def erosion_finding(base: dict, runs: dict, models: list) -> Finding:
    """Analysis 2: the sink and text skill along training, vision against text-only."""
    from plotly.subplots import make_subplots
    traj = trajectory_table(runs, models)
    claims, rows, notes = [], [], []
    if traj.empty:
        return Finding("Sink erosion along training", notes=["No probes were recorded."])
    panels = [("S", "Sink Strength S"), ("pos0_mass", "attention on the first token"),
              ("margin_G_minus_B", "median G - median B"), ("arithmetic_strict", "arithmetic, strict (probe)"),
              ("arithmetic_flexible", "arithmetic, flexible (probe)"), ("heldout_loss", "held-out text loss")]
    panels = [(c, t) for c, t in panels if c in traj]
    fig = make_subplots(rows=len(models), cols=len(panels), subplot_titles=[t for _ in models for _, t in panels])
    colours = {"vision": "#d62728", "text": "#1f77b4"}
    for r, model in enumerate(models, start=1):
        for c, (column, _) in enumerate(panels, start=1):
            for (modality, seed), t in traj[traj.model == model].groupby(["run", "seed"]):
                t = t.sort_values("step")
                fig.add_scatter(x=t.step, y=t[column], mode="lines+markers", line_color=colours[modality],
                                name=f"{modality} run", legendgroup=modality, showlegend=(r, c, seed) == (1, 1, min(traj.seed)),
                                row=r, col=c)
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
                f"{model}: text-only training moves S less downward than vision training",
                "text run holds S at +0.58 to +0.65 while the vision run falls",
                ", ".join(f"seed {s}: text {ds['text'][s]:+.3f} vs vision {ds['vision'][s]:+.3f}" for s in common),
                TEXT_KEEPS, value=all(ds["text"][s] > ds["vision"][s] for s in common), precondition=gate))
            b_gap = {m: {s: runs[(model, m, s)]["sink"].get("margin_median_B", float("nan")) for s in common}
                     for m in ("vision", "text")}
            claims.append(claim(
                f"vl_larger_b_gap_{slug(model)}", "measured", f"{SOURCE}, Sec. 4.3 / Table 5",
                f"{model}: vision training perturbs the sink logits more than text-only training (median B_gap)",
                "B_gap 2.1-5.0 after VL (released pairs)",
                ", ".join(f"seed {s}: vision {b_gap['vision'][s]:.2f} vs text {b_gap['text'][s]:.2f}" for s in common),
                B_LARGER, value=all(b_gap["vision"][s] > b_gap["text"][s] for s in common), precondition=gate))
        vision = traj[(traj.model == model) & (traj.run == "vision")]
        metric = probe_metric(base, model)
        if not vision.empty and metric in vision:
            first_text, first_s = _half_step(vision, metric), _half_step(vision, "S")
            moved = math.isfinite(first_text) and math.isfinite(first_s)
            claims.append(claim(
                f"format_falls_before_s_{slug(model)}", "measured", f"{SOURCE}, Sec. 5 / App. F.2",
                f"{model}: format-sensitive skill falls before S does during vision training",
                "IFEval takes most of its loss by step 1k, before S falls",
                f"{metric}: half of the loss at step {first_text:g}, half of the S drop at step {first_s:g}", EARLIER,
                value=moved and first_text < first_s,
                precondition=_both(gate, (moved, "the probe's arithmetic score or S did not fall during the vision runs"))))
    fig.update_layout(height=300 * len(models), title="Along training (probes; one line per seed)")
    fig.update_xaxes(title_text="stage-2 step")
    return Finding("Sink erosion along training", claims=claims, table=pd.DataFrame(rows), figures=[fig], notes=notes)


def theorem1_finding(runs: dict, models: list) -> Finding:
    """Analysis 3: Theorem 1's bound against the logit-gap change the actual W_q / W_k updates cause."""
    import plotly.graph_objects as go
    rows, claims, fig = [], [], go.Figure()
    for (model, modality, seed), doc in sorted(runs.items()):
        if model not in models or "theorem1" not in doc:
            continue
        t = doc["theorem1"]
        rows.append({"model": model, "run": modality, "seed": seed, "form": t["form"] or "none",
                     "median eps": t.get("median_eps", float("nan")), "share within": t["share_within"],
                     "median B / bound": t["median_ratio"], "max B / bound": t["max_ratio"],
                     "realised within": t["share_realised_within"]})
        pts = doc.get("theorem1_points") or {}
        if pts.get("bound") and t["form"]:
            fig.add_scatter(x=pts["bound"], y=pts["B_projection"], mode="markers", marker=dict(size=4, opacity=0.5),
                            name=f"{model} {modality} s{seed}")
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
            claims.append(claim(f"theorem1_eq5_holds_{slug(model)}", "measured", f"{SOURCE}, Thm. 1 Eq. 5 (c = 2 is ours)",
                                f"{model}: Eq. 5 (first order, our c = 2) bounds every projection-only gap change",
                                "a bound up to O(eps^2)", text, WITHIN, value=share))
        else:
            claims.append(claim(f"theorem1_holds_{slug(model)}", "measured", f"{SOURCE}, Thm. 1 / Remark 1",
                                f"{model}: Theorem 1 bounds the gap change", "a bound", "no bound for this QK-norm",
                                WITHIN, value=0.0, precondition=(False, "Theorem 1 covers no-QK-norm and per-head "
                                                                 "QK-norm; this model has neither")))
    fig.add_scatter(x=[1e-4, 1e4], y=[1e-4, 1e4], mode="lines", line=dict(color="black", dash="dash"), name="B = bound")
    fig.update_layout(height=420, title="Projection-only B_gap against Theorem 1's bound",
                      xaxis=dict(title="bound", type="log"), yaxis=dict(title="B_gap (W_q, W_k of the run)", type="log"))
    notes = ["The realised B_gap (whole adapted model) also contains the drift of the hidden states, which the theorem "
             "holds fixed; it is shown for reference, not tested against the bound."]
    return Finding("Theorem 1 on the actual updates", claims=claims, table=table, figures=[fig], notes=notes)


def dose_points(runs: dict, model: str, text_metric: str = "arithmetic_strict") -> pd.DataFrame:
    """One point per (run, probe after step 0): sink erosion S_0 - S_t and text loss (metric_0 - metric_t)."""
    traj = trajectory_table(runs, [model])
    rows = []
    for (modality, seed), t in traj.groupby(["run", "seed"]) if not traj.empty else []:
        t = t.sort_values("step")
        start = t.iloc[0]
        for _, p in t.iloc[1:].iterrows():
            rows.append({"run": f"{modality} s{seed}", "modality": modality, "step": p.step,
                         "erosion": start.S - p.S, "text loss": start[text_metric] - p[text_metric],
                         "held-out loss increase": p.heldout_loss - start.heldout_loss})
    return pd.DataFrame(rows)


def dose_finding(base: dict, runs: dict, models: list, resamples: int = 2000) -> Finding:
    """Analysis 4: sink erosion against text-capability loss over every probe of every run, run-level bootstrap."""
    import plotly.express as px

    from ..measures.regression import spearman_rho
    claims, tables, figures = [], [], []
    for model in models:
        metric = probe_metric(base, model)
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
        low, high = (np.quantile(boot, [ALPHA / 2, 1 - ALPHA / 2]) if len(boot) else (float("nan"),) * 2)
        varied = pts.erosion.nunique() > 2 and pts["text loss"].nunique() > 2 and pts.step.nunique() >= 3
        claims.append(claim(
            f"erosion_tracks_loss_{slug(model)}", "measured", f"{SOURCE}, Secs. 1 and 4 (the mechanism); test design ours",
            f"{model}: the more a run erodes the sink, the more format-sensitive skill it loses",
            "erosion carries the loss", f"{metric}: rho {rho:+.2f} [{low:+.2f}, {high:+.2f}] over {len(pts)} points, {len(groups)} runs",
            DOSE, value=bool(rho > 0 and low > 0), origin="ours",
            precondition=(varied, "fewer than three training strengths, or no variation in erosion or loss")))
        tables.append(pts.assign(model=model))
        fig = px.scatter(pts, x="erosion", y="text loss", color="modality", symbol="run", hover_data=["step"],
                         title=f"{model}: S_0 - S_t against the loss of {metric} (probe)")
        fig.update_layout(height=360)
        figures.append(fig)
    table = pd.concat(tables).groupby(["model", "modality", "step"])[["erosion", "text loss"]].mean() if tables else None
    return Finding("Dose and response", claims=claims, table=table, figures=figures)


def across_models_finding(base: dict, runs: dict, models: list, task: str = ACROSS_TASK) -> Finding:
    """Analysis 5: which model loses more under the same recipe, against what S (and the paper's fit) predicts."""
    from ..core.published import six_pairs
    from ..measures.regression import fit_line
    six = six_pairs()
    intercept, slope = fit_line(six.s, six.delta_ifeval_counts)
    rows = []
    for model in models:
        vl = _mean_over_seeds(runs, model, "vision", task)
        b = _items(base[model], task)
        rows.append({"model": model, "QK-norm": base[model]["model"]["qk_norm"], "S (unadapted)": base[model]["sink"]["S"],
                     "paper's fit: predicted IFEval change (pt)": float(intercept + slope * base[model]["sink"]["S"]),
                     f"measured {task} change (pt)": 100 * float(vl.mean() - b.mean()) if vl is not None and b is not None
                     else float("nan"),
                     "headroom": _has_headroom(base, model, task), "learned": vision_learned(runs, model)[0]})
    table = pd.DataFrame(rows).set_index("model")
    claims = []
    usable = table[table.headroom & table.learned]
    if len(models) >= 2:
        ok = len(usable) >= 2
        column = f"measured {task} change (pt)"
        order = usable.sort_values("S (unadapted)", ascending=False)
        holds = ok and bool(order[column].iloc[0] > order[column].iloc[-1])
        claims.append(claim(
            "larger_s_loses_less", "measured", f"{SOURCE}, Sec. 3.2",
            f"under the same recipe, the model with the larger S loses less {task}",
            "higher S, smaller loss (rho 0.97 over six pairs)",
            "; ".join(f"{m}: S {r['S (unadapted)']:.2f}, change {r[column]:+.1f} pt" for m, r in table.iterrows()),
            ORDER, value=holds, precondition=(ok, f"needs two models that learned the image task and have {task} "
                                                  f"headroom")))
    notes = ["Two models give a direction, not a correlation; they also differ in size, family and pretraining, not "
             "only in S and QK-norm."]
    return Finding("Across models", claims=claims, table=table, notes=notes)


# ---- the chapter --------------------------------------------------------------------------------------------------

class VLAdaptation:
    """The chapter: ``run()`` trains and evaluates (cached), then one method per finding, in notebook order."""

    def __init__(self, settings):
        self.s = settings
        if not settings.seeds:
            raise ValueError("seeds must name at least one seed")
        self.claims: list = []
        self.base: dict = {}
        self.runs: dict = {}
        self.seconds: dict = {}

    def jobs(self) -> list[dict]:
        spec, probe = eval_spec(self.s), probe_spec(self.s)
        device = "cpu" if self.s.device == "auto" else self.s.device
        base = [{"kind": "base", "model": m, "eval": spec, "device": device} for m in self.s.models]
        runs = [{"kind": "run", "config": cfg.record(), "eval": spec, "probe": probe, "device": device}
                for cfg in adapt_configs(self.s)]
        return base + runs

    def run(self) -> Finding:
        """Train and evaluate everything not in the cache, ``workers`` jobs at a time; then load the results."""
        from ..core.models import resolve_device
        start = time.perf_counter()
        jobs = self.jobs()
        if resolve_device(self.s.device) != "cpu":
            for job in jobs:
                job["device"] = resolve_device(self.s.device)
        paths = run_jobs(jobs, self.s.workers if resolve_device(self.s.device) == "cpu" else 1)
        for job, path in zip(jobs, paths):
            doc = json.loads(Path(path).read_text())
            if job["kind"] == "base":
                self.base[job["model"]] = doc
            else:
                c = job["config"]
                self.runs[(c["model"], c["modality"], c["seed"])] = doc
        self.seconds["run"] = time.perf_counter() - start
        table = pd.DataFrame([{"model": m, "run": mod, "seed": s, "training (s)": d.get("train_seconds"),
                               "evaluation (s)": d.get("seconds"), "steps": d["config"]["steps"]}
                              for (m, mod, s), d in self.runs.items()])
        notes = [f"{len(jobs)} jobs ({len(self.runs)} training runs); this call took {self.seconds['run']:.0f} s "
                 f"(cached runs load in seconds)."]
        return Finding("Runs", table=table, notes=notes)

    def _keep(self, finding: Finding) -> Finding:
        self.claims += finding.claims
        return finding

    def adaptation(self) -> Finding:
        return self._keep(adaptation_finding(self.base, self.runs, self.s.models))

    def capability(self) -> Finding:
        return self._keep(capability_finding(self.base, self.runs, self.s.models))

    def erosion(self) -> Finding:
        return self._keep(erosion_finding(self.base, self.runs, self.s.models))

    def theorem1(self) -> Finding:
        return self._keep(theorem1_finding(self.runs, self.s.models))

    def dose_response(self) -> Finding:
        return self._keep(dose_finding(self.base, self.runs, self.s.models))

    def across_models(self) -> Finding:
        return self._keep(across_models_finding(self.base, self.runs, self.s.models))

    def results(self) -> dict:
        summaries = {f"{m}|{mod}|{s}": {"sink": d["sink"], "theorem1": d.get("theorem1"),
                                        "vision_accuracy": (d.get("vision") or {}).get("accuracy"),
                                        "scores": {t: r["score"] for t, r in d["tasks"].items()},
                                        "train_seconds": d.get("train_seconds"), "directory": d.get("directory")}
                     for (m, mod, s), d in self.runs.items()}
        base = {m: {"sink": d["sink"], "scores": {t: r["score"] for t, r in d["tasks"].items()}}
                for m, d in self.base.items()}
        models = [d["model"]["record"] for d in self.base.values()]
        return dict(chapter=CHAPTER, parameters=self.s.as_dict(), claims=self.claims, models=models,
                    extra={"base": base, "runs": summaries, "seconds": self.seconds})
