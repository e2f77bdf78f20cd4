"""Our merges against peft's ``utils.merge_utils`` (peft is pinned, so this runs everywhere, unlike the mergekit
comparison): task arithmetic, TIES and DARE on state dicts with several task vectors of both signs, where sign
election and the disjoint mean have work to do. DARE's mask is random in both; given the same keep-mask (ours,
handed to peft in place of its Bernoulli draw) the formulas must agree, rescaling by 1/(1-p) included."""
from __future__ import annotations

import pytest
import torch
from peft.utils import merge_utils

from sinkbook.interventions import merging as M

SHAPES = {"a.weight": (16, 24), "b.weight": (40,), "c.bias": (7, 3)}


def _dicts(n_models: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    base = {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in SHAPES.items()}
    models = [{k: v + 0.3 * torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in base.items()}
              for _ in range(n_models)]
    return base, models


def _peft(fn, base, models, lam, **kwargs):
    weights = torch.full((len(models),), lam, dtype=torch.float64)
    return {k: base[k] + fn([m[k] - base[k] for m in models], weights, **kwargs) for k in base}


@pytest.mark.parametrize("lam", [1.0, 0.6])
def test_task_arithmetic_matches_peft(lam):
    base, models = _dicts()
    ours = M.task_arithmetic(base, models, lam=lam)
    for k, v in _peft(merge_utils.task_arithmetic, base, models, lam).items():
        torch.testing.assert_close(ours[k], v, rtol=0, atol=1e-12)


@pytest.mark.parametrize("density", [0.2, 0.5])
def test_ties_matches_peft(density):
    base, models = _dicts()
    ours = M.ties_merge(base, models, density=density, lam=1.0)
    theirs = _peft(merge_utils.ties, base, models, 1.0, density=density, majority_sign_method="total")
    for k in base:
        torch.testing.assert_close(ours[k], theirs[k], rtol=0, atol=1e-12)
    # the comparison can fail: dropping the sign election (a plain mean of the trimmed vectors) does not match
    plain = {k: base[k] + torch.stack([M.trim_top_k(m[k] - base[k], density) for m in models]).mean(0) for k in base}
    assert any(not torch.allclose(plain[k], theirs[k]) for k in base)


def test_dare_matches_peft_given_the_same_mask(monkeypatch):
    base, models = _dicts()
    drop, seed = 0.9, 3
    masks = iter([M.dare_mask(SHAPES[k], drop, seed + t, k).to(torch.float64) for k in base for t in range(len(models))])
    # peft draws its keep-mask with torch.bernoulli(density); give it ours, in the order it asks for them
    monkeypatch.setattr(merge_utils.torch, "bernoulli", lambda probabilities: next(masks))
    theirs = {k: base[k] + merge_utils.dare_linear([m[k] - base[k] for m in models],
                                                   torch.ones(len(models), dtype=torch.float64), 1 - drop)
              for k in base}
    ours = M.dare_merge(base, models, drop_rate=drop, seed=seed)
    for k in base:
        torch.testing.assert_close(ours[k], theirs[k], rtol=0, atol=1e-10)
    kept = torch.cat([M.dare_mask((4000,), drop, s, "x").double() for s in range(5)]).mean().item()
    assert abs(kept - (1 - drop)) < 0.01, f"the mask keeps {kept:.3f} of the entries, not 1 - p = {1 - drop}"
