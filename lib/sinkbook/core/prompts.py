"""Calibration prompts shipped with sinkbook, and reading prompts from a plain-text file.

The two JSON files under ``data/`` were written for this project (they are not IFEval items, though they
follow IFEval's style): ``prompts_calibration.json`` holds the 15 short instruction prompts that Sink
Strength is computed on by default (the VL paper's calibration set has the same size and style), and
``prompts_pool.json`` a disjoint pool of 100 for sample-size sweeps. Each record is

    {"id": "cal-001", "prompt": "...", "instruction_id_list": ["punctuation:no_comma", ...],
     "kwargs": [{...}, ...]}

where the ids and kwargs follow lm-eval's IFEval instruction registry, so a chapter can grade a model's
responses with lm-eval's checkers. No prompt asks for an instruction whose checker needs NLTK's punkt
sentence splitter (``length_constraints:number_sentences``, ``change_case:capital_word_frequency``), so
grading needs no data download.
"""
from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from pathlib import Path

# Instructions whose lm-eval checkers need NLTK punkt data (not available offline); none of ours uses them.
NEEDS_PUNKT = frozenset({"length_constraints:number_sentences", "change_case:capital_word_frequency"})


@lru_cache(maxsize=None)
def _records(name: str) -> tuple:
    text = resources.files("sinkbook").joinpath("data", name).read_text(encoding="utf-8")
    return tuple(json.loads(text))


def calibration_prompts() -> list[dict]:
    """The 15 default calibration prompts (records with id, prompt, instruction_id_list, kwargs)."""
    return [dict(r) for r in _records("prompts_calibration.json")]


def pool_prompts() -> list[dict]:
    """The pool of 100 further prompts, disjoint from the calibration set."""
    return [dict(r) for r in _records("prompts_pool.json")]


def prompt_texts(n: int | None = None, source: str = "calibration") -> list[str]:
    """The first ``n`` prompt strings of the calibration set, the pool, or "all" (calibration then pool)."""
    records = {"calibration": calibration_prompts, "pool": pool_prompts,
               "all": lambda: calibration_prompts() + pool_prompts()}
    if source not in records:
        raise ValueError(f"unknown prompt source {source!r}; use 'calibration', 'pool' or 'all'")
    texts = [r["prompt"] for r in records[source]()]
    if n is not None:
        if n < 1:
            raise ValueError(f"the number of prompts must be at least 1, got {n}")
        if n > len(texts):
            raise ValueError(f"asked for {n} prompts but the {source} set has only {len(texts)}; "
                             f"use source='all' (115 prompts) or a prompts file")
        texts = texts[:n]
    return texts


def load_prompts_file(path) -> list[str]:
    """Prompts from a UTF-8 text file, one per line; blank lines are skipped. A pipe is read too, so
    ``--prompts-file <(grep ... prompts.txt)`` works."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ValueError(f"prompts file {str(path)!r} is a directory; give a plain-text file with one prompt per line")
    if not path.exists():
        raise ValueError(f"prompts file {str(path)!r} does not exist; give a plain-text file with one prompt per line")
    if not (path.is_file() or path.is_fifo()):
        raise ValueError(f"prompts file {str(path)!r} is not a regular file or a pipe; give a plain-text file with one "
                         f"prompt per line")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise ValueError(f"prompts file {str(path)!r} is not UTF-8 text; give a plain-text file with one prompt "
                         f"per line") from None
    prompts = [line.strip() for line in lines if line.strip()]
    if not prompts:
        raise ValueError(f"prompts file {str(path)!r} holds no prompts; write one prompt per line")
    return prompts
