"""The results file each chapter writes, and the claims table the book assembles from them.

Schema of ``results/<chapter>.json``::

    {"chapter": str, "parameters": {...}, "models": [{"spec", "id", "files": {name: sha256}}],
     "packages": {name: version}, "git_commit": str, "created": iso-time,
     "claims": [Claim, ...]}

A claim compares one published number (or statement) with ours; ``holds`` is True, False or
"not comparable" (e.g. a 7B-model number against a 135M model measured differently).
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import math
import os
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO_ROOT / "results"


def default_results_dir() -> Path:
    """Where results files go: $SINKBOOK_RESULTS_DIR (the book build sets it per profile) or results/."""
    return Path(os.environ.get("SINKBOOK_RESULTS_DIR", RESULTS_DIR))
NOT_COMPARABLE = "not comparable"
_PACKAGES = ("torch", "transformers", "numpy", "scipy", "pandas", "gguf", "papermill", "lm-eval", "sinkbook")


@dataclasses.dataclass
class Claim:
    id: str
    source: str            # paper and section/table, e.g. "VL paper, Table 5"
    statement: str         # what is claimed, in our words
    paper_value: Any       # number or short text as published
    our_value: Any         # what we measured
    rule: str              # tolerance or verdict rule, e.g. "|ours - paper| <= 0.005"
    holds: bool | str      # True / False / "not comparable"

    def __post_init__(self):
        if self.holds != NOT_COMPARABLE:
            if type(self.holds).__name__ not in ("bool", "bool_"):  # numpy comparisons give numpy bools
                raise ValueError(f"claim {self.id!r}: holds must be True, False or {NOT_COMPARABLE!r}, got {self.holds!r}")
            self.holds = bool(self.holds)


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def package_versions(names: Iterable[str] = _PACKAGES) -> dict[str, str]:
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if hasattr(x, "item") and getattr(x, "ndim", 1) == 0:
        return _jsonable(x.item())
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if dataclasses.is_dataclass(x):
        return _jsonable(dataclasses.asdict(x))
    if isinstance(x, Path):
        return str(x)
    return x


def write_results(chapter: str, parameters: dict, claims: list[Claim], models: list[dict] | None = None,
                  extra: dict | None = None, results_dir: str | Path | None = None) -> Path:
    """Write ``results/<chapter>.json``; ``models`` entries come from ``sinkbook.models.model_record``."""
    out_dir = Path(results_dir) if results_dir else default_results_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    ids = [c.id for c in claims]
    dupes = {i for i in ids if ids.count(i) > 1}
    if dupes:
        raise ValueError(f"duplicate claim ids in chapter {chapter!r}: {sorted(dupes)}")
    doc = {
        "chapter": chapter,
        "parameters": parameters,
        "models": models or [],
        "packages": package_versions(),
        "git_commit": git_commit(),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "claims": [dataclasses.asdict(c) for c in claims],
    }
    if extra:
        doc["extra"] = extra
    path = out_dir / f"{chapter}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_jsonable(doc), indent=1))
    tmp.replace(path)  # atomic, so a crash never leaves a half-written results file
    return path


def load_all_results(results_dir: str | Path | None = None) -> list[dict]:
    out_dir = Path(results_dir) if results_dir else default_results_dir()
    return [json.loads(p.read_text()) for p in sorted(out_dir.glob("*.json"))]


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        return ", ".join(_fmt(x) for x in v)
    return str(v)


def claims_markdown(results: list[dict], order: list[str] | None = None) -> str:
    """The claims of every chapter as markdown: a summary table, then one table per chapter."""
    if not results:
        return "*No results files yet: build the book to compute them.*\n"
    rank = {name: i for i, name in enumerate(order or [])}
    results = sorted(results, key=lambda doc: (rank.get(doc["chapter"], len(rank)), doc["chapter"]))

    def tally(claims):
        return [sum(c["holds"] is True for c in claims), sum(c["holds"] is False for c in claims),
                sum(c["holds"] == NOT_COMPARABLE for c in claims)]

    total = tally([c for doc in results for c in doc["claims"]])
    out = [f"{total[0]} claims hold, {total[1]} do not, {total[2]} are not comparable at our scale.", "",
           "| chapter | hold | do not hold | not comparable | models | profile |", "|---|---|---|---|---|---|"]
    for doc in results:
        models = ", ".join(m.get("spec", "?") for m in doc.get("models", [])) or "none (synthetic)"
        profile = doc.get("parameters", {}).get("profile", "?")
        out.append(f"| {doc['chapter']} | " + " | ".join(map(str, tally(doc["claims"]))) + f" | {models} | {profile} |")
    for doc in results:
        out += ["", f"### {doc['chapter']}", "",
                "| claim | source | paper (or bound) | ours | rule | holds |", "|---|---|---|---|---|---|"]
        for c in doc["claims"]:
            mark = {True: "yes", False: "**no**"}.get(c["holds"], "not comparable")
            cells = [c["statement"], c["source"], _fmt(c["paper_value"]), _fmt(c["our_value"]), c["rule"], mark]
            out.append("| " + " | ".join(str(x).replace("|", "\\|").replace("\n", " ") for x in cells) + " |")
    return "\n".join(out) + "\n"
