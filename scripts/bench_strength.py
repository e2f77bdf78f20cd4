"""Cost of Sink Strength against a plain SDPA forward pass over the same prompts, in one run.

For each model: the forward is ``model(**batch, use_cache=False)`` on the calibration prompts (one padded
batch, the model's own SDPA kernel, LM head included); the strength run is ``sink_strength`` with the
default window (G computed inside the attention calls of the last K layers, forward stopped after them).
Time: the two are interleaved ``--repeats`` times in one process and the median ratio is reported.
Peak memory: each mode runs in a fresh child process; on CPU the peak is the process's peak RSS during
the run above its RSS just before (the kernel's high-water mark is reset through /proc/self/clear_refs),
on a GPU torch.cuda.max_memory_allocated above the memory allocated before.

Targets (ours: S should stay a cheap screen, as the VL paper sells it): time ratio <= 1.5, peak-memory
ratio <= 1.25.

    .venv/bin/python scripts/bench_strength.py [--models smollm2-135m-instruct gemma3-270m] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _setup(spec: str, n: int, device: str):
    from sinkbook.core.models import encode, load_model
    from sinkbook.core.prompts import prompt_texts
    loaded = load_model(spec, device=device)
    prompts = prompt_texts(n)
    batch = encode(loaded.tokenizer, prompts, device=loaded.device)
    return loaded, prompts, batch


def _runner(loaded, prompts, batch, mode: str, window: int):
    import torch

    from sinkbook.measures.strength import sink_strength
    if mode == "forward":
        def run():
            with torch.no_grad():
                loaded.model(**batch, use_cache=False)
    elif mode == "decoder":                           # the same forward without the LM head (for reference)
        def run():
            with torch.no_grad():
                loaded.model.model(**batch, use_cache=False)
    else:
        def run():
            sink_strength(loaded, prompts, window=window, batch_size=len(prompts))
    return run


def _sync(device):
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure_memory(spec: str, mode: str, n: int, window: int, device: str) -> dict:
    """Child process: peak memory of one run of ``mode`` above the memory in use just before it."""
    import gc

    import torch
    loaded, prompts, batch = _setup(spec, n, device)
    run = _runner(loaded, prompts, batch, mode, window)
    gc.collect()
    if loaded.device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        return {"peak_bytes": torch.cuda.max_memory_allocated() - before, "kind": "cuda allocated"}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                                  # reset VmHWM to the current RSS
    before = _rss_kib("VmRSS")
    run()
    return {"peak_bytes": (_rss_kib("VmHWM") - before) * 1024, "kind": "process RSS"}


def measure_time(spec: str, n: int, window: int, repeats: int, device: str) -> dict:
    loaded, prompts, batch = _setup(spec, n, device)
    runs = {mode: _runner(loaded, prompts, batch, mode, window) for mode in ("forward", "decoder", "strength")}
    for run in runs.values():                         # warm-up (first-call allocations, kernel selection)
        run()
    times = {mode: [] for mode in runs}
    for _ in range(repeats):
        for mode, run in runs.items():
            _sync(loaded.device)
            start = time.perf_counter()
            run()
            _sync(loaded.device)
            times[mode].append(time.perf_counter() - start)
    ratios = [s / f for s, f in zip(times["strength"], times["forward"])]
    vs_decoder = [s / d for s, d in zip(times["strength"], times["decoder"])]
    return {"forward_s": statistics.median(times["forward"]), "strength_s": statistics.median(times["strength"]),
            "decoder_s": statistics.median(times["decoder"]), "time_ratio_vs_decoder": statistics.median(vs_decoder),
            "time_ratio": statistics.median(ratios), "tokens": int(batch["attention_mask"].sum()),
            "device": loaded.device}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma3-270m"])
    parser.add_argument("--n", type=int, default=15, help="calibration prompts (default 15)")
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", help="also write the table to this JSON file")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure_memory(args.child[0], args.child[1], args.n, args.window, args.device)))
        return 0
    rows = []
    for spec in args.models:
        row = {"model": spec, **measure_time(spec, args.n, args.window, args.repeats, args.device)}
        for mode in ("forward", "strength"):
            out = subprocess.run([sys.executable, __file__, "--child", spec, mode, "--n", str(args.n),
                                  "--window", str(args.window), "--device", args.device],
                                 capture_output=True, text=True, check=True)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            row[f"{mode}_peak_mib"] = result["peak_bytes"] / 2**20
            row["memory"] = result["kind"]
        row["memory_ratio"] = row["strength_peak_mib"] / max(row["forward_peak_mib"], 1e-9)
        row["time_ok"] = row["time_ratio"] <= 1.5
        row["memory_ok"] = row["memory_ratio"] <= 1.25
        rows.append(row)
    header = (f"{'model':<24}{'device':<8}{'tokens':>7}{'forward s':>11}{'S s':>9}{'time x':>8}"
              f"{'fwd MiB':>10}{'S MiB':>9}{'mem x':>8}  targets (<=1.5x, <=1.25x)")
    print(header)
    for r in rows:
        print(f"{r['model']:<24}{r['device']:<8}{r['tokens']:>7}{r['forward_s']:>11.3f}{r['strength_s']:>9.3f}"
              f"{r['time_ratio']:>8.2f}{r['forward_peak_mib']:>10.1f}{r['strength_peak_mib']:>9.1f}"
              f"{r['memory_ratio']:>8.2f}  time {'ok' if r['time_ok'] else 'MISSED'}, "
              f"memory {'ok' if r['memory_ok'] else 'MISSED'}")
    print("without the LM head (decoder layers only) the same forward takes: " + ", ".join(
        f"{r['model']} {r['decoder_s']:.3f} s (S costs {r['time_ratio_vs_decoder']:.2f}x that)" for r in rows))
    print(f"memory measured as {rows[0]['memory']} peak above the level before the run; "
          f"time = median of {args.repeats} interleaved runs after one warm-up")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["time_ok"] and r["memory_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
