"""Vision-language adaptation of a pretrained language model on the digit tasks, in the paper's two stages.

Recipe (the shape of the VL paper's App. F.3 recipe, scaled to a CPU):
- stage 0 (ours) fits the projector alone, without the language model, so that the mean of an image's projected
  patches lands on the input embedding of its digit's word. Real encoders (CLIP, SigLIP) arrive aligned with text
  from their own pretraining; our small digit encoder does not, and a CPU-sized stage 1 is too short to learn the
  alignment through the language model. The language model is untouched, and the stage costs seconds;
- stage 1 trains the projector only (vision runs): the language model and the encoder are frozen, so the
  model learns to read the image without its text side moving;
- stage 2 trains the projector and the language model together; the vision encoder stays frozen (a pretrained
  tower) and so does the input embedding matrix, which both models tie to their output head. Freezing it is
  our deviation from the paper's full fine-tune: on a CPU the 49k x 576 (SmolLM2) and 262k x 640 (Gemma 3)
  embedding updates dominate the cost, and the sink mechanism the chapter tests lives in the attention
  projections, which are trained;
- loss on the answer tokens only; AdamW without weight decay, gradient clipping at 1.0, linear warm-up then a
  constant learning rate in stage 1 and a cosine decay in stage 2; fixed seeds.

The **text-only counterpart** (``modality="text"``) runs stage 2 with the same steps, batch size, learning rate
and answers, on the same examples with the image replaced by the digit words (``digits.Example.text_stand_in``).
Its stage 1 would train a projector that nothing reads, so it is skipped.

An **intervention** (``AdaptConfig.intervention``, placed in the recipe by ``training.remedies``) changes one thing
of a vision run: the language model's QK-norm before training, what stage 2 trains, a projection of its steps, or a
share of text-only steps; everything else is the plain recipe, so a plain run is its matched control.

Runs are cached by configuration under ``$SINKBOOK_CACHE/adapt/<key>/`` (the adapted model as a directory that
``load_model`` and ``load_vlm`` read, and ``run.json`` with the history and the probes). Training goes through
``training.loop.fit`` under accelerate: started with ``torchrun --nproc_per_node N``, each process trains on its
share of every global batch and the result matches one process with the same global batch.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Callable

import torch

from ..core.models import load_model, resolve_device
from ..core.paths import cache_key, cache_root, check_room, entry_lock, kill_point, staging, weight_bytes
from ..core.precision import check_precision
from .digits import TASKS, load_digit_splits, make_examples
from .loop import Every, adaptation_optimizer, fit, report_version_drift, trained_with, warmup_cosine
from .remedies import INTERVENTIONS, RecipeChange
from .vlm import DigitVLM, PromptFormat, build_vlm, encode_examples, load_vlm, save_vlm, train_encoder

RUN_FORMAT = 2                     # 2: each run's digit encoder is trained with the run's seed
MODALITIES = ("vision", "text")
INTERVENTION_FIELDS = ("intervention", "text_share", "lora_rank")
ENCODER_EPOCHS, ENCODER_WIDTH = 30, 64
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AdaptConfig:
    model: str                       # a model spec load_model accepts
    modality: str = "vision"         # "vision", or "text" for the matched text-only counterpart
    steps: int = 60                  # stage 2 steps
    lr: float = 1e-4                 # stage 2 peak learning rate
    stage1_steps: int = 30           # projector-only steps (vision runs)
    stage1_lr: float = 1e-3
    align_steps: int = 300           # stage 0: projector fitted to the digit words' embeddings (0 skips it)
    batch_size: int = 8
    warmup_ratio: float = 0.1
    clip: float = 1.0
    seed: int = 0
    tasks: tuple = TASKS
    probe_every: int = 20            # stage 2 steps between probes (and one before the first step)
    intervention: str = "none"       # a change of the recipe (training.remedies.INTERVENTIONS); "none": plain
    text_share: float = 0.25         # text_blend: share of stage-2 steps on text-only batches
    lora_rank: int = 16              # lora: adapter rank (alpha = 2 x rank)
    precision: str = "float32"       # or "bfloat16": stages 1-2 under bfloat16 autocast (core.precision)
    recovery_steps: int = 0          # fix_qk_norm: text-only recovery steps before stage 0 (training.recovery)

    def __post_init__(self):
        if self.modality not in MODALITIES:
            raise ValueError(f"modality must be one of {', '.join(MODALITIES)}, got {self.modality!r}")
        for name in ("steps", "batch_size", "probe_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("stage1_steps", "align_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.intervention not in INTERVENTIONS:
            raise ValueError(f"intervention must be one of {', '.join(INTERVENTIONS)}, got {self.intervention!r}")
        if self.intervention != "none" and self.modality != "vision":
            raise ValueError(f"intervention {self.intervention!r} changes vision-language training; "
                             "use modality 'vision'")
        if not 0 < self.text_share < 1:
            raise ValueError(f"text_share must be in (0, 1), got {self.text_share}")
        if self.lora_rank < 1:
            raise ValueError(f"lora_rank must be >= 1, got {self.lora_rank}")
        if not (self.lr > 0 and self.stage1_lr > 0):
            raise ValueError(f"learning rates must be > 0, got lr={self.lr}, stage1_lr={self.stage1_lr}")
        check_precision(self.precision)
        if self.recovery_steps < 0:
            raise ValueError(f"recovery_steps must be >= 0, got {self.recovery_steps}")
        if self.recovery_steps and self.intervention != "fix_qk_norm":
            raise ValueError("recovery_steps applies to intervention 'fix_qk_norm' only: the phase distils the "
                             "changed model back toward the unchanged one, which for any other model is the identity "
                             f"or not the paper's recipe (got intervention {self.intervention!r})")
        object.__setattr__(self, "tasks", tuple(self.tasks))

    def record(self) -> dict:
        out = dataclasses.asdict(self)
        out["tasks"] = list(self.tasks)
        if self.intervention == "none":      # plain runs keep the keys they had before interventions existed
            for name in INTERVENTION_FIELDS:
                out.pop(name)
        if self.precision == "float32":      # float32 runs keep the keys they had before the setting existed
            out.pop("precision")
        if not self.recovery_steps:          # and runs without a recovery phase the keys they had before it
            out.pop("recovery_steps")
        return out

    def key(self, tag: str = "") -> str:
        name = Path(self.model).name if ("/" in self.model or self.model.endswith(".gguf")) else self.model
        recovery = {}
        if self.recovery_steps:              # the phase's own settings and format key the run it starts
            from .recovery import Recovery
            recovery = {"recovery": Recovery(self.recovery_steps).record()}
        return f"{name}-{self.modality}-s{self.seed}-" + cache_key({"format": RUN_FORMAT, "tag": tag, **self.record(),
                                                                   **recovery})


@dataclasses.dataclass
class AdaptedRun:
    config: AdaptConfig
    vlm: DigitVLM
    loaded: object                   # LoadedModel of the adapted language model
    fmt: PromptFormat
    history: list                    # per step: stage, step, loss, lr, grad_norm, seconds
    probes: list                     # what the probe returned at each probed stage-2 step (step 0 = before)
    seconds: float
    from_cache: bool
    directory: Path | None
    intervention: dict = dataclasses.field(default_factory=dict)   # what the recipe change recorded


def run_dir(cfg: AdaptConfig, tag: str = "") -> Path:
    return cache_root() / "adapt" / cfg.key(tag)


def encoder_path(seed: int) -> Path:
    return cache_root() / "vision" / f"digit-encoder-w{ENCODER_WIDTH}-e{ENCODER_EPOCHS}-s{seed}.pt"


def vision_encoder(device: str = "cpu", seed: int = 0):
    """The frozen digit encoder of runs with this seed (trained once per seed, cached). A run's encoder follows
    its seed because retraining it is a source of variance as large as the language model's seed: one thread
    instead of two moved SmolLM2's arithmetic loss by 7.5 pt."""
    path = encoder_path(seed)
    from .vlm import DigitEncoder
    encoder = DigitEncoder(ENCODER_WIDTH)
    if not path.exists():
        # Pool workers that start together train it once: the others wait here, then read it.
        with entry_lock(path, "the digit encoder"):
            if not path.exists():
                log.info("training the digit encoder for seed %d once (%d epochs, about 40 s on a CPU); later runs "
                         "read %s", seed, ENCODER_EPOCHS, path)
                train, _ = load_digit_splits()
                trained = train_encoder(train.images, train.labels, seed, ENCODER_EPOCHS, ENCODER_WIDTH)
                torch.save(trained.state_dict(), staging(path))
                staging(path).replace(path)
    encoder.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return encoder.eval().requires_grad_(False).to(device)


