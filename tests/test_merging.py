"""Post-VL weight merging: each merge equals its formula on hand-computed tensors; self-merges are the identity
where the formula says so; the paper's two-endpoint settings reduce as the module docstring states."""
import pytest
import torch

from sinkbook.interventions import merging as M


def sd(**tensors):
    return {k: torch.tensor(v, dtype=torch.float64) for k, v in tensors.items()}


REF = sd(w=[[1.0, 2.0], [3.0, 4.0]], b=[0.5, -0.5])
ADA = sd(w=[[3.0, 2.0], [1.0, 8.0]], b=[1.5, 0.5])


def test_linear_mix_and_uniform_by_hand():
    mix = M.linear_mix(ADA, REF, 0.95)
    torch.testing.assert_close(mix["w"], torch.tensor([[2.9, 2.0], [1.1, 7.8]], dtype=torch.float64))
    torch.testing.assert_close(mix["b"], torch.tensor([1.45, 0.45], dtype=torch.float64))
    avg = M.uniform_average([ADA, REF])
    torch.testing.assert_close(avg["w"], torch.tensor([[2.0, 2.0], [2.0, 6.0]], dtype=torch.float64))
    torch.testing.assert_close(M.paper_merge("uniform", ADA, REF)["w"], avg["w"])


def test_task_arithmetic_by_hand():
    base = sd(x=[0.0, 1.0, 2.0])
    a, b = sd(x=[1.0, 1.0, 0.0]), sd(x=[0.0, 3.0, 2.5])
    out = M.task_arithmetic(base, [a, b], lam=0.5)       # base + 0.5 * ((1, 0, -2) + (0, 2, 0.5))
    torch.testing.assert_close(out["x"], torch.tensor([0.5, 2.0, 1.25], dtype=torch.float64))


def test_two_endpoint_full_task_arithmetic_returns_the_adapted_model():
    out = M.paper_merge("task_arithmetic", ADA, REF)
    for k in ADA:
        torch.testing.assert_close(out[k], ADA[k], rtol=0, atol=1e-15)
    # 95/5 is task arithmetic at lambda 0.95 on the same task vector
    torch.testing.assert_close(M.paper_merge("mix_95_5", ADA, REF)["w"], M.task_arithmetic(REF, [ADA], 0.95)["w"])


def test_ties_by_hand():
    base = sd(x=[0.0] * 5)
    t1 = sd(x=[1.0, -2.0, 3.0, -0.5, 0.1])
    t2 = sd(x=[-1.0, 1.0, 2.0, 0.4, -3.0])
    # density 0.4 keeps 2 of 5 entries: t1 -> (0, -2, 3, 0, 0), t2 -> (0, 0, 2, 0, -3)
    # elected signs from the sum (0, -2, 5, 0, -3): (+, -, +, +, -); disjoint means: 0, -2, 2.5, 0, -3
    out = M.ties_merge(base, [t1, t2], density=0.4, lam=1.0)
    torch.testing.assert_close(out["x"], torch.tensor([0.0, -2.0, 2.5, 0.0, -3.0], dtype=torch.float64))
    out = M.ties_merge(base, [t1, t2], density=0.4, lam=2.0)
    torch.testing.assert_close(out["x"], torch.tensor([0.0, -4.0, 5.0, 0.0, -6.0], dtype=torch.float64))


def test_ties_with_one_task_vector_is_the_trimmed_update():
    base = sd(x=[1.0] * 10)
    other = sd(x=[1.0 + v for v in (0.1, -0.9, 0.3, 0.05, -0.2, 0.7, 0.0, -0.4, 0.6, 0.15)])
    out = M.ties_merge(base, [other], density=0.2, lam=1.0)       # keeps -0.9 and 0.7
    expected = [1.0] * 10
    expected[1], expected[5] = 0.1, 1.7
    torch.testing.assert_close(out["x"], torch.tensor(expected, dtype=torch.float64))


def test_dare_entries_are_dropped_or_rescaled_by_one_over_one_minus_p():
    torch.manual_seed(0)
    base = {"w": torch.randn(200, 100, dtype=torch.float64)}
    tau = torch.randn(200, 100, dtype=torch.float64)
    other = {"w": base["w"] + tau}
    out = M.dare_merge(base, [other], drop_rate=0.9, lam=1.0, seed=3)
    delta = out["w"] - base["w"]
    kept = delta != 0
    torch.testing.assert_close(delta[kept], tau[kept] * 10.0)         # 1 / (1 - 0.9)
    frac = kept.double().mean().item()
    assert abs(frac - 0.1) < 4 * (0.1 * 0.9 / kept.numel()) ** 0.5 + 1e-9
    # the mask is the documented seeded draw, reproducible and seed-dependent
    torch.testing.assert_close(kept, M.dare_mask((200, 100), 0.9, 3, "w"))
    assert torch.equal(M.dare_merge(base, [other], 0.9, seed=3)["w"], out["w"])
    assert not torch.equal(M.dare_merge(base, [other], 0.9, seed=4)["w"], out["w"])
    # lambda scales the rescaled update
    torch.testing.assert_close(M.dare_merge(base, [other], 0.9, lam=0.5, seed=3)["w"] - base["w"], delta * 0.5)


