"""Text-capability suite: how much text capability a model keeps (VL paper, Sec. 3.1 and App. C.1).

The VL paper finds that adapting an LLM into a VLM costs most on *format-sensitive* tasks, graded by a
strict parser of the generated text (IFEval, GSM8K-CoT answer extraction), while *knowledge-like* tasks
graded by log-likelihood (MMLU, BoolQ) are preserved. This module measures small stand-ins for both kinds on
any ``LoadedModel``, chat or base, on a CPU:

- ``arithmetic`` (format): small arithmetic and counting questions with a unique integer answer, generated
  here (``arithmetic_items``), answered greedily and graded twice: *strict* (the whole response, stripped of
  surrounding whitespace, is exactly the number) and *flexible* (the last integer in the response, as
  lm-eval's GSM8K "flexible-extract" takes the last number match);
- ``knowledge_mc`` (knowledge): ~100 simple general-knowledge questions with 4 options that we wrote
  (``data/knowledge_mc.json``; no item comes from MMLU, BoolQ or any data set), graded like lm-eval's
  loglikelihood multiple-choice tasks: the option whose continuation has the largest summed log-probability
  given the prompt wins (``acc``); chance = mean of 1 / number of options;
- ``ifeval`` (format): the project's 115 IFEval-style prompts (``core.prompts``), greedy responses graded
  by lm-eval's strict checkers (``measures.ifeval.grade``); per prompt pass/fail = all instructions followed;
- ``heldout_loss``: mean next-token loss (nats) of token windows the caller provides.

Prompt formats (``chat=None`` picks chat iff the tokenizer has a chat template; pass True/False to force):
- chat: by default zero-shot, the question as the user turn of the chat template (the VL paper's instruct
  protocol, App. B.1); multiple-choice options are scored as the start of the assistant turn. ``shots=k``
  puts k worked examples before it as earlier user/assistant turns (multi-turn few-shot);
- base: by default all of the task's worked examples (ours; none is an evaluation item) in a plain format,
  ``Question: ...\\nAnswer: ...`` for arithmetic and multiple choice, ``Instruction: ...\\nResponse: ...`` for
  IFEval; generation stops at the format's stop string (the end of the answer line for arithmetic, the next
  ``Instruction:`` for IFEval), and the response is the text before it.

Generation is greedy, in left-padded batches sorted by prompt length, and stops as soon as every sequence of
the batch has ended (an end token, or a stop string in base format), so short answers cost little. The
vocabulary can be large (Gemma 3: 262k), so full-vocabulary logits are never kept for a whole batch: the
multiple-choice grader asks the model only for the last positions' logits (``logits_to_keep``) and gathers
the option tokens' log-probabilities; ``heldout_loss`` runs in chunks sized to a logits budget.

A chapter compares an adapted model with its base per item (paired), and drops a task whose base score sits
at its floor (``headroom``): chance for knowledge tasks, 0 for generation tasks.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import logging
import math
import random
import re
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from importlib import resources

import torch

from ..core.arch import head_logits, text_config
from ..core.prompts import calibration_prompts, pool_prompts
from . import ifeval as ifeval_grading

FORMAT, KNOWLEDGE = "format", "knowledge"
LOGITS_BUDGET = 2 ** 25          # float32 logits kept at once (128 MiB): rows x positions x vocabulary
PROBE = {"arithmetic": 24, "knowledge": 40, "ifeval": 0}     # a cheap subset for training probes


# ---- results ----------------------------------------------------------------------------------------------

@dataclass
class TaskResult:
    """One task's score on one model. ``per_item`` is in item order (0/1 for accuracy tasks), so two
    models' results on the same items can be compared pair by pair."""
    task: str
    kind: str                      # "format" (strictly parsed generation) or "knowledge" (log-likelihood)
    metric: str
    score: float
    per_item: list
    chance: float                  # the floor: chance level for multiple choice, 0 for generation tasks
    n: int
    seconds: float
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def headroom(result: TaskResult, margin: float = 0.05) -> bool:
    """True when the score sits more than ``margin`` above the task's floor (``result.chance``: chance
    level for multiple choice, 0 for generation). A task without headroom on the unadapted model cannot
    show a loss and is dropped."""
    if result.n == 0 or not math.isfinite(result.score):
        return False
    return result.score > result.chance + margin


# ---- formats ----------------------------------------------------------------------------------------------

