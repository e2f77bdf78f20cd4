"""V-scale: a learnable value-path gradient valve for Llama-style attention.

Gradient-sinks paper, Sec. 5 (formula restated in shared/notes/methods.md): each value state ``v`` of
one head, after ``v_proj`` and before the attention-weighted sum, becomes

    v_hat = v * ||v||^2 / (||v||^2 + C),   C = d_model * d_head * sigma^2 * exp(theta),

with sigma = 0.02 and one learnable ``theta`` per (layer, value head), initialised at 0.

Because a Llama ``v_proj`` output goes straight into aggregation (no RoPE on values), rescaling that output
is exactly "after v_proj, before aggregation". We therefore wrap each layer's ``v_proj`` in a small module;
the attention kernel itself (SDPA or eager) is untouched.
"""
from __future__ import annotations

import math

import torch
from torch import nn

SIGMA = 0.02


def vscale_values(v: torch.Tensor, theta: torch.Tensor, d_model: int, sigma: float = SIGMA) -> torch.Tensor:
    """Apply V-scale to value states ``v`` of shape (..., n_heads, d_head); ``theta`` has shape (n_heads,)."""
    d_head = v.shape[-1]
    c = (d_model * d_head * sigma**2) * torch.exp(theta).to(v.dtype)      # (n_heads,)
    sq_norm = v.pow(2).sum(-1, keepdim=True)                              # (..., n_heads, 1)
    return v * (sq_norm / (sq_norm + c.unsqueeze(-1)))


def vscale_jacobian_eigenvalues(sq_norm: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Closed-form eigenvalues of d v_hat / d v (paper Prop. 8): perpendicular r/(r+C), radial (r^2+3Cr)/(r+C)^2."""
    r = sq_norm
    return r / (r + c), (r * r + 3 * c * r) / (r + c) ** 2


class VScaledProjection(nn.Module):
    """``v_proj`` followed by V-scale, one ``theta`` per value head (KV head under GQA)."""

    def __init__(self, proj: nn.Linear, n_heads: int, d_head: int, d_model: int, sigma: float = SIGMA):
        super().__init__()
        if proj.out_features != n_heads * d_head:
            raise ValueError(f"v_proj gives {proj.out_features} features, expected {n_heads} heads x {d_head}")
        self.proj = proj
        self.n_heads, self.d_head, self.d_model, self.sigma = n_heads, d_head, d_model, sigma
        self.theta = nn.Parameter(torch.zeros(n_heads, device=proj.weight.device, dtype=proj.weight.dtype))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        v = self.proj(hidden)
        heads = v.view(*v.shape[:-1], self.n_heads, self.d_head)
        return vscale_values(heads, self.theta, self.d_model, self.sigma).view_as(v)

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, d_head={self.d_head}, d_model={self.d_model}, sigma={self.sigma}"


def apply_vscale(model: nn.Module, sigma: float = SIGMA) -> nn.Module:
    """Wrap every attention layer's ``v_proj`` of a Llama-style model with V-scale (in place; returns it)."""
    cfg = model.config
    layers = model.model.layers
    d_head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        if isinstance(attn.v_proj, VScaledProjection):
            raise ValueError(f"layer {i} already has V-scale; apply_vscale was called twice")
        if not isinstance(attn.v_proj, nn.Linear):
            raise TypeError(f"layer {i}: v_proj is {type(attn.v_proj).__name__}, expected nn.Linear (Llama-style)")
        attn.v_proj = VScaledProjection(attn.v_proj, n_kv, d_head, cfg.hidden_size, sigma)
    return model


def has_vscale(model: nn.Module) -> bool:
    return any(isinstance(m, VScaledProjection) for m in model.modules())


def value_projection(attn: nn.Module) -> nn.Linear:
    """The plain linear map producing raw value states ``v`` (inside the V-scale wrapper when there is one)."""
    return attn.v_proj.proj if isinstance(attn.v_proj, VScaledProjection) else attn.v_proj


def learned_theta(model: nn.Module) -> torch.Tensor:
    """theta as a (layers, value heads) tensor; raises if the model has no V-scale."""
    thetas = [layer.self_attn.v_proj.theta.detach().cpu() for layer in model.model.layers
              if isinstance(layer.self_attn.v_proj, VScaledProjection)]
    if not thetas:
        raise ValueError("this model has no V-scale layers (build it with vscale=True)")
    return torch.stack(thetas)


def vscale_constant(d_model: int, d_head: int, theta: float = 0.0, sigma: float = SIGMA) -> float:
    return d_model * d_head * sigma**2 * math.exp(theta)
