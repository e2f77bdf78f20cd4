"""A small, deterministic trainer for LlamaForCausalLM models built from a named size.

Recipe of the gradient-sinks paper (App. B, restated in shared/notes/methods.md): AdamW with betas
(0.9, 0.95), weight decay 0.1 on 2-D weights only, gradient clipping at 1.0, cosine schedule after a linear
warm-up; initialisation std 0.02. Runs are cached under ``${SINKBOOK_CACHE:-~/.cache/sinkbook}/runs/<key>/``,
where the key hashes the whole configuration (seed included), so a rebuild reuses a finished run.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from pathlib import Path

import torch

from .corpus import Corpus, cache_root, sample_batch, validation_batches
from .vscale import apply_vscale

# name: (layers, d_model, heads, d_ff). d_head = d_model / heads.
SIZES = {
    "nano": (2, 64, 4, 192),
    "xs": (4, 128, 4, 384),
    "s": (6, 192, 6, 512),
    "m": (8, 256, 8, 768),
    "l": (12, 384, 6, 1024),
    "0.1b": (16, 512, 8, 1376),   # the paper's 0.1B shape (16 x 512 x 8), our vocabulary
}
RUN_FORMAT = 1  # bump when the meaning of a cached run changes


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    size: str = "xs"
    steps: int = 1000
    batch_size: int = 16
    context: int = 128
    lr: float = 3e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0
    bos: bool = True
    vscale: bool = False
    vocab_size: int = 4096
    eval_every: int = 100
    eval_batches: int = 8

    def __post_init__(self):
        if self.size not in SIZES:
            raise ValueError(f"unknown model size {self.size!r}; choose one of {sorted(SIZES)}")
        for name in ("steps", "batch_size", "context", "eval_every", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_steps < 0 or self.warmup_steps > self.steps:
            raise ValueError(f"warmup_steps must lie in [0, steps={self.steps}], got {self.warmup_steps}")

    def key(self) -> str:
        blob = json.dumps({"format": RUN_FORMAT, **dataclasses.asdict(self)}, sort_keys=True)
        return f"{self.size}-{'vscale' if self.vscale else 'base'}-s{self.seed}-" + hashlib.sha256(blob.encode()).hexdigest()[:12]

    def with_(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but torch sees no CUDA device; use device='cpu' or 'auto'")
    return torch.device(device)


def llama_config(cfg: TrainConfig, bos_id: int):
    from transformers import LlamaConfig
    layers, d_model, heads, d_ff = SIZES[cfg.size]
    return LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=d_model, intermediate_size=d_ff,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                       max_position_embeddings=max(cfg.context, 128), initializer_range=0.02,
                       rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=bos_id, eos_token_id=None,
                       pad_token_id=None, attention_dropout=0.0, rope_theta=10000.0)


def build_model(cfg: TrainConfig, bos_id: int, attn_implementation: str = "sdpa"):
    """A freshly initialised LlamaForCausalLM (with V-scale when ``cfg.vscale``), seeded by ``cfg.seed``."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(llama_config(cfg, bos_id))
    model.set_attn_implementation(attn_implementation)
    if cfg.vscale:
        apply_vscale(model)
    return model


def param_groups(model, weight_decay: float):
    """Weight decay on matrices (2-D) only; norms' gains and V-scale's theta are 1-D and left undecayed."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr_ratio * lr`` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@torch.no_grad()
def validation_loss(model, corpus: Corpus, cfg: TrainConfig, device=None) -> float:
    device = device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    batches = validation_batches(corpus.val_ids, cfg.batch_size, cfg.context, corpus.bos_id if cfg.bos else None,
                                 cfg.eval_batches)
    # The loss on the token after BOS is kept: BOS is part of the input, not a target.
    losses = [model(input_ids=b.to(device), labels=b.to(device)).loss.item() for b in batches]
    model.train(was_training)
    return float(sum(losses) / len(losses))


def make_optimizer(model, cfg: TrainConfig):
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def train_step(model, optimizer, batch: torch.Tensor, lr: float, clip: float) -> tuple[float, float]:
    """One optimisation step; returns (loss, gradient norm before clipping)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = model(input_ids=batch, labels=batch).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    return float(loss.detach()), float(grad_norm)


@dataclasses.dataclass
class TrainedRun:
    config: TrainConfig
    model: object
    history: list[dict]        # one row per step: step, loss, lr, grad_norm, seconds
    evals: list[dict]          # step, val_loss
    train_seconds: float       # wall time of the training loop when it ran (not of a cache load)
    from_cache: bool
    path: Path | None


def run_dir(cfg: TrainConfig, root: str | Path | None = None) -> Path:
    return Path(root).expanduser() if root else cache_root() / "runs" / cfg.key()