def use_chat(tokenizer, chat: bool | None = None) -> bool:
    """The prompt format: ``chat=None`` -> chat iff the tokenizer has a chat template; True/False forces it
    (True on a tokenizer without a template is an error)."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat is None:
        return has_template
    if chat and not has_template:
        raise ValueError("this tokenizer has no chat template; use chat=False (few-shot format) or chat=None")
    return bool(chat)


QA = ("Question:", "Answer:")
INSTRUCTION = ("Instruction:", "Response:")


def resolve_shots(shots: int | None, chat: bool, available: int) -> int:
    """``None`` -> 0 in chat format (the VL paper's zero-shot instruct protocol), all worked examples in base
    format; an int is checked against the number of examples."""
    if shots is None:
        return 0 if chat else available
    if not 0 <= shots <= available:
        raise ValueError(f"shots must be between 0 and {available}, got {shots}")
    return shots


def format_label(chat: bool, shots: int) -> str:
    return f"chat {shots}-shot" if chat else f"base {shots}-shot"


def build_prompt(tokenizer, question: str, examples, chat: bool, shots: int, labels=QA) -> str:
    """The prompt for one question. Chat: the worked examples as earlier user/assistant turns (none by
    default), then the question as the user turn, ending where the assistant's reply begins. Base: the
    examples as ``Question: q\\nAnswer: a`` blocks separated by a blank line, then ``Question: q\\nAnswer:``
    (``labels`` replaces the two markers)."""
    if chat:
        messages = []
        for q, a in examples[:shots]:
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        messages.append({"role": "user", "content": question})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    head, tail = labels
    return "".join(f"{head} {q}\n{tail} {a}\n\n" for q, a in examples[:shots]) + f"{head} {question}\n{tail}"


# ---- task 1: arithmetic and counting (format-sensitive) ----------------------------------------------------

ARITHMETIC_KINDS = ("add", "sub", "seq", "larger", "digits")           # the default mix
# Also available: "next" (what comes after n) and list counting, which SmolLM2-135M and Gemma-3-270M answer
# at or near 0% (measured), and "mul" (products up to 25).
ALL_ARITHMETIC_KINDS = ARITHMETIC_KINDS + ("next", "mul", "count")
ANSWER_ONLY = " Answer with only the number."
_NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                 "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty")
_COUNT_WORDS = ("apple", "chair", "river", "lamp", "cloud", "horse", "spoon", "bottle", "garden", "pencil",
                "window", "candle", "basket", "mirror", "ticket", "button")
# Worked examples (one per kind of the default mix, in its order); arithmetic_items never returns these.
ARITHMETIC_SHOTS = (
    ("What is 3 plus 4?" + ANSWER_ONLY, "7"),
    ("What is 9 minus 5?" + ANSWER_ONLY, "4"),
    ("What number comes next: 20, 21, 22, 23?" + ANSWER_ONLY, "24"),
    ("Which number is larger, 6 or 14?" + ANSWER_ONLY, "14"),
    ("Write the number eighteen in digits." + ANSWER_ONLY, "18"),
)
_SHOT_QUESTIONS = {q for q, _ in ARITHMETIC_SHOTS}


@dataclass(frozen=True)
class ArithmeticItem:
    question: str
    answer: int
    kind: str


def _arithmetic_item(rng: random.Random, kind: str) -> ArithmeticItem:
    if kind == "add":                                   # sums up to 18
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        return ArithmeticItem(f"What is {a} plus {b}?" + ANSWER_ONLY, a + b, kind)
    if kind == "sub":                                   # non-negative differences of numbers up to 12
        a = rng.randint(3, 12)
        b = rng.randint(1, a - 1)
        return ArithmeticItem(f"What is {a} minus {b}?" + ANSWER_ONLY, a - b, kind)
    if kind == "next":                                  # counting on by one
        a = rng.randint(1, 19)
        return ArithmeticItem(f"What number comes after {a}?" + ANSWER_ONLY, a + 1, kind)
    if kind == "larger":
        a, b = rng.sample(range(1, 21), 2)
        return ArithmeticItem(f"Which number is larger, {a} or {b}?" + ANSWER_ONLY, max(a, b), kind)
    if kind == "digits":
        a = rng.randint(2, 20)
        return ArithmeticItem(f"Write the number {_NUMBER_WORDS[a]} in digits." + ANSWER_ONLY, a, kind)
    if kind == "mul":
        a, b = rng.randint(2, 5), rng.randint(2, 5)
        return ArithmeticItem(f"What is {a} times {b}?" + ANSWER_ONLY, a * b, kind)
    if kind == "seq":
        a = rng.randint(1, 15)
        return ArithmeticItem(f"What number comes next: {a}, {a + 1}, {a + 2}, {a + 3}?" + ANSWER_ONLY, a + 4, kind)
    if kind == "count":
        words = rng.sample(_COUNT_WORDS, rng.randint(2, 5))
        return ArithmeticItem(f"How many words are in this list: {', '.join(words)}?" + ANSWER_ONLY,
                              len(words), kind)
    raise ValueError(f"unknown arithmetic kind {kind!r}; choose from {ALL_ARITHMETIC_KINDS}")


def arithmetic_items(n: int, seed: int = 0, kinds=ARITHMETIC_KINDS) -> list[ArithmeticItem]:
    """``n`` questions cycling through ``kinds`` (balanced), drawn with ``random.Random(seed)``: the same
    (n, seed, kinds) always gives the same items. Questions are distinct while the kind's space allows and
    never one of the few-shot examples."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng, seen, out = random.Random(seed), set(_SHOT_QUESTIONS), []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        for _ in range(200):
            item = _arithmetic_item(rng, kind)
            if item.question not in seen:
                break
        else:           # the kind's space is exhausted: allow a repeat, never a few-shot example
            while item.question in _SHOT_QUESTIONS:
                item = _arithmetic_item(rng, kind)
        seen.add(item.question)
        out.append(item)
    return out


_NUMBER = re.compile(r"-?\d+")


def parse_strict(response: str) -> int | None:
    """The integer when the whole response, stripped of surrounding whitespace, is exactly one; else None."""
    text = response.strip()
    return int(text) if _NUMBER.fullmatch(text) else None


def parse_flexible(response: str) -> int | None:
    """The last integer anywhere in the response (lm-eval GSM8K flexible-extract: last number match)."""
    found = _NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3}\b)", "", response))     # 1,200 -> 1200
    return int(found[-1]) if found else None


