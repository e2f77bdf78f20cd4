"""A real image modality that needs no download: the 8x8 handwritten digits bundled with scikit-learn.

1,797 grey-scale images of the digits 0-9 (16 intensity levels), split once into training and held-out images
(stratified by label, fixed seed). On top of them, tasks a vision-language model can only solve by reading the
image, each with a strict short answer:

- ``caption``:  "Describe the image in a few words."               -> "a handwritten seven"
- ``identify``: "Which digit is shown? Answer with only the digit." -> "7"
- ``parity``:   "Is the digit even? Answer yes or no."              -> "no"
- ``greater``:  "Is the digit greater than four? Answer yes or no." -> "yes"
- ``row``:      2-4 digits side by side, "Read the digits from left to right. ..." -> "3 1 4"

The text-only counterpart of an example keeps the question and the answer and replaces the image by the digit
words ("Digits: three one four"): the same task form, the same answers and the same supervised answer tokens,
with the modality of the input as the only difference.
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache

import numpy as np
import torch

WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
TASKS = ("caption", "identify", "parity", "greater", "row")
HELD_OUT_SHARE = 0.25
SPLIT_SEED = 1234


@dataclasses.dataclass(frozen=True)
class DigitSplit:
    images: torch.Tensor      # (N, 8, 8) float32 in [0, 1]
    labels: torch.Tensor      # (N,) int64
    name: str

    def __len__(self) -> int:
        return len(self.labels)


@lru_cache(maxsize=None)
def load_digit_splits() -> tuple[DigitSplit, DigitSplit]:
    """(train, held_out): a stratified split of sklearn's digits, the same on every machine."""
    from sklearn.datasets import load_digits
    data = load_digits()
    images = torch.tensor(data.images / 16.0, dtype=torch.float32)
    labels = torch.tensor(data.target, dtype=torch.long)
    rng = np.random.default_rng(SPLIT_SEED)
    held = []
    for digit in range(10):
        idx = np.flatnonzero(data.target == digit)
        held += rng.choice(idx, size=round(HELD_OUT_SHARE * len(idx)), replace=False).tolist()
    mask = np.zeros(len(labels), dtype=bool)
    mask[held] = True
    train = DigitSplit(images[~mask], labels[~mask], "train")
    test = DigitSplit(images[mask], labels[mask], "held-out")
    return train, test


@dataclasses.dataclass(frozen=True)
class Example:
    task: str
    digits: tuple[int, ...]
    images: torch.Tensor      # (k, 8, 8): the k digit images of the example, left to right
    question: str
    answer: str

    @property
    def text_stand_in(self) -> str:
        """What replaces the image in the text-only counterpart."""
        return "Digits: " + " ".join(WORDS[d] for d in self.digits)


def question_and_answer(task: str, digits: tuple[int, ...], threshold: int = 4) -> tuple[str, str]:
    d = digits[0]
    if task == "caption":
        return "Describe the image in a few words.", f"a handwritten {WORDS[d]}"
    if task == "identify":
        return "Which digit is shown? Answer with only the digit.", str(d)
    if task == "parity":
        return "Is the digit even? Answer yes or no.", "yes" if d % 2 == 0 else "no"
    if task == "greater":
        return f"Is the digit greater than {WORDS[threshold]}? Answer yes or no.", "yes" if d > threshold else "no"
    if task == "row":
        return ("Read the digits from left to right. Answer with the digits separated by spaces.",
                " ".join(str(x) for x in digits))
    raise ValueError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")


def make_examples(split: DigitSplit, n: int, seed: int, tasks=TASKS, row_lengths=(2, 3, 4)) -> list[Example]:
    """``n`` examples drawn with ``seed``: tasks in turn, digits drawn uniformly from ``split``."""
    unknown = set(tasks) - set(TASKS)
    if unknown:
        raise ValueError(f"unknown task(s) {sorted(unknown)}; tasks: {', '.join(TASKS)}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        task = tasks[i % len(tasks)]
        k = int(rng.choice(row_lengths)) if task == "row" else 1
        idx = rng.integers(0, len(split), size=k)
        digits = tuple(int(split.labels[j]) for j in idx)
        question, answer = question_and_answer(task, digits)
        out.append(Example(task, digits, split.images[torch.as_tensor(idx)], question, answer))
    return out
