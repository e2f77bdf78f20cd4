"""Cost of a V-scale training step relative to a baseline step, measured in the same run.

Both models have the same size, data and optimiser; their steps are interleaved (baseline, V-scale,
baseline, ...) so that load from other processes hits both alike, and the ratio of median step times is
reported. Target from the issue: <= 1.10.

    .venv/bin/python scripts/bench_vscale.py [--size xs] [--steps 30] [--device auto]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from sinkbook.training.corpus import load_corpus, sample_batch
from sinkbook.training.scratch import TrainConfig, build_model, lr_at, make_optimizer, resolve_device, train_step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="xs")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per model (after 3 warm-up steps)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--target", type=float, default=1.10)
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    corpus = load_corpus()
    cfg = TrainConfig(size=args.size, steps=args.steps + 3, warmup_steps=1, batch_size=args.batch_size,
                      context=args.context)
    models = {name: build_model(cfg.with_(vscale=name == "vscale"), corpus.bos_id).to(device).train()
              for name in ("baseline", "vscale")}
    opts = {name: make_optimizer(m, cfg) for name, m in models.items()}
    gen = torch.Generator().manual_seed(0)
    times = {name: [] for name in models}
    for step in range(cfg.steps):
        batch = sample_batch(corpus.train_ids, cfg.batch_size, cfg.context, corpus.bos_id, gen).to(device)
        for name in (("baseline", "vscale") if step % 2 == 0 else ("vscale", "baseline")):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            train_step(models[name], opts[name], batch, lr_at(step, cfg), cfg.clip)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step >= 3:
                times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(t) for name, t in times.items()}
    ratio = med["vscale"] / med["baseline"]
    report = {"size": args.size, "device": str(device), "threads": torch.get_num_threads(), "steps": args.steps,
              "baseline_step_s": med["baseline"], "vscale_step_s": med["vscale"], "ratio": ratio,
              "target": args.target, "within_target": ratio <= args.target}
    print(json.dumps(report, indent=1))
    return 0 if ratio <= args.target else 1


if __name__ == "__main__":
    sys.exit(main())