def run_arithmetic(loaded, items: list[ArithmeticItem], chat: bool | None = None, shots: int | None = None,
                   max_new_tokens: int = 8, batch_size: int = 16, context=None,
                   share_prefix: bool = False) -> dict[str, TaskResult]:
    """Greedy answers to the items, graded strictly and flexibly: {"arithmetic_strict", "arithmetic_flexible"}
    (one generation, two parsers; both carry its time). Base format stops at the end of the answer line.
    ``share_prefix``: see ``generate``."""
    chat = use_chat(loaded.tokenizer, chat)
    shots = resolve_shots(shots, chat, len(ARITHMETIC_SHOTS))
    start = time.perf_counter()
    prompts = [build_prompt(loaded.tokenizer, item.question, ARITHMETIC_SHOTS, chat, shots) for item in items]
    responses = generate(loaded, prompts, chat=chat, max_new_tokens=max_new_tokens,
                         stop=() if chat else ("\n",), batch_size=batch_size, context=context, share_prefix=share_prefix)
    seconds = time.perf_counter() - start
    fmt = format_label(chat, shots)
    out = {}
    for name, parse in (("strict", parse_strict), ("flexible", parse_flexible)):
        per_item = [int(parse(r) == item.answer) for r, item in zip(responses, items)]
        by_kind = {k: _mean([p for p, it in zip(per_item, items) if it.kind == k])
                   for k in dict.fromkeys(it.kind for it in items)}
        out[f"arithmetic_{name}"] = TaskResult(
            f"arithmetic_{name}", FORMAT, f"exact_match_{name}", _mean(per_item), per_item, 0.0, len(items),
            seconds, {"format": fmt, "by_kind": by_kind, "responses": responses,
                      "answers": [it.answer for it in items], "max_new_tokens": max_new_tokens})
    return out


# ---- task 2: knowledge multiple choice (log-likelihood) ----------------------------------------------------

@dataclass(frozen=True)
class MCItem:
    id: str
    question: str
    options: tuple
    answer: int
    topic: str = ""


# Worked examples for the base format; none is a question of knowledge_mc.json.
KNOWLEDGE_SHOTS = (
    ("How many wheels does a bicycle have?", ("Two", "Five", "Nine", "One"), 0),
    ("What is the capital city of Norway?", ("Bergen", "Oslo", "Tromso", "Stavanger"), 1),
    ("What do birds use to fly?", ("Their tails", "Their beaks", "Their wings", "Their feet"), 2),
    ("What do people use to dry themselves after a bath?", ("A spoon", "A pan", "A brick", "A towel"), 3),
    ("What colour is milk?", ("White", "Green", "Blue", "Black"), 0),
)
MC_STYLES = ("text", "letter")
LETTERS = "ABCDEFGHIJ"


@lru_cache(maxsize=None)
def _knowledge_records() -> tuple:
    text = resources.files("sinkbook").joinpath("data", "knowledge_mc.json").read_text(encoding="utf-8")
    return tuple(json.loads(text))


