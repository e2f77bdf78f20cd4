"""A synthetic corpus on which small transformers are reported to grow an attention sink: Bigram-Backcopy.

Guo et al. (2024, "Active-dormant attention heads") train 1-3 layer transformers on sequences from a random
bigram chain in which a few *trigger* tokens are followed not by a bigram draw but by a copy of the token before
the trigger. A head that implements the copy is needed only after triggers; elsewhere its best output is nothing,
and the models learn to park it on the first token (an attention sink with a small value) and grow that token's
residual norm. Here: vocabulary of ``vocab`` tokens plus BOS (id ``vocab``), a bigram matrix whose rows are
Dirichlet(``alpha``) draws, ``triggers`` trigger tokens, all seeded. The corpus is one long stream (train and
validation drawn with different seeds) read in windows that start with BOS, like the Shakespeare corpus, so the
scratch trainer and the gradient-sinks probes use it unchanged.

``induction`` adds a rule that needs two layers (a previous-token head feeding an induction head): after one
of ``induction`` further trigger tokens, the next token repeats the token that followed that trigger's most recent
occurrence within the last ``LOOKBACK`` tokens, unless that token was itself a repeat (which keeps the stream from
locking into a loop); otherwise a bigram draw. A layer above the first then
also has a head that is useful only now and then, the situation in which sinks are reported to form.

What it cannot show: natural text has no single rule that makes a head useless most of the time; a sink grown
here says the training recipe can produce one, not that natural text at this scale would.
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np

DATA_PATTERN = re.compile(r"^bb-(\d+)-(\d+)(?:-i(\d+))?$")     # "bb-<vocab>-<triggers>[-i<induction triggers>]"
LOOKBACK = 16               # how far back the induction rule looks for the previous occurrence


@dataclasses.dataclass(frozen=True)
class BigramBackcopy:
    vocab: int = 64
    triggers: int = 3
    alpha: float = 0.3
    seed: int = 0
    induction: int = 0

    def __post_init__(self):
        if self.vocab < 4 or not 1 <= self.triggers < self.vocab // 2:
            raise ValueError(f"need vocab >= 4 and 1 <= triggers < vocab / 2, got {self.vocab}, {self.triggers}")
        if not 0 <= self.induction <= self.vocab // 2 - self.triggers:
            raise ValueError(f"need 0 <= induction triggers <= vocab / 2 - triggers, got {self.induction}")

    def transition(self) -> np.ndarray:
        """(vocab, vocab) bigram probabilities, one Dirichlet draw per row."""
        return np.random.default_rng(self.seed).dirichlet(np.full(self.vocab, self.alpha), size=self.vocab)

    def trigger_ids(self) -> np.ndarray:
        return np.sort(self._special()[:self.triggers])

    def induction_ids(self) -> np.ndarray:
        return np.sort(self._special()[self.triggers:])

    def _special(self) -> np.ndarray:
        """Back-copy triggers first, then induction triggers (without induction, the same draw as before)."""
        rng = np.random.default_rng(self.seed + 1)
        first = rng.choice(self.vocab, self.triggers, replace=False)
        if not self.induction:
            return first
        rest = np.setdiff1d(np.arange(self.vocab), first)
        return np.concatenate([first, rng.choice(rest, self.induction, replace=False)])

    def stream(self, n: int, seed: int) -> np.ndarray:
        """n tokens: x[t+1] = x[t-1] after a trigger x[t]; after an induction trigger, the token that followed its
        latest occurrence within LOOKBACK tokens (if there is one and that token was not itself a repeat); else a
        draw from the bigram row of x[t]."""
        rng = np.random.default_rng(seed)
        cdf = np.cumsum(self.transition(), axis=1)
        is_trigger = np.zeros(self.vocab, dtype=bool)
        is_trigger[self.trigger_ids()] = True
        is_induction = np.zeros(self.vocab, dtype=bool)
        is_induction[self.induction_ids()] = True
        last = np.full(self.vocab, -n, dtype=np.int64)       # latest position of each induction trigger
        repeated = np.zeros(self.vocab, dtype=bool)          # whether the token after it there was a repeat
        u = rng.random(n)
        x = np.empty(n, dtype=np.int64)
        x[0] = rng.integers(self.vocab)
        x[1] = min(int(np.searchsorted(cdf[x[0]], u[1])), self.vocab - 1)
        for t in range(1, n - 1):
            token = x[t]
            if is_trigger[token]:
                x[t + 1] = x[t - 1]
            elif is_induction[token] and t - last[token] <= LOOKBACK and not repeated[token]:
                x[t + 1] = x[last[token] + 1]
                last[token], repeated[token] = t, True
                continue
            else:
                x[t + 1] = min(int(np.searchsorted(cdf[token], u[t + 1])), self.vocab - 1)
            if is_induction[token]:
                last[token], repeated[token] = t, False
        return x.astype(np.uint16)


@dataclasses.dataclass
class SyntheticCorpus:
    """The fields of ``training.corpus.Corpus`` the scratch trainer and probes read."""
    train_ids: np.ndarray
    val_ids: np.ndarray
    bos_id: int
    vocab_size: int
    source: BigramBackcopy

    def describe(self) -> str:
        s = self.source
        return (f"Bigram-Backcopy: {s.vocab} tokens + BOS, {s.triggers} triggers, Dirichlet({s.alpha}) rows; "
                f"{len(self.train_ids):,} training and {len(self.val_ids):,} validation tokens")


def bigram_backcopy_corpus(vocab: int = 64, triggers: int = 3, train_tokens: int = 2_000_000,
                           val_tokens: int = 100_000, seed: int = 0, induction: int = 0) -> SyntheticCorpus:
    source = BigramBackcopy(vocab, triggers, seed=seed, induction=induction)
    return SyntheticCorpus(source.stream(train_tokens, seed + 10), source.stream(val_tokens, seed + 20), vocab,
                           vocab + 1, source)


def corpus_for(data: str, vocab_size: int = 4096):
    """The corpus a ``TrainConfig.data`` names: "shakespeare" (BPE with ``vocab_size`` tokens) or
    "bb-<vocab>-<triggers>[-i<induction triggers>]" (its vocabulary is vocab + 1, BOS included)."""
    if data == "shakespeare":
        from .corpus import load_corpus
        return load_corpus(vocab_size)
    found = DATA_PATTERN.match(data)
    if not found:
        raise ValueError(f"unknown data {data!r}; use 'shakespeare' or 'bb-<vocab>-<triggers>[-i<induction>]' "
                         f"(e.g. bb-64-3 or bb-64-3-i3)")
    return bigram_backcopy_corpus(int(found.group(1)), int(found.group(2)), induction=int(found.group(3) or 0))
