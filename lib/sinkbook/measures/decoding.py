"""Decoding cost: latency per generated token and peak memory of greedy generation under several settings
(plain kernel, an intervention, another kernel), measured in one run and reported as ratios to a reference."""
from __future__ import annotations

import statistics
import threading
import time

import torch

OUTRO_PAPER_OVERHEAD = 1.11     # OutRo paper, Table 7: 1.09 s / 0.98 s per token, OutRo over FlashAttention
OVERHEAD_TARGET = 1.10          # ours: the latency target of scripts/bench_outro.py, not a claim of the paper


class PeakMemory:
    """Peak memory above the starting level while the block runs: CUDA allocator peak on a GPU, resident set
    size sampled every millisecond on the CPU (allocations shorter than that can be missed)."""

    def __init__(self, device: str):
        self.device, self.peak_bytes = device, 0

    def __enter__(self):
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._start = torch.cuda.memory_allocated()
            return self
        import psutil
        process = psutil.Process()
        self._start = process.memory_info().rss
        self._peak, self._stop = self._start, threading.Event()

        def sample():
            while not self._stop.is_set():
                self._peak = max(self._peak, process.memory_info().rss)
                self._stop.wait(0.001)
        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            self.peak_bytes = torch.cuda.max_memory_allocated() - self._start
        else:
            self._stop.set()
            self._thread.join()
            self.peak_bytes = self._peak - self._start
        return False


def benchmark_decoding(loaded, settings: dict, prompt_tokens: int = 256, new_tokens: int = 32, repeats: int = 3,
                       batch_size: int = 1, seed: int = 0) -> list[dict]:
    """Latency per generated token and peak memory of greedy decoding under each setting (``{name: factory of a
    context manager}``, the first one the reference), all interleaved in every repeat, so a slow spell of a
    shared machine hits every setting. Per-token latency = (time for ``new_tokens`` - time for 1) /
    (new_tokens - 1): decode steps only; the prefill is reported separately. One row per (setting, repeat); a
    setting whose context yields an object with ``state.rotated_decode_rows`` (OutRo) reports that count."""
    if new_tokens < 2:
        raise ValueError("new_tokens must be at least 2 (the first token comes from the prefill)")
    model, device = loaded.model, loaded.device
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(min(100, vocab - 1), min(vocab, 20000), (batch_size, prompt_tokens), generator=generator)
    ids = ids.to(device)
    bos = getattr(loaded.tokenizer, "bos_token_id", None)
    if bos is not None:
        ids[:, 0] = bos
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    pad = getattr(loaded.tokenizer, "pad_token_id", None) or 0

    return time_settings(model, batch, settings, new_tokens, repeats, pad, device,
                         {"prompt_tokens": prompt_tokens, "batch_size": batch_size})


def time_settings(model, inputs: dict, settings: dict, new_tokens: int, repeats: int, pad: int, device: str,
                  extra: dict) -> list[dict]:
    """Greedy generation from ``inputs`` (``input_ids`` or ``inputs_embeds``, with ``attention_mask``) under each
    setting, interleaved in every repeat after one warm-up each; one row per (setting, repeat) plus ``extra``."""
    def run(n):
        start = time.perf_counter()
        model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - start

    rows = []
    with torch.no_grad():
        for make in settings.values():          # warm-up: first calls allocate and compile paths
            with make():
                run(2)
        for repeat in range(repeats):
            for name, make in settings.items():
                with make() as active:
                    prefill = run(1)
                    with PeakMemory(device) as memory:
                        total = run(new_tokens)
                rows.append({"setting": name, "repeat": repeat, "prefill_s": prefill,
                             "decode_s_per_token": (total - prefill) / (new_tokens - 1),
                             "peak_memory_mib": memory.peak_bytes / 2**20, **extra, "new_tokens": new_tokens,
                             "device": device,
                             "rotated_decode_rows": getattr(getattr(active, "state", None),
                                                            "rotated_decode_rows", 0)})
    return rows


def overhead_ratios(rows: list[dict]) -> dict:
    """Median per-token latency, prefill time and peak memory of each setting, and their ratios to the first
    setting's (the reference)."""
    out = {}
    for name in dict.fromkeys(r["setting"] for r in rows):
        mine = [r for r in rows if r["setting"] == name]
        out[name] = {"decode_s_per_token": statistics.median(r["decode_s_per_token"] for r in mine),
                     "prefill_s": statistics.median(r["prefill_s"] for r in mine),
                     "peak_memory_mib": statistics.median(r["peak_memory_mib"] for r in mine),
                     "rotated_decode_rows": min(r.get("rotated_decode_rows", 0) for r in mine)}
    base = out[next(iter(out))]
    for values in out.values():
        values["latency_ratio"] = values["decode_s_per_token"] / base["decode_s_per_token"]
        # below ~1 MiB the sampled RSS growth is noise (the allocator reuses freed blocks): no ratio
        values["memory_ratio"] = (values["peak_memory_mib"] / base["peak_memory_mib"]
                                  if base["peak_memory_mib"] >= 1.0 else float("nan"))
    return out


