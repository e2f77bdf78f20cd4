"""Grade responses to IFEval-style prompts with lm-eval's own instruction checkers (strict mode).

Prompt records come from ``sinkbook.prompts`` ({id, prompt, instruction_id_list, kwargs}). Grading follows
lm-eval's ``test_instruction_following_strict``: build the checker from the record's kwargs (None values
dropped; the prompt itself for checkers that take it), and a response follows an instruction when it is
non-empty after stripping and the checker accepts it.

Offline caveats, handled by trying rather than assuming:
- lm-eval imports ``immutabledict`` and ``langdetect`` at module level. When they are not installed, a
  stand-in is put in ``sys.modules`` only for the import: ``immutabledict`` by a read-only mapping (the
  checkers only read constant tables from it); ``langdetect`` by a module whose ``detect`` raises
  ``MissingDependency``. The checkers that call ``detect`` (response language, English capitals, English
  lowercase) then fail the probe below and are reported as excluded: never counted as followed (lm-eval
  counts a *langdetect* failure as followed, which is why the stand-in raises a different exception).
- lm-eval tries ``nltk.download("punkt_tab")`` at import; offline that cannot succeed, so the download is
  skipped (``nltk.download`` replaced by a no-op during the import). Checkers that need punkt then fail
  the probe and are excluded.
"""
from __future__ import annotations

import contextlib
import io
import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass, field

PROBE_RESPONSE = ("Title: <<A probe>>\n\nThis is a short probe answer, with a comma. It has two sentences.\n\n"
                  "* one\n* two\n\nP.S. done")
# Some checkers only reach their dependency for some texts (e.g. English-capitals checks isupper() first).
PROBES = (PROBE_RESPONSE, PROBE_RESPONSE.upper(), PROBE_RESPONSE.lower())


class MissingDependency(RuntimeError):
    """A checker needs a package or data file that is not available on this machine."""


class _ReadOnlyDict(Mapping):
    def __init__(self, *args, **kwargs):
        self._data = dict(*args, **kwargs)

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self):
        return len(self._data)


def _stand_in_modules() -> dict:
    made = {}
    try:
        import immutabledict  # noqa: F401
    except ImportError:
        module = types.ModuleType("immutabledict")
        module.immutabledict = _ReadOnlyDict
        module.__sinkbook_stand_in__ = True
        made["immutabledict"] = module
    try:
        import langdetect  # noqa: F401
    except ImportError:
        module = types.ModuleType("langdetect")

        class LangDetectException(Exception):
            pass

        def detect(text):
            raise MissingDependency("this checker needs the langdetect package, which is not installed")
        module.LangDetectException, module.detect = LangDetectException, detect
        module.__sinkbook_stand_in__ = True
        made["langdetect"] = module
    return made


@dataclass
class Registry:
    instructions: dict                     # instruction id -> checker class
    stand_ins: list = field(default_factory=list)   # packages replaced by stand-ins during import


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
    stand_ins = _stand_in_modules()
    added = [name for name in stand_ins if name not in sys.modules]
    sys.modules.update({name: stand_ins[name] for name in added})
    original_download = nltk.download
    nltk.download = lambda *args, **kwargs: False
    try:
        with contextlib.redirect_stdout(io.StringIO()):   # it prints "Downloaded punkt_tab" after the no-op
            from lm_eval.tasks.ifeval import instructions_registry
    except ImportError as err:
        raise MissingDependency(f"lm-eval's IFEval checkers could not be imported: {err}. "
                                f"Install lm-eval (pip install lm-eval) with its dependencies.") from None
    finally:
        nltk.download = original_download
        for name in added:       # keep the stand-ins out of everyone else's imports
            if sys.modules.get(name) is stand_ins[name]:
                del sys.modules[name]
    _REGISTRY = Registry(dict(instructions_registry.INSTRUCTION_DICT), sorted(stand_ins))
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
    stand_ins: list

    @property
    def graded(self) -> list:
        return [r for r in self.rows if r["followed"]]

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
    return Grades(rows, excluded, load_registry().stand_ins)


def generate_responses(loaded, records: list[dict], max_new_tokens: int = 128, batch_size: int = 8,
                       context=None) -> list[str]:
    """Greedy responses of a loaded chat model to the records' prompts (chat template, left-padded batches).

    ``context`` is a zero-argument callable returning a context manager (e.g. ``lambda: outro(model, ...)``)
    entered around each batch's ``generate``.
    """
    import torch

    from .models import encode
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
