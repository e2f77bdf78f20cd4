"""OutRo: the rotation formula, the relaxed sink rows, and how the intervention sits in a model (KV cache too).

Tiny random models have no massive activations, so most tests name the sinks with ``sink_positions``; one
test plants a massive activation in the embeddings to check that Phi_LLM detection drives the method.
"""
import math

import pytest
import torch

from sinkbook.core.hooks import capture, hook_count
from sinkbook.core.models import encode, load_model
from sinkbook.interventions.outro import OutRo, default_layers, detect_sinks, outro, rotate_toward

FAMILIES = ["llama", "qwen2", "qwen3", "gemma3"]
PROMPTS = ["the quick brown fox jumps", "a sink"]


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request):
    lm = load_model(f"tiny-{request.param}", device="cpu")
    return lm.model, encode(lm.tokenizer, PROMPTS)


@pytest.fixture(scope="module")
def llama():
    lm = load_model("tiny-llama", device="cpu")
    return lm.model, lm.tokenizer


def direct_rotation(o: list[float], v: list[float], gamma: float, temperature: float = 0.1) -> list[float]:
    """The formula of the methods page (book/methods.md) written out with plain floats, one head, one row."""
    dot = sum(a * b for a, b in zip(o, v))
    o_norm = math.sqrt(sum(a * a for a in o))
    v_sq = sum(b * b for b in v)
    gate = math.tanh(max(dot / max(o_norm * math.sqrt(v_sq), 1e-8), 0.0) / temperature)
    moved = [a + gate * gamma * abs(dot) / (v_sq + 1e-8) * b for a, b in zip(o, v)]
    moved_norm = math.sqrt(sum(a * a for a in moved))
    return [a * o_norm / (moved_norm + 1e-8) for a in moved]


def test_rotation_of_one_head_equals_direct_computation():
    torch.manual_seed(0)
    for _ in range(20):
        o, v = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
        gamma = float(torch.rand(1) * 4)
        got = rotate_toward(o, v, gamma).tolist()
        assert got == pytest.approx(direct_rotation(o.tolist(), v.tolist(), gamma), rel=1e-5, abs=1e-6)


def test_rotation_preserves_norm_and_moves_toward_direction():
    torch.manual_seed(1)
    o, v = torch.randn(500, 32), torch.randn(500, 32)
    new = rotate_toward(o, v, gamma=2.0)
    torch.testing.assert_close(new.norm(dim=-1), o.norm(dim=-1), rtol=1e-5, atol=1e-5)
    before = torch.nn.functional.cosine_similarity(o, v, dim=-1)
    after = torch.nn.functional.cosine_similarity(new, v, dim=-1)
    positive = before > 0.01
    assert (after[positive] > before[positive] + 1e-4).all()
    # a negative cosine closes the gate: those rows are untouched, bit for bit
    assert torch.equal(new[before <= 0], o[before <= 0])


def test_rotation_is_exactly_identity_at_gamma_zero():
    torch.manual_seed(2)
    o, v = torch.randn(64, 8) * 1e-3, torch.randn(64, 8)
    assert torch.equal(rotate_toward(o, v, gamma=0.0), o)


def test_gamma_zero_without_relaxation_gives_identical_logits(tiny):
    model, batch = tiny
    with torch.no_grad():
        plain = model(**batch).logits
        with outro(model, gamma=0.0, relax=False, sink_positions=[3]) as o:
            same = model(**batch).logits
        with outro(model, gamma=1.0, relax=False, sink_positions=[3]):
            moved = model(**batch).logits
    assert o.state.direction, "the rotation step did not run, so the comparison would prove nothing"
    assert torch.equal(plain, same)
    assert not torch.allclose(plain, moved), "gamma = 1 should change the logits"


def _layer0(model, batch, **options):
    """z, q, k, v of layer 0 (its input is untouched by OutRo, so plain q/k/v are what OutRo saw)."""
    with torch.no_grad():
        with capture(model, points=("q", "k", "v", "z"), layers=[0]) as plain:
            model(**batch)
        with OutRo(model, **options) as o, capture(model, points=("z",), layers=[0]) as edited:
            model(**batch)
    return plain, edited["z", 0], o