def _batch_maker(cfg: AdaptConfig, tokenizer, fmt: PromptFormat, modality: str, stage: int, accelerator):
    """batch_at(step): this process's share of the global batch of ``stage``'s ``step`` (the same examples on
    every machine and for every process count), with the global count of answer tokens."""
    train, _ = load_digit_splits()
    rank, world = accelerator.process_index, accelerator.num_processes
    if cfg.batch_size % world:
        raise ValueError(f"batch_size {cfg.batch_size} must be divisible by the number of processes ({world})")

    def batch_at(step: int) -> dict:
        examples = make_examples(train, cfg.batch_size, seed=cfg.seed * 1_000_003 + stage * 100_003 + step,
                                 tasks=cfg.tasks)
        whole = encode_examples(examples, tokenizer, fmt, modality)
        mine = encode_examples(examples[rank::world], tokenizer, fmt, modality)
        mine["label_count"] = int((whole["labels"][:, 1:] != -100).sum())
        return mine
    return batch_at


def align_projector(vlm: DigitVLM, tokenizer, steps: int, seed: int, lr: float = 3e-3, batch_size: int = 64) -> list:
    """Stage 0: fit the projector so that the mean of an image's projected patches is the input embedding of its
    digit's word (e.g. "seven"); the language model is only read. Returns the loss per step (relative MSE)."""
    from .digits import WORDS
    train, _ = load_digit_splits()
    table = vlm.llm.get_input_embeddings()
    with torch.no_grad():
        words = torch.stack([table(torch.tensor(tokenizer(w, add_special_tokens=False)["input_ids"][:1],
                                                device=table.weight.device))[0] for w in WORDS]).float()
        patches = vlm.encoder.patches(train.images.to(words.device))
    scale = words.pow(2).sum(-1).mean()
    optimizer = torch.optim.Adam(vlm.projector.parameters(), lr=lr)
    order = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, len(train), (batch_size,), generator=order)
        predicted = vlm.projector(patches[idx]).mean(1)
        loss = (predicted - words[train.labels[idx]]).pow(2).sum(-1).mean() / scale
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def _vlm_loss(model, batch):
    return model(**batch)


