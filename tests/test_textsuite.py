"""Text-capability suite: parsers, items, the multiple-choice grader against a direct computation, held-out
loss against the model's own loss, prompt formats, early stopping, headroom. Tiny models and synthetic
responses only."""
from __future__ import annotations

import json
import re
from importlib import resources

import pytest
import torch

from sinkbook.core.models import TINY_FAMILIES, byte_tokenizer
from sinkbook.measures import textsuite as ts

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _chat_tokenizer():
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def ts_loaded(model, tokenizer):
    from sinkbook.core.models import LoadedModel
    return LoadedModel(model, tokenizer, "test", "test")


# ---- parsers ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("response, strict, flexible", [
    ("12", 12, 12),
    (" 12\n", 12, 12),
    ("The answer is 12.", None, 12),
    ("12 apples, no 13", None, 13),
    ("12.", None, 12),
    ("-3", -3, -3),
    ("no number here", None, None),
    ("", None, None),
    ("1 2", None, 2),
    ("It costs 1,200 in total", None, 1200),
])
def test_strict_and_flexible_parsers(response, strict, flexible):
    assert ts.parse_strict(response) == strict
    assert ts.parse_flexible(response) == flexible


# ---- arithmetic items ------------------------------------------------------------------------------------

def _recompute(item: ts.ArithmeticItem) -> int:
    q = item.question
    if m := re.match(r"What is (\d+) (plus|minus|times) (\d+)\?", q):
        a, op, b = int(m[1]), m[2], int(m[3])
        return {"plus": a + b, "minus": a - b, "times": a * b}[op]
    if m := re.match(r"What number comes after (\d+)\?", q):
        return int(m[1]) + 1
    if m := re.match(r"What number comes next: ([\d, ]+)\?", q):
        seq = [int(x) for x in m[1].split(",")]
        assert all(b - a == 1 for a, b in zip(seq, seq[1:]))
        return seq[-1] + 1
    if m := re.match(r"Which number is larger, (\d+) or (\d+)\?", q):
        assert m[1] != m[2]
        return max(int(m[1]), int(m[2]))
    if m := re.match(r"Write the number (\w+) in digits\.", q):
        return ts._NUMBER_WORDS.index(m[1])
    if m := re.match(r"How many words are in this list: ([\w, ]+)\?", q):
        return len(m[1].split(", "))
    raise AssertionError(f"unrecognised question {q!r}")


def test_arithmetic_items_are_deterministic_and_correct():
    items = ts.arithmetic_items(60, seed=3)
    assert items == ts.arithmetic_items(60, seed=3)
    assert items != ts.arithmetic_items(60, seed=4)
    assert ts.arithmetic_items(10, seed=3) == items[:10]           # a prefix of a longer draw
    assert len({it.question for it in items}) == len(items)
    shots = {q for q, _ in ts.ARITHMETIC_SHOTS}
    for item in items:
        assert item.question not in shots
        assert item.question.endswith(ts.ANSWER_ONLY)
        assert item.answer == _recompute(item) and 0 <= item.answer <= 25
    assert [it.kind for it in items[:5]] == list(ts.ARITHMETIC_KINDS)
    every = ts.arithmetic_items(40, seed=0, kinds=ts.ALL_ARITHMETIC_KINDS)
    assert {it.kind for it in every} == set(ts.ALL_ARITHMETIC_KINDS)
    assert all(it.answer == _recompute(it) for it in every)
    assert all(int(a) == _recompute(ts.ArithmeticItem(q, 0, "")) for q, a in ts.ARITHMETIC_SHOTS)


def test_small_kind_space_still_gives_n_items():
    items = ts.arithmetic_items(30, seed=0, kinds=("mul",))          # only 16 distinct products exist
    assert len(items) == 30 and all(it.answer == _recompute(it) for it in items)


# ---- the knowledge data file -----------------------------------------------------------------------------

