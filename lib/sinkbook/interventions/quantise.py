"""Post-training quantisation at our scale: round-to-nearest weights and 8-bit residual-stream activations.

The gradient-sinks paper evaluates its models under post-training quantisation (App., Table 4: bfloat16 and
quantised variants) to check that removing massive activations costs nothing; the usual argument is that an
outlier sets the quantisation scale for everything quantised with it. Two quantisers, written from their
definitions (the maintained libraries, e.g. AWQ or bitsandbytes kernels, need a GPU or change the model class):

- **weights**, symmetric round-to-nearest per output channel, ``bits`` in {8, 4}: for a row w of a linear
  layer's weight, s = max_j |w_j| / q_max with q_max = 2^(bits-1) - 1, and w_hat = s * clamp(round(w / s), -q_max,
  q_max). Applied to every linear layer of the decoder blocks; embeddings and the output head stay in float (the
  common PTQ setting).
- **activations**, the residual stream entering each decoder block, symmetric round-to-nearest with a dynamic
  scale per token (s_t = max_d |h_t[d]| / 127) or per tensor (one scale for the whole batch): with a massive
  activation on token 0, per-token scaling sacrifices token 0's other coordinates, per-tensor scaling every
  token's. The hooks live only inside the ``quantised_residual`` block.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..core.arch import decoder_layers

GRANULARITIES = ("token", "tensor")


def _q_max(bits: int) -> int:
    if bits not in (2, 3, 4, 8):
        raise ValueError(f"bits must be 8, 4, 3 or 2, got {bits!r}")
    return 2 ** (bits - 1) - 1


def rtn_scales(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """One scale per output channel (row): max |w| / q_max (rows of zeros get scale 1, so they stay zero)."""
    amax = weight.detach().abs().amax(dim=-1, keepdim=True).float()
    return torch.where(amax > 0, amax / _q_max(bits), torch.ones_like(amax))


def rtn_quantise(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """Symmetric round-to-nearest per output channel (module docstring); same shape and dtype as ``weight``."""
    q_max, scale = _q_max(bits), rtn_scales(weight, bits)
    return (torch.clamp(torch.round(weight.float() / scale), -q_max, q_max) * scale).to(weight.dtype)


@torch.no_grad()
def quantise_weights(model: nn.Module, bits: int) -> dict:
    """Quantise every linear layer's weight inside the decoder blocks, in place. Returns what changed: the number
    of layers and the largest relative Frobenius error of one weight."""
    _q_max(bits)
    count, worst = 0, 0.0
    for block in decoder_layers(model):
        for module in block.modules():
            if isinstance(module, nn.Linear):
                original = module.weight.detach().clone()
                module.weight.copy_(rtn_quantise(module.weight, bits))
                worst = max(worst, float((module.weight - original).float().norm() / original.float().norm()))
                count += 1
    if not count:
        raise ValueError("no linear layer found in the decoder blocks; is this a supported language model?")
    return {"bits": bits, "layers": count, "max_relative_error": worst}


def quantise_activations(x: torch.Tensor, bits: int = 8, granularity: str = "token") -> torch.Tensor:
    """Symmetric round-to-nearest of hidden states (..., d): a scale per token (last axis) or one per tensor."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
    q_max = _q_max(bits)
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True) if granularity == "token" else xf.abs().amax()
    scale = torch.where(amax > 0, amax / q_max, torch.ones_like(amax))
    return (torch.clamp(torch.round(xf / scale), -q_max, q_max) * scale).to(x.dtype)


@contextlib.contextmanager
def quantised_residual(model: nn.Module, bits: int = 8, granularity: str = "token"):
    """Inside the block, the residual stream entering every decoder block is quantised (``quantise_activations``).
    Hooks are removed on leaving, also after an exception."""
    _q_max(bits)
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")

    def hook(module, args, kwargs):
        if args:
            return (quantise_activations(args[0], bits, granularity), *args[1:]), kwargs
        kwargs["hidden_states"] = quantise_activations(kwargs["hidden_states"], bits, granularity)
        return args, kwargs
    handles = [block.register_forward_pre_hook(hook, with_kwargs=True) for block in decoder_layers(model)]
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()
