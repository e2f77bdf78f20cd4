"""Reading the adaptation records: per-item outcomes, headroom, and whether the vision runs learned the images.

Every chapter built on the adaptation runs gates its claims the same way: a task whose unadapted score sits at
its floor cannot show a loss (``has_headroom``), and a claim about vision-language adaptation needs vision runs
that answer held-out image questions above chance (``vision_learned``). Both rules live here, once.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

LEARNED_ALPHA = 0.05            # the paired test that says the vision runs beat chance
HEADROOM_MARGIN = 0.05          # a task needs its base score 5 points above its floor to be able to show a loss


def items(doc: dict, task: str) -> np.ndarray | None:
    """Per-item scores of ``task`` in one evaluation record (None when it was not evaluated)."""
    t = doc.get("tasks", {}).get(task)
    return None if t is None or not t["n"] else np.asarray(t["per_item"], dtype=float)


def mean_items(docs: list[dict], task: str) -> np.ndarray | None:
    """Per-item scores averaged over several runs' records (seeds) of the same items."""
    rows = [r for r in (items(d, task) for d in docs) if r is not None]
    return np.mean(rows, axis=0) if rows else None


def has_headroom(doc: dict, task: str) -> bool:
    """The unadapted model's ``task`` score sits more than ``HEADROOM_MARGIN`` above the task's floor."""
    from ..measures.textsuite import TaskResult, headroom
    r = doc.get("tasks", {}).get(task)
    return bool(r) and headroom(TaskResult(**r), HEADROOM_MARGIN)


def interval_pt(test) -> str:
    """A paired test's effect and interval in points: '+1.2 pt [-0.4, +2.8]'."""
    low, high = test.detail.get("interval", (float("nan"), float("nan")))
    from ..core.claims import signed
    return f"{signed(100 * test.effect, '.1f')} pt [{signed(100 * low, '.1f')}, {signed(100 * high, '.1f')}]"


def vision_learned(vision_runs: dict) -> tuple[bool, str, dict]:
    """Whether every vision run (``{seed: record}``) answers held-out image questions above chance, by a paired
    bootstrap over items against the chance level: (ok, one line per seed, {seed: (accuracy, chance, test)})."""
    from ..measures.stats import paired_bootstrap
    if not vision_runs:
        return False, "no vision run", {}
    accuracies, ok = {}, True
    for seed, doc in sorted(vision_runs.items()):
        v = doc.get("vision")
        if not v:
            return False, "the vision run has no image-task evaluation", {}
        hits = np.asarray(v["per_item"], dtype=float)
        if len(hits) < 2:
            return False, "fewer than two held-out image questions were evaluated", {}
        test = paired_bootstrap(np.full_like(hits, v["chance"]), hits, LEARNED_ALPHA)
        accuracies[seed] = (v["accuracy"], v["chance"], test)
        ok &= test.outcome == "improves"
    text = "; ".join(f"seed {s}: {a:.2f} (chance {c:.2f}, {interval_pt(t)})" for s, (a, c, t) in accuracies.items())
    return ok, text, accuracies


def probe_metric(base_doc: dict) -> str:
    """The probe's format-sensitive score for a model: strict arithmetic, or the flexible parse where strict sits
    at its floor on the unadapted model (a floored score cannot fall)."""
    return "arithmetic_strict" if has_headroom(base_doc, "arithmetic_strict") else "arithmetic_flexible"


# ---- records of several runs: ``runs[(model, arm, seed)]`` (arm: a modality, an intervention or a merge) ---------

def seeds_of(runs: dict, model: str, arm: str) -> list:
    return sorted(seed for (m, a, seed) in runs if m == model and a == arm)


def arm_items(runs: dict, model: str, arm: str, task: str, seeds=None) -> np.ndarray | None:
    """Per-item scores of ``task`` averaged over the seeds of one arm (all of its seeds unless ``seeds``)."""
    return mean_items([runs[(model, arm, s)] for s in (seeds or seeds_of(runs, model, arm))], task)


def arm_vision_items(runs: dict, model: str, arm: str, seeds=None) -> np.ndarray | None:
    """Per-question image-task outcomes averaged over the seeds of one arm."""
    rows = [runs[(model, arm, s)].get("vision", {}).get("per_item") for s in (seeds or seeds_of(runs, model, arm))]
    rows = [np.asarray(r, dtype=float) for r in rows if r]
    return np.mean(rows, axis=0) if rows else None


def arm_runs(runs: dict, model: str, arm: str, task: str, seeds=None) -> np.ndarray | None:
    """Per-item scores of ``task`` in each seed of one arm, a row per seed (``measures.stats.paired_runs`` pairs
    two arms seed by seed and item by item); None when a seed lacks the task."""
    rows = [items(runs[(model, arm, s)], task) for s in (seeds or seeds_of(runs, model, arm))]
    return None if not rows or any(r is None for r in rows) else np.stack(rows)


def arm_vision_runs(runs: dict, model: str, arm: str, seeds=None) -> np.ndarray | None:
    """Per-question image-task outcomes in each seed of one arm, a row per seed."""
    rows = [runs[(model, arm, s)].get("vision", {}).get("per_item") for s in (seeds or seeds_of(runs, model, arm))]
    return None if not rows or not all(rows) else np.asarray(rows, dtype=float)


def base_runs(doc: dict, task: str, seeds: int) -> np.ndarray | None:
    """The unadapted model's per-item scores repeated once per seed of the arm it is paired with: every seed
    starts from the same model."""
    b = items(doc, task)
    return None if b is None else np.tile(b, (seeds, 1))


def probe_change(doc: dict, column: str) -> float:
    probes = sorted(doc.get("probes") or [], key=lambda p: p["step"])
    if len(probes) < 2 or column not in probes[0]:
        return float("nan")
    return float(probes[-1][column] - probes[0][column])


def trajectory_table(runs: dict, models: list) -> pd.DataFrame:
    rows = []
    for (model, modality, seed), doc in runs.items():
        if model not in models:
            continue
        for p in doc.get("probes", []):
            rows.append({"model": model, "run": modality, "seed": seed, **p})
    return pd.DataFrame(rows)


def half_step(traj: pd.DataFrame, column: str, falling: bool = True) -> float:
    """The first probe step at which ``column`` has covered half of its total change (NaN if it did not move
    in the expected direction)."""
    t = traj.groupby("step")[column].mean().sort_index()
    total = t.iloc[-1] - t.iloc[0]
    if (falling and total >= 0) or (not falling and total <= 0):
        return float("nan")
    reached = t.index[((t - t.iloc[0]) / total) >= 0.5]
    return float(reached[0]) if len(reached) else float("nan")


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
