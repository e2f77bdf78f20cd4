"""float32 against bfloat16 autocast (``core.precision``) on the real models, in one run: what each costs for an
adaptation step, a probe, an evaluation pass and a decoding step, and whether bfloat16 gives the same numbers.

    .venv/bin/python scripts/bench_dtype.py [--models smollm2-135m-instruct gemma3-270m] [--blocks 3] [--threads 1]

Times are this process's CPU seconds (one thread by default), the two precisions alternating block by block so
that a busy spell of a shared machine hits both; ``ratio`` is bfloat16 / float32 (our target for training steps:
at most 0.5). Agreement is measured first, on the untrained models: S and the mean gap on the 15 calibration
prompts, greedy answers to generated arithmetic items, picks on the knowledge items, and the held-out loss.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from sinkbook.core.models import REAL_MODELS, load_model
from sinkbook.core.precision import autocast, fast_bfloat16
from sinkbook.core.prompts import prompt_texts
from sinkbook.measures.strength import sink_strength
from sinkbook.measures.textsuite import (arithmetic_items, heldout_loss, knowledge_items, run_arithmetic,
                                         run_knowledge)
from sinkbook.runs.adaptation import RECIPE
from sinkbook.training.adapt import (AdaptConfig, _batch_maker, adaptation_optimizer, trainable_parameters,
                                     vision_encoder)
from sinkbook.training.corpus import heldout_text_windows
from sinkbook.training.loop import fit
from sinkbook.training.probes import AdaptationProbe
from sinkbook.training.vlm import PromptFormat, build_vlm

PRECISIONS = ("float32", "bfloat16")


def cpu_seconds(work) -> float:
    start = time.process_time()
    work()
    return time.process_time() - start


def context(precision: str, model=None):
    """The evaluation context the book uses: autocast, frozen weights cast once per context (``core.precision``)."""
    return lambda: autocast(precision, model=model)


def agreement(loaded, n_arithmetic: int, n_knowledge: int, n_windows: int) -> dict:
    """The numbers a chapter reads, in both precisions, on the same items."""
    prompts, items = prompt_texts(15), arithmetic_items(n_arithmetic, seed=0)
    mc, windows = knowledge_items(n_knowledge, seed=0), heldout_text_windows(loaded.tokenizer, n_windows, 128)[0]
    out = {}
    for precision in PRECISIONS:
        with torch.no_grad(), autocast(precision):
            strength = sink_strength(loaded, prompts, layers="all")
        arithmetic = run_arithmetic(loaded, items, context=context(precision, loaded.model))["arithmetic_strict"]
        knowledge = run_knowledge(loaded, mc, context=context(precision, loaded.model))
        held_out = heldout_loss(loaded, windows, context=context(precision, loaded.model))
        window = min(10, strength.n_layers)                     # the book's K = 10 (fewer on a tiny model)
        out[precision] = {"S": strength.strength(window), "mean_G": strength.strength(window, reduce="mean"),
                          "responses": arithmetic.details["responses"], "arithmetic": arithmetic.score,
                          "picks": knowledge.details["picks"], "knowledge": knowledge.score,
                          "heldout_loss": held_out.loss, "per_window": held_out.per_window}
    f, b = out["float32"], out["bfloat16"]
    return {"S": [f["S"], b["S"]], "mean_G": [f["mean_G"], b["mean_G"]],
            "arithmetic_strict": [f["arithmetic"], b["arithmetic"]],
            "same_greedy_answers": float(np.mean([x == y for x, y in zip(f["responses"], b["responses"])])),
            "knowledge_acc": [f["knowledge"], b["knowledge"]],
            "same_knowledge_picks": float(np.mean([x == y for x, y in zip(f["picks"], b["picks"])])),
            "heldout_loss": [f["heldout_loss"], b["heldout_loss"]],
            "max_window_loss_difference": float(np.max(np.abs(np.subtract(f["per_window"], b["per_window"])))),
            "items": {"prompts": len(prompts), "arithmetic": len(items), "knowledge": len(mc), "windows": n_windows}}


def timings(loaded, model: str, blocks: int, steps: int) -> dict:
    """CPU seconds per adaptation step, probe, evaluation pass and decoding step, per precision."""
    from accelerate import Accelerator
    settings = RECIPE.resolve("default")
    fmt = PromptFormat.for_tokenizer(loaded.tokenizer)
    vlm = build_vlm(loaded, vision_encoder("cpu"))
    cfg = AdaptConfig(model, batch_size=settings.batch_size, tasks=tuple(settings.tasks))
    accelerator = Accelerator(cpu=True)
    batch_at = _batch_maker(cfg, loaded.tokenizer, fmt, "vision", 2, accelerator)
    params = trainable_parameters(vlm, 2)
    optimizers = {p: adaptation_optimizer(params, 1e-6, p) for p in PRECISIONS}   # each precision its own kernel
    probe = AdaptationProbe(loaded, window=min(settings.window, loaded.model.config.num_hidden_layers),
                            arithmetic=settings.probe_arithmetic, vision=0,
                            heldout_windows=settings.probe_heldout_windows, prompts=settings.probe_prompts)
    items = arithmetic_items(16, seed=1)
    tokenizer = loaded.tokenizer
    encoded = tokenizer(["Write a short story about a lighthouse keeper."] * 4, return_tensors="pt")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    step = 0

    def train(precision):
        nonlocal step
        first = step
        fit(vlm, optimizers[precision], lambda i: batch_at(first + i), steps, lambda i: 1e-6,
            loss_fn=lambda m, b: m(**b), clip=1.0, accelerator=accelerator, progress=False, precision=precision)
        step += steps

    # A language-model step on 8 x 128 tokens (the shape of the first bfloat16 measurement), where the products,
    # not the casts of the weights and the optimiser, take most of the time (the recipe's steps: 4 x ~50 tokens).
    lm_batch = torch.randint(0, loaded.model.config.vocab_size, (8, 128), generator=torch.Generator().manual_seed(0))
    lm_params = [p for p in loaded.model.parameters() if p.requires_grad]
    lm_optimizers = {p: adaptation_optimizer(lm_params, 1e-9, p) for p in PRECISIONS}

    def lm_step(precision):
        fit(loaded.model, lm_optimizers[precision], lambda i: lm_batch, 1, lambda i: 1e-9, clip=1.0,
            accelerator=accelerator, progress=False, precision=precision)

    def decode(precision, new_tokens):
        with torch.no_grad(), autocast(precision, model=loaded.model):
            loaded.model.generate(**encoded, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                  pad_token_id=pad)

    work = {
        "adaptation_step": lambda p: train(p),
        "lm_step_8x128": lm_step,
        "probe": lambda p: _probe(probe, vlm, loaded, fmt, p),
        "evaluation_pass": lambda p: run_arithmetic(loaded, items, context=context(p, loaded.model)),
        "decoding_32_tokens": lambda p: decode(p, 32),
        "prefill_1_token": lambda p: decode(p, 1),
    }
    for name, run in work.items():                     # warm-up: first calls allocate and pick kernels
        for precision in PRECISIONS:
            run(precision)
    rows = {name: {p: [] for p in PRECISIONS} for name in work}
    for block in range(blocks):
        for name, run in work.items():
            for precision in (PRECISIONS if block % 2 == 0 else PRECISIONS[::-1]):
                rows[name][precision].append(cpu_seconds(lambda: run(precision)))
        print(json.dumps({"model": model, "block": block, **{n: {p: round(v[p][-1], 3) for p in PRECISIONS}
                                                               for n, v in rows.items()}}), flush=True)
    out = {}
    for name, per in rows.items():
        f, b = statistics.median(per["float32"]), statistics.median(per["bfloat16"])
        if name == "adaptation_step":
            f, b = f / steps, b / steps
        out[name] = {"float32_s": round(f, 4), "bfloat16_s": round(b, 4), "ratio": round(b / f, 3)}
    decode_f = (out["decoding_32_tokens"]["float32_s"] - out["prefill_1_token"]["float32_s"]) / 31
    decode_b = (out["decoding_32_tokens"]["bfloat16_s"] - out["prefill_1_token"]["bfloat16_s"]) / 31
    out["decoding_step"] = {"float32_s": round(decode_f, 5), "bfloat16_s": round(decode_b, 5),
                            "ratio": round(decode_b / decode_f, 3)}
    return out


def _probe(probe, vlm, loaded, fmt, precision):
    probe.precision = precision              # as a run of that precision builds it (training.probes)
    probe(0, vlm, loaded, fmt, "vision")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(REAL_MODELS))
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="adaptation steps per block")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--arithmetic", type=int, default=60)
    ap.add_argument("--knowledge", type=int, default=60)
    ap.add_argument("--windows", type=int, default=8)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(json.dumps({"fast_bfloat16": fast_bfloat16("cpu"), "threads": a.threads, "torch": torch.__version__}),
          flush=True)
    for model in a.models:
        loaded = load_model(model, device="cpu")
        agreed = agreement(loaded, a.arithmetic, a.knowledge, a.windows)
        print(json.dumps({"model": model, "agreement": agreed}), flush=True)
        print(json.dumps({"model": model, "cpu_seconds": timings(loaded, model, a.blocks, a.steps)}), flush=True)


if __name__ == "__main__":
    main()