def test_dare_is_unbiased_over_seeds():
    base = {"w": torch.zeros(50, dtype=torch.float64)}
    other = {"w": torch.linspace(-1, 1, 50, dtype=torch.float64)}
    mean = sum(M.dare_merge(base, [other], 0.5, seed=s)["w"] for s in range(400)) / 400
    assert (mean - other["w"]).abs().max() < 0.25


@pytest.mark.parametrize("name", M.PAPER_MERGES)
def test_merging_a_model_with_itself_is_the_identity(name):
    out = M.paper_merge(name, ADA, ADA)
    for k in ADA:
        torch.testing.assert_close(out[k], ADA[k], rtol=0, atol=1e-15)


def test_three_endpoint_task_arithmetic_adds_both_task_vectors():
    anc = sd(x=[0.0, 0.0])
    out = M.paper_merge("task_arithmetic", sd(x=[1.0, 2.0]), sd(x=[3.0, -1.0]), ancestor=anc)
    torch.testing.assert_close(out["x"], torch.tensor([4.0, 1.0], dtype=torch.float64))


def test_models_tied_weights_stay_tied_and_dtypes_kept():
    from sinkbook.core.models import load_model
    ref = load_model("tiny-llama", device="cpu").model
    ada = load_model("tiny-llama", device="cpu").model
    with torch.no_grad():
        for p in ada.parameters():
            p.add_(0.01)
    merged = M.paper_merge("dare", M.state_of(ada), M.state_of(ref))
    assert all(merged[k].dtype == v.dtype for k, v in M.state_of(ada).items())
    # a tied pair (same storage under two names) is merged once
    shared = torch.randn(4, 3, dtype=torch.float64)
    a = {"emb": shared, "head": shared}
    b = {"emb": torch.zeros(4, 3, dtype=torch.float64), "head": torch.zeros(4, 3, dtype=torch.float64)}
    out = M.dare_merge(b, [a], 0.5, seed=0)
    assert out["emb"] is out["head"]


def test_merge_models_loads_into_a_model():
    from sinkbook.core.models import load_model
    ref = load_model("tiny-llama", device="cpu").model
    ada = load_model("tiny-llama", device="cpu").model
    with torch.no_grad():
        for p in ada.parameters():
            p.mul_(2.0)
    M.merge_models(ada, ref, "uniform")
    for (n, p), q in zip(ada.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q * 1.5)


def test_mismatched_state_dicts_are_refused():
    with pytest.raises(ValueError, match="differ"):
        M.linear_mix({"a": torch.zeros(2)}, {"b": torch.zeros(2)})
    with pytest.raises(ValueError, match="unknown merge"):
        M.paper_merge("star", ADA, REF)


def test_matches_mergekit_where_it_implements_the_same_formula(tmp_path):
    """Task arithmetic and TIES equal mergekit 0.1.5's; its dare_linear rescales to the L1 norm instead."""
    pytest.importorskip("mergekit")
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions
    from safetensors.torch import load_file

    from sinkbook.core.models import load_model
    ref = load_model("tiny-llama", device="cpu")
    ada = load_model("tiny-llama", device="cpu")
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in ada.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    for name, m in (("ref", ref), ("ada", ada)):
        m.model.save_pretrained(tmp_path / name)
        m.tokenizer.save_pretrained(tmp_path / name)
    ours = {"task_arithmetic": M.paper_merge("task_arithmetic", M.state_of(ada.model), M.state_of(ref.model)),
            "ties": M.paper_merge("ties", M.state_of(ada.model), M.state_of(ref.model))}
    for method, params in (("task_arithmetic", {"weight": 1.0}), ("ties", {"weight": 1.0, "density": 0.2})):
        cfg = {"merge_method": method, "base_model": str(tmp_path / "ref"), "dtype": "float32",
               "models": [{"model": str(tmp_path / "ada"), "parameters": params}], "parameters": {"lambda": 1.0}}
        run_merge(MergeConfiguration.model_validate(cfg), str(tmp_path / method),
                  MergeOptions(cuda=False, copy_tokenizer=False, lazy_unpickle=False, quiet=True))
        theirs = {}
        for f in (tmp_path / method).glob("*.safetensors"):
            theirs.update(load_file(f))
        for k, v in theirs.items():
            torch.testing.assert_close(v, ours[method][k], rtol=0, atol=1e-6)


def test_ties_leaves_an_entry_no_model_changed_without_sorting_it(monkeypatch):
    base = sd(frozen=[0.5, -1.0, 2.0], moved=[0.0, 0.0, 0.0])
    other = sd(frozen=[0.5, -1.0, 2.0], moved=[1.0, -2.0, 0.1])
    trimmed = []
    original = M.trim_top_k
    monkeypatch.setattr(M, "trim_top_k", lambda tau, density: trimmed.append(tau.shape) or original(tau, density))
    out = M.ties_merge(base, [other], density=0.4)
    torch.testing.assert_close(out["frozen"], base["frozen"], rtol=0, atol=0)
    torch.testing.assert_close(out["moved"], torch.tensor([0.0, -2.0, 0.0], dtype=torch.float64))
    assert len(trimmed) == 1                     # only the entry a model changed was trimmed
