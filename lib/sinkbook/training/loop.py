"""One training loop for every model the book trains: from scratch, fine-tuning a loaded model, adaptation.

``fit`` runs ``steps`` optimisation steps under Hugging Face accelerate, so the same code runs on the CPU, one
GPU or several processes (DDP): the caller builds the model, the optimiser and a ``batch_at(step)`` function;
``fit`` sets the learning rate of each step, computes the loss, back-propagates, clips, steps, and calls the
callbacks. It never decides what is trained: freeze parameters before calling it. A parameter group with an
``lr_scale`` entry runs at that multiple of the step's learning rate.

Callbacks receive ``(step, model, record)`` after each step (``step`` counts finished steps, from 1); ``record``
holds step, loss, lr, grad_norm, seconds. ``Every(n, fn)`` calls ``fn`` every n steps and at the last one, and
stores what ``fn`` returns in ``FitResult.probes``; ``Checkpoint`` saves the weights every n steps. A
callback may raise ``StopTraining`` to end the run early (the result says so).
"""
from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Callable, Iterable

import torch

from ..core.paths import kill_point, staging
from ..core.precision import autocast, check_precision, frozen_linears_cast_once


class CachedRunVersionWarning(UserWarning):
    """A cached run was trained under other torch / transformers versions than the ones running now."""


def trained_with() -> dict[str, str]:
    """The versions a run records beside its weights: a rerun under others may not reproduce its numbers."""
    import transformers
    return {"torch": torch.__version__, "transformers": transformers.__version__}


def report_version_drift(record: dict, where: str | Path) -> list[str]:
    """Warn (``CachedRunVersionWarning``) when a cached run's recorded versions differ from the running ones;
    returns the differences, "name recorded -> running". A version the run did not record is not compared."""
    import warnings
    running = trained_with()
    drift = [f"{name} {record[name]} -> {version}" for name, version in running.items()
             if record.get(name) not in (None, version)]
    if drift:
        warnings.warn(f"the cached run {where} was trained under other versions ({', '.join(drift)}); its numbers "
                      f"may differ from a fresh run: delete it to retrain", CachedRunVersionWarning, stacklevel=2)
    return drift


class StopTraining(Exception):
    """Raised by a callback to end training after the current step."""


class Diverged(FloatingPointError):
    """The loss became NaN or infinite."""


@dataclasses.dataclass
class FitResult:
    history: list[dict]            # one row per step: step, loss, lr, grad_norm, seconds
    probes: list[dict]             # what Every(...) callbacks returned, with their step
    seconds: float
    stopped_early: bool = False


class Every:
    """Call ``fn(step, model)`` every ``n`` finished steps and after the last one; keep what it returns."""

    def __init__(self, n: int, fn: Callable, name: str = "probe", at_start: bool = False):
        if n < 1:
            raise ValueError(f"Every: n must be >= 1, got {n}")
        self.n, self.fn, self.name, self.at_start = n, fn, name, at_start
        self.rows: list[dict] = []

    def start(self, model) -> None:
        if self.at_start:
            self._call(0, model)

    def __call__(self, step: int, model, record: dict, last: bool) -> None:
        if step % self.n == 0 or last:
            self._call(step, model)

    def _call(self, step, model):
        was_training = model.training
        model.eval()
        try:
            out = self.fn(step, model)
        finally:
            model.train(was_training)
        if out is not None:
            self.rows.append({"step": step, "name": self.name, **(out if isinstance(out, dict) else {"value": out})})


class Checkpoint:
    """Save ``model.state_dict()`` as ``<directory>/step-<n>.pt`` every ``n`` steps (not at the last one:
    the caller saves the final model with whatever else it keeps)."""

    def __init__(self, n: int, directory: str | Path, extra: dict | None = None):
        self.n, self.directory, self.extra = n, Path(directory), dict(extra or {})

    def start(self, model) -> None:
        pass

    def __call__(self, step: int, model, record: dict, last: bool) -> None:
        if step % self.n == 0 and not last:
            self.directory.mkdir(parents=True, exist_ok=True)
            path = self.directory / f"step-{step}.pt"
            torch.save({**self.extra, "step": step, "model": _unwrap(model).state_dict()}, staging(path))
            staging(path).replace(path)


def _unwrap(model):
    return getattr(model, "module", model)