def knowledge_items(n: int | None = None, seed: int = 0) -> list[MCItem]:
    """The multiple-choice items of ``data/knowledge_mc.json``: all of them (``n=None``), or ``n`` of them
    drawn with ``random.Random(seed)`` and kept in file order (so a subset mixes the topics)."""
    items = [MCItem(r["id"], r["question"], tuple(r["options"]), int(r["answer"]), r.get("topic", ""))
             for r in _knowledge_records()]
    if n is None or n >= len(items):
        return items
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    keep = sorted(random.Random(seed).sample(range(len(items)), n))
    return [items[i] for i in keep]


def _letter_block(question: str, options) -> str:
    return question + "\n" + "\n".join(f"{LETTERS[i]}. {o}" for i, o in enumerate(options))


def knowledge_request(tokenizer, item: MCItem, chat: bool, shots: int = 0, style: str = "text"):
    """(prompt, continuations) for one item. ``style="text"``: the continuation is the option's text (ARC
    style); ``"letter"``: options listed A-D in the prompt, the continuation is the letter (MMLU style).
    Base format: the continuation follows ``Answer:`` after a space; chat: it starts the assistant turn."""
    if style not in MC_STYLES:
        raise ValueError(f"unknown multiple-choice style {style!r}; choose from {MC_STYLES}")
    if style == "text":
        question, labels = item.question, list(item.options)
        shot_pairs = [(q, opts[a]) for q, opts, a in KNOWLEDGE_SHOTS]
    else:
        question, labels = _letter_block(item.question, item.options), list(LETTERS[:len(item.options)])
        shot_pairs = [(_letter_block(q, opts), LETTERS[a]) for q, opts, a in KNOWLEDGE_SHOTS]
    if chat and style == "letter":
        suffix = "\nAnswer with the letter of the correct option."
        question, shot_pairs = question + suffix, [(q + suffix, a) for q, a in shot_pairs]
    prompt = build_prompt(tokenizer, question, shot_pairs, chat, shots)
    return prompt, labels if chat else [" " + label for label in labels]


def run_knowledge(loaded, items: list[MCItem], chat: bool | None = None, shots: int | None = None,
                  style: str = "text", batch_size: int = 16, context=None, share_prefix: bool = False) -> TaskResult:
    """Accuracy of the highest summed log-probability option (lm-eval ``acc``). ``share_prefix``: see
    ``option_logprobs``."""
    chat = use_chat(loaded.tokenizer, chat)
    shots = resolve_shots(shots, chat, len(KNOWLEDGE_SHOTS))
    start = time.perf_counter()
    requests = [knowledge_request(loaded.tokenizer, item, chat, shots, style) for item in items]
    scores = option_logprobs(loaded, [p for p, _ in requests], [c for _, c in requests], chat=chat,
                             batch_size=batch_size, context=context, share_prefix=share_prefix)
    picks = [max(range(len(s)), key=s.__getitem__) for s in scores]
    per_item = [int(p == item.answer) for p, item in zip(picks, items)]
    chance = _mean([1.0 / len(item.options) for item in items])
    by_topic = {t: _mean([p for p, it in zip(per_item, items) if it.topic == t])
                for t in dict.fromkeys(it.topic for it in items)}
    return TaskResult("knowledge_mc", KNOWLEDGE, "acc", _mean(per_item), per_item, chance, len(items),
                      time.perf_counter() - start,
                      {"format": format_label(chat, shots), "style": style, "by_topic": by_topic,
                       "picks": picks, "logprobs": scores})


