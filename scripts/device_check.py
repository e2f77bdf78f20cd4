"""The project's device check: what a GPU changes, measured on the two shipped models, in a few minutes.

    bash scripts/device_check.sh              # on a machine with one NVIDIA GPU, from a fresh clone (set-up included)
    .venv/bin/python scripts/device_check.py --device cpu --steps 2 --out /tmp/check.json    # the code path, here

1. Captures and S of both models on the device, in float32 and in bfloat16 (what ``device="auto"`` loads on CUDA),
   against the CPU float32 values: S on the 15 calibration prompts, the largest difference of the attention
   pattern at every layer.
2. One adaptation run of SmolLM2 at the ``gpu-local`` budget (its steps, batch, bfloat16 autocast), timed per step.
3. The decoding overhead of OutRo against plain SDPA (the benchmark of ``scripts/bench_outro.py``).

Writes one JSON file (default ``measurements/gpu/<date>.json``); commit it.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from sinkbook.core.hooks import capture
from sinkbook.core.models import REAL_MODELS, SMOLLM2, load_model
from sinkbook.core.prompts import prompt_texts
from sinkbook.measures.decoding import benchmark_decoding, overhead_ratios
from sinkbook.measures.strength import sink_strength
from sinkbook.runs.adaptation import adapt_configs, recipe
from sinkbook.runs.outro_text import benchmark_settings
from sinkbook.training.adapt import adapt

PATTERN_TEXT = "The lighthouse keeper climbed the stairs, counting each step as the storm rose over the sea."


def patterns(loaded) -> list[torch.Tensor]:
    ids = loaded.tokenizer([PATTERN_TEXT], return_tensors="pt")["input_ids"].to(loaded.device)
    with torch.no_grad(), capture(loaded.model, points=("pattern",)) as cap:
        loaded.model(ids)
    return [cap["pattern", layer].float().cpu() for layer in cap.layers]


def against_cpu(model: str, device: str) -> dict:
    prompts = prompt_texts(15)
    reference = load_model(model, device="cpu")
    s_cpu, p_cpu = sink_strength(reference, prompts).strength(), patterns(reference)
    del reference
    out = {"S_cpu_float32": s_cpu}
    for dtype in ("float32", "bfloat16"):
        start = time.perf_counter()
        loaded = load_model(model, device=device, dtype=dtype)
        s = sink_strength(loaded, prompts)
        diff = max(float((a - b).abs().max()) for a, b in zip(patterns(loaded), p_cpu))
        out[dtype] = {"S": s.strength(), "S_difference": s.strength() - s_cpu, "max_pattern_difference": diff,
                      "seconds": round(time.perf_counter() - start, 2)}
        del loaded
    return out


def adaptation_run(device: str, steps: int | None) -> dict:
    settings = recipe("gpu-local", device=device, models=[SMOLLM2], seeds=[0], workers=1)
    cfg = next(c for c in adapt_configs(settings) if c.modality == "vision")
    if steps:
        cfg = dataclasses.replace(cfg, steps=steps, stage1_steps=min(cfg.stage1_steps, steps))
    with tempfile.TemporaryDirectory() as out:
        run = adapt(cfg, device=device, use_cache=False, progress=True, out=Path(out) / "run")
    stage2 = [h for h in run.history if h["stage"] == 2]
    per_step = (stage2[-1]["seconds"] - stage2[0]["seconds"]) / max(1, len(stage2) - 1)
    return {"config": cfg.record(), "seconds": round(run.seconds, 1), "stage2_s_per_step": per_step,
            "final_loss": stage2[-1]["loss"]}


def outro_overhead(device: str) -> dict:
    loaded = load_model(SMOLLM2, device=device)
    rows = benchmark_decoding(loaded, benchmark_settings(loaded.model, 1.0), prompt_tokens=256, new_tokens=32,
                              repeats=3)
    return overhead_ratios(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=0, help="stage-2 steps of the adaptation run (0: gpu-local's)")
    ap.add_argument("--out", default=f"measurements/gpu/{datetime.date.today()}.json")
    a = ap.parse_args()
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA GPU is visible; run the check on a GPU machine (or --device cpu to try it)")
    started = time.perf_counter()
    doc = {"date": str(datetime.date.today()), "device": a.device, "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name(0) if a.device.startswith("cuda") else platform.processor()}
    for part, work in (("captures_and_S", lambda: {m: against_cpu(m, a.device) for m in REAL_MODELS}),
                       ("adaptation", lambda: adaptation_run(a.device, a.steps)),
                       ("outro_decoding", lambda: outro_overhead(a.device))):
        start = time.perf_counter()
        doc[part] = work()
        doc[f"{part}_seconds"] = round(time.perf_counter() - start, 1)
        print(json.dumps({part: doc[part]}, default=float), flush=True)
    doc["total_seconds"] = round(time.perf_counter() - started, 1)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1, default=float) + "\n")
    print(f"wrote {a.out} ({doc['total_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