def load_run(cfg: TrainConfig, corpus: Corpus, device="auto", root=None) -> TrainedRun | None:
    path = run_dir(cfg, root) / "final.pt"
    if not path.exists():
        return None
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state["config"] != dataclasses.asdict(cfg):
        raise RuntimeError(f"cached run {path} holds a different configuration; delete that folder and rerun")
    model = build_model(cfg, corpus.bos_id)
    model.load_state_dict(state["model"])
    model.to(resolve_device(device)).eval()
    return TrainedRun(cfg, model, state["history"], state["evals"], state["train_seconds"], True, path)


def load_checkpoints(cfg: TrainConfig, corpus: Corpus, device="auto", root=None) -> list[tuple[int, object]]:
    """[(step, model)] for the intermediate checkpoints of a finished run (see ``train(checkpoint_every=...)``)
    followed by the final model, in step order; [] when the run is not cached."""
    final = load_run(cfg, corpus, device, root)
    if final is None:
        return []
    found = []
    for path in run_dir(cfg, root).glob("step-*.pt"):
        state = torch.load(path, map_location="cpu", weights_only=False)
        if state["config"] != dataclasses.asdict(cfg):
            raise RuntimeError(f"checkpoint {path} holds a different configuration; delete that folder and rerun")
        model = build_model(cfg, corpus.bos_id)
        model.load_state_dict(state["model"])
        found.append((state["step"], model.to(resolve_device(device)).eval()))
    return sorted(found, key=lambda pair: pair[0]) + [(cfg.steps, final.model)]


def train(cfg: TrainConfig, corpus: Corpus, device: str = "auto", use_cache: bool = True, save: bool = True,
          progress: bool = True, root: str | Path | None = None, checkpoint_every: int | None = None) -> TrainedRun:
    """Train from scratch (or load the cached run with the same configuration when ``use_cache``).

    ``checkpoint_every``: also save the model weights every that many steps as ``step-<n>.pt`` in the run
    folder (for probes across training), besides the final checkpoint ``final.pt``."""
    if corpus.vocab_size != cfg.vocab_size:
        raise ValueError(f"corpus tokenizer has {corpus.vocab_size} tokens but the config says {cfg.vocab_size}")
    if use_cache:
        cached = load_run(cfg, corpus, device, root)
        if cached is not None:
            return cached
    dev = resolve_device(device)
    model = build_model(cfg, corpus.bos_id).to(dev)
    model.train()
    optimizer = make_optimizer(model, cfg)
    batches = torch.Generator().manual_seed(cfg.seed + 1)   # data order: same for baseline and V-scale
    bos = corpus.bos_id if cfg.bos else None
    history, evals = [], []
    try:
        from tqdm.auto import tqdm
        bar = tqdm(range(cfg.steps), desc=f"{cfg.size} {'V-scale' if cfg.vscale else 'baseline'}",
                   disable=not progress, mininterval=2.0)
    except ImportError:  # tqdm is a declared dependency; this only keeps a bare environment working
        bar = range(cfg.steps)
    start = time.perf_counter()
    for step in bar:
        batch = sample_batch(corpus.train_ids, cfg.batch_size, cfg.context, bos, batches).to(dev)
        lr = lr_at(step, cfg)
        loss, grad_norm = train_step(model, optimizer, batch, lr, cfg.clip)
        if not math.isfinite(loss):
            raise FloatingPointError(f"training diverged at step {step} (loss {loss}); lower lr (now {cfg.lr})")
        history.append({"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                        "seconds": time.perf_counter() - start})
        if save and checkpoint_every and (step + 1) % checkpoint_every == 0 and step + 1 < cfg.steps:
            out = run_dir(cfg, root)
            out.mkdir(parents=True, exist_ok=True)
            torch.save({"config": dataclasses.asdict(cfg), "step": step + 1, "model": model.state_dict()},
                       out / f"step-{step + 1}.pt")
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            evals.append({"step": step + 1, "val_loss": validation_loss(model, corpus, cfg, dev)})
            if hasattr(bar, "set_postfix"):
                bar.set_postfix(loss=f"{loss:.3f}", val=f"{evals[-1]['val_loss']:.3f}")
    train_seconds = time.perf_counter() - start
    model.eval()
    path = None
    if save:
        out = run_dir(cfg, root)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "final.pt"
        tmp = out / "final.pt.tmp"
        torch.save({"config": dataclasses.asdict(cfg), "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(), "history": history, "evals": evals,
                    "train_seconds": train_seconds, "torch": torch.__version__}, tmp)
        tmp.replace(path)
    return TrainedRun(cfg, model, history, evals, train_seconds, False, path)
