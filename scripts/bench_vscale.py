"""Cost of a V-scale training step relative to a baseline step, measured in the same run.

Both models have the same size, data and optimiser and train through the book's one loop
(``sinkbook.training.loop.fit``). They take turns in short rounds (baseline, V-scale, V-scale, baseline, ...),
so that load from other processes hits both alike; step times are the differences of the loop's own per-step
clock, the first step of each round is left out as warm-up, and the ratio of median step times is reported.
Target (ours): <= 1.10.

    .venv/bin/python scripts/bench_vscale.py [--size xs] [--steps 30] [--rounds 6] [--device auto]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np
import torch

from sinkbook.core.models import resolve_device
from sinkbook.training.corpus import load_corpus, sample_batch
from sinkbook.training.loop import fit
from sinkbook.training.scratch import TrainConfig, build_model, lr_at, make_optimizer


def step_seconds(history: list[dict]) -> list[float]:
    """Per-step durations from ``fit``'s cumulative clock, without the round's first (warm-up) step."""
    clock = [row["seconds"] for row in history]
    return [float(x) for x in np.diff(clock)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="xs")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per model, over all rounds")
    ap.add_argument("--rounds", type=int, default=6, help="turns each model takes")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--target", type=float, default=1.10)
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    corpus = load_corpus()
    per_round = max(1, -(-args.steps // args.rounds)) + 1          # +1: the warm-up step of each round
    cfg = TrainConfig(size=args.size, steps=per_round * args.rounds, warmup_steps=1, batch_size=args.batch_size,
                      context=args.context)
    models = {name: build_model(cfg.with_(vscale=name == "vscale"), corpus.bos_id).to(device)
              for name in ("baseline", "vscale")}
    optimizers = {name: make_optimizer(m, cfg) for name, m in models.items()}
    gen = torch.Generator().manual_seed(0)
    batches = [sample_batch(corpus.train_ids, cfg.batch_size, cfg.context, corpus.bos_id, gen)
               for _ in range(cfg.steps)]
    times = {name: [] for name in models}
    for r in range(args.rounds):
        offset = r * per_round
        for name in (("baseline", "vscale") if r % 2 == 0 else ("vscale", "baseline")):
            result = fit(models[name], optimizers[name], lambda step: batches[offset + step], per_round,
                         lambda step: lr_at(offset + step, cfg), clip=cfg.clip, progress=False)
            times[name] += step_seconds(result.history)
    med = {name: statistics.median(t) for name, t in times.items()}
    ratio = med["vscale"] / med["baseline"]
    report = {"size": args.size, "device": str(device), "threads": torch.get_num_threads(),
              "timed_steps": len(times["baseline"]), "baseline_step_s": med["baseline"], "vscale_step_s": med["vscale"],
              "ratio": ratio, "target": args.target, "within_target": ratio <= args.target}
    print(json.dumps(report, indent=1))
    return 0 if ratio <= args.target else 1


if __name__ == "__main__":
    sys.exit(main())
