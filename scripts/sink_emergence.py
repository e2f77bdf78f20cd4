"""Does a longer run (or another shape) grow an attention sink? Train one baseline with the chapter's recipe and
probe it every N steps: Sink^eps(0) and the token-0 / early-token norm ratio per layer, the largest alpha_0 of any
head, median R_GS and the validation loss. One JSON row per probe, printed and written to --out.

Not part of the book build (these runs take 20-60 minutes on two CPU cores); the gradient-sinks chapter's
default profile stays under ten minutes a model. Examples (numbers in the issue tracker came from these):

    .venv/bin/python scripts/sink_emergence.py --size xs --steps 8000 --threads 1 --out xs-8000.json
    .venv/bin/python scripts/sink_emergence.py --size xs --shape 4,128,8,384 --steps 4000   # 8 heads of 16
    .venv/bin/python scripts/sink_emergence.py --size xs --steps 3000 --lr 1e-2
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from sinkbook import trainer
from sinkbook.training.corpus import load_corpus, sample_batch, validation_batches
from sinkbook.measures.gradprobes import probe_batch, shows_sink_and_massive_activation


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="xs", help=f"one of {sorted(trainer.SIZES)}")
    ap.add_argument("--shape", help="override the size's shape: layers,d_model,heads,d_ff")
    ap.add_argument("--steps", type=int, default=8000)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--every", type=int, default=500, help="probe every this many steps")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--out", default="sink_emergence.json")
    a = ap.parse_args()
    if a.size not in trainer.SIZES:
        ap.error(f"unknown size {a.size!r}; choose one of {sorted(trainer.SIZES)}")
    if a.shape:
        try:
            shape = tuple(int(x) for x in a.shape.split(","))
            assert len(shape) == 4 and shape[1] % shape[2] == 0
        except (ValueError, AssertionError):
            ap.error("--shape takes four integers layers,d_model,heads,d_ff with d_model divisible by heads")
        trainer.SIZES[a.size] = shape
    if a.threads:
        torch.set_num_threads(a.threads)

    corpus = load_corpus()
    cfg = trainer.TrainConfig(size=a.size, steps=a.steps, warmup_steps=a.steps // 10, batch_size=a.batch,
                              context=a.context, lr=a.lr, eval_every=a.every)
    model = trainer.build_model(cfg, corpus.bos_id)
    model.train()
    optimizer = trainer.make_optimizer(model, cfg)
    order = torch.Generator().manual_seed(cfg.seed + 1)     # the same data order as trainer.train
    probe_ids = validation_batches(corpus.val_ids, 16, 128, corpus.bos_id, 1)[0]
    rows, start = [], time.perf_counter()
    for step in range(cfg.steps):
        batch = sample_batch(corpus.train_ids, cfg.batch_size, cfg.context, corpus.bos_id, order)
        loss, _ = trainer.train_step(model, optimizer, batch, trainer.lr_at(step, cfg), cfg.clip)
        if (step + 1) % a.every == 0 or step + 1 == cfg.steps:
            model.eval()
            probe = probe_batch(model, probe_ids)
            check = shows_sink_and_massive_activation(probe)
            row = {"step": step + 1, "seconds": round(time.perf_counter() - start, 1), "train_loss": loss,
                   "val_loss": trainer.validation_loss(model, corpus, cfg),
                   "sink_rate_by_layer": [round(float(x), 3) for x in probe.sink_rate],
                   "token0_ratio_by_layer": [round(float(x), 2) for x in probe.early_ratio()],
                   "largest_alpha0": round(float(probe.alpha0.max()), 3),
                   "median_r_gs": round(float(np.median(probe.r_gs())), 2), **check}
            model.train()
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(a.out, "w") as f:
                json.dump({"config": vars(a), "shape": trainer.SIZES[a.size], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
