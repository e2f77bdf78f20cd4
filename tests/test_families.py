"""Every decoder-only family the library serves, each a tiny random model from transformers' own config class.

Per family and capability: the capability works and is checked against its definition, or it is refused with one
line naming the capability and why. ``coverage_rows`` turns this file's parametrisation into the family x capability
table of the capture-points page; ``test_coverage_table_in_the_book_is_current`` refuses a stale page
(``SINKBOOK_WRITE_COVERAGE=1`` rewrites it).
"""
from __future__ import annotations

import copy
import functools
import os
import re
from pathlib import Path

import pytest
import torch

from sinkbook.core.arch import (CAPABILITIES, UnsupportedArchitecture, arch_for, capability_problem, decoder_layers,
                                get_module)
from sinkbook.core.hooks import capture, hook_count, intervene
from sinkbook.core.models import FAMILIES, TINY_FAMILIES, family_model, load_model
from sinkbook.interventions.outro import outro
from sinkbook.interventions.vscale import RETROFIT_THETA, apply_vscale
from sinkbook.measures.strength import gaps_for_batch

ALL = tuple(TINY_FAMILIES) + tuple(FAMILIES)
BOOK_PAGE = Path(__file__).resolve().parents[1] / "book" / "capture_points.md"
# The QK-norm each family is documented to have (its paper / model card), written here, not read from the model:
# OLMo 2 / OLMo 3 / OLMoE normalise q and k over all heads at once; Qwen 3, Gemma 3, Apertus, EXAONE 4 and
# Persimmon (a LayerNorm) per head.
EXPECTED_QK_NORM = {"olmo2": "layerwise", "olmo3": "layerwise", "olmoe": "layerwise", "qwen3": "per-head",
                    "qwen3_moe": "per-head", "gemma3": "per-head", "apertus": "per-head", "exaone4": "per-head",
                    "persimmon": "per-head"}
# Families whose two branches read the same layer input (GPT-J, Phi, GPT-NeoX, Cohere): documented, not read.
EXPECTED_PARALLEL = {"gptj", "phi", "gpt_neox", "cohere", "cohere2"}
# Families transformers has but that the library refuses, with the reason it must give.
REFUSED = {"falcon": "attention interface", "opt": "no MLP", "codegen": "channel order"}


@functools.lru_cache(maxsize=None)
def _model(family):
    return load_model(f"tiny-{family}", device="cpu").model if family in TINY_FAMILIES else family_model(family)


@pytest.fixture
def ids():
    torch.manual_seed(1)
    return torch.randint(0, 256, (2, 12))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


# ---- capture ------------------------------------------------------------------------------------------------

def _eager_attentions(model, ids):
    impl = model.config._attn_implementation          # sdpa, or eager where the family offers only that
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            return model(input_ids=ids, output_attentions=True, use_cache=False).attentions
    finally:
        model.set_attn_implementation(impl)


