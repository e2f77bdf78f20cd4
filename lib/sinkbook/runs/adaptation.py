"""Vision-language adaptation runs and their evaluations, as cached jobs (the VL chapters' records).

A job trains one adaptation run (``training.adapt``), probes it along training and evaluates it
(``evaluate``: the text-capability suite, held-out loss, the sink, Theorem 1 on the weight update, image
accuracy), or evaluates an unadapted model ("base"), a model whose QK-norm was changed before training
("start"), or a plain run merged with its base ("merge"). Each job writes one JSON record under the run cache,
named by ``core.paths.cache_key`` of what it evaluates, and returns its path: a second build reads them.

``RECIPE`` is the adaptation recipe and evaluation of each profile; every chapter that trains or reads these runs
(adaptation, protection, the multimodal OutRo chapter) resolves it, so the three share runs and items.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch

from ..core.arch import arch_for
from ..core.claims import slug
from ..core.models import encode, load_model, resolve_device
from ..core.paths import cache_key, cache_root, entry_lock, kill_point, write_json
from ..core.precision import PRECISIONS, autocast
from ..core.profiles import Profiles, one_of
from ..core.prompts import prompt_texts
from ..interventions.merging import merge_models
from ..interventions.qknorm import fix_qk_norm, inject_qk_norm
from ..measures.margins import (first_order_regime, sink_state, theorem1_on_update, theorem1_summary,
                                window_layers)
from ..measures.textsuite import heldout_loss, run_suite
from ..training.adapt import AdaptConfig, adapt, load_run, run_dir
from ..training.corpus import heldout_text_windows
from ..training.digits import TASKS
from ..training.probes import AdaptationProbe, held_out_vision_examples, vision_scores
from ..training.recovery import Recovery, recovered_start
from ..training.remedies import CHANGES_NORMS, calibration_batch
from .pool import run_jobs


EVAL_FORMAT = 1                 # bump when what a job evaluates changes
PROBE_FORMAT = 1                # bump when what a probe measures changes (it keys the cached training runs)
# Reading a row of 2-4 digits stays at zero accuracy within a CPU-sized run; the single-digit tasks are learned.
SINGLE_DIGIT = ("caption", "identify", "parity", "greater")
# Probe sizes: the default profile's probe costs at most a tenth of the training it watches in
# scripts/bench_adapt_probe.py, on both models: the first 8 calibration prompts, one 64-token held-out window and
# 8 arithmetic items whose shared prompt prefix (system prompt or worked examples) runs once. The default probe
# leaves image accuracy to the final evaluation (100 held-out questions): along training it cost as much as the
# rest of the probe, and no analysis reads it.
# Precision: the default profile trains and evaluates its text and image tasks under bfloat16 autocast (float32 master
# weights), the dtype of the papers' GPU runs; its float32 agreement is measured in scripts/bench_dtype.py (S,
# held-out loss, greedy answers). The sink and Theorem 1 stay float32. quick stays float32 for CI's small runs.
# Evaluations run the arithmetic and knowledge prompts' common prefix (system prompt or worked examples) once per
# batch: the same answers up to floating-point rounding, at half of Gemma 3's cost for these tasks, whose five worked
# examples are most of each prompt. The default profile spends that on twice the arithmetic items (120; it had 60),
# the format-sensitive task most claims read, at about the evaluation time it had.
SHARE_PREFIX = True
RECIPE = Profiles({
    "quick": dict(tasks=list(SINGLE_DIGIT), steps=6, stage1_steps=4, lr=2e-4, stage1_lr=3e-4, batch_size=4,
                  probe_every=3, probe_arithmetic=8, probe_vision=0, probe_prompts=8, probe_heldout_windows=1,
                  probe_heldout_length=64, arithmetic=12, knowledge=16, ifeval=8, ifeval_tokens=32,
                  ifeval_base_models=False, vision=20, heldout_windows=2, window=10, precision="float32"),
    "default": dict(tasks=list(SINGLE_DIGIT), steps=60, stage1_steps=20, lr=2e-4, stage1_lr=3e-4, batch_size=4,
                    probe_every=20, probe_arithmetic=8, probe_vision=0, probe_prompts=8, probe_heldout_windows=1,
                    probe_heldout_length=64, arithmetic=120, knowledge=103, ifeval=115, ifeval_tokens=48,
                    ifeval_base_models=False, vision=100, heldout_windows=8, window=10, precision="bfloat16"),
    "gpu": dict(tasks=list(TASKS), steps=1000, stage1_steps=300, lr=2e-5, stage1_lr=1e-4, batch_size=32,
                probe_every=100, probe_arithmetic=60, probe_vision=60, probe_prompts=15, probe_heldout_windows=2,
                probe_heldout_length=128, arithmetic=200, knowledge=103, ifeval=115, ifeval_tokens=256,
                ifeval_base_models=True, vision=300, heldout_windows=32, window=10, precision="bfloat16"),
}, limits=dict(precision=one_of(*PRECISIONS)))


def recipe(profile: str, device: str = "auto", **overrides):
    """The recipe settings of ``profile``, with ``models``, ``seeds`` and ``workers`` (and any overrides) added."""
    extra = {k: overrides.pop(k) for k in ("models", "seeds", "workers") if k in overrides}
    base = RECIPE.resolve(profile, device=device, **overrides)
    return dataclasses.replace(base, values=type(base.values)({**base.values, **extra}))


def eval_spec(s) -> dict:
    """What a job evaluates; its hash keys the cached evaluation (training is keyed by the run's configuration).
    IFEval-style compliance follows the paper's instruct protocol (chat template); on a base model it needs a
    few-shot format and costs minutes per evaluation, so ``ifeval_base_models`` decides."""
    spec = {"format": EVAL_FORMAT, "arithmetic": s.arithmetic, "knowledge": s.knowledge, "ifeval": s.ifeval,
            "ifeval_tokens": s.ifeval_tokens, "ifeval_base_models": s.ifeval_base_models, "vision": s.vision,
            "heldout_windows": s.heldout_windows, "window": s.window}
    if s.precision != "float32":             # float32 evaluations keep the keys they had before the setting
        spec["precision"] = s.precision
    spec["share_prefix"] = SHARE_PREFIX
    return spec


def probe_spec(s) -> dict:
    return {"format": PROBE_FORMAT, "arithmetic": s.probe_arithmetic, "vision": s.probe_vision, "window": s.window,
            "heldout_windows": s.probe_heldout_windows, "heldout_length": s.probe_heldout_length,
            "prompts": s.probe_prompts}


def adapt_configs(s) -> list:
    return [AdaptConfig(model, modality, steps=s.steps, lr=s.lr, stage1_steps=s.stage1_steps, stage1_lr=s.stage1_lr,
                        batch_size=s.batch_size, seed=seed, probe_every=s.probe_every, tasks=tuple(s.tasks),
                        precision=s.precision)
            for model in s.models for modality in ("vision", "text") for seed in s.seeds]


def base_eval_path(model: str, spec: dict) -> Path:
    return cache_root() / "adapt" / f"base-{slug(Path(model).name)}-{cache_key(spec)}.json"


def merge_eval_path(run_directory: Path, name: str, spec: dict) -> Path:
    return run_directory / f"merge-{name}-eval-{cache_key(spec)}.json"


def start_eval_path(model: str, intervention: str, spec: dict) -> Path:
    return cache_root() / "adapt" / f"start-{slug(Path(model).name)}-{intervention}-{cache_key(spec)}.json"


def _write(path: Path, doc: dict) -> None:
    write_json(path, doc, strict=False)      # a cache of records: NaN stays a number


def run_job(job: dict) -> str:
    """One job in a worker: "base" (an unadapted model), "run" (train, probe, evaluate one run), "start" (a model
    whose QK-norm was changed, before any training) or "merge" (a plain run merged with its base)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(job.get("threads", 1))
    try:
        return _run_job(job)
    finally:                       # a job run in the caller's process leaves its thread count as it was
        torch.set_num_threads(previous)


def _run_job(job: dict) -> str:
    spec, device = job["eval"], job.get("device", "cpu")
    if job["kind"] == "base":
        path = base_eval_path(job["model"], spec)
        with entry_lock(path, f"the evaluation of {job['model']}"):
            if not path.exists():
                reference = load_model(job["model"], device=device)
                _write(path, evaluate(reference, None, None, spec, reference=None))
        return str(path)
    if job["kind"] == "start":
        return _start_job(job, spec, device)
    if job["kind"] == "merge":
        return _merge_job(job, spec, device)
    cfg = AdaptConfig(**job["config"])
    tag = cache_key(job["probe"])
    with entry_lock(run_dir(cfg, tag), f"the adaptation run {run_dir(cfg, tag).name}"):
        return _train_and_evaluate(job, cfg, tag, spec, device)


def _train_and_evaluate(job: dict, cfg, tag: str, spec: dict, device: str) -> str:
    path = run_dir(cfg, tag) / f"eval-{cache_key(spec)}.json"
    if path.exists():
        _add_first_order_regime(path, cfg, spec, device)
        return str(path)
    reference = load_model(cfg.model, device=device)
    probe = AdaptationProbe(reference, window=job["probe"]["window"], arithmetic=job["probe"]["arithmetic"],
                            vision=job["probe"]["vision"], heldout_windows=job["probe"]["heldout_windows"],
                            heldout_length=job["probe"]["heldout_length"], prompts=job["probe"]["prompts"],
                            tasks=cfg.tasks, precision=cfg.precision)
    run = adapt(cfg, probe=probe, probe_tag=tag, device=device, progress=job.get("progress", False))
    result = evaluate(run.loaded, run.vlm, run.fmt, spec, reference=reference, modality=cfg.modality, tasks=cfg.tasks,
                      theorem1=cfg.intervention not in CHANGES_NORMS)
    result.update({"config": cfg.record(), "probes": run.probes, "train_seconds": run.seconds,
                   "intervention": run.intervention,
                   "history": [{k: h[k] for k in ("stage", "step", "loss")} for h in run.history],
                   "directory": str(run.directory / "model")})
    _write(path, result)
    _add_first_order_regime(path, cfg, spec, device)
    return str(path)


def _add_first_order_regime(path: Path, cfg, spec: dict, device: str) -> None:
    """Theorem 1's regime check (``max_relative_change``) added to a run's evaluation record, from the saved run:
    a fresh record and one evaluated before the check existed get it the same way, so the two are equal."""
    doc = json.loads(path.read_text())
    if "theorem1" not in doc or "max_relative_change" in doc["theorem1"]:
        return
    reference = load_model(cfg.model, device=device)
    adapted = load_run(path.parent, device=device).loaded
    batch = {k: v.to(reference.device) for k, v in encode(reference.tokenizer, prompt_texts()).items()}
    layers = window_layers(reference.model, spec["window"])
    doc["theorem1"]["max_relative_change"] = first_order_regime(reference.model, adapted.model, batch, layers)
    _write(path, doc)


def _start_job(job: dict, spec: dict, device: str) -> str:
    """A changed model before VL training; with ``recovery_steps`` (fixed scale only), after the text-only recovery
    phase of that seed (``training.recovery``), whose record the evaluation carries."""
    steps = job.get("recovery_steps", 0)
    recovery = Recovery(steps) if steps else None
    name, keyed = job["intervention"], spec
    if recovery is not None:
        name = f"{name}-recovered-s{job['seed']}"
        keyed = {**spec, "recovery": recovery.record(), "recovery_precision": job["precision"]}
    path = start_eval_path(job["model"], name, keyed)
    with entry_lock(path, f"the {name} start of {job['model']}"):
        if path.exists():
            return str(path)
        loaded, reference = load_model(job["model"], device=device), load_model(job["model"], device=device)
        recovered = None
        if job["intervention"] == "fix_qk_norm":
            fix_qk_norm(loaded.model, calibration_batch(loaded))
            if recovery is not None:
                recovered = recovered_start(job["model"], loaded, job["seed"], recovery, job["precision"])
        else:
            inject_qk_norm(loaded.model)
        result = evaluate(loaded, None, None, spec, reference=reference, theorem1=False)
        if recovered is not None:
            result["recovery"] = recovered
        _write(path, result)
    return str(path)


def _merge_job(job: dict, spec: dict, device: str) -> str:
    cfg = AdaptConfig(**job["config"])
    directory = run_dir(cfg, cache_key(job["probe"]))
    path = merge_eval_path(directory, job["merge"], spec)
    # the plain run's lock first (a merge reads the finished run), then the merge's own
    with entry_lock(directory, f"the adaptation run {directory.name}"), \
            entry_lock(path, f"the {job['merge']} merge of {directory.name}"):
        if path.exists():
            return str(path)
        run = load_run(directory, device)
        reference = load_model(cfg.model, device=device)
        merge_models(run.loaded.model, reference.model, job["merge"], seed=cfg.seed)
        result = evaluate(run.loaded, run.vlm, run.fmt, spec, reference=reference, modality="vision", tasks=cfg.tasks)
        result.update({"config": cfg.record(), "merge": job["merge"]})
        _write(path, result)
    return str(path)


def evaluate(loaded, vlm, fmt, spec: dict, reference=None, modality: str | None = None, tasks=None,
             theorem1: bool = True) -> dict:
    """The full suite on one model (``vlm`` None: an unadapted model): text tasks with per-item outcomes,
    held-out loss, the sink on the calibration prompts, and for adapted models the margin against ``reference``,
    Theorem 1 on the weight update (``theorem1``: not for a model whose QK-norm was changed, whose attention is
    no longer the reference's with other weights) and (vision runs) held-out image-task accuracy. The text tasks,
    held-out loss and image questions run in ``spec["precision"]`` (float32 when absent); the sink and Theorem 1
    compare against the reference exactly, in float32."""

    start = time.perf_counter()
    chat = bool(getattr(loaded.tokenizer, "chat_template", None))
    ifeval = spec["ifeval"] if (chat or spec["ifeval_base_models"]) else 0
    evaluated = vlm if vlm is not None else loaded.model
    context = lambda: autocast(spec.get("precision", "float32"), str(loaded.device), evaluated)
    suite = run_suite(loaded, arithmetic=spec["arithmetic"], knowledge=spec["knowledge"], ifeval=ifeval,
                      ifeval_tokens=spec["ifeval_tokens"], context=context, share_prefix=spec.get("share_prefix", False))
    kill_point("evaluate-adapted" if vlm is not None else "evaluate")
    windows = heldout_text_windows(loaded.tokenizer, spec["heldout_windows"], 128)[0]
    out = {"tasks": {name: r.to_dict() for name, r in suite.items()},
           "heldout_loss": heldout_loss(loaded, windows, context=context).per_window}
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
        examples = held_out_vision_examples(spec["vision"], tasks=tasks or TASKS)
        with context():
            out["vision"] = vision_scores(vlm, loaded.tokenizer, examples, fmt)
    # An adapted model is recorded by the model it was adapted from (spec, file hashes); the run's own folder is
    # the record's "directory". The model in hand cannot say: trained in this process it still carries its base's
    # spec, read back from the cache it carries the cache folder's, and the same run must give the same record.
    source = reference if (vlm is not None and reference is not None) else loaded
    out["model"] = {"spec": source.spec, "record": source.record(), "qk_norm": arch_for(loaded.model).qk_norm}
    out["seconds"] = time.perf_counter() - start
    return out


# ---- the job lists of the chapters, and running them -------------------------------------------------------------

def _device(s) -> str:
    return resolve_device(s.device)


def adaptation_jobs(s) -> list[dict]:
    """Every unadapted model's evaluation, then a vision and a text-only run per model and seed."""
    spec, probe = eval_spec(s), probe_spec(s)
    device = _device(s)
    base = [{"kind": "base", "model": m, "eval": spec, "device": device} for m in s.models]
    runs = [{"kind": "run", "config": cfg.record(), "eval": spec, "probe": probe, "device": device}
            for cfg in adapt_configs(s)]
    return base + runs


def protection_jobs(recipe_settings, interventions: dict, seeds: list, merges: list, merge_models: list,
                    merge_seeds: list, recovery_steps: int = 0) -> list[dict]:
    """The protection chapter's jobs: unadapted evaluations, the plain vision runs every intervention and merge
    is compared with, each intervention's runs (and, for a fixed QK-norm, the changed model before training:
    with ``recovery_steps``, each seed's recovered start, from which that seed's run trains), and the merges.
    Interventions and merges are evaluated without IFEval-style compliance."""
    a = recipe_settings
    full, probe = eval_spec(a), probe_spec(a)
    reduced = {**full, "ifeval": 0}
    device = _device(a)
    plain = {(c.model, c.seed): c for c in adapt_configs(a) if c.modality == "vision"}
    models = sorted(set(interventions) | set(merge_models))
    jobs = [{"kind": "base", "model": m, "eval": full, "device": device} for m in models]
    for model in models:
        wanted = set(seeds) if model in interventions else set()
        wanted |= set(merge_seeds) if model in merge_models else set()
        jobs += [{"kind": "run", "config": plain[model, s].record(), "eval": full, "probe": probe, "device": device,
                  "arm": "none"} for s in sorted(wanted)]
        for arm in interventions.get(model, []):
            recovery = {"recovery_steps": recovery_steps} if arm == "fix_qk_norm" else {}
            jobs += [{"kind": "run", "config": dataclasses.replace(plain[model, s], intervention=arm,
                                                                   **recovery).record(),
                      "eval": reduced, "probe": probe, "device": device, "arm": arm} for s in seeds]
            if arm == "fix_qk_norm" and recovery_steps:
                jobs += [{"kind": "start", "model": model, "intervention": arm, "eval": reduced, "device": device,
                          "seed": s, "recovery_steps": recovery_steps, "precision": a.precision} for s in seeds]
            elif arm == "fix_qk_norm":
                jobs.append({"kind": "start", "model": model, "intervention": arm, "eval": reduced, "device": device})
        if model in merge_models:
            jobs += [{"kind": "merge", "config": plain[model, s].record(), "merge": m, "eval": reduced,
                      "probe": probe, "device": device, "arm": f"merge:{m}"} for m in merges for s in merge_seeds]
    return jobs


def _plain_run_trained(job: dict) -> bool:
    return (run_dir(AdaptConfig(**job["config"]), cache_key(job["probe"])) / "run.json").exists()


def run_adaptation_jobs(jobs: list[dict], workers: int, device: str) -> list[dict]:
    """Every job's record (trained and evaluated where the cache lacks it), in the order of ``jobs``. A merge
    reads its plain run, so it waits for the runs unless that run is already trained (cached)."""
    workers = workers if device == "cpu" else 1
    paths = {}
    waits = [job["kind"] == "merge" and not _plain_run_trained(job) for job in jobs]
    for phase in (False, True):
        mine = [i for i, wait in enumerate(waits) if wait == phase]
        paths.update(zip(mine, run_jobs(run_job, [jobs[i] for i in mine], workers)))
    return [json.loads(Path(paths[i]).read_text()) for i in range(len(jobs))]