def causal_lm_loss(model, batch) -> torch.Tensor:
    """Next-token cross-entropy of a batch of token ids (B, T), or of a dict the model accepts with labels."""
    if isinstance(batch, torch.Tensor):
        return model(input_ids=batch, labels=batch).loss
    return model(**batch).loss


def fit(model, optimizer, batch_at: Callable[[int], object], steps: int, lr_at: Callable[[int], float],
        loss_fn: Callable = causal_lm_loss, clip: float | None = 1.0, callbacks: Iterable = (),
        accelerator=None, progress: bool = True, desc: str = "training", precision: str = "float32") -> FitResult:
    """Train ``model`` in place for ``steps`` steps; see the module docstring. Returns the history.

    ``batch_at(step)`` gives the batch of step ``step`` (0-based) on any device; it is moved to the model's.
    ``accelerator``: an ``accelerate.Accelerator``; by default one is made for the model's device. Under
    several processes ``batch_at`` should return this process's share of the global batch. ``precision``:
    "bfloat16" runs the forward pass and loss under bfloat16 autocast (``core.precision``); weights, gradients
    and the optimiser stay float32."""
    check_precision(precision)
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if accelerator is None:
        from accelerate import Accelerator
        device = next(model.parameters()).device
        accelerator = Accelerator(cpu=device.type == "cpu")
    model, optimizer = accelerator.prepare(model, optimizer)
    callbacks = list(callbacks)
    # Clip over the model's parameters in the model's order: the norm is a sum, and its rounding depends on order.
    params = [p for p in model.parameters() if p.requires_grad]
    history: list[dict] = []
    stopped = False
    model.train()
    for cb in callbacks:
        cb.start(_unwrap(model))
    from tqdm.auto import tqdm
    bar = tqdm(range(steps), desc=desc, disable=not progress or not accelerator.is_local_main_process,
               mininterval=2.0)
    start = time.perf_counter()
    with frozen_linears_cast_once(_unwrap(model), precision):
        for step in bar:
            batch = _to(batch_at(step), accelerator.device)
            lr = lr_at(step)
            for group in optimizer.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)
            with autocast(precision, str(accelerator.device)):
                loss = loss_fn(model, batch).float()
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(loss)
            grad_norm = float(accelerator.clip_grad_norm_(params, clip)) if clip else float("nan")
            optimizer.step()
            kill_point("train")
            # Under several processes each holds its share's loss, scaled so that the mean over processes is the
            # global batch's loss: record that mean.
            value = float(accelerator.reduce(loss.detach(), "mean") if accelerator.num_processes > 1 else loss.detach())
            if not math.isfinite(value):
                raise Diverged(f"training diverged at step {step} (loss {value}); lower the learning rate (now {lr:g})")
            record = {"step": step, "loss": value, "lr": lr, "grad_norm": grad_norm,
                      "seconds": time.perf_counter() - start}
            history.append(record)
            last = step + 1 == steps
            try:
                for cb in callbacks:
                    cb(step + 1, _unwrap(model), record, last)
            except StopTraining:
                stopped = True
            if hasattr(bar, "set_postfix") and step % 10 == 0:
                bar.set_postfix(loss=f"{value:.3f}")
            if stopped:
                break
    model.eval()
    probes = [row for cb in callbacks for row in getattr(cb, "rows", [])]
    return FitResult(history, sorted(probes, key=lambda r: r["step"]), time.perf_counter() - start, stopped)


def _to(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    return batch


def adaptation_optimizer(params, lr: float, precision: str = "float32"):
    """AdamW without weight decay. bfloat16 runs take torch's fused AdamW kernel: on one CPU thread its step over
    the ~100M trained parameters takes a quarter of the time of the default one (0.11 s against 0.45 s for 88M),
    which would otherwise be a third of a step. float32 runs keep the default kernel their cached runs were
    trained with (the two round differently)."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, **({"fused": True} if precision != "float32" else {}))


def warmup_cosine(lr: float, steps: int, warmup_steps: int, min_lr_ratio: float = 0.1) -> Callable[[int], float]:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr_ratio * lr`` at the last step."""
    if not 0 <= warmup_steps <= steps:
        raise ValueError(f"warmup_steps must lie in [0, steps={steps}], got {warmup_steps}")

    def at(step: int) -> float:
        if step < warmup_steps:
            return lr * (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, steps - warmup_steps)
        return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
    return at


def decay_groups(model, weight_decay: float):
    """Weight decay on trainable matrices (2-D) only; norms' gains, biases and V-scale's theta are left undecayed."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
