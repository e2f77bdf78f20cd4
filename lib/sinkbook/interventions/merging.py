"""Post-VL weight merging of an adapted language model with its reference LLM (VL paper, Sec. 5 and App. F.4).

All merges act on state dicts (parameter name -> tensor), one tensor at a time, computed in float64 and cast
back to the adapted model's dtype. Non-floating entries are copied from the adapted model. Two names that share
one tensor in the adapted model (tied input/output embeddings) are merged once, so the result stays tied.

Notation: theta_L the reference (text-only) LLM, theta_V the language backbone of the adapted VLM (the
"VLM-LM"), theta_b the base a task vector is taken from, tau_t = theta_t - theta_b.

=====================  =======================================================================================
merge                  formula
=====================  =======================================================================================
``linear_mix``         theta = w theta_V + (1 - w) theta_L; the paper's "95% VLM + 5% LLM" is w = 0.95
``uniform_average``    theta = (1/n) sum_t theta_t; for the two endpoints (theta_V + theta_L) / 2
``task_arithmetic``    theta = theta_b + lambda sum_t tau_t                         (Ilharco et al., 2023)
``ties_merge``         theta = theta_b + lambda tau_m, with, per tensor: trim each tau_t to its
                       k = max(1, floor(density * numel)) largest |entries| (the rest 0); elect the sign
                       gamma = +1 where sum_t trim(tau_t) >= 0, else -1; tau_m = mean of the trimmed entries
                       whose sign equals gamma (entries equal to 0 never count; 0 where none count)
                       (Yadav et al., 2023; tie-breaking as mergekit's ``ties``)
``dare_merge``         theta = theta_b + lambda sum_t m_t * tau_t / (1 - p), m_t iid Bernoulli(1 - p) per entry,
                       p the mask (drop) rate; seeded per tensor, so the result does not depend on the order of
                       the state dict                                                   (Yu et al., 2024)
=====================  =======================================================================================

**What "task arithmetic with lambda = 1" means for two endpoints.** The paper (App. F.4) names its settings
("full Task Arithmetic (lambda=1)", "TIES (density 0.2, lambda=1)", "DARE (mask rate 0.9, lambda=1)") but not
the base model they were taken against. With only the two endpoints, the base is the reference LLM and there
is one task vector, tau = theta_V - theta_L (the VL update). Then

- task arithmetic gives theta_L + lambda tau, so **lambda = 1 returns theta_V itself**: "full" task arithmetic
  is the adapted model, no repair at all, and the linear mixes are the same family at smaller lambda
  (95/5 = lambda 0.95, uniform averaging = lambda 0.5);
- TIES with one task vector has nothing to elect (every kept entry agrees with itself): it is
  theta_L + lambda trim_0.2(tau), the 20% largest entries of the VL update of each tensor;
- DARE gives theta_L + lambda m * tau / (1 - p): 10% of the VL update's entries, each scaled by 10.

(The reverse reading, base theta_V with task vector theta_L - theta_V, would make lambda = 1 return theta_L,
a full recovery, which the paper's result, tens of points lost under full TA on Qwen2.5-VL, rules out.)
With a third endpoint, a common pretrained ancestor theta_0 from which both the reference LLM and the VLM
descend, the same names mean the usual multi-task merge of two fine-tunes: base theta_0, task vectors
theta_L - theta_0 and theta_V - theta_0 (``paper_merge(..., ancestor=...)``); lambda = 1 then adds both.

**Why not mergekit.** ``mergekit==0.1.5`` installs beside our pins (it asks torch>=2.0, transformers>=5,<6,
accelerate>=1.6,<2 and adds peft, pydantic, immutables, sentencepiece, protobuf, datasets), but it merges
checkpoint directories from a YAML configuration, not tensors in memory, and its ``dare_linear`` rescales the
kept entries to the L1 norm of the full task vector (``rescale_norm=l1``), not by 1/(1-p) as the DARE paper and
the paper's setting do. Its ``task_arithmetic`` and ``ties`` agree with the formulas above (same top-k rule,
same sign election with ties to +1); ``tests/test_merging.py`` compares them when mergekit is importable.
mergekit is not among our dependencies, so that comparison is usually skipped; ``tests/test_merging_peft.py``
compares task arithmetic, TIES and DARE (given the same keep-mask) with ``peft.utils.merge_utils``, which is
pinned, on every run.
"""
from __future__ import annotations

