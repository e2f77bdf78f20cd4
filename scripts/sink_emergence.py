"""Does a longer run (or another shape) grow an attention sink? Train one baseline with the gradient-sinks chapter's
recipe and probe it every N steps: Sink^eps(0) and the token-0 / early-token norm ratio per layer, the largest
alpha_0 of any head, median R_GS and the validation loss. One JSON row per probe, printed and written to --out.

Not part of the book build (these runs take 20-60 minutes on two CPU cores); the chapter's default profile stays
under ten minutes a model. Training runs through the book's one training loop (``training.scratch.train``), with
the probe as an ``Every`` callback. The file has the schema of ``measurements/sink_emergence/*.json``: command,
status, machine, batch, context, rows. Examples (the recorded runs came from these):

    .venv/bin/python scripts/sink_emergence.py --size xs --steps 8000 --threads 1 --out xs-8000.json
    .venv/bin/python scripts/sink_emergence.py --size xs --shape 4,128,8,384 --steps 4000   # 8 heads of 16
    .venv/bin/python scripts/sink_emergence.py --size xs --steps 3000 --lr 1e-2
    .venv/bin/python scripts/sink_emergence.py --size nano --data bb-64-3 --steps 2000 --every 250  # synthetic
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

import numpy as np
import torch

from sinkbook.measures.gradprobes import probe_batch, sink_check
from sinkbook.training.corpus import validation_batches
from sinkbook.training.loop import Every
from sinkbook.training.scratch import SIZES, TrainConfig, train, validation_loss
from sinkbook.training.synthetic import corpus_for

PROBE_BATCH, PROBE_CONTEXT = 16, 128     # the probe batch is fixed, whatever the training batch (its windows no
# longer than the training context: positions the model never saw would say nothing about the sink it learned)


class LastStep:
    """A ``fit`` callback that remembers the latest step's record (its training loss), for the probe rows."""

    def __init__(self):
        self.record: dict = {}

    def start(self, model) -> None:
        pass

    def __call__(self, step, model, record, last) -> None:
        self.record = record


def probe_row(step: int, model, probe_ids, corpus, cfg: TrainConfig, last: LastStep) -> dict:
    probe = probe_batch(model, probe_ids)
    return {"step": step, "seconds": round(last.record["seconds"], 1), "train_loss": last.record["loss"],
            "val_loss": validation_loss(model, corpus, cfg),
            "sink_rate_by_layer": [round(float(x), 3) for x in probe.sink_rate],
            "token0_ratio_by_layer": [round(float(x), 2) for x in probe.early_ratio()],
            "largest_alpha0": round(float(probe.alpha0.max()), 3),
            "median_r_gs": round(float(np.median(probe.r_gs())), 2), **sink_check(probe)}


def record(command: str, status: str, cfg: TrainConfig, rows: list[dict]) -> dict:
    """One file of measurements/sink_emergence/: the fields the chapter's ``load_emergence_runs`` reads."""
    machine = f"{os.cpu_count()} CPU cores, {torch.get_num_threads()} torch threads"
    return {"command": command, "status": status, "machine": machine, "data": cfg.data, "batch": cfg.batch_size,
            "context": cfg.context, "shape": list(cfg.dims), "rows": rows}


def write(path: Path, doc: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)


def parse_shape(text: str, ap: argparse.ArgumentParser) -> tuple | None:
    if not text:
        return None
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1 or shape[1] % shape[2]:
        ap.error("--shape takes four integers layers,d_model,heads,d_ff with d_model divisible by heads")
    return shape


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="xs", choices=sorted(SIZES))
    ap.add_argument("--shape", help="override the size's shape: layers,d_model,heads,d_ff")
    ap.add_argument("--steps", type=int, default=8000)
    ap.add_argument("--lr", type=float, default=TrainConfig.lr)
    ap.add_argument("--batch", type=int, default=TrainConfig.batch_size)
    ap.add_argument("--context", type=int, default=TrainConfig.context)
    ap.add_argument("--every", type=int, default=500, help="probe every this many steps")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="sink_emergence.json")
    ap.add_argument("--data", default="shakespeare",
                    help="shakespeare, or the synthetic Bigram-Backcopy corpus bb-<vocab>-<triggers> (e.g. bb-64-3)")
    ap.add_argument("--weight-decay", type=float, default=TrainConfig.weight_decay)
    args = ap.parse_args(argv)
    shape = parse_shape(args.shape, ap)
    if args.threads:
        torch.set_num_threads(args.threads)
    given = sys.argv[1:] if argv is None else argv
    command = " ".join([".venv/bin/python", "scripts/sink_emergence.py", *map(shlex.quote, given)])

    try:
        corpus = corpus_for(args.data)
    except ValueError as e:
        ap.error(str(e))
    # eval_every only schedules the loop's own validation (which does not touch the data order); the probe
    # computes its own validation loss, so the loop validates once, at the end.
    cfg = TrainConfig(size=args.size, shape=shape, steps=args.steps, warmup_steps=args.steps // 10,
                      batch_size=args.batch, context=args.context, lr=args.lr, eval_every=args.steps,
                      data=args.data, vocab_size=corpus.vocab_size, weight_decay=args.weight_decay)
    probe_ids = validation_batches(corpus.val_ids, PROBE_BATCH, min(PROBE_CONTEXT, args.context), corpus.bos_id, 1)[0]
    out, rows, last = Path(args.out), [], LastStep()

    def probe(step, model):
        rows.append(probe_row(step, model, probe_ids, corpus, cfg, last))
        print(json.dumps(rows[-1]), flush=True)
        write(out, record(command, f"running (last probe at step {step})", cfg, rows))

    status = "complete"
    try:
        train(cfg, corpus, device=args.device, use_cache=False, save=False, callbacks=[last, Every(args.every, probe)])
    except KeyboardInterrupt:
        status = f"stopped after step {rows[-1]['step'] if rows else 0} (interrupted)"
    write(out, record(command, status, cfg, rows))


if __name__ == "__main__":
    main()