def test_knowledge_file_is_well_formed():
    records = json.loads(resources.files("sinkbook").joinpath("data", "knowledge_mc.json").read_text("utf-8"))
    assert 90 <= len(records) <= 130
    assert len({r["id"] for r in records}) == len(records)
    questions = [r["question"].strip().lower() for r in records]
    assert len(set(questions)) == len(questions)
    for r in records:
        assert set(r) == {"id", "topic", "question", "options", "answer"}
        assert r["question"].strip() and r["question"].endswith("?")
        assert len(r["options"]) == 4 and len(set(o.strip().lower() for o in r["options"])) == 4
        assert all(isinstance(o, str) and o.strip() == o and o for o in r["options"])
        assert isinstance(r["answer"], int) and 0 <= r["answer"] < len(r["options"])
    counts = [sum(r["answer"] == k for r in records) for k in range(4)]
    assert min(counts) >= len(records) // 8                        # answers are spread over the positions
    shot_questions = {q.lower() for q, _, _ in ts.KNOWLEDGE_SHOTS}
    assert not shot_questions & set(questions)
    for q, options, answer in ts.KNOWLEDGE_SHOTS:
        assert len(set(options)) == 4 and 0 <= answer < 4


def test_knowledge_items_subsets_are_seeded():
    everything = ts.knowledge_items()
    assert len(everything) == len(json.loads(
        resources.files("sinkbook").joinpath("data", "knowledge_mc.json").read_text("utf-8")))
    sub = ts.knowledge_items(40, seed=1)
    assert sub == ts.knowledge_items(40, seed=1) and len(sub) == 40
    assert sub != ts.knowledge_items(40, seed=2)
    assert [it.id for it in sub] == sorted(it.id for it in sub)   # file order kept
    assert len({it.topic for it in sub}) >= 4


# ---- multiple-choice grading -----------------------------------------------------------------------------

def _direct_option_logprob(loaded, prompt: str, option: str, special: bool) -> float:
    tokenizer = loaded.tokenizer
    prompt_ids = tokenizer(prompt, add_special_tokens=special)["input_ids"]
    whole = tokenizer(prompt + option, add_special_tokens=special)["input_ids"]
    assert whole[:len(prompt_ids)] == prompt_ids
    with torch.no_grad():
        logits = loaded.model(torch.tensor([whole])).logits[0].double()
    logprobs = torch.log_softmax(logits, -1)
    return sum(logprobs[t - 1, whole[t]].item() for t in range(len(prompt_ids), len(whole)))


@pytest.mark.parametrize("family, chat", [(f, False) for f in TINY_FAMILIES] + [("llama", True), ("gemma3", True)])
def test_option_logprobs_match_a_direct_computation(loaded_model, family, chat):
    base = loaded_model(f"tiny-{family}")
    loaded = ts_loaded(base.model, _chat_tokenizer() if chat else base.tokenizer)
    item = ts.MCItem("x-1", "What colour is the sky on a clear day?", ("Blue", "Green", "A red one", "Grey"), 0)
    other = ts.MCItem("x-2", "Which is a fruit?", ("An apple", "A brick"), 0)   # other lengths: padding
    single = ts.MCItem("x-3", "Yes or no?", ("y", "n", "m"), 0)                  # one-token options
    items = (item, other, single)
    requests = [ts.knowledge_request(loaded.tokenizer, it, chat, shots=0 if chat else 2) for it in items]
    if chat:
        assert requests[0][0].endswith("<assistant>") and requests[0][1] == list(item.options)
    else:
        assert requests[0][0].endswith(f"Question: {item.question}\nAnswer:")
        assert requests[0][1] == [" " + o for o in item.options]
    got = ts.option_logprobs(loaded, [p for p, _ in requests], [c for _, c in requests], chat=chat, batch_size=3)
    assert [len(g) for g in got] == [4, 2, 3]
    for (prompt, conts), scores in zip(requests, got):
        want = [_direct_option_logprob(loaded, prompt, c, special=not chat) for c in conts]
        assert scores == pytest.approx(want, abs=2e-3)
    # a tiny logits budget forces one item per forward pass: same numbers
    one_by_one = ts.option_logprobs(loaded, [p for p, _ in requests], [c for _, c in requests], chat=chat,
                                    logits_budget=1)
    for a, b in zip(one_by_one, got):
        assert a == pytest.approx(b, abs=2e-3)