import zlib
from typing import Iterable

import torch

PAPER_MERGES = ("mix_95_5", "uniform", "task_arithmetic", "ties", "dare")


# ---- one tensor -------------------------------------------------------------------------------------------------

def trim_top_k(tau: torch.Tensor, density: float) -> torch.Tensor:
    """Keep the k = max(1, floor(density * numel)) entries of largest magnitude (ties broken by sort order)."""
    if not 0 < density <= 1:
        raise ValueError(f"density must lie in (0, 1], got {density}")
    if density == 1 or tau.numel() == 0:
        return tau.clone()
    k = max(1, int(density * tau.numel()))
    flat = tau.reshape(-1)
    keep = torch.argsort(flat.abs(), descending=True, stable=True)[:k]
    out = torch.zeros_like(flat)
    out[keep] = flat[keep]
    return out.view_as(tau)


def ties_tensor(base: torch.Tensor, others: list[torch.Tensor], density: float = 0.2, lam: float = 1.0):
    # An entry no model changed merges to the base (every trimmed task vector is zero). Saying so first spares
    # the sort of a frozen tied embedding: 168M float64 entries on Gemma 3, ~14 GB at the peak of a merge.
    if all(torch.equal(t, base) for t in others):
        return base.clone()
    taus = torch.stack([trim_top_k(t - base, density) for t in others])
    elected = torch.where(taus.sum(0) >= 0, 1.0, -1.0).to(taus.dtype)
    agree = (torch.sign(taus) == elected).to(taus.dtype)             # zeros have sign 0: never agree
    count = agree.sum(0)
    merged = (taus * agree).sum(0) / count.clamp_min(1)
    return base + lam * merged


def dare_mask(shape, drop_rate: float, seed: int, name: str = "", device="cpu") -> torch.Tensor:
    """The Bernoulli(1 - p) keep-mask DARE draws for one tensor: a generator seeded by (seed, name)."""
    generator = torch.Generator(device="cpu").manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    return (torch.rand(shape, generator=generator, dtype=torch.float64) >= drop_rate).to(device)


def dare_tensor(base: torch.Tensor, others: list[torch.Tensor], drop_rate: float = 0.9, lam: float = 1.0,
                seed: int = 0, name: str = ""):
    if not 0 <= drop_rate < 1:
        raise ValueError(f"the DARE mask rate must lie in [0, 1), got {drop_rate}")
    total = torch.zeros_like(base)
    for index, other in enumerate(others):
        keep = dare_mask(base.shape, drop_rate, seed + index, name, base.device).to(base.dtype)
        total = total + keep * (other - base) / (1.0 - drop_rate)
    return base + lam * total


# ---- state dicts --------------------------------------------------------------------------------------------------

def _check_keys(dicts: list[dict]) -> list[str]:
    keys = list(dicts[0])
    for other in dicts[1:]:
        if set(other) != set(keys):
            missing, extra = sorted(set(keys) - set(other)), sorted(set(other) - set(keys))
            raise ValueError(f"state dicts differ: missing {missing[:5]}, extra {extra[:5]}; merge models of one "
                             f"architecture (the language backbone of the VLM against its reference LLM)")
        for key in keys:
            if other[key].shape != dicts[0][key].shape:
                raise ValueError(f"{key}: shapes {tuple(dicts[0][key].shape)} and {tuple(other[key].shape)} differ")
    return keys


def _merge(dicts: list[dict], fn, template: dict) -> dict:
    """Apply ``fn(name, [float64 tensors in dicts order]) -> float64 tensor`` per floating entry; cast back to
    ``template``'s dtypes. Entries sharing storage in ``template`` are merged once."""
    keys = _check_keys(dicts)
    out, done = {}, {}
    for key in keys:
        ref = template[key]
        if not torch.is_floating_point(ref):
            out[key] = ref.clone()
            continue
        alias = (ref.untyped_storage().data_ptr(), ref.storage_offset(), tuple(ref.shape), tuple(ref.stride()))
        if alias in done:
            out[key] = out[done[alias]]
            continue
        merged = fn(key, [d[key].detach().to(torch.float64) for d in dicts])
        out[key] = merged.to(ref.dtype)
        done[alias] = key
    return out


