"""Grade responses to IFEval-style prompts with lm-eval's own instruction checkers (strict mode).

Prompt records come from ``sinkbook.core.prompts`` ({id, prompt, instruction_id_list, kwargs}). Grading follows
lm-eval's ``test_instruction_following_strict``: build the checker from the record's kwargs (None values
dropped; the prompt itself for checkers that take it), and a response follows an instruction when it is
non-empty after stripping and the checker accepts it.

Offline caveats, handled by trying rather than assuming:
- lm-eval tries ``nltk.download("punkt_tab")`` at import; offline that cannot succeed, so the download is
  skipped (``nltk.download`` replaced by a no-op during the import). Checkers that need punkt then fail
  the probe and are excluded.
"""
from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass

PROBE_RESPONSE = ("Title: <<A probe>>\n\nThis is a short probe answer, with a comma. It has two sentences.\n\n"
                  "* one\n* two\n\nP.S. done")
# Some checkers only reach their dependency for some texts (e.g. English-capitals checks isupper() first).
PROBES = (PROBE_RESPONSE, PROBE_RESPONSE.upper(), PROBE_RESPONSE.lower())


class MissingDependency(RuntimeError):
    """A checker needs a package or data file that is not available on this machine."""


@dataclass
class Registry:
    instructions: dict                     # instruction id -> checker class


_REGISTRY: Registry | None = None


def load_registry() -> Registry:
    """lm-eval's instruction registry, imported without network access (see module docstring)."""
    global _REGISTRY
    if _REGISTRY is not None:
        return _REGISTRY
    try:
        import nltk
    except ImportError:
        raise MissingDependency("lm-eval's IFEval checkers need nltk; install lm-eval with its ifeval extras") from None
    original_download = nltk.download
    nltk.download = lambda *args, **kwargs: False
    try:
        with contextlib.redirect_stdout(io.StringIO()):   # it prints "Downloaded punkt_tab" after the no-op
            from lm_eval.tasks.ifeval import instructions_registry
    except ImportError as err:
        raise MissingDependency(f"lm-eval's IFEval checkers could not be imported: {err}. Install the "
                                f"project's pinned dependencies (langdetect, immutabledict: make setup).") from None
    finally:
        nltk.download = original_download
    _REGISTRY = Registry(dict(instructions_registry.INSTRUCTION_DICT))
    return _REGISTRY


def _checker(instruction_id: str, kwargs: dict, prompt: str):
    registry = load_registry().instructions
    if instruction_id not in registry:
        raise KeyError(f"unknown IFEval instruction id {instruction_id!r}")
    checker = registry[instruction_id](instruction_id)
    checker.build_description(**{k: v for k, v in (kwargs or {}).items() if v})
    args = checker.get_instruction_args()
    if args and "prompt" in args:
        checker.build_description(prompt=prompt)
    return checker


def follows(instruction_id: str, kwargs: dict, prompt: str, response: str) -> bool:
    """lm-eval's strict verdict for one instruction."""
    checker = _checker(instruction_id, kwargs, prompt)
    return bool(response.strip()) and bool(checker.check_following(response))


def excluded_instructions(records: list[dict]) -> dict:
    """{instruction id: reason} for every instruction of ``records`` whose checker cannot run here,
    found by building it with each record's kwargs and checking a probe response."""
    reasons = {}
    for record in records:
        for instruction_id, kwargs in zip(record["instruction_id_list"], record["kwargs"]):
            if instruction_id in reasons:
                continue
            try:
                for probe in PROBES:
                    follows(instruction_id, kwargs, record["prompt"], probe)
            except (LookupError, MissingDependency, ImportError, OSError) as err:
                reasons[instruction_id] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:160]}"
    return reasons


@dataclass
class Grades:
    rows: list                 # per prompt: {id, followed: {instruction: bool}, excluded: [...], all_followed}
    excluded: dict             # instruction id -> reason

    @property
    def graded(self) -> list:
        return [r for r in self.rows if r["followed"]]

    @property
    def prompt_passes(self) -> list:
        """Per prompt, in order: True / False (all its graded instructions followed or not), None when every
        instruction of the prompt was excluded (not graded). What a paired test of two settings pairs."""
        return [r["all_followed"] if r["followed"] else None for r in self.rows]

    @property
    def prompt_level(self) -> float:
        graded = self.graded
        return sum(r["all_followed"] for r in graded) / len(graded) if graded else float("nan")

    @property
    def instruction_level(self) -> float:
        flags = [f for r in self.graded for f in r["followed"].values()]
        return sum(flags) / len(flags) if flags else float("nan")

    @property
    def n_instructions(self) -> int:
        return sum(len(r["followed"]) for r in self.graded)

    def summary(self) -> dict:
        return {"prompts_graded": len(self.graded), "prompts_total": len(self.rows),
                "instructions_graded": self.n_instructions,
                "instructions_excluded": sum(len(r["excluded"]) for r in self.rows),
                "prompt_level_strict": self.prompt_level, "instruction_level_strict": self.instruction_level}


def grade(records: list[dict], responses: list[str]) -> Grades:
    """Strict prompt- and instruction-level grading; excluded checkers are listed, never counted."""
    if len(records) != len(responses):
        raise ValueError(f"{len(records)} prompts but {len(responses)} responses")
    excluded = excluded_instructions(records)
    rows = []
    for record, response in zip(records, responses):
        followed, skipped = {}, []
        for instruction_id, kwargs in zip(record["instruction_id_list"], record["kwargs"]):
            if instruction_id in excluded:
                skipped.append(instruction_id)
            else:
                followed[instruction_id] = follows(instruction_id, kwargs, record["prompt"], response)
        rows.append({"id": record["id"], "followed": followed, "excluded": skipped,
                     "all_followed": bool(followed) and all(followed.values())})
    return Grades(rows, excluded)


def generate_responses(loaded, records: list[dict], max_new_tokens: int = 128, batch_size: int = 8,
                       context=None) -> list[str]:
    """Greedy responses of a loaded chat model to the records' prompts (chat template, left-padded batches).

    ``context`` is a zero-argument callable returning a context manager (e.g. ``lambda: outro(model, ...)``)
    entered around each batch's ``generate``.
    """
    import torch

    from ..core.models import encode
    tokenizer, model = loaded.tokenizer, loaded.model
    out = []
    for start in range(0, len(records), batch_size):
        prompts = [r["prompt"] for r in records[start:start + batch_size]]
        batch = encode(tokenizer, prompts, device=loaded.device)
        with torch.no_grad(), (context() if context else contextlib.nullcontext()):
            generated = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                       pad_token_id=tokenizer.pad_token_id)
        new = generated[:, batch["input_ids"].shape[1]:]
        out.extend(tokenizer.batch_decode(new, skip_special_tokens=True))
    return out