def test_knowledge_accuracy_picks_the_largest_summed_logprob_and_reports_chance(loaded_model):
    loaded = loaded_model("tiny-llama")
    items = [ts.MCItem("a", "Pick one?", ("Yes", "No"), 1, "t1"),
             ts.MCItem("b", "Pick another?", ("Red", "Green", "Blue", "Black"), 2, "t2"),
             ts.MCItem("c", "And this?", ("One", "Two", "Three", "Four"), 0, "t2")]
    result = ts.run_knowledge(loaded, items, shots=1)
    assert result.task == "knowledge_mc" and result.kind == ts.KNOWLEDGE and result.metric == "acc"
    assert result.chance == pytest.approx((1 / 2 + 1 / 4 + 1 / 4) / 3)
    assert result.n == 3 and result.details["format"] == "base 1-shot"
    scores = result.details["logprobs"]
    picks = [max(range(len(s)), key=s.__getitem__) for s in scores]
    assert result.per_item == [int(p == it.answer) for p, it in zip(picks, items)]
    assert result.score == pytest.approx(sum(result.per_item) / 3)
    assert ts.run_knowledge(loaded, ts.knowledge_items(4)).chance == 0.25


# ---- held-out loss ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_heldout_loss_matches_the_models_own_loss(loaded_model, family):
    loaded = loaded_model(f"tiny-{family}")
    torch.manual_seed(0)
    windows = torch.randint(0, 256, (5, 24))
    result = ts.heldout_loss(loaded, windows, logits_budget=2 * 24 * 260)     # chunks of 2 windows
    assert len(result.per_window) == 5 and result.n_tokens == 5 * 23
    with torch.no_grad():
        everything = loaded.model(input_ids=windows, labels=windows).loss.item()
        each = [loaded.model(input_ids=w[None], labels=w[None]).loss.item() for w in windows]
    assert result.loss == pytest.approx(everything, abs=1e-4)
    assert result.per_window == pytest.approx(each, abs=1e-4)
    with pytest.raises(ValueError, match="T >= 2"):
        ts.heldout_loss(loaded, windows[:, :1])


# ---- formats ---------------------------------------------------------------------------------------------

def test_format_is_chat_iff_the_tokenizer_has_a_template():
    plain, chat = byte_tokenizer(), _chat_tokenizer()
    assert ts.use_chat(plain) is False and ts.use_chat(chat) is True
    assert ts.use_chat(chat, chat=False) is False
    with pytest.raises(ValueError, match="no chat template"):
        ts.use_chat(plain, chat=True)
    assert ts.resolve_shots(None, chat=True, available=5) == 0
    assert ts.resolve_shots(None, chat=False, available=5) == 5
    assert ts.resolve_shots(2, chat=True, available=5) == 2
    with pytest.raises(ValueError, match="shots"):
        ts.resolve_shots(6, chat=False, available=5)


def test_prompts_in_both_formats():
    item = ts.arithmetic_items(1)[0]
    base = ts.build_prompt(byte_tokenizer(), item.question, ts.ARITHMETIC_SHOTS, chat=False, shots=2)
    (q1, a1), (q2, a2) = ts.ARITHMETIC_SHOTS[:2]
    assert base == f"Question: {q1}\nAnswer: {a1}\n\nQuestion: {q2}\nAnswer: {a2}\n\nQuestion: {item.question}\nAnswer:"
    chat = ts.build_prompt(_chat_tokenizer(), item.question, ts.ARITHMETIC_SHOTS, chat=True, shots=0)
    assert chat == f"<user>{item.question}\n<assistant>"
    turns = ts.build_prompt(_chat_tokenizer(), item.question, ts.ARITHMETIC_SHOTS, chat=True, shots=1)
    assert turns == f"<user>{q1}\n<assistant>{a1}\n<user>{item.question}\n<assistant>"
    record = ts.ifeval_records(1)[0]
    instruction = ts.build_prompt(byte_tokenizer(), record["prompt"], ts.IFEVAL_SHOTS, False, 1, ts.INSTRUCTION)
    assert instruction.startswith("Instruction: ") and instruction.endswith(f"Instruction: {record['prompt']}\nResponse:")
    assert len(ts.ifeval_records()) == 115


