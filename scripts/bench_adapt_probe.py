"""What probing costs during adaptation: stage-2 training with the chapter's probes against the same training
without them, measured in one run (alternating blocks, so a slow spell of a shared machine hits both).

    .venv/bin/python scripts/bench_adapt_probe.py [--model smollm2-135m-instruct] [--blocks 3] [--every 20]

Each block trains ``every`` steps and, in the probed variant, runs one probe (the probe of
``sinkbook.training.probes.AdaptationProbe`` with the sizes of the vision-language chapter's default profile,
read from ``runs.adaptation.RECIPE``, so the benchmark follows the chapters when their profile changes). The ratio
(probed time) / (plain time) is the cost of probing per training step, amortised the way the chapter pays it.
Target of ours: at most 1.10.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from sinkbook.core.models import load_model
from sinkbook.runs.adaptation import RECIPE, probe_spec
from sinkbook.training.adapt import AdaptConfig, _batch_maker, trainable_parameters, vision_encoder
from sinkbook.training.loop import fit
from sinkbook.training.probes import AdaptationProbe
from sinkbook.training.vlm import PromptFormat, build_vlm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--every", type=int, default=None, help="training steps per probe (default: the chapter's probe_every)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    a.every = a.every or RECIPE.resolve("default").probe_every
    torch.set_num_threads(a.threads)
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True)
    loaded = load_model(a.model, device="cpu")
    reference = load_model(a.model, device="cpu")
    fmt = PromptFormat.for_tokenizer(loaded.tokenizer)
    vlm = build_vlm(loaded, vision_encoder("cpu"))
    settings = RECIPE.resolve("default")
    spec = probe_spec(settings)
    probe = AdaptationProbe(reference, window=spec["window"], arithmetic=spec["arithmetic"], vision=spec["vision"],
                            heldout_windows=spec["heldout_windows"], heldout_length=spec["heldout_length"],
                            prompts=spec["prompts"],
                            tasks=tuple(settings.tasks))
    cfg = AdaptConfig(a.model, batch_size=settings.batch_size, tasks=tuple(settings.tasks))
    batch_at = _batch_maker(cfg, loaded.tokenizer, fmt, "vision", 2, accelerator)
    params = trainable_parameters(vlm, 2)
    optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0)
    step = 0

    def train(n):
        nonlocal step
        first = step
        fit(vlm, optimizer, lambda i: batch_at(first + i), n, lambda i: 1e-5, loss_fn=lambda model, batch: model(**batch),
            clip=1.0, accelerator=accelerator, progress=False)
        step += n

    train(2)                                             # warm-up: first calls allocate
    rows = []
    for block in range(a.blocks):
        start = time.perf_counter()
        train(a.every)
        plain = time.perf_counter() - start
        start = time.perf_counter()
        train(a.every)
        vlm.eval()
        probe(step, vlm, loaded, fmt, "vision")
        probed = time.perf_counter() - start
        rows.append({"block": block, "plain_s": plain, "probed_s": probed, "ratio": probed / plain})
        print(json.dumps(rows[-1]), flush=True)
    ratio = statistics.median(r["ratio"] for r in rows)
    print(json.dumps({"model": a.model, "every": a.every, "probe": spec, "median_ratio": ratio,
                      "step_s": statistics.median(r["plain_s"] for r in rows) / a.every,
                      "probe_s": statistics.median(r["probed_s"] - r["plain_s"] for r in rows)}))


if __name__ == "__main__":
    main()