def test_rotation_in_model_matches_direct_computation_per_head(tiny):
    model, batch = tiny
    sink = 4
    plain, z_new, o = _layer0(model, batch, gamma=1.5, relax=False, sink_positions=[sink])
    z, v = plain["z", 0], plain["v", 0]
    groups = z.shape[2] // v.shape[1]
    padding = batch["attention_mask"].bool()
    assert padding[0, sink] and not padding[1, sink], "the batch should hold one sequence with the sink, one without"
    assert torch.equal(z_new[1], z[1]), "a sequence whose sink position is padding has no sink: no rotation"
    for b in range(1):
        for head in range(z.shape[2]):
            v_bar = v[b, head // groups, sink]
            for t in range(z.shape[1]):
                if t == sink:
                    assert torch.equal(z_new[b, t, head], z[b, t, head]), "sink rows must not be rotated"
                    continue
                want = direct_rotation(z[b, t, head].tolist(), v_bar.tolist(), 1.5)
                assert z_new[b, t, head].tolist() == pytest.approx(want, rel=1e-4, abs=1e-5)
    assert torch.allclose(z_new.norm(dim=-1), z.norm(dim=-1), rtol=1e-5, atol=1e-6)
    v_bar_all = v[:1, :, sink].repeat_interleave(groups, dim=1)[:, None]          # (1, 1, H, d)
    before = torch.nn.functional.cosine_similarity(z[:1], v_bar_all, dim=-1)
    after = torch.nn.functional.cosine_similarity(z_new[:1], v_bar_all, dim=-1)
    assert (after >= before - 1e-6).all() and (after > before + 1e-4).sum() > 0


def test_relaxed_sink_rows_equal_an_unmasked_softmax(tiny):
    model, batch = tiny
    sink = 2
    plain, z_new, o = _layer0(model, batch, gamma=0.0, rotate=False, relax=True, relax_layers=[0],
                              sink_positions=[sink])
    q, k, v, z = plain["q", 0], plain["k", 0], plain["v", 0], plain["z", 0]
    attn = model.model.layers[0].self_attn
    groups = q.shape[1] // k.shape[1]
    padding = batch["attention_mask"].bool()
    for b in range(q.shape[0]):
        if not padding[b, sink]:
            assert torch.equal(z_new[b], z[b]), "a padded sink position must not be relaxed"
            continue
        scores = torch.einsum("hd,hsd->hs", q[b, :, sink], k[b].repeat_interleave(groups, 0)) * attn.scaling
        scores = scores.masked_fill(~padding[b][None], float("-inf"))
        want = torch.einsum("hs,hsd->hd", scores.softmax(-1), v[b].repeat_interleave(groups, 0))
        torch.testing.assert_close(z_new[b, sink], want, rtol=1e-4, atol=1e-5)
        others = [t for t in range(z.shape[1]) if t != sink]
        assert torch.equal(z_new[b, others], z[b, others])
        assert not torch.allclose(z_new[b, sink], z[b, sink]), "the relaxed row should see later keys"
    assert o.state.relaxed[0][0] == [sink]


def test_each_sink_is_relaxed_once(llama):
    model, tok = llama
    batch = encode(tok, PROMPTS)
    with torch.no_grad(), outro(model, gamma=1.0, relax_layers=[0, 1, 2], sink_positions=[3]) as o:
        model(**batch)
    assert sorted(o.state.relaxed) == [0]


def test_hooks_are_removed_also_after_an_exception(llama):
    model, tok = llama
    batch = encode(tok, PROMPTS)
    assert hook_count(model) == 0
    with outro(model, sink_positions=[1]):
        assert hook_count(model) > 0
        model(**batch)
    assert hook_count(model) == 0
    with pytest.raises(RuntimeError, match="boom"):
        with outro(model, sink_positions=[1]):
            model(**batch)
            raise RuntimeError("boom")
    assert hook_count(model) == 0
    assert not any(c._attn_implementation.startswith("sinkbook_") for c in [model.config])


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_generate_with_cache_rotates_decode_steps_like_a_full_recomputation(family):
    lm = load_model(f"tiny-{family}", device="cpu")
    model = lm.model
    batch = encode(lm.tokenizer, ["the quick brown fox jumps over"])      # one sequence: no padding effects
    options = dict(gamma=3.0, relax=False, sink_positions=[0])
    n_new, prompt_len = 6, batch["input_ids"].shape[1]
    with torch.no_grad():
        plain = model.generate(**batch, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False)
        with outro(model, **options) as o:
            out = model.generate(**batch, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        assert o.state.decode_steps == n_new - 1
        with outro(model, **options):      # the whole sequence at once, no cache
            full = model(input_ids=out.sequences).logits
    cached = torch.stack(out.logits, dim=1)                                 # (1, n_new, V)
    torch.testing.assert_close(cached, full[:, prompt_len - 1:-1], rtol=1e-4, atol=1e-4)
    assert not torch.equal(plain, out.sequences), "OutRo should change what the tiny model writes"


def test_decode_steps_do_not_relax_or_redetect(llama):
    model, tok = llama
    batch = encode(tok, PROMPTS)
    with torch.no_grad(), outro(model, gamma=1.0, sink_positions=[4]) as o:
        model.generate(**batch, max_new_tokens=4, do_sample=False)
    assert set(o.state.sinks) == {0, 1, 2} and all(s.shape[1] == batch["input_ids"].shape[1]
                                                   for s in o.state.sinks.values())
    assert sorted(o.state.relaxed) == [0]
    assert o.state.rotated_decode_rows == 3 * 2     # 3 decode steps x 2 sequences at rotation layer 0


def test_phi_llm_detection_drives_the_method(llama):
    """Plant a massive activation on one token's embedding: Phi_LLM must flag exactly those positions."""
    model, tok = llama
    batch = encode(tok, ["abcXdefX"], chat=False)
    embedding = model.model.embed_tokens.weight
    x_id = batch["input_ids"][0, 4].item()
    saved = embedding[x_id].clone()
    try:
        with torch.no_grad():
            embedding[x_id, 5] = 5000.0
            state = detect_sinks(model, batch)
            with outro(model, gamma=2.0, relax=False) as o:
                model(**batch)
    finally:
        with torch.no_grad():
            embedding[x_id] = saved
    flagged = torch.nonzero(state.sinks[0][0]).flatten().tolist()
    assert flagged == [4, 8]
    assert all(state.sinks[l][0, [4, 8]].all() for l in state.sinks)         # cumulative: kept at later layers
    assert 0 in o.state.direction


def test_direction_controls():
    lm = load_model("tiny-qwen2", device="cpu")
    model, batch = lm.model, encode(lm.tokenizer, PROMPTS)
    with torch.no_grad():
        with capture(model, points=("v",), layers=[0]) as cap:
            model(**batch)
        states = {}
        for kind in ("sink", "head_mean", "random_token"):
            with outro(model, gamma=1.0, relax=False, direction=kind, sink_positions=[5], seed=3) as o:
                model(**batch)
            states[kind] = o.state
    v = cap["v", 0]
    groups = 4 // v.shape[1]
    padding = batch["attention_mask"].bool()
    assert padding[0, 5] and not padding[1, 5]
    torch.testing.assert_close(states["sink"].direction[0][:1], v[:1, :, 5].repeat_interleave(groups, 1))
    assert not states["sink"].direction[0][1].any(), "no sink in the second sequence: no direction"
    # the controls rotate exactly where the sink direction would: not in the sink-less sequence either
    assert not states["head_mean"].direction[0][1].any() and not states["random_token"].direction[0][1].any()
    mean = torch.stack([v[b][:, padding[b]].mean(1) for b in range(v.shape[0])])
    torch.testing.assert_close(states["head_mean"].direction[0][:1], mean[:1].repeat_interleave(groups, 1))
    picks = states["random_token"].random_position
    first_real = padding.float().argmax(1)
    assert (picks != first_real).all() and padding[torch.arange(2), picks].all()
    torch.testing.assert_close(states["random_token"].direction[0][:1],
                               v[0, :, picks[0]][None].repeat_interleave(groups, 1))


def test_bad_options_give_clear_errors(llama):
    model, _ = llama
    with pytest.raises(ValueError, match="direction must be one of"):
        OutRo(model, direction="north")
    with pytest.raises(ValueError, match="gamma"):
        OutRo(model, gamma=-1)
    with pytest.raises(ValueError, match="out of range"):
        OutRo(model, rotate_layers=[7])


def test_default_layers_follow_the_paper():
    rotate, relax = default_layers(30)
    assert rotate == list(range(28)) and relax == [0, 4, 8, 12, 16, 20, 24, 28]
    rotate, relax = default_layers(18)
    assert rotate == list(range(16)) and relax == list(range(0, 18, 2))
    assert default_layers(3) == ([0], [0, 1, 2])


# ---- grading with lm-eval's IFEval checkers ----------------------------------------------------------------

def test_ifeval_grading_is_strict_and_never_counts_excluded_checkers():
    from sinkbook.measures import ifeval
    records = [
        {"id": "a", "prompt": "Say hi. Do not use any commas.", "instruction_id_list": ["punctuation:no_comma"],
         "kwargs": [{}]},
        {"id": "b", "prompt": "Say hi in lowercase, no commas.",
         "instruction_id_list": ["change_case:english_lowercase", "punctuation:no_comma"], "kwargs": [{}, {}]},
    ]
    grades = ifeval.grade(records, ["hi there", "hi, there"])
    assert grades.rows[0]["followed"] == {"punctuation:no_comma": True}
    assert grades.rows[1]["followed"]["punctuation:no_comma"] is False
    try:
        import langdetect  # noqa: F401
        assert "change_case:english_lowercase" in grades.rows[1]["followed"]
    except ImportError:   # the checker needs langdetect: excluded, not counted as followed
        assert grades.rows[1]["excluded"] == ["change_case:english_lowercase"]
        assert "change_case:english_lowercase" in grades.excluded
    assert grades.prompt_level == 0.5
    assert grades.prompt_passes == [True, False]
    assert ifeval.grade(records[:1], ["   "]).prompt_level == 0.0        # empty responses never pass


def test_a_model_without_sinks_is_left_unchanged():
    """Tiny random models have no massive activation: Phi_LLM finds nothing and OutRo is the identity."""
    lm = load_model("tiny-qwen2", device="cpu")
    batch = encode(lm.tokenizer, PROMPTS)
    state = detect_sinks(lm.model, batch)
    assert state.sinks and not any(s.any() for s in state.sinks.values())
    with torch.no_grad():
        plain = lm.model(**batch).logits
        with outro(lm.model, gamma=3.0) as o:
            same = lm.model(**batch).logits
            lm.model.generate(**batch, max_new_tokens=2, do_sample=False)
    assert torch.equal(plain, same) and not o.state.direction and o.state.rotated_decode_rows == 0


# ---- image tokens: OutRo on a small vision-language model (inputs_embeds) ----------------------------------

@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny_vlm(request, tmp_path_factory):
    """A tiny adapted vision-language model (two training steps): a real save/load round trip."""
    from sinkbook.training.adapt import AdaptConfig, adapt
    from sinkbook.training.vlm import load_vlm
    out = tmp_path_factory.mktemp(f"vlm-{request.param}")
    adapt(AdaptConfig(f"tiny-{request.param}", steps=2, stage1_steps=1, batch_size=4), out=out, use_cache=False,
          progress=False)
    return load_vlm(out / "model", device="cpu")


def _image_batch(vlm, loaded, fmt, n=3):
    """Left-padded prompts with 4, 8 and 12 image tokens (different lengths, so padding is exercised)."""
    from sinkbook.training.digits import load_digit_splits, question_and_answer, Example
    from sinkbook.training.vlm import encode_examples
    _, held_out = load_digit_splits()
    examples = []
    for i, k in enumerate([1, 2, 3][:n]):
        digits = tuple(int(held_out.labels[j]) for j in range(i, i + k))
        task = "row" if k > 1 else "identify"
        q, a = question_and_answer(task, digits)
        examples.append(Example(task, digits, held_out.images[i:i + k], q, a))
    batch = encode_examples(examples, loaded.tokenizer, fmt, "vision", answers=False, padding_side="left")
    with torch.no_grad():
        embeds = vlm.embed(batch["input_ids"], batch["image_mask"], batch["images"])
    return batch, embeds


def first_real_and_first_image(first_image: torch.Tensor):
    """A detector for tests: the first real token and the first image token of each sequence are sinks."""
    def detector(hidden, padding):
        found = torch.zeros(hidden.shape[:2], dtype=torch.bool)
        rows = torch.arange(len(found))
        found[rows, padding.float().argmax(1)] = True
        found[rows, first_image] = True
        return found & padding.bool()
    return detector


def test_outro_on_image_tokens_cached_decoding_equals_one_full_pass(tiny_vlm):
    """Prefill + cached decode steps under OutRo (rotation and relaxation, image-token sinks included) give the
    logits of one pass over prompt + generated tokens under OutRo with ``prompt_length``."""
    vlm, loaded, fmt = tiny_vlm
    model = vlm.llm
    batch, embeds = _image_batch(vlm, loaded, fmt)
    first_image = batch["image_mask"].float().argmax(1)
    mask, T, n_new = batch["attention_mask"], embeds.shape[1], 5
    options = dict(gamma=3.0, relax=True, relax_layers=[0, 1], detector=first_real_and_first_image(first_image))
    with torch.no_grad():
        plain = model.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=n_new,
                               min_new_tokens=n_new, do_sample=False, output_logits=True,
                               return_dict_in_generate=True, pad_token_id=0)
        with outro(model, **options) as o:
            out = model.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=n_new,
                                 min_new_tokens=n_new, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
        assert o.state.decode_steps == n_new - 1 and o.state.relaxed and o.state.direction
        assert all(set(r) == {f.item(), i.item()} for r, f, i in
                   zip(o.state.relaxed[0], mask.float().argmax(1), first_image)), "both sinks relaxed once"
        generated = out.sequences[:, -n_new:]
        full = torch.cat([embeds, model.get_input_embeddings()(generated)], dim=1)
        full_mask = torch.cat([mask, torch.ones_like(generated)], dim=1)
        with outro(model, prompt_length=T, **options) as whole:
            logits = model(inputs_embeds=full, attention_mask=full_mask).logits
        with outro(model, **options):        # without prompt_length the relaxed rows would see the answer
            leaky = model(inputs_embeds=full, attention_mask=full_mask).logits
    cached = torch.stack(out.logits, dim=1)
    torch.testing.assert_close(cached, logits[:, T - 1:-1], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(cached, leaky[:, T - 1:-1], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(torch.stack(plain.logits, 1), cached), "OutRo should change the logits"
    assert not whole.state.sinks[0][:, T:].any(), "generated tokens are never sinks"


@pytest.mark.parametrize("direction", ["head_mean", "random_token"])
def test_direction_controls_on_image_tokens_also_match_one_full_pass(tiny_vlm, direction):
    """The controls read the prompt only (the head mean over its keys, the random token among its positions)."""
    vlm, loaded, fmt = tiny_vlm
    model = vlm.llm
    batch, embeds = _image_batch(vlm, loaded, fmt)
    mask, T, n_new = batch["attention_mask"], embeds.shape[1], 4
    options = dict(gamma=3.0, relax=False, direction=direction, seed=1,
                   detector=first_real_and_first_image(batch["image_mask"].float().argmax(1)))
    with torch.no_grad():
        with outro(model, **options) as o:
            out = model.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=n_new,
                                 min_new_tokens=n_new, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
        generated = out.sequences[:, -n_new:]
        full = torch.cat([embeds, model.get_input_embeddings()(generated)], dim=1)
        full_mask = torch.cat([mask, torch.ones_like(generated)], dim=1)
        with outro(model, prompt_length=T, **options) as whole:
            logits = model(inputs_embeds=full, attention_mask=full_mask).logits
    torch.testing.assert_close(torch.stack(out.logits, dim=1), logits[:, T - 1:-1], rtol=1e-4, atol=1e-4)
    if direction == "random_token":
        assert torch.equal(whole.state.random_position, o.state.random_position)


def test_phi_llm_finds_a_massive_image_token(tiny_vlm):
    """A massive activation planted in one projected image token: Phi_LLM flags that position (and only
    it), and the rotation direction is that token's value."""
    vlm, loaded, fmt = tiny_vlm
    batch, embeds = _image_batch(vlm, loaded, fmt, n=2)
    position = batch["image_mask"].float().argmax(1) + 2                       # the third image token
    planted = embeds.clone()
    planted[torch.arange(2), position, 3] = 5000.0
    inputs = {"inputs_embeds": planted, "attention_mask": batch["attention_mask"]}
    state = detect_sinks(vlm.llm, inputs)
    for b in range(2):
        assert torch.nonzero(state.sinks[0][b]).flatten().tolist() == [position[b].item()]
    with torch.no_grad(), capture(vlm.llm, points=("v",), layers=[0]) as cap, \
            outro(vlm.llm, gamma=1.0, relax=False) as o:
        vlm.llm(**inputs)
    v = cap["v", 0]
    groups = o.state.direction[0].shape[1] // v.shape[1]
    want = v[torch.arange(2), :, position].repeat_interleave(groups, dim=1)
    torch.testing.assert_close(o.state.direction[0], want)


def test_prompt_length_must_be_positive(llama):
    model, _ = llama
    with pytest.raises(ValueError, match="prompt_length"):
        OutRo(model, prompt_length=0)
