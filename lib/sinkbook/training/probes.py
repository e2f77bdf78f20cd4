"""What an adaptation run measures on its way: the sink against the reference model, and text and vision skill.

``AdaptationProbe(reference)`` is called by ``adapt`` every few steps (and before the first): on the first
``prompts`` calibration prompts (all 15 by default) it measures the sink of the language model being trained (S, strong-sink share, attention on
the first token, Phi_LLM on the first token, token-0 norm ratio) and the Table 5 margin against the reference
model's logits, stored once at construction; then the held-out text loss, a cheap subset of the strictly parsed
arithmetic task (its prompts' shared prefix run once), and, for vision runs, exact-match accuracy on held-out digit
questions. Everything is a forward pass or a few greedy tokens, so a probe costs a few training steps.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from ..core.models import LoadedModel, encode
from ..core.precision import autocast, check_precision
from ..core.prompts import prompt_texts
from ..measures.margins import sink_state, window_layers
from ..measures.textsuite import arithmetic_items, heldout_loss, run_suite
from .corpus import heldout_text_windows
from .digits import TASKS, load_digit_splits, make_examples
from .vlm import generate_answers

VISION_SEED = 777          # held-out digit questions: the same for every run


def answer_matches(response: str, answer: str) -> bool:
    """Strict exact match: the response, stripped of surrounding white space, is the answer."""
    return response.strip() == answer


def chance_level(task: str, digits: int = 1) -> float:
    """Accuracy of guessing uniformly among the possible answers of a task."""
    if task in ("parity", "greater"):
        return 0.5
    return 0.1 ** digits


def vision_scores(vlm, tokenizer, examples, fmt, max_new_tokens: int = 12) -> dict:
    """Exact-match outcome per held-out example, the accuracy per task, and the chance level of the mix."""
    responses = generate_answers(vlm, tokenizer, examples, "vision", fmt, max_new_tokens=max_new_tokens)
    hits = [answer_matches(r, e.answer) for r, e in zip(responses, examples)]
    by_task = {t: float(np.mean([h for h, e in zip(hits, examples) if e.task == t]))
               for t in TASKS if any(e.task == t for e in examples)}
    return {"per_item": [int(h) for h in hits], "accuracy": float(np.mean(hits)), "by_task": by_task,
            "chance": float(np.mean([chance_level(e.task, len(e.digits)) for e in examples])),
            "examples": [(e.question, e.answer, r) for e, r in list(zip(examples, responses))[:6]]}


def held_out_vision_examples(n: int, seed: int = VISION_SEED, tasks=TASKS):
    _, held_out = load_digit_splits()
    return make_examples(held_out, n, seed=seed, tasks=tasks)


class AdaptationProbe:
    def __init__(self, reference: LoadedModel, window: int = 10, arithmetic: int = 24, vision: int = 20,
                 heldout_windows: int = 4, heldout_length: int = 128, seed: int = 0, tasks=TASKS,
                 prompts: int | None = None, precision: str = "float32"):
        self.precision = check_precision(precision)
        self.batch = encode(reference.tokenizer, prompt_texts(prompts), device="cpu")
        self.layers = window_layers(reference.model, window)
        self.reference_logits = sink_state(reference.model, _on(self.batch, reference.device), self.layers)[1]
        self.windows = heldout_text_windows(reference.tokenizer, heldout_windows, heldout_length)[0]
        self.arithmetic = arithmetic_items(arithmetic, seed) if arithmetic else []
        self.vision = held_out_vision_examples(vision, tasks=tasks) if vision else []

    def __call__(self, step: int, vlm, loaded: LoadedModel, fmt, modality: str = "vision") -> dict:
        start = time.perf_counter()
        with torch.no_grad():
            # the sink against the reference's logits stays float32 (an exact comparison); the rest follows the run
            state, _ = sink_state(vlm.llm, _on(self.batch, loaded.device), self.layers, self.reference_logits)
            context = lambda: autocast(self.precision, str(loaded.device), vlm)
            out = {**state, "heldout_loss": float(heldout_loss(loaded, self.windows, context=context).loss)}
            if self.arithmetic:
                suite = run_suite(loaded, arithmetic=self.arithmetic, knowledge=0, ifeval=0, share_prefix=True,
                                  context=context)
                out.update({name: result.score for name, result in suite.items()})
            if self.vision and modality == "vision":
                with context():
                    out["vision_accuracy"] = vision_scores(vlm, loaded.tokenizer, self.vision, fmt)["accuracy"]
        out["probe_seconds"] = time.perf_counter() - start
        return out


def _on(batch: dict, device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}