def option_logprobs(loaded, prompts: list[str], continuations: list[list[str]], chat: bool,
                    batch_size: int = 16, context=None, logits_budget: int = LOGITS_BUDGET,
                    share_prefix: bool = False) -> list[list[float]]:
    """Summed log-probability of each continuation given its prompt, [item][option].

    Prompt and continuation are tokenised together and split where the prompt's own tokens end (lm-eval's
    rule; the continuation alone is tokenised when the split does not line up). Each prompt is run once
    (left-padded batch, its cache kept); the cache is then copied to one row per option and the options'
    tokens are run on top of it. Logits are computed only at the last prompt position (``logits_to_keep``) and
    at the positions that score an option token (the head applied to those hidden states alone, not to the
    padding of shorter options), in chunks of at most ``logits_budget`` floats, and only the option tokens'
    log-probabilities are kept. ``share_prefix``: the prompts' common prefix (worked examples, a system
    prompt) runs once per chunk, as in ``greedy_shared_prefix``; the same numbers up to floating-point rounding,
    unless a sliding attention window is shorter than the padded rows (then the prompts run whole).
    """
    tokenizer, model = loaded.tokenizer, loaded.model
    special = not chat
    prompt_ids, conts = [], []
    for i, (prompt, options) in enumerate(zip(prompts, continuations)):
        ids = tokenizer(prompt, add_special_tokens=special)["input_ids"]
        prompt_ids.append(ids)
        conts.append([])
        for option in options:
            whole = tokenizer(prompt + option, add_special_tokens=special)["input_ids"]
            if whole[:len(ids)] == ids and len(whole) > len(ids):
                cont = whole[len(ids):]
            else:
                cont = tokenizer(option, add_special_tokens=False)["input_ids"]
            if not cont:
                raise ValueError(f"option {option!r} of item {i} tokenises to nothing")
            conts[i].append(cont)
    vocab = text_config(model).vocab_size
    pad = pad_id(tokenizer)

    def cost(chunk):        # floats of logits a chunk needs: the prompts' last positions, the options' scored ones
        return vocab * sum(1 + sum(len(c) - 1 for c in conts[i]) for i in chunk)

    out = [[0.0] * len(options) for options in continuations]
    order = sorted(range(len(prompts)), key=lambda i: len(prompt_ids[i]))
    pos = 0
    while pos < len(order):
        chunk = [order[pos]]
        while (pos + len(chunk) < len(order) and len(chunk) < batch_size
               and cost(chunk + [order[pos + len(chunk)]]) <= logits_budget):
            chunk.append(order[pos + len(chunk)])
        pos += len(chunk)
        rows = [(b, j) for b, i in enumerate(chunk) for j in range(len(conts[i]))]
        tokens = [conts[chunk[b]][j] for b, j in rows]
        with torch.no_grad(), _entered(context):
            first, mask = _prompt_pass(model, [prompt_ids[i] for i in chunk], pad, loaded.device,
                                       share_prefix and _window_covers(model, [prompt_ids[i] for i in chunk],
                                                                       max(len(t) for i in chunk for t in conts[i])))
            cache, first_logits = first.cache, first.logits[:, -1].float()                    # (B, V)
            first_logprobs = first_logits - torch.logsumexp(first_logits, -1, keepdim=True)
            del first, first_logits
            width = max(len(t) for t in tokens) - 1        # option tokens fed after the prompt
            later = []                                      # log-probabilities of the options' later tokens
            if width > 0:
                select = torch.tensor([b for b, _ in rows], device=mask.device)
                cache.batch_select_indices(select)
                fed = torch.full((len(rows), width), pad, dtype=torch.long, device=mask.device)
                fed_mask = torch.zeros_like(fed)
                for r, t in enumerate(tokens):
                    fed[r, :len(t) - 1] = torch.tensor(t[:-1], device=mask.device)
                    fed_mask[r, :len(t) - 1] = 1
                positions = mask.sum(-1)[select][:, None] + torch.arange(width, device=mask.device)
                decoder = model.get_decoder()
                hidden = decoder(input_ids=fed, attention_mask=torch.cat([mask[select], fed_mask], -1),
                                 position_ids=positions, use_cache=True,
                                 **{_cache_arg(decoder): cache}).last_hidden_state
                # the head only where an option token is scored, not on the padding of shorter options
                real = fed_mask.bool()
                logits = head_logits(model, hidden[real])                                 # (scored, V)
                scored = torch.tensor([t for tok in tokens for t in tok[1:]], device=mask.device)
                later = (logits.gather(1, scored[:, None])[:, 0] - torch.logsumexp(logits, -1)).tolist()
                del hidden, logits
        at = 0
        for (b, j), t in zip(rows, tokens):
            out[chunk[b]][j] = first_logprobs[b, t[0]].item() + sum(later[at:at + len(t) - 1])
            at += len(t) - 1
        del cache
    return out


def _prompt_pass(model, prompts: list[list[int]], pad: int, device, share_prefix: bool):
    """The prompts' forward pass with their cache and the last position's logits, and the attention mask the
    tokens fed after them extend. Shared: the common prefix runs once and each row's own tokens, left-padded
    between the prefix and themselves, run on top at the positions they would have alone."""
    n = common_prefix_length(prompts) if share_prefix and len(prompts) > 1 else 0
    if n == 0:
        ids, mask = left_pad(prompts, pad, device)
        return model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), use_cache=True,
                     logits_to_keep=1), mask
    ids, own_mask = left_pad([p[n:] for p in prompts], pad, device)
    lengths = own_mask.sum(-1) + n
    positions = (lengths[:, None] - ids.shape[1] + torch.arange(ids.shape[1], device=device)).clamp(min=0)
    mask = torch.cat([torch.ones(len(prompts), n, dtype=torch.long, device=device), own_mask], 1)
    cache = model(input_ids=torch.tensor([prompts[0][:n]], device=device), use_cache=True).past_key_values
    cache.batch_repeat_interleave(len(prompts))
    return model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                 **{_cache_arg(model): cache}), mask


