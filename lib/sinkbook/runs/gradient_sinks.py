"""The gradient-sinks runs: Llama baselines and a V-scale model trained from scratch on Shakespeare (cached by
configuration in ``training.scratch``), their probes on one fixed validation batch, the probes of pretrained
models, the snapshot trajectories, the late-query attention, and the longer runs recorded by
``scripts/sink_emergence.py``. Every method computes once and returns plain records."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ..core.arch import UnsupportedArchitecture
from ..core.models import ModelNotAvailable, load_model, resolve_device
from ..core.paths import REPO_ROOT, entry_lock
from ..interventions.vscale import probe_raw_values
from ..measures.criteria import late_query_attention, uniform_share
from ..measures.gradprobes import ProbeResult, probe_batch, sink_check, text_windows
from ..training.corpus import load_corpus, validation_batches
from ..training.scratch import TrainConfig, load_checkpoints, run_dir, train

EMERGENCE_DIR = REPO_ROOT / "measurements" / "sink_emergence"
EVAL_EVERY = 500          # validation every 500 steps and at the end (part of the cached runs' configuration)
SNAPSHOTS = 8             # weight snapshots per baseline run, for the training-trajectory figure


def trajectory_row(step: int, probe: ProbeResult) -> dict:
    check_ = sink_check(probe)
    return {"step": step, "Sink^eps middle": check_["sink_rate_middle"],
            "token-0 ratio (max, middle)": check_["token0_ratio_middle_max"],
            "largest alpha_0 of a head": float(probe.alpha0.max()),
            "median R_GS": float(probe.summary()["median_r_gs"]), "sink + massive": check_["both"]}


def training_trajectory(checkpoints, input_ids) -> pd.DataFrame:
    """Probe each (step, model) of ``load_checkpoints`` on one batch: how the attention sink, the token-0 norm
    ratio and the gradient sink grow during training (middle layers, as in the size criterion)."""
    return pd.DataFrame([trajectory_row(step, probe_batch(model, input_ids)) for step, model in checkpoints])


def load_emergence_runs(directory: str | Path | None = None) -> pd.DataFrame:
    """The runs recorded by ``scripts/sink_emergence.py`` (one row per probe; columns run, step, tokens (M),
    sink_rate_middle, token0_ratio_middle_max, largest_alpha0, val_loss, ..., status, command).

    Training batch and context are the file's ``batch`` and ``context`` fields; files written before those
    fields existed were all trained with the script's defaults, which are ``TrainConfig``'s."""
    frames = []
    for path in sorted(Path(directory or EMERGENCE_DIR).glob("*.json")):
        record = json.loads(path.read_text())
        rows = pd.DataFrame(record["rows"])
        batch = int(record.get("batch", TrainConfig.batch_size))
        context = int(record.get("context", TrainConfig.context))
        rows.insert(0, "run", path.stem)
        rows["data"] = record.get("data", "shakespeare")
        rows["tokens (M)"] = rows.step * batch * context / 1e6
        rows["status"], rows["command"] = record.get("status", ""), record.get("command", "")
        frames.append(rows)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


class GradientSinkRuns:
    """One chapter run's models and probes; ``s`` holds the sweep and training settings (sizes, steps per size,
    batch, context, BOS, seed, lr, the pretrained models and their probe windows, ``use_cache``, device)."""

    def __init__(self, s, sweep_sizes: list[str], steps: dict[str, int]):
        self.settings, self.sweep_sizes, self.steps = s, sweep_sizes, steps
        self.device = resolve_device(s.device)
        self._corpus = self._probe_ids = None
        self.baselines, self.baseline_probes, self.vscale_run, self._pair = {}, {}, None, None
        self.trajectories: dict[str, pd.DataFrame] = {}

    @property
    def corpus(self):
        if self._corpus is None:
            self._corpus = load_corpus()
        return self._corpus

    @property
    def probe_ids(self) -> torch.Tensor:
        """One fixed validation batch, the same for every model trained here."""
        if self._probe_ids is None:
            s = self.settings
            self._probe_ids = validation_batches(self.corpus.val_ids, s.batch_size, s.context,
                                                 self.corpus.bos_id if s.bos else None, 1)[0]
        return self._probe_ids

    def config_for(self, size: str, vscale: bool = False) -> TrainConfig:
        s, n = self.settings, self.steps[size]
        return TrainConfig(size=size, steps=n, warmup_steps=n // 10, batch_size=s.batch_size, context=s.context,
                           lr=float(s.lr), seed=s.seed, bos=s.bos, vscale=vscale, eval_every=EVAL_EVERY)

    def baseline(self, size: str):
        if size not in self.baselines:
            cfg = self.config_for(size)
            with entry_lock(run_dir(cfg), f"the {size} baseline {cfg.key()}"):
                run = train(cfg, self.corpus, device=self.device, use_cache=self.settings.use_cache,
                            checkpoint_every=max(1, self.steps[size] // SNAPSHOTS), progress=False)
            self.baselines[size] = run
            self.baseline_probes[size] = probe_batch(run.model, self.probe_ids)
        return self.baselines[size]

    def size_rows(self) -> list[dict]:
        """One row per size of the sweep: shape, budget, loss and the sink criteria of its baseline."""
        rows = []
        for size in self.sweep_sizes:
            run = self.baseline(size)
            probe, check_ = self.baseline_probes[size], sink_check(self.baseline_probes[size])
            layers, d_model, heads, _ = run.config.dims
            rows.append({"size": size, "layers x d_model x heads": f"{layers} x {d_model} x {heads}",
                         "parameters (M)": sum(p.numel() for p in run.model.parameters()) / 1e6,
                         "steps": run.config.steps,
                         "tokens seen (M)": run.config.steps * run.config.batch_size * run.config.context / 1e6,
                         "train minutes": run.train_seconds / 60, "val loss": run.evals[-1]["val_loss"],
                         "Sink^eps middle": check_["sink_rate_middle"],
                         "token-0 ratio (max, middle)": check_["token0_ratio_middle_max"],
                         "median R_GS": float(np.median(probe.r_gs())), "sink + massive": check_["both"]})
        return rows

    def vscale(self, size: str):
        if self.vscale_run is None:
            cfg = self.config_for(size, vscale=True)
            with entry_lock(run_dir(cfg), f"the {size} V-scale run {cfg.key()}"):
                self.vscale_run = train(cfg, self.corpus, device=self.device, use_cache=self.settings.use_cache,
                                        progress=False)
        return self.vscale_run

    def runs(self, size: str) -> dict:
        return {"baseline": self.baseline(size), "V-scale": self.vscale(size)}

    def probes(self, size: str) -> dict[str, ProbeResult]:
        """The baseline of ``size`` and the V-scale model, probed on the same batch (V-scale at its raw values)."""
        if self._pair is None:
            self.baseline(size)
            self._pair = {"baseline": self.baseline_probes[size],
                          "V-scale": probe_raw_values(self.vscale(size).model, self.probe_ids)}
        return self._pair

    def val_losses(self, size: str) -> dict[str, float]:
        return {name: float(run.evals[-1]["val_loss"]) for name, run in self.runs(size).items()}

    def snapshot_trajectories(self) -> dict[str, pd.DataFrame]:
        """Every trained baseline's snapshots, probed on the fixed batch."""
        self.trajectories = {
            size: training_trajectory(load_checkpoints(run.config, self.corpus, device=self.device), self.probe_ids)
            for size, run in self.baselines.items()}
        return self.trajectories

    def late_attention(self) -> tuple[dict, dict]:
        """Per trained baseline, the late-query attention share on token 0 and on line breaks, and the share a
        uniform head would give."""
        ids, tokenizer = self.probe_ids, self.corpus.tokenizer
        newline = torch.tensor([["\n" in tokenizer.decode([int(t)]) for t in row] for row in ids.tolist()])
        first = torch.zeros_like(newline)
        first[:, 0] = True
        masks = {"token 0": first, "line breaks": newline}
        shares = {size: late_query_attention(run.model, ids, masks) for size, run in self.baselines.items()}
        return shares, {name: uniform_share(m) for name, m in masks.items()}


def probe_pretrained(specs: list[str], batch: int, context: int, device: str) -> dict:
    """The probes on ``batch`` windows of ``context`` tokens of the Shakespeare validation text, cut with each
    pretrained model's own tokenizer (BOS first): {"probes": {spec: ProbeResult}, "records", "seconds",
    "skipped": {spec: why}} (a model that is not available here, or not supported, is skipped with the reason)."""
    corpus = load_corpus()
    val_text = corpus.tokenizer.decode(corpus.val_ids[: 40 * batch * context].tolist())
    out = {"probes": {}, "records": [], "seconds": {}, "skipped": {}}
    for spec in specs:
        try:
            loaded = load_model(spec, device=resolve_device(device))
        except (ModelNotAvailable, UnsupportedArchitecture) as err:
            out["skipped"][spec] = str(err)
            continue
        ids = text_windows(loaded.tokenizer, val_text, batch, context, bos=True)
        start = time.perf_counter()
        out["probes"][spec] = probe_batch(loaded.model, ids)
        out["seconds"][spec] = time.perf_counter() - start
        out["records"].append(loaded.record())
        del loaded
    return out
