"""The runs of the chapter on models that have a sink: baseline and V-scale models trained on the synthetic
Bigram-Backcopy setting (cached in ``training.scratch``), their probes, the V-scale retrofit of a pretrained model
and post-training quantisation of all of them. Every function returns plain numbers."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import json

import numpy as np
import pandas as pd
import torch

from ..core.hooks import capture
from ..core.models import SMOLLM2, load_model
from ..core.paths import cache_key, cache_root, entry_lock, jsonable, write_json
from ..interventions.quantise import quantise_weights, quantised_residual
from ..interventions.vscale import apply_vscale, calibrated_theta, learned_theta, probe_raw_values
from ..measures.gradprobes import RGS_T_E, ProbeResult, probe_batch, sink_check
from ..measures.regression import spearman_rho
from ..training.corpus import heldout_text_windows, validation_batches
from ..training.loop import fit
from ..training.scratch import TrainConfig, run_dir, train
from ..training.synthetic import corpus_for

# The smallest setting of the recorded search whose baseline has an attention sink (README of
# measurements/sink_emergence): 1 layer x 64 dims, 1 head, context 32, lr 1e-2, no weight decay.
SETTING = dict(data="bb-64-3", shape=(1, 64, 1, 256), context=32, batch_size=16, lr=1e-2, weight_decay=0.0)
QUANTISERS = ("int8 weights", "int4 weights", "int8 residual (per token)", "int8 residual (per tensor)")


def setting_config(steps: int, seed: int, vscale: bool, eval_every: int = 500) -> TrainConfig:
    corpus = corpus_for(SETTING["data"])
    return TrainConfig(size="nano", shape=SETTING["shape"], data=SETTING["data"], vocab_size=corpus.vocab_size,
                       steps=steps, warmup_steps=steps // 10, batch_size=SETTING["batch_size"],
                       context=SETTING["context"], lr=SETTING["lr"], weight_decay=SETTING["weight_decay"],
                       seed=seed, vscale=vscale, eval_every=min(eval_every, steps))


def setting_probe_ids(corpus) -> torch.Tensor:
    """16 validation windows of the training context, the same for every run of the setting."""
    return validation_batches(corpus.val_ids, 16, SETTING["context"], corpus.bos_id, 1)[0]


def probe_numbers(probe: ProbeResult, raw_value_norm: np.ndarray | None = None) -> dict:
    """What the claims read from one probe: the summary, the chapter's sink check, the Fig. 3 / Fig. 12 relations."""
    s, check_ = probe.summary(), sink_check(probe)
    bloat, change, compress = (probe.attn_ratios[k] for k in ("bloat", "change", "compress"))
    with np.errstate(divide="ignore", invalid="ignore"):       # a zero gradient makes a ratio 0 or undefined
        norms, log_compress = np.log10(probe.input_norm).ravel(), np.log10(compress).ravel()
        log_change = np.abs(np.log10(change)).ravel()
    related = np.isfinite(norms) & np.isfinite(log_compress)
    values = probe.value_norm if raw_value_norm is None else raw_value_norm      # (layers, heads, T)
    return {"median R_GS": s["median_r_gs"], "Sink^eps middle": check_["sink_rate_middle"],
            "token-0 ratio": check_["token0_ratio_middle_max"], "token-0 norm": s["token0_norm_mean"],
            "token-0 value norm / early": float(np.median(values[:, :, 0] / values[:, :, 1:RGS_T_E + 1].mean(-1))),
            "Bloat token 0": float(np.median(bloat[:, :, 0])), "Bloat others": float(np.median(bloat[:, :, 1:])),
            "median |log10 Change|": float(np.median(log_change[np.isfinite(log_change)])),
            "rho(norm, Compress)": float(spearman_rho(norms[related], log_compress[related]))}


