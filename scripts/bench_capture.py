"""Cost of capturing every layer, as a ratio against a plain SDPA forward pass in the same run.

    .venv/bin/python scripts/bench_capture.py [--models smollm2-135m-instruct gemma3-270m] [--repeats 3] [--cold]

For each model: load time (warm from the safetensors cache; with --cold also the first GGUF
dequantisation into an empty temporary cache), then over the 15 calibration prompts (one forward per
prompt, chat template when the tokenizer has one) the median time of a plain forward and of the same
forward inside ``capture`` of all layers: attention patterns only, and every capture point.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from sinkbook.core.hooks import CAPTURE_POINTS, capture
from sinkbook.core.models import encode, load_model
from sinkbook.core.prompts import calibration_prompts


def timed_pass(model, batches, points=None) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        for batch in batches:
            if points is None:
                model(**batch)
            else:
                with capture(model, points=points):
                    model(**batch)
    return time.perf_counter() - start


def cold_load_seconds(spec: str) -> float:
    """Load into an empty cache in a fresh process, so the GGUF dequantisation is really measured."""
    with tempfile.TemporaryDirectory() as cache:
        code = f"from sinkbook.core.models import load_model; print(load_model({spec!r}).load_seconds)"
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "SINKBOOK_CACHE": cache},
                             capture_output=True, text=True, check=True)
        return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma3-270m"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="also measure a cold load (slow)")
    args = parser.parse_args()
    prompts = [p["prompt"] for p in calibration_prompts()]
    print(f"torch threads: {torch.get_num_threads()}; {len(prompts)} prompts; median of {args.repeats} repeats")
    print(f"{'model':<24}{'cold s':>8}{'warm s':>8}{'plain s':>9}{'pattern':>9}{'ratio':>7}{'all pts':>9}{'ratio':>7}")
    for spec in args.models:
        cold = cold_load_seconds(spec) if args.cold else float("nan")
        loaded = load_model(spec, device="cpu")
        batches = [encode(loaded.tokenizer, p) for p in prompts]
        timed_pass(loaded.model, batches[:2])  # warm-up
        plain, pattern, every = [], [], []
        for _ in range(args.repeats):  # interleaved, so drift in machine load hits all three alike
            plain.append(timed_pass(loaded.model, batches))
            pattern.append(timed_pass(loaded.model, batches, ("pattern",)))
            every.append(timed_pass(loaded.model, batches, tuple(CAPTURE_POINTS)))
        p, a, e = map(statistics.median, (plain, pattern, every))
        print(f"{spec:<24}{cold:>8.1f}{loaded.load_seconds:>8.2f}{p:>9.2f}{a:>9.2f}{a / p:>7.2f}{e:>9.2f}{e / p:>7.2f}")


if __name__ == "__main__":
    main()