def test_fewshot_examples_are_not_evaluation_items():
    prompts = {r["prompt"] for r in ts.ifeval_records()}
    assert not prompts & {q for q, _ in ts.IFEVAL_SHOTS}


# ---- generation ------------------------------------------------------------------------------------------

def test_stop_criterion_is_per_sequence():
    """Generation stops at stop strings through transformers' criterion, which decides each row on its own."""
    from transformers.generation.stopping_criteria import StopStringCriteria
    ids = torch.tensor([[65, 66, ord("x"), ord("\n")], [65, 66, ord("a"), ord("b")], [65, ord("\n"), 67, 68]])
    assert StopStringCriteria(byte_tokenizer(), ["\n"])(ids, None).tolist() == [True, False, False]


def test_generation_is_batched_in_input_order_and_cut_at_stops(loaded_model):
    loaded = loaded_model("tiny-llama")
    prompts = ["Question: a\nAnswer:", "Question: a much longer prompt here\nAnswer:", "Q: mid length\nA:"]
    alone = [ts.generate(loaded, [p], chat=False, max_new_tokens=12)[0] for p in prompts]
    together = ts.generate(loaded, prompts, chat=False, max_new_tokens=12, batch_size=3)
    assert together == alone                                          # left padding changes nothing
    stops = tuple(next(c for c in text[2:] if c.isascii() and c.isprintable()) for text in together)

    def cut(text):
        ends = [text.find(s) for s in stops if s in text]
        return text[:min(ends)] if ends else text

    stopped = ts.generate(loaded, prompts, chat=False, max_new_tokens=12, stop=stops)
    assert stopped == [cut(t) for t in together]
    assert all(len(s) < len(t) for s, t in zip(stopped, together))


def test_generation_stops_when_every_sequence_has_ended(loaded_model, monkeypatch):
    loaded = loaded_model("tiny-llama")
    calls = []
    original = loaded.model.forward

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(loaded.model, "forward", counting)
    # every single byte decodes to one of these, so every sequence ends with its first new token
    every_byte = tuple(chr(c) for c in range(128)) + ("\ufffd",)
    out = ts.generate(loaded, ["abc", "defgh"], chat=False, max_new_tokens=20, stop=every_byte)
    assert len(calls) <= 2 and out == ["", ""]