def _cache_arg(model) -> str:
    # transformers 5.x renames the forward argument past_key_values to cache
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


# ---- task 3: IFEval-style strict compliance (format-sensitive) ---------------------------------------------

# Worked examples for the base format, written for this module (not IFEval items, not among the 115 prompts).
IFEVAL_SHOTS = (
    ("Describe a sunny morning in two sentences. Write everything in lowercase letters.",
     "the sun rose slowly over the quiet street. birds sang from every roof."),
    ("Name three kinds of fruit. Answer with a markdown bullet list of exactly 3 items, like * item.",
     "* apple\n* banana\n* cherry"),
    ("Say why people keep plants at home. Do not use any commas. End your answer with the phrase \"Hope this helps.\"",
     "Plants make a room look fresh and calm. Many people also like caring for something that grows. "
     "Hope this helps."),
)


def ifeval_records(n: int | None = None) -> list[dict]:
    """The project's 115 IFEval-style prompt records (calibration then pool), or the first ``n``."""
    records = calibration_prompts() + pool_prompts()
    return records if n is None else records[:n]


def run_ifeval(loaded, records: list[dict], chat: bool | None = None, shots: int | None = None,
               max_new_tokens: int = 128, batch_size: int = 8, context=None) -> TaskResult:
    """Prompt-level strict accuracy: a prompt passes when every gradable instruction is followed. Base format
    stops at the next ``Instruction:``."""
    chat = use_chat(loaded.tokenizer, chat)
    shots = resolve_shots(shots, chat, len(IFEVAL_SHOTS))
    start = time.perf_counter()
    prompts = [build_prompt(loaded.tokenizer, r["prompt"], IFEVAL_SHOTS, chat, shots, INSTRUCTION) for r in records]
    responses = generate(loaded, prompts, chat=chat, max_new_tokens=max_new_tokens,
                         stop=() if chat else ("Instruction:",), batch_size=batch_size, context=context)
    if not chat:
        responses = [r.strip() for r in responses]     # the separator whitespace of the few-shot format
    gen_seconds = time.perf_counter() - start
    grades = ifeval_grading.grade(records, responses)
    graded = [row for row in grades.rows if row["followed"]]
    per_item = [int(row["all_followed"]) for row in graded]
    return TaskResult("ifeval", FORMAT, "prompt_level_strict_acc", _mean(per_item), per_item, 0.0, len(per_item),
                      time.perf_counter() - start,
                      {"format": format_label(chat, shots), "ids": [row["id"] for row in graded],
                       "instruction_level_strict": grades.instruction_level, "excluded": grades.excluded,
                       "responses": responses, "generation_seconds": gen_seconds,
                       "max_new_tokens": max_new_tokens})


# ---- task 4: held-out loss --------------------------------------------------------------------------------

@dataclass
class HeldoutLoss:
    loss: float                    # mean next-token loss over all windows (nats)
    per_window: list               # mean next-token loss of each window (nats)
    n_tokens: int                  # predicted tokens: N x (T - 1)
    seconds: float


def heldout_loss(loaded, windows: torch.Tensor, batch_size: int | None = None, context=None,
                 logits_budget: int = 2 * LOGITS_BUDGET) -> HeldoutLoss:
    """Mean next-token cross-entropy of each (N, T) window, as the model's own ``labels=`` loss computes it
    for one window; run in chunks of rows so that chunk x T x vocabulary logits fit ``logits_budget``."""
    if windows.ndim != 2 or windows.shape[1] < 2:
        raise ValueError(f"windows must be an (N, T) tensor of token ids with T >= 2, got {tuple(windows.shape)}")
    start = time.perf_counter()
    n, length = windows.shape
    vocab = text_config(loaded.model).vocab_size
    rows = max(1, logits_budget // (length * vocab))
    if batch_size:
        rows = min(rows, batch_size)
    per_window = []
    for first in range(0, n, rows):
        ids = windows[first:first + rows].to(loaded.device)
        with torch.no_grad(), _entered(context):
            logits = loaded.model(input_ids=ids, use_cache=False).logits
        losses = torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:],
                                                   reduction="none")
        per_window += losses.mean(-1).tolist()
        del logits, losses
    return HeldoutLoss(_mean(per_window), per_window, n * (length - 1), time.perf_counter() - start)


# ---- generation -------------------------------------------------------------------------------------------

def pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def end_ids(loaded, chat: bool) -> list[int]:
    """Token ids that end a response: the generation config's and tokenizer's eos, plus, in chat format,
    the template's end-of-turn tokens when the vocabulary has them."""
    ids = set()
    for source in (getattr(loaded.model, "generation_config", None), loaded.tokenizer):
        eos = getattr(source, "eos_token_id", None)
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    if chat:
        added = loaded.tokenizer.get_added_vocab() if hasattr(loaded.tokenizer, "get_added_vocab") else {}
        ids.update(added[t] for t in ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<|endoftext|>")
                   if t in added)
    return sorted(ids)


def left_pad(sequences: list[list[int]], pad: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, s in enumerate(sequences):
        if s:
            ids[row, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[row, width - len(s):] = 1
    return ids.to(device), mask.to(device)


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


def common_prefix_length(sequences: list[list[int]]) -> int:
    """Tokens every sequence starts with, leaving each at least one token of its own."""
    n = min(len(s) for s in sequences) - 1
    for i in range(max(n, 0)):
        if any(s[i] != sequences[0][i] for s in sequences):
            return i
    return max(n, 0)


def greedy_shared_prefix(model, sequences: list[list[int]], ends: list[int], max_new_tokens: int,
                         done_text=None, pad: int = 0) -> list[list[int]]:
    """Greedy continuations of token sequences that share a long prefix (a system prompt, worked examples):
    the prefix runs once, its key/value cache is copied to every row, then each row's own tokens and the new
    ones run on top. Rows are padded between the prefix and their own tokens (masked out; explicit positions keep
    every real token where it would be alone). ``done_text(row_tokens)`` says whether a row may stop early (a
    stop string); a row also stops at an end token. Returns the new tokens of each row, end token included."""
    device = next(model.parameters()).device
    n = common_prefix_length(sequences)
    own = [s[n:] for s in sequences]
    rows, width = len(own), max(len(s) for s in own)
    ids, own_mask = left_pad(own, pad, device)
    lengths = torch.tensor([n + len(s) for s in own], device=device)
    positions = (lengths[:, None] - width + torch.arange(width, device=device)).clamp(min=0)
    mask = torch.cat([torch.ones(rows, n, dtype=torch.long, device=device), own_mask], 1)
    new = [[] for _ in range(rows)]
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    cache_arg = _cache_arg(model)
    with torch.no_grad():
        cache = model(input_ids=torch.tensor([sequences[0][:n]], device=device), use_cache=True).past_key_values
        cache.batch_repeat_interleave(rows)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                       **{cache_arg: cache}).logits[:, -1]
        for _ in range(max_new_tokens):
            token = logits.argmax(-1)
            for row in range(rows):
                if not done[row]:
                    new[row].append(int(token[row]))
                    done[row] = new[row][-1] in ends or bool(done_text and done_text(new[row]))
            if done.all():
                break
            mask = torch.cat([mask, torch.ones(rows, 1, dtype=torch.long, device=device)], 1)
            logits = model(input_ids=token[:, None], attention_mask=mask, position_ids=lengths[:, None],
                           use_cache=True, **{cache_arg: cache}).logits[:, -1]
            lengths = lengths + 1
    return new


def generate(loaded, prompts: list[str], chat: bool, max_new_tokens: int, stop: tuple = (),
             batch_size: int = 16, context=None, share_prefix: bool = False) -> list[str]:
    """Greedy responses to fully formatted prompts (chat template applied, or few-shot text), in the order
    given. Batches are left-padded and sorted by length; a batch stops when all its sequences have ended.
    A response is the decoded text before the first end token and before the first stop string.
    ``context``: a zero-argument callable returning a context manager entered around each batch (e.g. an
    intervention). ``share_prefix``: run the prompts' common prefix once (``greedy_shared_prefix``; the same
    greedy answers up to floating-point ties, at a fraction of the cost when the prefix is long), unless a sliding
    attention window is shorter than the padded rows."""
    tokenizer, model = loaded.tokenizer, loaded.model
    encoded = [tokenizer(p, add_special_tokens=not chat)["input_ids"] for p in prompts]
    order = sorted(range(len(encoded)), key=lambda k: len(encoded[k]))
    pad, ends = pad_id(tokenizer), end_ids(loaded, chat)
    out = [""] * len(prompts)
    for first in range(0, len(order), batch_size):
        chunk = order[first:first + batch_size]
        if share_prefix and _window_covers(model, [encoded[k] for k in chunk], max_new_tokens):
            def stopped(tokens):
                return any(s in tokenizer.decode(tokens, skip_special_tokens=True) for s in stop)
            with torch.no_grad(), _entered(context):
                news = greedy_shared_prefix(model, [encoded[k] for k in chunk], ends, max_new_tokens,
                                            stopped if stop else None, pad)
            for k, new in zip(chunk, news):
                out[k] = _response(tokenizer, new, ends, stop)
            continue
        ids, mask = left_pad([encoded[k] for k in chunk], pad, loaded.device)
        # a row ends at an end token or (base format) a stop string: transformers' own criteria, which give the same
        # answers and stopping steps as the per-row decode we used before (tests/test_stop_strings.py)
        with torch.no_grad(), _entered(context):
            generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                       do_sample=False, temperature=None, top_p=None, top_k=None,
                                       eos_token_id=ends, pad_token_id=pad, stop_strings=list(stop) or None,
                                       tokenizer=tokenizer if stop else None)
        for row, k in enumerate(chunk):
            out[k] = _response(tokenizer, generated[row, ids.shape[1]:].tolist(), ends, stop)
    return out


