"""The arithmetic a run computes in: ``"float32"``, or ``"bfloat16"`` autocast over float32 weights.

bfloat16 here means what the papers' GPU runs do: weights, optimiser state and the loss stay float32, and matrix
products run in bfloat16 under ``torch.autocast``. Training enters the same context around its forward pass and
loss rather than passing accelerate's ``mixed_precision``: accelerate fixes that once per process (its state is a
singleton), and one process of the book runs both precisions. A processor with AVX512-BF16 or AMX runs those products several times faster; one
without runs the same precision, only slower, so a number never depends on the reader's processor.
Comparisons with an exact reference (captured attention against eager, S against its definition, the theorem
checks) stay in float32.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

PRECISIONS = ("float32", "bfloat16")


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def fast_bfloat16(device: str = "cpu") -> bool:
    """Whether ``device`` has bfloat16 matrix units (a CUDA GPU that supports it; a CPU with AVX512-BF16 or AMX)."""
    if str(device).startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text() if cpuinfo.exists() else ""
    return "avx512_bf16" in flags or "amx_bf16" in flags


def autocast(precision: str, device: str = "cpu"):
    """The context a forward pass runs in: nothing for float32, ``torch.autocast`` to bfloat16 otherwise."""
    if check_precision(precision) == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type="cuda" if str(device).startswith("cuda") else "cpu", dtype=torch.bfloat16)

