"""Generation stops at a stop string through transformers' ``stop_strings`` (``StopStringCriteria``) instead of the
criterion we wrote by hand, which decoded each row's new tokens after every step and looked for the string. The two
must stop every row at the same step, so the answers are the same; the hand-written one is kept here as the reference.

One difference is by design and cannot arise in our prompts: transformers also matches a stop string that begins in
the prompt and ends in the new tokens; our base-format prompts end in "Answer:" / "Response:", which end no prefix
of the stop strings "\\n" and "Instruction:" (checked below)."""
from __future__ import annotations

import random

import pytest
import torch
from transformers.generation.stopping_criteria import StopStringCriteria

from sinkbook.core.models import TINY_FAMILIES, byte_tokenizer
from sinkbook.measures import textsuite as ts

STOPS = (("\n",), ("Instruction:",))


def hand_written_stop(tokenizer, prompt_len: int, stop: tuple):
    """The criterion generation used before: a row is done when its decoded new text contains a stop string."""
    def done(input_ids, scores=None, **kwargs):
        new = input_ids[:, prompt_len:]
        return torch.tensor([any(s in tokenizer.decode(row, skip_special_tokens=True) for s in stop) for row in new])
    return done


def _first_stop(criterion, prompt: list[int], new: list[int]):
    for k in range(1, len(new) + 1):
        if bool(criterion(torch.tensor([prompt + new[:k]]), None)[0]):
            return k
    return None


@pytest.mark.parametrize("stop", STOPS)
def test_both_criteria_stop_at_the_same_step_on_random_text(stop):
    tokenizer = byte_tokenizer()
    rng = random.Random(0)
    pieces = ["ab", " ", ":", "\n", "Instruction:", "Instr", "uction", "ion:"]
    prompt = tokenizer("Question: 2 + 2?\nAnswer:")["input_ids"]
    stopped = 0
    for _ in range(200):
        text = "".join(rng.choice(pieces) for _ in range(8))
        new = tokenizer(text, add_special_tokens=False)["input_ids"]
        ours = _first_stop(hand_written_stop(tokenizer, len(prompt), stop), prompt, new)
        assert ours == _first_stop(StopStringCriteria(tokenizer, list(stop)), prompt, new), repr(text)
        stopped += ours is not None
    assert stopped > 20, "too few texts contain the stop string for the comparison to mean anything"


def test_transformers_also_matches_across_the_prompt_boundary_which_our_prompts_never_offer():
    tokenizer = byte_tokenizer()
    prompt = tokenizer("Instruct")["input_ids"]
    new = tokenizer("ion: more", add_special_tokens=False)["input_ids"]
    assert _first_stop(StopStringCriteria(tokenizer, ["Instruction:"]), prompt, new) == 4
    assert _first_stop(hand_written_stop(tokenizer, len(prompt), ("Instruction:",)), prompt, new) is None
    for ending in ("Answer:", "Response:"):
        for (stop,) in STOPS:
            assert not any(ending.endswith(stop[:i]) for i in range(1, len(stop))), (ending, stop)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_generate_gives_the_hand_written_criterions_answers(family, loaded_model):
    loaded = loaded_model(f"tiny-{family}")
    prompts = ["Question: a\nAnswer:", "Question: a much longer prompt here\nAnswer:", "Q: mid\nA:"]
    ends = ts.end_ids(loaded, False)
    for stop in STOPS:
        answers = ts.generate(loaded, prompts, chat=False, max_new_tokens=16, stop=stop)
        encoded = [loaded.tokenizer(p)["input_ids"] for p in prompts]
        ids, mask = ts.left_pad(encoded, ts.pad_id(loaded.tokenizer), loaded.device)
        from transformers import StoppingCriteriaList
        with torch.no_grad():
            reference = loaded.model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False, temperature=None,
                top_p=None, top_k=None, eos_token_id=ends, pad_token_id=ts.pad_id(loaded.tokenizer),
                stopping_criteria=StoppingCriteriaList([hand_written_stop(loaded.tokenizer, ids.shape[1], stop)]))
        expected = [ts._response(loaded.tokenizer, reference[r, ids.shape[1]:].tolist(), ends, stop)
                    for r in range(len(prompts))]
        assert answers == expected
