"""Peak memory and time of sinkbook's reduced measures against eager attention, as the prompt grows.

    .venv/bin/python scripts/bench_memory.py [--models tiny-llama-16k smollm2-135m-instruct]
                                             [--lengths 256 512 1024 2048 4096 8192] [--max-gb 8] [--fit-from 1024]

One prompt of T tokens (the calibration prompts, repeated and cut to T), batch 1, one torch thread. Methods:

- ``sdpa``: a plain forward on the model's SDPA kernel (the floor: no pattern is formed);
- ``S``: ``gaps_for_batch`` over every layer (what ``sink_strength`` runs per batch): each layer's logits are
  reduced to per-query gaps inside the attention call and the pass stops after the last layer;
- ``criteria``: ``sink_census`` (every sink criterion; the pattern is reduced per layer by a reducer, the layer
  inputs (T, D) are kept; its own full forward, LM head included);
- ``eager``: transformers' eager attention with ``output_attentions=True``, which returns every layer's (H, T, T).

``sdpa`` and ``eager`` use ``logits_to_keep=1`` (no (T, vocab) logits), ``use_cache=False`` everywhere.
Each (model, method, T) runs in a fresh process, forked from one that has loaded the model and run nothing
(so imports and loading are paid once per model): one warm-up pass on 32 tokens, then the peak resident set
size is reset (``/proc/self/clear_refs``) and the measured pass runs; memory is the peak RSS (VmHWM) during
the pass minus the RSS before it. A method whose estimated memory passes ``--max-gb`` is
skipped and says so. The exponent k of memory ~ T^k and time ~ T^k is a least-squares fit on log-log over
T >= ``--fit-from``.

``tiny-llama-16k`` is the tests' tiny llama (3 layers, 4 heads of 16, hidden 64) with a 16384-position rope
window; ``smollm2-135m-instruct`` (30 layers, 9 heads, context 8192).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

METHODS = ("sdpa", "S", "criteria", "eager")
TINY = "tiny-llama-16k"


def status_mb(field: str) -> float:
    text = open("/proc/self/status").read()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) / 1024


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def load(spec: str):
    import torch

    from sinkbook.core.models import LoadedModel, byte_tokenizer, load_model, tiny_config
    if spec == TINY:
        from transformers import AutoModelForCausalLM
        config = tiny_config("llama")
        config.max_position_embeddings = 16384
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
        with torch.no_grad():       # the tests' peaked init, so attention is not uniform
            for p in model.parameters():
                if p.ndim == 2:
                    p.normal_(0.0, 0.2)
        return LoadedModel(model.eval(), byte_tokenizer(), spec, spec)
    return load_model(spec, device="cpu")


def token_ids(loaded, length: int):
    """(1, length) ids: the calibration prompts, joined and repeated, cut to ``length`` tokens."""
    import torch

    from sinkbook.core.prompts import calibration_prompts
    text = "\n\n".join(p["prompt"] for p in calibration_prompts())
    ids = loaded.tokenizer(text, add_special_tokens=True)["input_ids"]
    while len(ids) < length:
        ids = ids + loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids[:length])[None]


def worker(loaded, method: str, length: int) -> dict:
    """Runs in a forked child: warm up on 32 tokens, reset the peak RSS, run once on ``length`` tokens."""
    import torch

    from sinkbook.measures.criteria import sink_census
    from sinkbook.measures.strength import gaps_for_batch
    model = loaded.model
    if method == "eager":
        model.set_attn_implementation("eager")

    def run(n: int):
        ids = token_ids(loaded, n)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        with torch.no_grad():
            if method == "sdpa":
                return model(**batch, use_cache=False, logits_to_keep=1), n
            if method == "eager":
                return model(**batch, use_cache=False, logits_to_keep=1, output_attentions=True), n
            if method == "S":
                return gaps_for_batch(model, batch), n
            if method == "criteria":
                # the census encodes text itself: hand it the decoded tokens (without a chat template)
                text = loaded.tokenizer.decode(ids[0], skip_special_tokens=True)
                census = sink_census(loaded, [text], chat=False)
                return census, census["n_tokens"]
        raise ValueError(method)

    run(32)                                          # warm-up: kernels, lazy imports, first allocations
    import gc
    gc.collect()
    exact = reset_peak()
    before = status_mb("VmRSS")
    start, cpu = time.perf_counter(), time.process_time()
    out, tokens = run(length)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    peak = status_mb("VmHWM") if exact else status_mb("VmRSS")
    del out
    return {"model": loaded.spec, "method": method, "T": tokens, "mb": peak - before, "s": seconds, "cpu_s": cpu,
            "baseline_mb": before, "exact_peak": exact}


def in_child(loaded, method: str, length: int) -> dict:
    """``worker`` in a fresh process forked from this one (which holds the loaded model and nothing else), so
    that no run inherits another's allocations; the result comes back through a pipe."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        code = 0
        try:
            result = worker(loaded, method, length)
        except BaseException as err:
            result, code = {"error": f"{type(err).__name__}: {err}"[:200]}, 1
        with os.fdopen(write, "w") as f:
            f.write(json.dumps(result))
        os._exit(code)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    if not text:
        return {"error": f"the process ended without a result (wait status {status}; killed for memory?)"}
    return json.loads(text)