@pytest.mark.parametrize("family", ALL)
def test_capture_equals_eager_attention(family, ids):
    model = _model(family)
    reference = _eager_attentions(model, ids)
    impl = model.config._attn_implementation
    with torch.no_grad(), capture(model, points=("pattern",)) as cap:
        model(input_ids=ids, use_cache=False)
    assert model.config._attn_implementation == impl
    for layer in cap.layers:
        assert cap["pattern", layer].shape == reference[layer].shape
        torch.testing.assert_close(cap["pattern", layer], reference[layer].float(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ALL)
def test_projection_points_are_the_kernel_inputs(family, ids):
    """v_proj, split into heads (out of a fused projection too), is what the kernel attends with; q_proj at position
    0, where rotary embeddings are the identity, is the kernel's query when nothing normalises or rescales it."""
    model, spec = _model(family), arch_for(_model(family))
    with torch.no_grad(), capture(model, points=("q_proj", "v_proj", "q", "v"), layers=[0]) as cap:
        model(input_ids=ids)
    torch.testing.assert_close(cap["v_proj", 0], cap["v", 0].transpose(1, 2), rtol=0, atol=0)
    if spec.qk_norm == "none" and family != "gpt_oss":     # gpt-oss's YaRN scales cos at position 0 too
        torch.testing.assert_close(cap["q_proj", 0][:, 0], cap["q", 0][:, :, 0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", ALL)
def test_residual_points_add_up(family, ids):
    model = _model(family)
    with torch.no_grad(), capture(model, points=("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")) as cap:
        model(input_ids=ids)
    for layer in cap.layers:
        torch.testing.assert_close(cap["resid_mid", layer], cap["resid_pre", layer] + cap["attn_out", layer])
        torch.testing.assert_close(cap["resid_post", layer], cap["resid_mid", layer] + cap["mlp_out", layer])


@pytest.mark.parametrize("family", ALL)
def test_hooks_removed_after_an_exception(family, ids):
    model = _model(family)
    before = hook_count(model)
    with pytest.raises(RuntimeError, match="inside"):
        with capture(model, points=("pattern", "z", "resid_mid", "v_proj")):
            model(input_ids=ids)
            raise RuntimeError("inside the block")
    with pytest.raises(RuntimeError, match="inside"):
        with intervene(model, {("z", 0): lambda z, layer: z, ("attn", 1): lambda call: None}):
            raise RuntimeError("inside the block")
    with pytest.raises(RuntimeError, match="inside"):
        with outro(model, gamma=1.0, relax=False, sink_positions=[0]):
            model(input_ids=ids)
            raise RuntimeError("inside the block")
    assert hook_count(model) == before
    assert not any(hasattr(m, "_sinkbook_listeners") for m in model.modules())


# ---- architecture facts --------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ALL)
def test_qk_norm_kind_detected(family):
    spec = arch_for(_model(family))
    assert spec.qk_norm == EXPECTED_QK_NORM.get(family, "none")
    if spec.qk_norm != "none":           # the kind follows from what the norm's weight covers
        width = get_module(decoder_layers(_model(family))[0], spec.q_norm).weight.shape[-1]
        assert width == (spec.head_dim if spec.qk_norm == "per-head" else spec.heads * spec.head_dim)


@pytest.mark.parametrize("family", ALL)
def test_parallel_blocks_detected(family):
    assert arch_for(_model(family)).parallel == (family in EXPECTED_PARALLEL)


def test_derived_rows_equal_the_rows_once_written_by_hand():
    """The six families' rows as the library wrote them by hand before they were derived."""
    llama = dict(layers="model.layers", attn="self_attn", q_proj="self_attn.q_proj", k_proj="self_attn.k_proj",
                 v_proj="self_attn.v_proj", o_proj="self_attn.o_proj", mlp="mlp")
    pre = dict(input_norm="input_layernorm", resid_mid_input="post_attention_layernorm", attn_out="self_attn.o_proj",
               mlp_out="mlp")
    sandwich = dict(attn_out="post_attention_layernorm", mlp_out="post_feedforward_layernorm")
    qk = dict(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm")
    old = {"llama": dict(**llama, **pre, qk_norm="none"), "mistral": dict(**llama, **pre, qk_norm="none"),
           "qwen2": dict(**llama, **pre, qk_norm="none"), "qwen3": dict(**llama, **pre, **qk, qk_norm="per-head"),
           "gemma3": dict(**llama, **qk, **sandwich, qk_norm="per-head", input_norm="input_layernorm",
                          resid_mid_input="pre_feedforward_layernorm", norm_gain_offset=1.0),
           "olmo2": dict(**llama, **qk, **sandwich, qk_norm="layerwise", input_norm=None, resid_mid_input="mlp")}
    for family, row in old.items():
        spec = arch_for(_model(family))
        assert {key: getattr(spec, key) for key in row} == row, family


@pytest.mark.parametrize("family, why", sorted(REFUSED.items()))
def test_unsupported_family_refused_in_one_line(family, why):
    from transformers import AutoModelForCausalLM
    from sinkbook.core.models import family_config
    model = AutoModelForCausalLM.from_config(family_config(family))
    with pytest.raises(UnsupportedArchitecture) as err:
        arch_for(model)
    message = str(err.value)
    assert "\n" not in message and family in message and why in message
    assert "arch.py" not in message.replace("core.arch", "")      # no stale path to a file that no longer holds rows


# ---- measures and interventions ---------------------------------------------------------------------------------

def _direct_gaps(model, ids):
    """G = log(a / (1 - a)) at each query's most attended key, from eager attention probabilities; NaN where a
    query sees a single key (query 0)."""
    out = []
    for probs in _eager_attentions(model, ids):
        top = probs.double().max(-1).values
        # with learned sink logits (gpt-oss) eager rows sum to less than 1: G is over the keys, so the competitors'
        # mass is the row's sum less the top key's, not 1 less it
        rest = probs.double().sum(-1) - top if arch_for(model).sinks else 1 - top
        gap = torch.log(top / rest)
        gap[:, :, 0] = float("nan")
        out.append(gap.float())
    return out


def test_a_learned_sink_is_reported_beside_s_over_the_keys(ids):
    model = _model("gpt_oss")
    learned = {}
    gaps_for_batch(model, {"input_ids": ids}, layers=None, learned_sink=learned)
    for layer, probs in enumerate(_eager_attentions(model, ids)):
        share, with_sink = learned[layer]
        torch.testing.assert_close(share, 1 - probs.sum(-1), rtol=1e-4, atol=1e-5)      # the column eager drops
        top = torch.maximum(probs.max(-1).values, 1 - probs.sum(-1)).double()
        expected = torch.log(top / (1 - top)).float()
        conditioned = expected < 9.0               # as in the test below: past that, a rounds to 1 in float32
        assert conditioned.float().mean() > 0.5
        torch.testing.assert_close(with_sink[conditioned], expected[conditioned], rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("family", ALL)
def test_sink_strength_equals_a_direct_computation(family, ids):
    model = _model(family)
    problem = capability_problem(model, "sink strength")
    if problem:
        with pytest.raises(UnsupportedArchitecture, match="sink strength is not available"):
            gaps_for_batch(model, {"input_ids": ids}, layers=None)
        return
    gaps, _ = gaps_for_batch(model, {"input_ids": ids}, layers=None)
    for layer, expected in enumerate(_direct_gaps(model, ids)):
        ours = gaps[layer]
        assert torch.isfinite(ours[:, :, 1:]).all() and torch.isnan(ours[:, :, 0]).all()
        ours, expected = ours[:, :, 1:], expected[:, :, 1:]
        # From float32 probabilities G is exact to 2e-3 only while 1 - a stays well above float32's rounding
        # (G below 9); Granite's and Nemotron's peaked random heads reach 16 and more, where a rounds to 1 and the
        # direct G is inf. There ours, read from the logits, must be at least as large.
        conditioned = expected < 9.0
        assert conditioned.float().mean() > 0.5, "too few well-conditioned queries to compare"
        torch.testing.assert_close(ours[conditioned], expected[conditioned], rtol=2e-3, atol=2e-3)
        assert (ours[~conditioned] > 9.0 - 2e-3).all()


@pytest.mark.parametrize("family", ALL)
def test_outro_at_gamma_zero_is_the_identity(family, ids):
    model = _model(family)
    plain = _logits(model, ids)
    every = list(range(len(decoder_layers(model))))          # the default skips the last two: none of two layers
    with outro(model, gamma=0.0, relax=False, sink_positions=[3], rotate_layers=every) as o:
        same = _logits(model, ids)
    with outro(model, gamma=1.0, relax=False, sink_positions=[3], rotate_layers=every):
        moved = _logits(model, ids)
    assert o.state.direction, "the rotation step did not run, so the comparison would prove nothing"
    assert torch.equal(plain, same)
    assert not torch.allclose(plain, moved)


@pytest.mark.parametrize("family", ALL)
def test_vscale_at_its_identity_start_leaves_logits_unchanged(family, ids):
    model = copy.deepcopy(_model(family))
    plain = _logits(model, ids)
    apply_vscale(model, theta=RETROFIT_THETA)
    torch.testing.assert_close(_logits(model, ids), plain, rtol=1e-5, atol=1e-5)
    apply_vscale_check = copy.deepcopy(_model(family))
    apply_vscale(apply_vscale_check, theta=5.0)               # a valve that is shut: the values do shrink
    assert not torch.allclose(_logits(apply_vscale_check, ids), plain, atol=1e-3)


@pytest.mark.parametrize("family", ALL)
def test_gradient_probes_or_refusal(family, ids):
    from sinkbook.measures.gradprobes import probe_batch
    model = _model(family)
    if capability_problem(model, "gradient probes"):
        with pytest.raises(UnsupportedArchitecture, match="in parallel"):
            probe_batch(model, ids[:1])
        return
    result = probe_batch(model, ids[:1])
    import numpy as np
    assert np.isfinite(result.grad_h_tilde).all() and (result.grad_h_tilde > 0).any()
    assert all(np.isfinite(v).all() for v in result.attn_ratios.values())


@pytest.mark.parametrize("family", ALL)
def test_qk_norm_tools_or_refusal(family, ids):
    from sinkbook.interventions.qknorm import fix_qk_norm, inject_qk_norm
    model = copy.deepcopy(_model(family))
    spec = arch_for(model)
    problem = capability_problem(model, "QK-norm tools")
    if problem:
        with pytest.raises((UnsupportedArchitecture, ValueError)):
            (fix_qk_norm(model, {"input_ids": ids}) if spec.qk_norm != "none" else inject_qk_norm(model))
        return
    if spec.qk_norm == "per-head":
        fixed = fix_qk_norm(model, {"input_ids": ids})
        assert len(fixed) == len(decoder_layers(model))
    else:
        plain = _logits(model, ids)
        injected = inject_qk_norm(model)
        assert not torch.allclose(_logits(model, ids), plain)          # unit-gain norms do act on q and k
        injected.remove()
        torch.testing.assert_close(_logits(model, ids), plain, rtol=0, atol=0)


# ---- the coverage table ---------------------------------------------------------------------------------------

# capability -> the tests above that check it on every family
CAPABILITY_TESTS = {
    "capture": ("test_capture_equals_eager_attention", "test_projection_points_are_the_kernel_inputs",
                "test_residual_points_add_up", "test_hooks_removed_after_an_exception"),
    "sink strength": ("test_sink_strength_equals_a_direct_computation",),
    "gradient probes": ("test_gradient_probes_or_refusal",),
    "OutRo": ("test_outro_at_gamma_zero_is_the_identity",),
    "V-scale": ("test_vscale_at_its_identity_start_leaves_logits_unchanged",),
    "QK-norm tools": ("test_qk_norm_tools_or_refusal", "test_qk_norm_kind_detected"),
}
START, END = "<!-- coverage table: written by tests/test_families.py -->", "<!-- end of coverage table -->"


def coverage_table() -> str:
    assert set(CAPABILITY_TESTS) == set(CAPABILITIES)
    head = ["family", "QK-norm", "q/k/v", "block"] + list(CAPABILITIES)
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = {}
    for family in ALL:
        model = _model(family)
        spec = arch_for(model)
        cells = [f"`{spec.family}`", spec.qk_norm, f"fused ({spec.qkv_layout})" if spec.fused else "separate",
                 "parallel" if spec.parallel else "sequential"]
        for capability in CAPABILITIES:
            problem = capability_problem(model, capability)
            if problem:
                mark = notes.setdefault(problem, len(notes) + 1)
                cells.append(f"refused ({mark})")
            else:
                cells.append("tested")
        rows.append("| " + " | ".join(cells) + " |")
    lines = rows + [""] + [f"({n}) {why}." for why, n in notes.items()]
    lines += ["", "Refused families: " + "; ".join(f"`{f}` ({why})" for f, why in sorted(REFUSED.items())) + ".",
              "", "Tests per capability: " + "; ".join(f"{cap}: " + ", ".join(f"`{t}`" for t in tests)
                                                      for cap, tests in CAPABILITY_TESTS.items()) + "."]
    return "\n".join(lines) + "\n"


def test_coverage_table_names_only_tests_that_exist():
    names = {name for name in globals() if name.startswith("test_")}
    assert {t for tests in CAPABILITY_TESTS.values() for t in tests} <= names


def test_coverage_table_in_the_book_is_current():
    table = coverage_table()
    page = BOOK_PAGE.read_text()
    pattern = re.compile(re.escape(START) + r"\n(.*?)" + re.escape(END), re.S)
    assert pattern.search(page), f"{BOOK_PAGE} has no coverage-table markers"
    if os.environ.get("SINKBOOK_WRITE_COVERAGE") == "1":
        BOOK_PAGE.write_text(pattern.sub(lambda _: f"{START}\n{table}{END}", page))
        page = BOOK_PAGE.read_text()
    assert pattern.search(page).group(1) == table, ("the coverage table is stale: run SINKBOOK_WRITE_COVERAGE=1 "
                                                    "pytest tests/test_families.py -k coverage")
