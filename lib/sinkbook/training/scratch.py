"""LlamaForCausalLM models trained from scratch on the Shakespeare corpus, with or without V-scale.

Recipe of the gradient-sinks paper (App. B; see the book's methods page): AdamW with betas (0.9, 0.95), weight
decay 0.1 on 2-D weights only, gradient clipping at 1.0, cosine schedule after a linear warm-up; initialisation
std 0.02. Training runs through ``training.loop.fit``. Runs are cached under
``${SINKBOOK_CACHE:-~/.cache/sinkbook}/runs/<key>/``, where the key hashes the whole configuration (seed
included), so a rebuild reuses a finished run.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..core.models import resolve_device
from ..core.paths import cache_key, cache_root, staging
from ..interventions.vscale import apply_vscale
from .corpus import Corpus, sample_batch, validation_batches
from .loop import Checkpoint, Every, decay_groups, fit, report_version_drift, trained_with, warmup_cosine

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
    shape: tuple | None = None      # (layers, d_model, heads, d_ff) instead of the named size's shape
    data: str = "shakespeare"       # or a synthetic corpus, "bb-<vocab>-<triggers>" (training.synthetic)

    def __post_init__(self):
        if self.size not in SIZES:
            raise ValueError(f"unknown model size {self.size!r}; choose one of {sorted(SIZES)}")
        if self.shape is not None:
            shape = tuple(int(x) for x in self.shape)
            if len(shape) != 4 or min(shape) < 1 or shape[1] % shape[2]:
                raise ValueError(f"shape must be (layers, d_model, heads, d_ff) with d_model divisible by heads, "
                                 f"got {self.shape!r}")
            object.__setattr__(self, "shape", shape)
        for name in ("steps", "batch_size", "context", "eval_every", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_steps < 0 or self.warmup_steps > self.steps:
            raise ValueError(f"warmup_steps must lie in [0, steps={self.steps}], got {self.warmup_steps}")

    @property
    def dims(self) -> tuple[int, int, int, int]:
        return self.shape or SIZES[self.size]

    def record(self) -> dict:
        """The configuration as stored in a run and hashed into its key."""
        fields = dataclasses.asdict(self)
        if fields["shape"] is None:        # runs cached before ``shape`` existed keep their key
            del fields["shape"]
        else:
            fields["shape"] = list(fields["shape"])
        if fields["data"] == "shakespeare":  # and before ``data`` existed
            del fields["data"]
        return fields

    def key(self) -> str:
        return f"{self.size}-{'vscale' if self.vscale else 'base'}-s{self.seed}-" + cache_key(
            {"format": RUN_FORMAT, **self.record()})

    def with_(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)


def llama_config(cfg: TrainConfig, bos_id: int):
    from transformers import LlamaConfig
    layers, d_model, heads, d_ff = cfg.dims
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


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr_ratio * lr`` at the last step."""
    return warmup_cosine(cfg.lr, cfg.steps, cfg.warmup_steps, cfg.min_lr_ratio)(step)


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
    return torch.optim.AdamW(decay_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


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
    if state["config"] != cfg.record():
        raise RuntimeError(f"cached run {path} holds a different configuration; delete that folder and rerun")
    report_version_drift(state, path)
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
        if state["config"] != cfg.record():
            raise RuntimeError(f"checkpoint {path} holds a different configuration; delete that folder and rerun")
        model = build_model(cfg, corpus.bos_id)
        model.load_state_dict(state["model"])
        found.append((state["step"], model.to(resolve_device(device)).eval()))
    return sorted(found, key=lambda pair: pair[0]) + [(cfg.steps, final.model)]


def train(cfg: TrainConfig, corpus: Corpus, device: str = "auto", use_cache: bool = True, save: bool = True,
          progress: bool = True, root: str | Path | None = None, checkpoint_every: int | None = None,
          callbacks: list | None = None) -> TrainedRun:
    """Train from scratch (or load the cached run with the same configuration when ``use_cache``).

    ``checkpoint_every``: also save the model weights every that many steps as ``step-<n>.pt`` in the run
    folder (for probes across training), besides the final checkpoint ``final.pt``. ``callbacks`` are
    passed on to ``fit`` (e.g. ``Every(n, probe)``); a cached run does not call them."""
    if corpus.vocab_size != cfg.vocab_size:
        raise ValueError(f"corpus tokenizer has {corpus.vocab_size} tokens but the config says {cfg.vocab_size}")
    if use_cache:
        cached = load_run(cfg, corpus, device, root)
        if cached is not None:
            return cached
    dev = resolve_device(device)
    model = build_model(cfg, corpus.bos_id).to(dev)
    optimizer = make_optimizer(model, cfg)
    order = torch.Generator().manual_seed(cfg.seed + 1)   # data order: same for baseline and V-scale
    bos = corpus.bos_id if cfg.bos else None
    evaluate = Every(cfg.eval_every, lambda step, m: {"val_loss": validation_loss(m, corpus, cfg, dev)}, "eval")
    extra = list(callbacks or [])
    if save and checkpoint_every:
        extra.append(Checkpoint(checkpoint_every, run_dir(cfg, root), {"config": cfg.record()}))
    result = fit(model, optimizer, lambda step: sample_batch(corpus.train_ids, cfg.batch_size, cfg.context, bos, order),
                 cfg.steps, lambda step: lr_at(step, cfg), clip=cfg.clip, callbacks=[*extra, evaluate],
                 progress=progress, desc=f"{cfg.size} {'V-scale' if cfg.vscale else 'baseline'}")
    evals = [{"step": r["step"], "val_loss": r["val_loss"]} for r in evaluate.rows]
    path = None
    if save:
        out = run_dir(cfg, root)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "final.pt"
        tmp = staging(path)
        torch.save({"config": cfg.record(), "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(), "history": result.history, "evals": evals,
                    "train_seconds": result.seconds, **trained_with()}, tmp)
        tmp.replace(path)
    return TrainedRun(cfg, model, result.history, evals, result.seconds, False, path)