def _quantised(model, name: str):
    """A context in which ``model`` (a deep copy for the weight quantisers) computes under quantiser ``name``."""
    if name.endswith("weights"):
        other = copy.deepcopy(model)
        with torch.no_grad():
            quantise_weights(other, 8 if name.startswith("int8") else 4)
        return contextlib.nullcontext(other)
    granularity = "token" if "per token" in name else "tensor"
    return quantised_residual(model, 8, granularity)


def mean_loss(model, batches) -> float:
    with torch.no_grad():
        return float(np.mean([model(input_ids=b, labels=b).loss.item() for b in batches]))


def largest_activation(model, batches) -> float:
    """Largest |h| of the residual stream entering any decoder block, over the batches."""
    largest = 0.0
    with torch.no_grad():
        for b in batches:
            with capture(model, points=("resid_pre",)) as cap:
                model(input_ids=b)
            largest = max(largest, max(float(cap["resid_pre", l].abs().max()) for l in cap.layers))
    return largest


def quantisation_rows(models: dict, batches) -> pd.DataFrame:
    """Loss in float and under each quantiser for every model, with the largest residual activation."""
    rows = []
    for name, model in models.items():
        model.eval()
        base = mean_loss(model, batches)
        row = {"model": name, "largest |h|": largest_activation(model, batches), "float loss": base}
        for q in QUANTISERS:
            with _quantised(model, q) as m:
                row[f"{q}: loss increase"] = mean_loss(m, batches) - base
        rows.append(row)
    return pd.DataFrame(rows)


@dataclasses.dataclass(frozen=True)
class RetrofitConfig:
    model: str = SMOLLM2
    steps: int = 40
    batch_size: int = 4
    context: int = 64
    lr: float = 1e-5
    theta_lr: float = 1e-1       # theta starts far from where it acts: at 1e-2 it moved +0.1 on average in 60 steps
    start_share: float = 1e-4    # C starts at this share of each head's median ||v||^2: (nearly) the identity
    seed: int = 0


def fine_tune(model, windows: torch.Tensor, cfg: RetrofitConfig, vscale: bool, progress: bool = False) -> dict:
    """Fine-tune ``model`` in place on ``windows`` (N, T) at a constant learning rate, with V-scale added first
    (calibrated start) when ``vscale``. The first ``batch_size`` windows calibrate the start and measure how far
    it is from the identity; the rest are drawn from, seeded. Returns history, seconds, the start's loss change
    and, with V-scale, the learned theta."""
    out = {}
    calibration, pool = windows[: cfg.batch_size], windows[cfg.batch_size:]
    if vscale:
        before = mean_loss(model, [calibration])
        start = calibrated_theta(model, calibration, cfg.start_share)
        apply_vscale(model, theta=start)
        out["theta_start"] = start.numpy()
        out["start_loss_change"] = mean_loss(model, [calibration]) - before
    thetas = [p for n, p in model.named_parameters() if n.endswith(".theta")]
    others = [p for n, p in model.named_parameters() if not n.endswith(".theta")]
    groups = [{"params": others}] + ([{"params": thetas, "lr_scale": cfg.theta_lr / cfg.lr}] if thetas else [])
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    order = torch.Generator().manual_seed(cfg.seed)
    picks = [torch.randint(0, len(pool), (cfg.batch_size,), generator=order) for _ in range(cfg.steps)]
    result = fit(model, optimizer, lambda step: pool[picks[step]], cfg.steps, lambda step: cfg.lr, clip=1.0,
                 progress=progress, desc=f"{cfg.model}: {'V-scale retrofit' if vscale else 'plain fine-tune'}")
    model.eval()
    out.update({"history": result.history, "seconds": result.seconds})
    if vscale:
        out["theta"] = learned_theta(model).numpy()
    return out