def _window_covers(model, sequences: list[list[int]], max_new_tokens: int) -> bool:
    """Whether a sliding attention window (if any) spans every padded row: with padding between the shared prefix
    and a row's own tokens, a window shorter than that would cut at other tokens than it does for the row alone."""
    window = getattr(text_config(model), "sliding_window", None)
    return window is None or max(len(s) for s in sequences) + max_new_tokens <= window     # padded row width


def _response(tokenizer, new: list[int], ends, stop) -> str:
    cut = next((i for i, t in enumerate(new) if t in ends), len(new))
    text = tokenizer.decode(new[:cut], skip_special_tokens=True)
    for s in stop:
        text = text.split(s, 1)[0]
    return text


# ---- the suite --------------------------------------------------------------------------------------------

def run_suite(loaded, arithmetic: int | list = 60, knowledge: int | list | None = None,
              ifeval: int | list | None = None, chat: bool | None = None, seed: int = 0, shots: dict | None = None,
              arithmetic_tokens: int = 8, ifeval_tokens: int = 128, mc_style: str = "text",
              batch_size: int = 16, context=None, share_prefix: bool = False) -> dict[str, TaskResult]:
    """Run the suite; each task's argument is a size or an explicit item list, 0 skips it:

    - ``arithmetic``: n generated items (``arithmetic_items(n, seed)``) or a list of ArithmeticItem ->
      ``arithmetic_strict`` and ``arithmetic_flexible``;
    - ``knowledge``: None = all items, n = ``knowledge_items(n, seed)``, or a list of MCItem -> ``knowledge_mc``;
    - ``ifeval``: None = all 115 prompts, n = the first n, or a list of records -> ``ifeval``.

    ``shots`` overrides the number of worked examples per task ({"arithmetic": 5, "knowledge": 0, "ifeval": 3});
    a task left out uses its default (0 in chat format, all of its examples in base format).
    ``share_prefix``: arithmetic and knowledge run their prompts' common prefix once (``generate``,
    ``option_logprobs``); IFEval's answers are long enough that the prompts' prefill hardly counts.
    ``run_suite(loaded, **PROBE)`` is the cheap probe (24 arithmetic items, 40 multiple-choice items).
    """
    shots = dict(shots or {})
    unknown = set(shots) - {"arithmetic", "knowledge", "ifeval"}
    if unknown:
        raise ValueError(f"shots names unknown tasks {sorted(unknown)}; use arithmetic, knowledge, ifeval")
    results: dict[str, TaskResult] = {}
    if arithmetic:
        items = arithmetic_items(arithmetic, seed) if isinstance(arithmetic, int) else list(arithmetic)
        _log_task("arithmetic", len(items))
        results.update(run_arithmetic(loaded, items, chat, shots.get("arithmetic"), arithmetic_tokens, batch_size, context,
                                      share_prefix))
    if knowledge is None or knowledge:
        items = knowledge_items(knowledge, seed) if knowledge is None or isinstance(knowledge, int) else list(knowledge)
        _log_task("knowledge (multiple choice)", len(items))
        results["knowledge_mc"] = run_knowledge(loaded, items, chat, shots.get("knowledge"), mc_style, batch_size, context,
                                                share_prefix)
    if ifeval is None or ifeval:
        records = ifeval_records(ifeval) if ifeval is None or isinstance(ifeval, int) else list(ifeval)
        _log_task("instruction following (IFEval-style, generated answers)", len(records))
        results["ifeval"] = run_ifeval(loaded, records, chat, shots.get("ifeval"), ifeval_tokens, max(1, batch_size // 2), context)
    return results


def _log_task(name: str, items: int) -> None:
    logging.getLogger(__name__).info("text suite: %s, %d items ...", name, items)


def _entered(context):
    return context() if context is not None else contextlib.nullcontext()


def _mean(values) -> float:
    values = list(values)
    return float(sum(values) / len(values)) if values else float("nan")