def linear_mix(adapted: dict, reference: dict, weight_adapted: float = 0.95) -> dict:
    """w * adapted + (1 - w) * reference (the paper's asymmetric 95/5 mix at w = 0.95)."""
    w = float(weight_adapted)
    return _merge([adapted, reference], lambda _, t: w * t[0] + (1.0 - w) * t[1], adapted)


def uniform_average(models: list[dict]) -> dict:
    """The mean of the models' parameters (the first model's dtypes)."""
    return _merge(list(models), lambda _, t: torch.stack(t).mean(0), models[0])


def task_arithmetic(base: dict, models: list[dict], lam: float = 1.0) -> dict:
    """base + lam * sum_t (model_t - base); dtypes follow the last model (the adapted one, by convention)."""
    return _merge([base, *models], lambda _, t: t[0] + lam * sum(x - t[0] for x in t[1:]), models[-1])


def ties_merge(base: dict, models: list[dict], density: float = 0.2, lam: float = 1.0) -> dict:
    """TIES: trim each task vector to ``density`` per tensor, elect signs, disjoint mean, scale by ``lam``."""
    return _merge([base, *models], lambda _, t: ties_tensor(t[0], t[1:], density, lam), models[-1])


def dare_merge(base: dict, models: list[dict], drop_rate: float = 0.9, lam: float = 1.0, seed: int = 0) -> dict:
    """DARE (linear): drop each task-vector entry with probability ``drop_rate``, rescale the kept ones by
    1/(1 - drop_rate), add lam times the sum to the base. Seeded per (seed, model index, parameter name)."""
    return _merge([base, *models], lambda name, t: dare_tensor(t[0], t[1:], drop_rate, lam, seed, name), models[-1])


def paper_merge(name: str, adapted: dict, reference: dict, ancestor: dict | None = None, seed: int = 0) -> dict:
    """One of the paper's five settings (App. F.4) that have a closed form here: ``PAPER_MERGES``.

    Without ``ancestor`` the base of task arithmetic / TIES / DARE is the reference LLM and the single task
    vector is adapted - reference (see the module docstring: full task arithmetic then returns ``adapted``).
    With ``ancestor`` (a pretrained model both descend from) the base is the ancestor and the task vectors are
    reference - ancestor and adapted - ancestor."""
    if name == "mix_95_5":
        return linear_mix(adapted, reference, 0.95)
    if name == "uniform":
        return linear_mix(adapted, reference, 0.5)
    base, models = (reference, [adapted]) if ancestor is None else (ancestor, [reference, adapted])
    if name == "task_arithmetic":
        return task_arithmetic(base, models, lam=1.0)
    if name == "ties":
        return ties_merge(base, models, density=0.2, lam=1.0)
    if name == "dare":
        return dare_merge(base, models, drop_rate=0.9, lam=1.0, seed=seed)
    raise ValueError(f"unknown merge {name!r}; choose one of {', '.join(PAPER_MERGES)} (Task Singular Vectors and "
                     f"STAR, the paper's two spectral settings, are not implemented)")


# ---- models -----------------------------------------------------------------------------------------------------

def state_of(model: torch.nn.Module) -> dict:
    """The model's state dict, detached (tied parameters keep sharing storage, so they are merged once)."""
    return {k: v.detach() for k, v in model.state_dict().items()}


def load_merged(model: torch.nn.Module, merged: dict) -> torch.nn.Module:
    """Copy a merged state dict into ``model`` in place (strict: every key must match). Returns the model."""
    model.load_state_dict(merged, strict=True)
    return model


def merge_models(adapted: torch.nn.Module, reference: torch.nn.Module, name: str,
                 ancestor: torch.nn.Module | None = None, seed: int = 0, into: torch.nn.Module | None = None):
    """``paper_merge`` on two (three) loaded language models; the result is copied into ``into`` (default: the
    adapted model, in place) and returned. Both must be the same architecture (the VLM's language backbone and
    its reference LLM)."""
    merged = paper_merge(name, state_of(adapted), state_of(reference),
                         state_of(ancestor) if ancestor is not None else None, seed)
    return load_merged(into if into is not None else adapted, merged)


def names_changed(a: dict, b: dict, keys: Iterable[str] | None = None) -> list[str]:
    """Which entries of two state dicts differ (a diagnostic for tests and notebooks)."""
    return [k for k in (keys or a) if not torch.equal(a[k], b[k])]