def test_common_prefix_leaves_every_sequence_a_token_of_its_own():
    assert ts.common_prefix_length([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == 2
    assert ts.common_prefix_length([[1, 2, 3], [1, 2, 3]]) == 2
    assert ts.common_prefix_length([[7], [7, 8]]) == 0
    assert ts.common_prefix_length([[1, 2], [3, 4]]) == 0


SHARED = "Question: what comes after the worked examples below, in order, one at a time?\nAnswer: "


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_shared_prefix_generation_gives_the_plain_answers(loaded_model, family, monkeypatch):
    loaded = loaded_model(f"tiny-{family}")
    prompts = [SHARED + t for t in ("a", "a much longer tail here", "mid tail", "b")]
    plain = ts.generate(loaded, prompts, chat=False, max_new_tokens=10, batch_size=3)
    assert ts.generate(loaded, prompts, chat=False, max_new_tokens=10, batch_size=3, share_prefix=True) == plain
    stops = ("e", "a")
    assert (ts.generate(loaded, prompts, chat=False, max_new_tokens=10, stop=stops, share_prefix=True)
            == ts.generate(loaded, prompts, chat=False, max_new_tokens=10, stop=stops))
    # a sliding window shorter than the rows makes sharing inexact, so those models generate the plain way
    shared = []
    monkeypatch.setattr(ts, "greedy_shared_prefix", lambda *a, **k: shared.append(1) or [[] for _ in a[1]])
    ts.generate(loaded, prompts, chat=False, max_new_tokens=10, share_prefix=True)
    window = getattr(ts.text_config(loaded.model), "sliding_window", None)
    assert bool(shared) == (window is None)


def test_shared_prefix_gives_the_real_models_arithmetic_answers(real):
    loaded = real
    items = ts.arithmetic_items(8, seed=3)
    plain = ts.run_arithmetic(loaded, items)["arithmetic_strict"].details["responses"]
    assert ts.run_arithmetic(loaded, items, share_prefix=True)["arithmetic_strict"].details["responses"] == plain


def test_the_shared_prefix_runs_once(loaded_model, monkeypatch):
    loaded = loaded_model("tiny-llama")
    shapes = []
    original = loaded.model.forward

    def recording(*args, **kwargs):
        shapes.append(tuple(kwargs["input_ids"].shape))
        return original(*args, **kwargs)

    monkeypatch.setattr(loaded.model, "forward", recording)
    ts.generate(loaded, [SHARED + "a", SHARED + "bcd"], chat=False, max_new_tokens=3, share_prefix=True)
    prefix = len(loaded.tokenizer(SHARED + "a")["input_ids"]) - 1
    assert shapes[0] == (1, prefix) and shapes[1] == (2, 3) and all(s == (2, 1) for s in shapes[2:])


# ---- headroom and the suite ------------------------------------------------------------------------------

def _result(score, chance, kind=ts.FORMAT, n=10):
    return ts.TaskResult("t", kind, "m", score, [], chance, n, 0.0)


def test_headroom_on_synthetic_results():
    assert ts.headroom(_result(0.30, 0.25, ts.KNOWLEDGE), margin=0.02)
    assert not ts.headroom(_result(0.26, 0.25, ts.KNOWLEDGE), margin=0.05)
    assert not ts.headroom(_result(0.20, 0.25, ts.KNOWLEDGE))
    assert not ts.headroom(_result(0.0, 0.0))
    assert not ts.headroom(_result(0.04, 0.0), margin=0.05)
    assert ts.headroom(_result(0.4, 0.0))
    assert not ts.headroom(_result(float("nan"), 0.0, n=0))


def test_suite_on_a_tiny_model(loaded_model):
    loaded = loaded_model("tiny-llama")
    results = ts.run_suite(loaded, arithmetic=5, knowledge=3, ifeval=0, arithmetic_tokens=3)
    assert set(results) == {"arithmetic_strict", "arithmetic_flexible", "knowledge_mc"}
    strict, flexible = results["arithmetic_strict"], results["arithmetic_flexible"]
    assert strict.kind == flexible.kind == ts.FORMAT and strict.chance == 0.0 and strict.n == 5
    assert strict.details["responses"] == flexible.details["responses"]
    assert all(s <= f for s, f in zip(strict.per_item, flexible.per_item))
    assert results["knowledge_mc"].n == 3 and results["knowledge_mc"].details["format"] == "base 5-shot"
    assert ts.run_suite(loaded, arithmetic=0, knowledge=0, ifeval=0) == {}
    items = ts.arithmetic_items(2, seed=9)
    explicit = ts.run_suite(loaded, arithmetic=items, knowledge=0, ifeval=0, arithmetic_tokens=2,
                            shots={"arithmetic": 1})
    assert explicit["arithmetic_strict"].details["answers"] == [it.answer for it in items]
    assert explicit["arithmetic_strict"].details["format"] == "base 1-shot"


def test_ifeval_task_grades_per_prompt_with_the_strict_checkers(loaded_model, monkeypatch):
    from sinkbook.measures import ifeval
    loaded = loaded_model("tiny-llama")
    records = [{"id": "a", "prompt": "Say hi. Write in lowercase.", "instruction_id_list": ["change_case:english_lowercase"],
                "kwargs": [{}]},
               {"id": "b", "prompt": "Say hi. No commas.", "instruction_id_list": ["punctuation:no_comma"],
                "kwargs": [{}]}]
    seen = {}

    def fake_generate(loaded_, prompts, chat, max_new_tokens, stop=(), batch_size=16, context=None):
        seen.update(prompts=prompts, stop=stop, max_new_tokens=max_new_tokens)
        return ["  hello there\n\n", "Hello, there"]

    monkeypatch.setattr(ts, "generate", fake_generate)
    result = ts.run_ifeval(loaded, records, max_new_tokens=7)
    assert seen["stop"] == ("Instruction:",) and seen["max_new_tokens"] == 7
    assert seen["prompts"][0].endswith("Instruction: Say hi. Write in lowercase.\nResponse:")
    assert result.details["responses"] == ["hello there", "Hello, there"]       # format whitespace stripped
    assert result.per_item == [1, 0] and result.details["ids"] == ["a", "b"]
    assert result.score == 0.5 and result.kind == ts.FORMAT and result.chance == 0.0
    want = ifeval.grade(records, ["hello there", "Hello, there"])
    assert result.per_item == [int(r["all_followed"]) for r in want.rows]


@pytest.mark.parametrize("family, chat", [(f, False) for f in TINY_FAMILIES] + [("llama", True)])
def test_option_logprobs_with_a_shared_prefix_match_the_whole_prompts(loaded_model, family, chat, monkeypatch):
    base = loaded_model(f"tiny-{family}")
    loaded = ts_loaded(base.model, _chat_tokenizer() if chat else base.tokenizer)
    items = (ts.MCItem("x-1", "What colour is the sky on a clear day?", ("Blue", "Green", "A red one"), 0),
             ts.MCItem("x-2", "Which is a fruit?", ("An apple", "A brick"), 0),
             ts.MCItem("x-3", "Yes or no?", ("y", "n", "m"), 0))
    requests = [ts.knowledge_request(loaded.tokenizer, it, chat, shots=0 if chat else 2) for it in items]
    prompts, conts = [p for p, _ in requests], [c for _, c in requests]
    whole = ts.option_logprobs(loaded, prompts, conts, chat=chat, batch_size=3)
    passes = []
    original = ts._prompt_pass
    monkeypatch.setattr(ts, "_prompt_pass", lambda *a: passes.append(a[-1]) or original(*a))
    shared = ts.option_logprobs(loaded, prompts, conts, chat=chat, batch_size=3, share_prefix=True)
    for a, b in zip(shared, whole):
        assert a == pytest.approx(b, abs=1e-4)
    # a sliding window shorter than the padded rows makes sharing inexact: those models run the prompts whole
    window = getattr(ts.text_config(loaded.model), "sliding_window", None)
    assert passes == [window is None or window >= max(len(loaded.tokenizer(p)["input_ids"]) for p in prompts) + 3]


def test_the_shared_prefix_of_the_options_runs_once(loaded_model, monkeypatch):
    loaded = loaded_model("tiny-llama")
    shapes = []
    original = loaded.model.forward

    def recording(*args, **kwargs):
        shapes.append(tuple(kwargs["input_ids"].shape))
        return original(*args, **kwargs)

    monkeypatch.setattr(loaded.model, "forward", recording)
    ts.option_logprobs(loaded, [SHARED + "a", SHARED + "bcd"], [[" x", " yy"], [" z"]], chat=False,
                       share_prefix=True)
    prefix = ts.common_prefix_length([loaded.tokenizer(SHARED + t)["input_ids"] for t in ("a", "bcd")])
    assert shapes[0] == (1, prefix) and shapes[1][0] == 2 and shapes[1][1] < 5


def test_shared_prefix_gives_the_real_models_knowledge_logprobs(real):
    items = ts.knowledge_items(12, seed=1)
    whole = ts.run_knowledge(real, items)
    shared = ts.run_knowledge(real, items, share_prefix=True)
    assert shared.details["picks"] == whole.details["picks"]
    for a, b in zip(shared.details["logprobs"], whole.details["logprobs"]):
        assert a == pytest.approx(b, abs=1e-3)
