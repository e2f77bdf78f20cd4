"""The arithmetic a run computes in: ``"float32"``, or ``"bfloat16"`` autocast over float32 weights.

bfloat16 here means what the papers' GPU runs do: weights, optimiser state and the loss stay float32, and matrix
products run in bfloat16 under ``torch.autocast``. Training enters the same context around its forward pass and
loss rather than passing accelerate's ``mixed_precision``: accelerate fixes that once per process (its state is a
singleton), and one process of the book runs both precisions. A processor with AVX512-BF16 or AMX runs those
products several times faster; one without runs the same precision, only slower, so a number never depends on the
reader's processor. During training, frozen linear weights are cast once per run (``frozen_linears_cast_once``).
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


def autocast(precision: str, device: str = "cpu", model: torch.nn.Module | None = None):
    """The context a forward pass runs in: nothing for float32, ``torch.autocast`` to bfloat16 otherwise.

    ``model``: for evaluation (gradients off), the model whose frozen float32 weights should be cast once per
    context rather than once per forward pass (see ``_cast_once``)."""
    if check_precision(precision) == "float32":
        return contextlib.nullcontext()
    cast = torch.autocast(device_type="cuda" if str(device).startswith("cuda") else "cpu", dtype=torch.bfloat16)
    return _cast_once(cast, model) if model is not None and not torch.is_grad_enabled() else cast


@contextlib.contextmanager
def _cast_once(cast, model: torch.nn.Module):
    # Autocast keeps the bfloat16 copy of a weight for the whole context only when the weight requires grad; a
    # frozen weight (the tied embedding and output matrix of an adapted model, 168M values in Gemma 3) is cast
    # again at every decoding step, which made bfloat16 decoding slower than float32. With gradients off, marking
    # the frozen weights for the context's length changes no number and builds no graph.
    frozen = [p for p in model.parameters() if p.dtype == torch.float32 and not p.requires_grad]
    with cast:
        for p in frozen:
            p.requires_grad_(True)
        try:
            yield
        finally:
            for p in frozen:
                p.requires_grad_(False)


@contextlib.contextmanager
def frozen_linears_cast_once(model: torch.nn.Module, precision: str):
    """For a training run: every ``nn.Linear`` of ``model`` whose float32 weight is frozen uses one bfloat16 copy
    of it for the context's whole length instead of autocast's fresh cast at each forward pass.

    Autocast caches a cast only for weights that require grad, and only within one ``with`` block, which a training
    step is. A frozen weight is therefore cast again at every step: Gemma 3's tied output matrix (168M values) took
    a third of a bfloat16 adaptation step, and a run that trains only the projector or LoRA recasts the whole
    language model. The copy is the same rounding autocast makes, so no number changes; it is made again if the
    weight is changed in place, and outside bfloat16 autocast the layer runs as it always does."""
    if check_precision(precision) == "float32":
        yield
        return
    patched = []
    copies: dict[int, tuple[int, torch.Tensor]] = {}      # by parameter: tied weights share one copy

    def cast(weight: torch.Tensor) -> torch.Tensor:
        version, copy = copies.get(id(weight), (None, None))
        if version != weight._version:
            copy = weight.detach().to(torch.bfloat16)
            copies[id(weight)] = (weight._version, copy)
        return copy

    def make_forward(layer: torch.nn.Linear, original):
        def forward(x, *args, **kwargs):
            kind = x.device.type
            bfloat16 = torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) == torch.bfloat16
            if bfloat16 and not args and not kwargs and not layer.weight.requires_grad:
                return torch.nn.functional.linear(x, cast(layer.weight), layer.bias)
            return original(x, *args, **kwargs)
        return forward

    try:
        for layer in model.modules():
            if isinstance(layer, torch.nn.Linear) and layer.weight.dtype == torch.float32 \
                    and not layer.weight.requires_grad and "forward" not in vars(layer):
                layer.forward = make_forward(layer, layer.forward)
                patched.append(layer)
        yield
    finally:
        for layer in patched:
            del layer.forward
