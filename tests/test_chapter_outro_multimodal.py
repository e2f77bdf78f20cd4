"""The multimodal OutRo chapter: its model-side helpers against direct computations on a tiny adapted
vision-language model (sink-query scores, which image tokens pruning keeps, where dimension removal acts), its
finding functions on synthetic measurements (verdicts and precondition gating), and its quick profile on a tiny
model of every family, adapted through the adaptation chapter's jobs."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from sinkbook.chapters import outro_multimodal as C
from sinkbook.runs import multimodal as R
from sinkbook.core.claims import INCONCLUSIVE, NOT_COMPARABLE, missing_effects
from sinkbook.core.hooks import capture, intervene
from sinkbook.core.models import TINY_FAMILIES


def _by_id(finding, suffix="_m"):
    return {c.id.removesuffix(suffix): c for c in finding.claims}


# ---- helpers on tensors ------------------------------------------------------------------------------------------

def test_batches_hold_one_task_and_length_and_cover_every_example():
    from sinkbook.training.probes import held_out_vision_examples
    examples = held_out_vision_examples(40)
    batches = R.example_batches(examples, 4)
    assert sorted(i for b in batches for i in b) == list(range(40))
    for b in batches:
        assert len(b) <= 4 and len({(examples[i].task, len(examples[i].digits)) for i in b}) == 1
        assert b == sorted(b)


def test_pruning_keeps_the_highest_scored_image_tokens():
    image = torch.tensor([[0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 0, 0]], dtype=torch.bool)
    scores = torch.tensor([[9.0, 0.1, 0.4, 0.3, 0.2, 9.0], [9.0, 9.0, 0.5, 0.5, 9.0, 9.0]])
    pruned = R.prune_image_tokens(scores, image, keep=0.5)
    assert pruned.tolist() == [[False, True, False, False, True, False], [False, False, False, True, False, False]]
    assert not (pruned & ~image).any(), "only image tokens are pruned"
    assert R.prune_image_tokens(scores, image, keep=0.1).sum(1).tolist() == [3, 1]      # at least one is kept
    assert not R.prune_image_tokens(scores, image, keep=1.0).any()


def test_select_gamma_takes_the_best_accuracy_and_the_smaller_on_ties():
    assert R.select_gamma({0.5: [1, 0, 0], 1.0: [1, 1, 0], 4.0: [1, 1, 0]}) == 1.0
    assert R.select_gamma({3.0: [0, 0], 0.5: [0, 0]}) == 0.5


def test_vlm_top_detector_ranks_flagged_tokens_only():
    torch.manual_seed(0)
    hidden = torch.randn(2, 6, 1024)                               # |h_d| / RMS can reach sqrt(1024) = 32
    hidden[0, 2, 5], hidden[0, 4, 5], hidden[1, 3, 5] = 400.0, 60.0, 5.0         # ratios ~32, ~28 and ~5
    padding = torch.ones(2, 6, dtype=torch.long)
    top = R.vlm_top_detector([5])(hidden, padding)
    assert top.tolist() == [[False, False, True, False, False, False], [False] * 6]
    both = R.vlm_top_detector([5], share=0.5)(hidden, padding)                      # 3 of 6, but two are flagged
    assert torch.nonzero(both[0]).flatten().tolist() == [2, 4] and not both[1].any()
    padding[0, 2] = 0
    assert torch.nonzero(R.vlm_top_detector([5])(hidden, padding)[0]).flatten().tolist() == [4]


# ---- helpers against direct computations on a tiny adapted model --------------------------------------------------

@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    from sinkbook.training.adapt import AdaptConfig, adapt
    from sinkbook.training.probes import held_out_vision_examples
    from sinkbook.training.vlm import encode_examples, load_vlm
    out = tmp_path_factory.mktemp("vlm")
    adapt(AdaptConfig("tiny-llama", steps=2, stage1_steps=1, batch_size=4), out=out, use_cache=False, progress=False)
    vlm, loaded, fmt = load_vlm(out / "model", device="cpu")
    examples = [e for e in held_out_vision_examples(15) if e.task == "row"][:3]
    batch = encode_examples(examples, loaded.tokenizer, fmt, "vision", answers=False, padding_side="left")
    with torch.no_grad():
        embeds = vlm.embed(batch["input_ids"], batch["image_mask"], batch["images"])
    assert batch["attention_mask"].min() == 0, "the fixture should exercise left padding"
    return vlm.llm, embeds, batch["attention_mask"], batch["image_mask"]


def _grab(model, embeds, mask, layer):
    grabbed = {}

    def grab(call):
        grabbed["call"] = call
    with torch.no_grad(), intervene(model, {("attn", layer): grab}):
        model(inputs_embeds=embeds, attention_mask=mask)
    return grabbed["call"]


def test_sink_query_scores_are_an_unmasked_softmax_of_the_sink_row(tiny_vlm):
    model, embeds, mask, image = tiny_vlm
    layer = 1
    with torch.no_grad(), capture(model, points=("q", "k"), layers=[layer]) as cap:
        model(inputs_embeds=embeds, attention_mask=mask)
    q, k = cap["q", layer], cap["k", layer]
    sinks = torch.zeros(mask.shape, dtype=torch.bool)
    first = R.first_real(mask)
    sinks[torch.arange(3), first] = True
    sinks[0, first[0] + 1] = True                                  # two sink rows in the first sequence
    got = R.sink_query_attention(_grab(model, embeds, mask, layer), sinks, mask.bool())
    scaling = model.model.layers[layer].self_attn.scaling
    groups = q.shape[1] // k.shape[1]
    for b in range(3):
        rows = torch.nonzero(sinks[b]).flatten()
        want = torch.zeros(mask.shape[1])
        for r in rows:
            for h in range(q.shape[1]):
                scores = (k[b, h // groups] @ q[b, h, r]) * scaling
                scores[~mask[b].bool()] = float("-inf")
                want += scores.softmax(-1) / (len(rows) * q.shape[1])
        torch.testing.assert_close(got[b], want, rtol=1e-5, atol=1e-6)
        assert got[b][image[b]].sum() > 0, "the sink row sees the image tokens after it"


def test_mean_query_scores_average_the_causal_pattern(tiny_vlm):
    model, embeds, mask, _ = tiny_vlm
    with torch.no_grad(), capture(model, points=("pattern",), layers=[0]) as cap:
        model(inputs_embeds=embeds, attention_mask=mask)
    rows = mask.bool().clone()
    rows[:, :-3] = False                                           # the last three positions
    got = R.mean_query_attention(_grab(model, embeds, mask, 0), rows)
    want = cap["pattern", 0][:, :, -3:].mean(dim=(1, 2))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_pruned_tokens_are_gone_like_removed_tokens(tiny_vlm):
    """Masking the pruned positions out gives the logits of the sequence with them deleted (positions kept):
    pruning removes exactly the tokens it names, and keeps the others."""
    model, embeds, mask, image = tiny_vlm
    scores = torch.rand(mask.shape, generator=torch.Generator().manual_seed(0))
    pruned = R.prune_image_tokens(scores, image, keep=0.5)
    assert (pruned.sum(1) == (image.sum(1) - (image.sum(1) * 0.5).round())).all()
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        masked = model(inputs_embeds=embeds, attention_mask=mask * (~pruned).long(), position_ids=positions).logits
        full = model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions).logits
        for b in range(3):
            keep = mask[b].bool() & ~pruned[b]
            alone = model(inputs_embeds=embeds[b:b + 1, keep], position_ids=positions[b:b + 1, keep]).logits
            torch.testing.assert_close(masked[b, -1], alone[0, -1], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(masked[:, -1], full[:, -1]), "pruning should change what the model predicts"


def test_dimension_removal_edits_only_the_chosen_tokens_and_dimensions(tiny_vlm):
    model, embeds, mask, image = tiny_vlm
    L = len(model.model.layers)
    chosen = torch.zeros(mask.shape, dtype=torch.bool)
    first_image = image.float().argmax(1)
    chosen[torch.arange(3), first_image] = True
    dims = [3, 7]
    # at the first layer the edit is a direct change of the input: zeroed embeddings give the same logits
    direct = embeds.clone()
    direct[chosen.nonzero(as_tuple=True)[0][:, None], chosen.nonzero(as_tuple=True)[1][:, None],
           torch.tensor(dims)[None]] = 0.0
    edits = R.remove_dimensions_edits(L, chosen, dims)
    with torch.no_grad():
        want = model(inputs_embeds=direct, attention_mask=mask).logits
        with intervene(model, {("resid_pre", 0): edits[("resid_pre", 0)]}):
            got = model(inputs_embeds=embeds, attention_mask=mask).logits
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        with capture(model, points=("resid_pre",)) as plain:
            model(inputs_embeds=embeds, attention_mask=mask)
        with intervene(model, edits), capture(model, points=("resid_pre",)) as edited:
            model(inputs_embeds=embeds, attention_mask=mask)
    for layer in range(L):
        h, h0 = edited["resid_pre", layer], plain["resid_pre", layer]
        assert (h[chosen][:, dims] == 0).all(), "the chosen entries are zero at every layer"
        for b in range(3):
            before = slice(0, int(first_image[b]))
            assert torch.equal(h[b, before], h0[b, before]), "earlier tokens cannot see the edit"
        if layer == 0:
            untouched = torch.ones_like(h, dtype=torch.bool)
            untouched[chosen.nonzero(as_tuple=True)[0][:, None], chosen.nonzero(as_tuple=True)[1][:, None],
                      torch.tensor(dims)[None]] = False
            assert torch.equal(h[untouched], h0[untouched]), "nothing else changes at the first layer"
    step = torch.randn(3, 1, embeds.shape[-1])
    assert torch.equal(edits[("resid_pre", 1)](step, 1), step), "decode steps are left alone"


# ---- finding functions on synthetic measurements ----------------------------------------------------------------
# ``measured[spec][seed]`` is one run's record; ``_one`` wraps a single run as seed 0 of model "m".

N, L, H, HKV = 60, 8, 4, 2


def _variant(base, lost=0, gained=0):
    """A copy of ``base`` outcomes that loses ``lost`` passing questions and gains ``gained`` failing ones."""
    out = list(base)
    passing, failing = [i for i, x in enumerate(base) if x], [i for i, x in enumerate(base) if not x]
    for i in passing[:lost]:
        out[i] = 0
    for i in failing[:gained]:
        out[i] = 1
    return out


def _measured(learned=True, has_sink=True, effect=0, n=N, vlm_tokens=2.0, massive=True, top_percent_is_top1=True,
              gamma=1.0, flat=False, seed=0):
    """A synthetic measurement of one run. ``effect`` > 0: every intervention the paper says helps gains
    ``effect`` questions and every one it says hurts loses ``effect`` (the paper's world); < 0 the opposite."""
    base = ([1] * int(0.7 * n) + [0] * (n - int(0.7 * n))) if learned else ([1] * int(0.2 * n) + [0] * (n - int(0.2 * n)))
    good = lambda: _variant(base, gained=effect) if effect >= 0 else _variant(base, lost=-effect)
    bad = lambda: _variant(base, lost=effect) if effect >= 0 else _variant(base, gained=-effect)
    collapse = [0] * n if effect > 0 else list(base)
    test = {"baseline": base, "outro": good(), "rotate": good(), "relax": good(),
            "prune_sink_query_0.5": good(), "prune_random_0.5": bad(), "prune_mean_query_0.5": list(base),
            "remove_llm_sink": collapse, "remove_vlm_random": _variant(base, lost=1 if effect >= 0 else 10),
            "remove_vlm_others": _variant(base, lost=1, gained=1) if effect >= 0 else _variant(base, lost=10),
            "rotate_vlm_top1": list(base), "rotate_vlm_top_percent": list(base),
            "zero_k": bad()}
    held = base[n // 2:n // 2 + 20]
    val = {"baseline": held, **{f"{g:g}": (held if flat or g != gamma else _variant(held, gained=2))
                                for g in (0.5, 1.0, 3.0)}}
    sign = 1 if effect >= 0 else -1
    attention_base = [[0.5, 0.1, 0.4]] * L
    attention_rot = [[0.5 - 0.02 * sign, 0.1 + 0.015 * sign, 0.4 + 0.005 * sign]] * L
    geometry = {"key_ratio": [[0.3 if sign > 0 else 2.0] * HKV] * L, "value_ratio": [[0.3 if sign > 0 else 2.0] * HKV] * L,
                "key_top_sink": [[0.6] * HKV] * L, "key_top_other": [[0.4 if sign > 0 else 0.8] * HKV] * L,
                "cos_sink": [[0.4] * H] * L, "cos_other": [[0.0 if sign > 0 else 0.6] * H] * L,
                "value_heads_cos": [0.1] * L, "value_layers_cos": [0.3] * (L - 1)}
    return {"spec": "m", "seed": seed, "layers": L, "heads": H, "kv_heads": HKV, "relax_layers": [0, 2, 4, 6],
            "record": {"spec": "m"}, "directory": "/nowhere", "chat": True,
            "sink": {"has_sink": has_sink, "items_with_sink": 1.0 if has_sink else 0.0,
                     "first_layer": 1 if has_sink else None, "is_first_real": True},
            "vision": {"per_item": base, "accuracy": float(np.mean(base)), "chance": 0.24, "n": n,
                       "by_task": {"identify": float(np.mean(base))}},
            "gamma": gamma, "val": val, "test": test,
            "prune": {"layer": 2, "keep": [0.5], "image_tokens": 8.0},
            "vlm_criterion": {"sink_dims": [5], "massive": massive, "tau": 20.0, "vlm_tokens_per_item": vlm_tokens,
                              "items_with_other_vlm_tokens": float(vlm_tokens > 0),
                              "items_with_vlm_tokens": float(vlm_tokens > 0) or 1.0,
                              "top_percent_is_top1": top_percent_is_top1},
            "attention": {"base": attention_base, "rotated": attention_rot, "counts": [1.0, 16.0, 30.0], "items": 8},
            "zero_k": {"before": [0.5] * L, "after": [0.5 - 0.2 * sign] * L},
            "geometry": geometry,
            "relaxation": {"relaxed_at": [2] * 8, "cosine": [float("nan")] * 2 + [0.999 if sign > 0 else 0.9] * (L - 2),
                           "distance": [float("nan")] * 2 + [0.01] * (L - 2)},
            "check": {"max_abs_diff": 1e-5, "max_abs_logit": 30.0, "rotated_decode_rows": 12},
            "seconds": {}}


def _one(world) -> dict:
    return {"m": {0: world}}


def _seeds(*worlds) -> dict:
    return {"m": {s: {**w, "seed": s} for s, w in enumerate(worlds)}}


FINDINGS = ("models_finding", "rotation_strength_finding", "accuracy_finding", "redistribution_finding",
            "pruning_finding", "identification_finding", "zero_k_finding", "geometry_finding", "relaxation_finding")


def _claims(measured, findings=FINDINGS) -> dict:
    out = {}
    for name in findings:
        out.update({c.id: c for c in getattr(C, name)(measured).claims})
    return out


def test_the_papers_world_holds_everywhere():
    claims = _claims(_one(_measured(effect=12)))
    measured = {k: c for k, c in claims.items() if not c.must_hold}
    assert measured["vlm_gamma_varies_across_models"].holds == NOT_COMPARABLE     # one model
    del measured["vlm_gamma_varies_across_models"]
    assert measured.pop("vlm_rotation_llm_beats_vlm_top_percent_m").holds == NOT_COMPARABLE   # top 1% = top 1
    # "little effect" is a non-inferiority claim: 60 questions cannot put the interval inside the 2 pt margin
    for name in ("random", "others"):
        little = measured.pop(f"vlm_remove_vlm_{name}_little_effect_m")
        assert little.holds == INCONCLUSIVE and "could detect" in little.caveat
    assert {k: c.holds for k, c in measured.items() if c.holds is not True} == {}
    assert all(c.holds is True for c in claims.values() if c.must_hold)
    assert claims["vlm_sink_query_beats_mean_query_m"].origin == "ours"
    assert "vlm_zero_k_lowers_sink_attention_m" not in claims      # claimed once, in the sink-criteria chapter


def test_the_opposite_world_does_not_hold():
    claims = _claims(_one(_measured(effect=-12, top_percent_is_top1=False)))
    measured = {k: c for k, c in claims.items() if not c.must_hold and k != "vlm_gamma_varies_across_models"}
    assert {k: c.holds for k, c in measured.items() if c.holds is not False} == {}


ACCURACY_KEYS = ("vlm_outro_accuracy_m", "vlm_rotation_accuracy_m", "vlm_relaxation_accuracy_m",
                 "vlm_sink_query_pruning_m", "vlm_random_pruning_hurts_m", "vlm_zero_k_accuracy_m")
ACCURACY_SETTINGS = ("outro", "rotate", "relax", "prune_sink_query_0.5", "prune_random_0.5", "zero_k")


def _no_difference(n, changed):
    """A world where each setting gains ``changed`` questions and loses as many: no difference, with noise."""
    world = _measured(effect=0, n=n)
    for name in ACCURACY_SETTINGS:
        world["test"][name] = _variant(world["test"]["baseline"], lost=changed, gained=changed)
    return world


def test_no_difference_is_inconclusive_on_few_questions_and_refutes_on_many():
    few = _claims(_one(_no_difference(N, 3)))
    for key in ACCURACY_KEYS:
        assert few[key].holds == INCONCLUSIVE, key
        assert few[key].effect["low"] < 0 < few[key].interest["value"] < few[key].effect["high"], key
    findings = ("accuracy_finding", "pruning_finding", "zero_k_finding", "relaxation_finding")
    many = _claims(_one(_no_difference(4000, 1)), findings)
    for key in ACCURACY_KEYS:
        assert many[key].holds is False, key         # the interval now excludes the effect of interest
    # no fall at all excludes a fall to chance even on 60 questions
    assert _claims(_one(_measured(effect=0)))["vlm_remove_llm_sink_collapses_m"].holds is False


STATISTICAL = ("vlm_outro_accuracy", "vlm_rotation_accuracy", "vlm_relaxation_accuracy", "vlm_sink_query_pruning",
               "vlm_random_pruning_hurts", "vlm_sink_query_beats_mean_query", "vlm_zero_k_accuracy",
               "vlm_remove_llm_sink_collapses", "vlm_remove_vlm_random_little_effect",
               "vlm_remove_vlm_others_little_effect", "vlm_rotation_llm_beats_vlm_top1",
               "vlm_rotation_llm_beats_vlm_top_percent")


def test_statistical_claims_carry_their_effect_interest_and_source():
    claims = _claims(_one(_measured(effect=12, top_percent_is_top1=False)))
    assert missing_effects(claims.values()) == []
    paired = [k for k in claims if k.startswith(STATISTICAL)]
    assert len(paired) == 12 and all(claims[k].effect and claims[k].interest for k in paired)
    # the check can fail: the same claim without its effect is caught
    bare = dataclasses.replace(claims["vlm_outro_accuracy_m"], effect=None, holds=True, caveat="")
    assert missing_effects([bare]) == [bare]
    outro = claims["vlm_outro_accuracy_m"]
    assert outro.effect["estimate"] == pytest.approx(20.0) and outro.effect["units"] == "pt"
    assert outro.effect["test"].startswith("paired bootstrap over items") and (outro.effect["items"], outro.effect["seeds"]) == (N, 1)
    assert outro.interest["source"].startswith("paper: Table B.6")


def test_accuracy_claims_bootstrap_the_seed_means_of_each_question():
    """Seed 0 alone gains 12 questions with OutRo; seeds 1 and 2 each lose 30 others. Per question the seed means
    are +1/3 on 12 questions and -2/3 on 30: -26.7 pt, the opposite of seed 0's +20 pt."""
    worlds = [_measured(effect=12), _measured(effect=12), _measured(effect=12)]
    for w in worlds[1:]:
        w["test"]["outro"] = _variant(w["test"]["baseline"], lost=30)
    alone = C.accuracy_finding(_one(worlds[0])).claims[0]
    assert alone.holds is True and alone.effect["estimate"] == pytest.approx(20.0)
    pooled = _by_id(C.accuracy_finding(_seeds(*worlds)))["vlm_outro_accuracy"]
    assert pooled.effect["estimate"] == pytest.approx(100 * (12 / 3 - 60 / 3) / N)
    assert (pooled.effect["items"], pooled.effect["seeds"]) == (N, 3)
    assert pooled.holds is False
    # the question is the unit resampled: the same seed means on twice the questions narrow the interval
    doubled = {s: {**w, "test": {k: v + v for k, v in w["test"].items()},
                   "vision": {**w["vision"], "per_item": w["vision"]["per_item"] * 2, "n": 2 * N}}
               for s, w in _seeds(*worlds)["m"].items()}
    wide = pooled.effect["high"] - pooled.effect["low"]
    narrow = _by_id(C.accuracy_finding({"m": doubled}))["vlm_outro_accuracy"].effect
    assert narrow["estimate"] == pytest.approx(pooled.effect["estimate"])
    assert narrow["high"] - narrow["low"] < 0.8 * wide
    table = C.accuracy_finding(_seeds(*worlds)).table
    assert list(table.columns) == [("m", "seed 0"), ("m", "seed 1"), ("m", "seed 2"), ("m", "mean")]
    assert table.loc["OutRo", ("m", "seed 0")] == pytest.approx(0.9)
    assert table.loc["OutRo", ("m", "mean")] == pytest.approx((0.9 + 0.2 + 0.2) / 3)


def test_a_model_without_a_sink_or_without_the_skill_is_not_comparable():
    few = _measured(effect=3, n=5)
    few["vision"]["per_item"] = [1] * 5                  # above chance, but too few questions to decide
    for kind, world in (("sink", _one(_measured(effect=12, has_sink=False))),
                        ("above chance", _one(_measured(effect=12, learned=False))),
                        ("at least 6", _one(few)),
                        # one seed of three did not learn the digits, or has no sink: the model is not comparable
                        ("above chance", _seeds(_measured(effect=12), _measured(effect=12), _measured(learned=False))),
                        ("seed 1", _seeds(_measured(effect=12), _measured(effect=12, has_sink=False),
                                          _measured(effect=12)))):
        claims = _claims(world)
        measured = [c for c in claims.values() if not c.must_hold]
        assert measured and all(c.holds == NOT_COMPARABLE for c in measured), kind
        assert all(kind in c.why_not_comparable or "two models" in c.why_not_comparable for c in measured), kind
        assert all(c.holds is True for c in claims.values() if c.must_hold)
    # the same three seeds, all learned and with a sink: tested
    assert _claims(_seeds(*[_measured(effect=12)] * 3))["vlm_outro_accuracy_m"].holds is True


def test_phi_vlm_claims_need_massive_dimensions_and_flagged_tokens():
    claims = _claims(_one(_measured(effect=12, massive=False)))
    for key in ("vlm_remove_llm_sink_collapses_m", "vlm_remove_vlm_random_little_effect_m",
                "vlm_rotation_llm_beats_vlm_top1_m"):
        assert "fallback" in claims[key].why_not_comparable
    claims = _claims(_one(_measured(effect=12, vlm_tokens=0.0)))
    assert "flags no token besides" in claims["vlm_remove_vlm_others_little_effect_m"].why_not_comparable
    assert claims["vlm_remove_llm_sink_collapses_m"].holds is True
    # every seed's model must have them
    claims = _claims(_seeds(_measured(effect=12), _measured(effect=12, massive=False)))
    assert "fallback" in claims["vlm_remove_llm_sink_collapses_m"].why_not_comparable
    assert "seed 1" in claims["vlm_remove_llm_sink_collapses_m"].why_not_comparable


def test_a_fall_that_stays_above_chance_is_not_a_collapse():
    world = _measured(effect=12)
    world["test"]["remove_llm_sink"] = _variant(world["test"]["baseline"], lost=12)    # 70% -> 50%, chance 24%
    c = _claims(_one(world), ("identification_finding",))["vlm_remove_llm_sink_collapses_m"]
    assert c.holds is False and "excludes a fall to chance" in c.caveat          # interval about [10, 30] pt
    assert c.interest["value"] == pytest.approx(46.0)     # the baseline's margin over chance, in points
    world["test"]["remove_llm_sink"] = _variant(world["test"]["baseline"], lost=25)    # 70% -> 28%: near chance
    c = _claims(_one(world), ("identification_finding",))["vlm_remove_llm_sink_collapses_m"]
    assert c.holds == INCONCLUSIVE and "above chance" in c.caveat                # about [29, 54] pt spans 46


def test_little_effect_allows_two_points():
    world = _measured(effect=12, n=1500)
    key = "vlm_remove_vlm_random_little_effect_m"
    world["test"]["remove_vlm_random"] = _variant(world["test"]["baseline"], lost=45)         # -3 pt
    assert _claims(_one(world), ("identification_finding",))[key].holds is False
    world["test"]["remove_vlm_random"] = _variant(world["test"]["baseline"], lost=15)         # -1 pt
    assert _claims(_one(world), ("identification_finding",))[key].holds is True


def _val(world, own, gain, n=40):
    """Validation outcomes where ``own`` gains ``gain`` of ``n`` questions over every other gamma."""
    held = [1] * (n // 4) + [0] * (n - n // 4)
    world["gamma"] = own
    world["val"] = {"baseline": held, **{f"{g:g}": (_variant(held, gained=gain) if g == own else held)
                                         for g in (0.5, 1.0, 3.0)}}
    return world


def test_gamma_claim_compares_two_models_and_needs_choices_that_are_more_than_noise():
    finding = lambda a, b: C.rotation_strength_finding({"a": {0: a}, "b": {0: b}}).claims[0]
    differs = finding(_val(_measured(effect=12), 1.0, 20), _val(_measured(effect=12), 3.0, 20))
    assert differs.holds is True and "a: 1, b: 3" in differs.our_value
    noise = finding(_val(_measured(effect=12), 1.0, 2), _val(_measured(effect=12), 3.0, 2))
    assert noise.holds == INCONCLUSIVE                    # two questions apart: the choice may be noise
    same = finding(_val(_measured(effect=12), 1.0, 20), _val(_measured(effect=12), 1.0, 20))
    assert same.holds is False                            # both models clearly prefer the same gamma
    assert finding(_val(_measured(effect=12), 1.0, 2), _val(_measured(effect=12), 1.0, 2)).holds == INCONCLUSIVE
    flat = C.rotation_strength_finding({"a": {0: _measured(effect=12, flat=True)},
                                        "b": {0: _measured(effect=12, gamma=3.0)}})
    assert flat.claims[0].holds == NOT_COMPARABLE
    table = C.rotation_strength_finding({"a": {0: _measured(effect=12, gamma=1.0)},
                                         "b": {0: _measured(effect=12, gamma=3.0)}})
    assert list(table.table.index) == ["no OutRo", "gamma 0.5", "gamma 1", "gamma 3", "chosen gamma"]


def test_gamma_is_chosen_per_seed_and_the_model_choice_reads_the_seed_means():
    # seeds 0 and 2 choose gamma 3 by 4 questions; seed 1 chooses 1 by 20: on the seed means gamma 1 wins
    runs = [_val(_measured(effect=12), 3.0, 4), _val(_measured(effect=12), 1.0, 20), _val(_measured(effect=12), 3.0, 4)]
    finding = C.rotation_strength_finding(_seeds(*runs))
    chosen = finding.table.loc["chosen gamma"]
    assert [chosen[("m", f"seed {s}")] for s in range(3)] == [3.0, 1.0, 3.0] and chosen[("m", "mean")] == 1.0
    other = {0: _val(_measured(effect=12), 3.0, 20)}
    claim = C.rotation_strength_finding({"m": _seeds(*runs)["m"], "o": other}).claims[0]
    assert "m: 1 (per seed 3, 1, 3), o: 3" in claim.our_value


def test_non_accuracy_claims_read_the_seed_means():
    """Rotation lowers the attention to the sink in seed 0 only; the claim follows the mean over seeds."""
    def rotated(change):
        w = _measured(effect=12)
        w["attention"]["rotated"] = [[0.5 + change, 0.1 - change, 0.4]] * L
        return w
    key = "vlm_rotation_lowers_sink_attention_m"
    falls = _claims(_seeds(rotated(-0.03), rotated(0.01), rotated(0.01)), ("redistribution_finding",))[key]
    rises = _claims(_seeds(rotated(-0.01), rotated(0.01), rotated(0.01)), ("redistribution_finding",))[key]
    assert falls.holds is True and falls.our_value == pytest.approx(-0.01 / 3, abs=1e-5)
    assert rises.holds is False
    # relaxation: 0.999 in seed 0, 0.97 in seed 1: the mean, 0.9845, is below 0.99
    worlds = [_measured(effect=12), _measured(effect=12)]
    worlds[1]["relaxation"]["cosine"] = [float("nan")] * 2 + [0.97] * (L - 2)
    finding = C.relaxation_finding(_seeds(*worlds))
    identical = _by_id(finding)["vlm_relaxed_sink_nearly_identical"]
    assert identical.holds is False and identical.our_value == pytest.approx(0.9845)
    assert finding.table.loc[("m", "seed 0"), "lowest cosine"] == pytest.approx(0.999)
    assert list(finding.table.index) == [("m", "seed 0"), ("m", "seed 1"), ("m", "mean")]


def test_freed_attention_follows_the_less_attended_modality():
    world = _measured(effect=12)
    world["attention"]["counts"] = [1.0, 2.0, 30.0]        # now image tokens get more per token than text
    claims = _claims(_one(world))
    assert claims["vlm_rotation_lowers_sink_attention_m"].holds is True
    assert claims["vlm_freed_attention_to_less_attended_m"].holds is False


def test_the_cache_check_fails_loudly():
    worlds = [_measured(effect=12), _measured(effect=12)]
    worlds[1]["check"]["max_abs_diff"] = 1.0               # in one seed's model
    check = _claims(_seeds(*worlds))["vlm_outro_cache_m"]
    assert check.must_hold and check.holds is False


# ---- the quick profile on every tiny family ---------------------------------------------------------------------

SMALL_ADAPTATION = dict(steps=2, stage1_steps=1, batch_size=4, probe_every=2, probe_arithmetic=2, probe_vision=2,
                        arithmetic=3, knowledge=3, ifeval=1, ifeval_tokens=4, vision=3, heldout_windows=1, workers=1)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_quick_profile_runs_on_a_tiny_model_of_every_family(family, private_cache, tmp_path):
    from sinkbook.book.results import write_results
    settings = C.PROFILES.resolve("quick", device="cpu", models=[f"tiny-{family}"], n_test=6, n_val=2,
                                  analysis_items=2, batch_size=4, adaptation=SMALL_ADAPTATION)
    chapter = C.OutRoMultimodalChapter(settings)
    results = chapter.results()
    claims = {c.id: c for c in results["claims"]}
    checks = [c for c in claims.values() if c.must_hold]
    assert checks and all(c.holds is True for c in checks)
    measured = [c for c in claims.values() if not c.must_hold]
    assert len(measured) == 20 and all(c.holds == NOT_COMPARABLE and c.why_not_comparable for c in measured)
    assert results["extra"]["models"][f"tiny-{family}"]["seeds"]["0"]["directory"].startswith(str(private_cache))
    write_results(**results, directory=tmp_path / "results")
    assert (tmp_path / "results" / "outro_multimodal.json").exists()


def test_every_seed_is_measured_on_its_own_run(private_cache):
    settings = C.PROFILES.resolve("quick", device="cpu", models=["tiny-qwen2"], seeds=[0, 1], n_test=6, n_val=2,
                                  analysis_items=2, batch_size=4, adaptation=SMALL_ADAPTATION)
    chapter = C.OutRoMultimodalChapter(settings)
    runs = chapter.measured["tiny-qwen2"]
    assert sorted(runs) == [0, 1] and [runs[s]["seed"] for s in (0, 1)] == [0, 1]
    assert runs[0]["directory"] != runs[1]["directory"], "each seed has its own adaptation run"
    assert set(chapter.adaptation["tiny-qwen2"]) == {0, 1}
    results = chapter.results()
    assert set(results["extra"]["models"]["tiny-qwen2"]["seeds"]) == {"0", "1"}
    assert ("tiny-qwen2", "mean") in chapter.accuracy().table.columns
    assert len(chapter.model_records()) == 2


def test_bad_settings_are_refused_in_one_line():
    from sinkbook.core.profiles import SettingsError
    with pytest.raises(SettingsError, match="analysis_items"):
        C.OutRoMultimodalChapter(C.PROFILES.resolve("quick", n_test=3, analysis_items=5))
    with pytest.raises(SettingsError, match="prune_keep"):
        C.OutRoMultimodalChapter(C.PROFILES.resolve("quick", prune_keep=[1.5]))
    with pytest.raises(SettingsError, match="unknown parameter"):
        C.OutRoMultimodalChapter(C.PROFILES.resolve("quick", adaptation={"no_such": 1}))
    with pytest.raises(SettingsError, match="seeds"):
        C.OutRoMultimodalChapter(C.PROFILES.resolve("quick", seeds=[0, 0]))
    with pytest.raises(SettingsError, match="seeds"):
        C.OutRoMultimodalChapter(C.PROFILES.resolve("quick", seeds=[]))
    with pytest.raises(SettingsError, match="n_val"):
        C.OutRoMultimodalChapter(C.PROFILES.resolve("quick", n_val=1))
    assert math.isclose(R.TOP_SHARE, 0.01)


def test_decoding_benchmark_runs_with_image_tokens_in_the_prompt(tmp_path):
    from sinkbook.runs.outro_text import benchmark_settings
    from sinkbook.core.hooks import hook_count
    from sinkbook.measures.decoding import overhead_ratios
    from sinkbook.training.adapt import AdaptConfig, adapt
    from sinkbook.training.vlm import load_vlm
    adapt(AdaptConfig("tiny-qwen2", steps=2, stage1_steps=1, batch_size=4), out=tmp_path, use_cache=False,
          progress=False)
    vlm, loaded, fmt = load_vlm(tmp_path / "model", device="cpu")
    rows = R.benchmark_vlm_decoding(vlm, loaded, fmt, benchmark_settings(loaded.model, 1.0), new_tokens=3, repeats=1,
                                    digits=2)
    assert [r["setting"] for r in rows] == ["sdpa", "outro", "eager"] and rows[0]["image_tokens"] == 8
    ratios = overhead_ratios(rows)
    assert ratios["sdpa"]["latency_ratio"] == 1.0 and ratios["outro"]["rotated_decode_rows"] == 0
    assert hook_count(loaded.model) == 0