def trainable_parameters(vlm: DigitVLM, stage: int) -> list:
    """Stage 1: the projector. Stage 2: the projector and the language model except its (tied) embeddings."""
    vlm.requires_grad_(False)
    vlm.projector.requires_grad_(True)
    if stage == 2:
        vlm.llm.requires_grad_(True)
        vlm.llm.get_input_embeddings().requires_grad_(False)
        vlm.llm.get_output_embeddings().requires_grad_(False)
    return [p for p in vlm.parameters() if p.requires_grad]


def adapt(cfg: AdaptConfig, probe: Callable | None = None, probe_tag: str = "", device: str = "auto",
          use_cache: bool = True, progress: bool = True, accelerator=None, out: str | Path | None = None) -> AdaptedRun:
    """Run (or load from the cache) one adaptation; ``probe(step, vlm, loaded, fmt, modality) -> dict`` is called
    every ``cfg.probe_every`` stage-2 steps and once before the first (its tag is part of the cache key)."""
    directory = Path(out) if out else run_dir(cfg, probe_tag)
    if use_cache and (directory / "run.json").exists():
        return load_run(directory, device)
    from accelerate import Accelerator
    device = resolve_device(device)
    accelerator = accelerator or Accelerator(cpu=device == "cpu")
    torch.manual_seed(cfg.seed)
    loaded = load_model(cfg.model, device=str(accelerator.device))
    fmt = PromptFormat.for_tokenizer(loaded.tokenizer)
    vlm = build_vlm(loaded, vision_encoder(str(accelerator.device), cfg.seed), seed=cfg.seed)
    check_room(directory, weight_bytes(vlm))
    change = RecipeChange(cfg, vlm, loaded)
    change.prepare()
    if cfg.recovery_steps:
        from .recovery import Recovery, recovered_start
        change.record["recovery"] = recovered_start(cfg.model, loaded, cfg.seed, Recovery(cfg.recovery_steps),
                                                    cfg.precision, progress=progress)
    history, probes, start = [], [], time.perf_counter()
    warm = lambda steps: max(1, round(cfg.warmup_ratio * steps))
    if cfg.modality == "vision" and cfg.align_steps:
        aligned = align_projector(vlm, loaded.tokenizer, cfg.align_steps, cfg.seed)
        history.append({"stage": 0, "step": cfg.align_steps - 1, "loss": aligned[-1], "lr": 3e-3,
                        "grad_norm": None, "seconds": time.perf_counter() - start})
    if cfg.modality == "vision" and cfg.stage1_steps:
        params = trainable_parameters(vlm, 1)
        optimizer = adaptation_optimizer(params, cfg.stage1_lr, cfg.precision)
        constant = lambda step: cfg.stage1_lr * min(1.0, (step + 1) / warm(cfg.stage1_steps))
        result = fit(vlm, optimizer, _batch_maker(cfg, loaded.tokenizer, fmt, "vision", 1, accelerator),
                     cfg.stage1_steps, constant, loss_fn=_vlm_loss, clip=cfg.clip, accelerator=accelerator,
                     progress=progress, desc=f"{cfg.model} stage 1 (projector)", precision=cfg.precision)
        history += [{"stage": 1, **row} for row in result.history]
    params = change.stage2_parameters(trainable_parameters(vlm, 2))
    optimizer = adaptation_optimizer(params, cfg.lr, cfg.precision)
    change.attach(optimizer)
    callbacks = []
    if probe is not None:
        callbacks.append(Every(cfg.probe_every, lambda step, model: probe(step, vlm, loaded, fmt, cfg.modality), "probe",
                               at_start=True))
    vision_batch = _batch_maker(cfg, loaded.tokenizer, fmt, cfg.modality, 2, accelerator)
    text_batch = _batch_maker(cfg, loaded.tokenizer, fmt, "text", 2, accelerator)
    batch_at = lambda step: text_batch(step) if change.text_step(step) else vision_batch(step)
    result = fit(vlm, optimizer, batch_at, cfg.steps,
                 warmup_cosine(cfg.lr, cfg.steps, warm(cfg.steps), min_lr_ratio=0.0), loss_fn=_vlm_loss,
                 clip=cfg.clip, callbacks=callbacks, accelerator=accelerator, progress=progress,
                 desc=f"{cfg.model} stage 2 ({cfg.modality})", precision=cfg.precision)
    history += [{"stage": 2, **row} for row in result.history]
    intervention = change.finish()
    probes = [{k: v for k, v in row.items() if k != "name"} for row in result.probes]
    seconds = time.perf_counter() - start
    vlm = accelerator.unwrap_model(vlm).eval().requires_grad_(False)
    record = {"config": cfg.record(), "probe_tag": probe_tag, "history": history, "probes": probes,
              "intervention": intervention,
              "seconds": seconds, **trained_with(), "processes": accelerator.num_processes}
    if accelerator.is_main_process:
        save_vlm(vlm, loaded.tokenizer, directory / "model", fmt, {"config": cfg.record(), "intervention": intervention})
        kill_point("save")
        (directory / "run.json.tmp").write_text(json.dumps(record, indent=1, default=float))
        (directory / "run.json.tmp").replace(directory / "run.json")
    accelerator.wait_for_everyone()
    return AdaptedRun(cfg, vlm, loaded, fmt, history, probes, seconds, False, directory, intervention)


def load_run(directory: str | Path, device: str = "auto") -> AdaptedRun:
    directory = Path(directory)
    record = json.loads((directory / "run.json").read_text())
    report_version_drift(record, directory)
    cfg = AdaptConfig(**record["config"])
    vlm, loaded, fmt = load_vlm(directory / "model", device=device)
    return AdaptedRun(cfg, vlm, loaded, fmt, record["history"], record["probes"], record["seconds"], True, directory,
                      record.get("intervention", {}))