def estimate_gb(spec: str, method: str, length: int) -> float:
    """Rough float32 attention memory: eager keeps every layer's (H, T, T) plus one layer's temporaries;
    S and the criteria form one layer's (H, T, T) several times over."""
    layers, heads = (3, 4) if spec == TINY else (30, 9)
    one = heads * length * length * 4 / 1e9
    return {"sdpa": 0.0, "S": 4 * one, "criteria": 4 * one, "eager": (layers + 2) * one}[method]


def context_window(model) -> int:
    from sinkbook.core.models import context_window as window
    return window(model) or 1 << 30


def fit(rows: list[dict], key: str, fit_from: int) -> float:
    import numpy as np
    points = [(r["T"], r[key]) for r in rows if r["T"] >= fit_from and r[key] > 0]
    if len(points) < 2:
        return float("nan")
    x, y = np.log([p[0] for p in points]), np.log([p[1] for p in points])
    return float(np.polyfit(x, y, 1)[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=[TINY, "smollm2-135m-instruct"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--lengths", nargs="+", type=int, default=[256, 512, 1024, 2048, 4096, 8192])
    parser.add_argument("--max-gb", type=float, default=8.0, help="skip a run whose estimated memory passes this")
    parser.add_argument("--fit-from", type=int, default=1024, help="fit exponents over T >= this")
    args = parser.parse_args()
    import torch
    torch.set_num_threads(1)           # before any operation: no thread pool exists when the children fork
    print(f"peak RSS above the pre-pass RSS (fresh process per run), one thread; fit over T >= {args.fit_from}")
    print(f"{'model':<24}{'method':<10}{'T':>6}{'MB':>10}{'cpu s':>9}{'wall s':>9}")
    results = []
    for spec in args.models:
        loaded = load(spec)
        window = context_window(loaded.model)
        for length in args.lengths:
            for method in args.methods:
                if length > window:
                    print(f"{spec:<24}{method:<10}{length:>6}   skipped: over the context window ({window})")
                    continue
                need = estimate_gb(spec, method, length)
                if need > args.max_gb:
                    print(f"{spec:<24}{method:<10}{length:>6}   skipped: needs about {need:.0f} GB "
                          f"(--max-gb {args.max_gb:g})")
                    continue
                row = in_child(loaded, method, length)
                if "error" in row:
                    print(f"{spec:<24}{method:<10}{length:>6}   failed: {row['error']}")
                    continue
                results.append(row)
                print(f"{spec:<24}{method:<10}{row['T']:>6}{row['mb']:>10.1f}{row['cpu_s']:>9.2f}{row['s']:>9.2f}"
                      + ("" if row["exact_peak"] else "   (peak not resettable: RSS after the pass)"), flush=True)
    print(f"\nexponent k (log-log least squares, T >= {args.fit_from}): memory above baseline ~ T^k, "
          f"CPU time ~ T^k (one thread; CPU time, since the wall clock counts the other processes' share)")
    for spec in args.models:
        for method in args.methods:
            rows = [r for r in results if r["model"] == spec and r["method"] == method]
            used = sorted(r["T"] for r in rows if r["T"] >= args.fit_from)
            if rows:
                print(f"{spec:<24}{method:<10} memory k = {fit(rows, 'mb', args.fit_from):5.2f}   "
                      f"time k = {fit(rows, 'cpu_s', args.fit_from):5.2f}   over T = {used}")


if __name__ == "__main__":
    main()