def retrofit_measurements(cfg: RetrofitConfig, probe_batch_size: int = 2, probe_context: int = 256,
                          eval_windows: int = 8, device: str = "cpu", progress: bool = False) -> dict:
    """Pretrained model, plain fine-tune and V-scale fine-tune of it, each probed (gradient sinks, the sink, the
    token-0 norm) and evaluated in float and under every quantiser. Cached by configuration (numbers only: the
    fine-tuned weights are not kept)."""
    key = cache_key({**dataclasses.asdict(cfg), "probe": [probe_batch_size, probe_context],
                     "eval_windows": eval_windows, "format": 2})
    path = cache_root() / "retrofit" / f"{key}.json"
    with entry_lock(path, f"the V-scale retrofit of {cfg.model}"):
        if path.exists():
            return {**json.loads(path.read_text()), "from_cache": True}
        return _retrofit(cfg, path, probe_batch_size, probe_context, eval_windows, device, progress)


def _retrofit(cfg: RetrofitConfig, path, probe_batch_size: int, probe_context: int, eval_windows: int, device: str,
              progress: bool) -> dict:
    torch.manual_seed(cfg.seed)
    out = {"config": dataclasses.asdict(cfg), "arms": {}}
    windows = None
    for arm in ("pretrained", "plain fine-tune", "V-scale fine-tune"):
        loaded = load_model(cfg.model, device=device)
        if windows is None:
            windows = heldout_text_windows(loaded.tokenizer, cfg.batch_size * 16, cfg.context, part=0)[0]
            evaluation = heldout_text_windows(loaded.tokenizer, eval_windows, cfg.context, part=1)[0]
            probe_ids = heldout_text_windows(loaded.tokenizer, probe_batch_size, probe_context, part=2)[0]
        model = loaded.model
        record = {}
        if arm != "pretrained":
            record = fine_tune(model, windows, cfg, vscale=arm.startswith("V-scale"), progress=progress)
        probe = probe_raw_values(model, probe_ids) if arm.startswith("V-scale") else probe_batch(model, probe_ids)
        numbers = probe_numbers(probe, probe.value_norm)
        numbers["val loss"] = mean_loss(model, [evaluation])
        quant = quantisation_rows({arm: model}, [evaluation]).iloc[0].to_dict()
        out["arms"][arm] = {"numbers": numbers, "quantisation": quant,
                            "history": [{k: h[k] for k in ("step", "loss")} for h in record.get("history", [])],
                            **{k: record[k] for k in ("seconds", "start_loss_change", "theta", "theta_start") if k in record}}
        del loaded, model
    write_json(path, jsonable(out, strict=False), strict=False)
    return {**out, "from_cache": False}


def setting_pairs(steps: int, seeds: list[int], device: str, use_cache: bool = True) -> tuple[dict, dict, dict, dict]:
    """A baseline and a V-scale model of the synthetic setting per seed, trained (or read from the cache) and
    probed on the same windows: ({seed: {name: numbers}}, {seed: learned theta}, {"name seed": train seconds},
    {"name (seed s)": model})."""
    corpus = corpus_for(SETTING["data"])
    ids = setting_probe_ids(corpus)
    pairs, theta, seconds, models = {}, {}, {}, {}
    for seed in seeds:
        pairs[seed] = {}
        for name, vscale in (("baseline", False), ("V-scale", True)):
            cfg = setting_config(steps, seed, vscale)
            with entry_lock(run_dir(cfg), f"the {name} run {cfg.key()}"):
                run = train(cfg, corpus, device=device, use_cache=use_cache, progress=False)
            probe = probe_raw_values(run.model, ids) if vscale else probe_batch(run.model, ids)
            pairs[seed][name] = {**probe_numbers(probe), "val loss": float(run.evals[-1]["val_loss"])}
            models[f"{name} (seed {seed})"] = run.model
            seconds[f"{name} {seed}"] = 0.0 if run.from_cache else run.train_seconds
            if vscale:
                theta[seed] = learned_theta(run.model).numpy()
    return pairs, theta, seconds, models


def setting_quantisation(models: dict) -> pd.DataFrame:
    """``quantisation_rows`` of the synthetic models on four validation batches of the setting."""
    corpus = corpus_for(SETTING["data"])
    return quantisation_rows(models, validation_batches(corpus.val_ids, 16, SETTING["context"], corpus.bos_id, 4))
