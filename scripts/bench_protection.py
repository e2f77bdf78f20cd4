"""What head-selective protection costs per training step: stage-2 steps of the adaptation recipe with the
protection attached (its optimizer pre/post-step hooks project the sink heads' W_q / W_k updates) against the
same steps without it, in one run, alternating blocks so that a slow spell of a shared machine hits both.

    .venv/bin/python scripts/bench_protection.py [--model smollm2-135m-instruct] [--blocks 3] [--steps 10]

Three variants per block: plain (every stage-2 parameter trains), frozen only (the protection's frozen layers,
no projection) and protected (frozen layers and the projection). ``ratio`` (protected / plain) is what the
recipe pays per step; ``projection_ratio`` (protected / frozen only) is the projection's own cost. Target of
ours for both: at most 1.10.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from sinkbook.core.models import load_model
from sinkbook.interventions.protection import calibrate_protection
from sinkbook.runs.adaptation import RECIPE
from sinkbook.training.adapt import AdaptConfig, _batch_maker, trainable_parameters, vision_encoder
from sinkbook.training.loop import fit
from sinkbook.training.remedies import calibration_batch
from sinkbook.training.vlm import PromptFormat, build_vlm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="training steps per block")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from accelerate import Accelerator
    settings = RECIPE.resolve("default")
    loaded = load_model(a.model, device="cpu")
    fmt = PromptFormat.for_tokenizer(loaded.tokenizer)
    vlm = build_vlm(loaded, vision_encoder("cpu"))
    cfg = AdaptConfig(a.model, batch_size=settings.batch_size, tasks=tuple(settings.tasks))
    accelerator = Accelerator(cpu=True)
    batch_at = _batch_maker(cfg, loaded.tokenizer, fmt, "vision", 2, accelerator)
    params = trainable_parameters(vlm, 2)
    optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0)
    protection = calibrate_protection(vlm.llm, calibration_batch(loaded))
    frozen_only = dataclasses.replace(protection, heads={}, directions={}, _handles=[], _flags=[])
    print(json.dumps({"protection": protection.reason}), flush=True)
    step = 0

    def train(n, variant=None):
        nonlocal step
        if variant is not None:
            variant.attach(vlm.llm, optimizer)
        try:
            first, start = step, time.perf_counter()
            fit(vlm, optimizer, lambda i: batch_at(first + i), n, lambda i: 1e-5,
                loss_fn=lambda model, batch: model(**batch), clip=1.0, accelerator=accelerator, progress=False)
            step += n
            return time.perf_counter() - start
        finally:
            if variant is not None:
                variant.detach()

    for variant in (None, frozen_only, protection):     # warm-up: first calls allocate
        train(2, variant)
    rows = []
    for block in range(a.blocks):
        plain, frozen, protected = (train(a.steps, v) for v in (None, frozen_only, protection))
        rows.append({"block": block, "plain_s": plain, "frozen_s": frozen, "protected_s": protected,
                     "ratio": protected / plain, "projection_ratio": protected / frozen})
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"model": a.model, "steps": a.steps, "median_ratio": statistics.median(r["ratio"] for r in rows),
                      "median_projection_ratio": statistics.median(r["projection_ratio"] for r in rows),
                      "step_s": statistics.median(r["plain_s"] for r in rows) / a.steps}))


if __name__ == "__main__":
    main()
