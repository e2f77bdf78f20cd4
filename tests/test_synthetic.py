"""The Bigram-Backcopy corpus: its two rules, its seeding, and its use by the scratch trainer's configuration."""
from __future__ import annotations

import numpy as np
import pytest

from sinkbook.training.scratch import TrainConfig
from sinkbook.training.synthetic import BigramBackcopy, bigram_backcopy_corpus, corpus_for


def test_triggers_copy_the_token_before_them_and_others_follow_the_bigram_support():
    source = BigramBackcopy(vocab=16, triggers=2, alpha=0.05, seed=3)
    x = source.stream(20_000, seed=1).astype(int)
    triggers = set(source.trigger_ids().tolist())
    after = [t for t in range(1, len(x) - 1) if x[t] in triggers]
    assert after and all(x[t + 1] == x[t - 1] for t in after)
    p = source.transition()
    others = [t for t in range(1, len(x) - 1) if x[t] not in triggers]
    # with alpha 0.05 most bigram entries are ~0: a draw lands where the row has mass
    assert np.mean([p[x[t], x[t + 1]] > 1e-3 for t in others]) > 0.99
    counts = np.bincount(x[:-1][np.isin(x[:-1], list(triggers), invert=True)] * 16
                         + x[1:][np.isin(x[:-1], list(triggers), invert=True)], minlength=256).reshape(16, 16)
    row = int(np.argmax(counts.sum(1)))
    empirical = counts[row] / counts[row].sum()
    assert np.abs(empirical - p[row]).max() < 0.05


def test_streams_are_seeded_and_the_corpus_reserves_bos():
    source = BigramBackcopy(vocab=8, triggers=1)
    assert np.array_equal(source.stream(500, 4), source.stream(500, 4))
    assert not np.array_equal(source.stream(500, 4), source.stream(500, 5))
    corpus = bigram_backcopy_corpus(vocab=8, triggers=1, train_tokens=1000, val_tokens=200)
    assert corpus.bos_id == 8 and corpus.vocab_size == 9 and corpus.train_ids.max() < 8
    assert not np.array_equal(corpus.train_ids[:200], corpus.val_ids)


def test_data_names_are_checked_and_keys_stay_for_shakespeare():
    with pytest.raises(ValueError, match="unknown data"):
        corpus_for("bb-64")
    with pytest.raises(ValueError, match="triggers"):
        BigramBackcopy(vocab=8, triggers=4)
    assert "data" not in TrainConfig().record()
    assert TrainConfig(data="bb-64-3", vocab_size=65).key() != TrainConfig(vocab_size=65).key()


def test_induction_triggers_repeat_what_followed_them_last_time_unless_that_was_a_repeat():
    from sinkbook.training.synthetic import LOOKBACK
    source = BigramBackcopy(vocab=16, triggers=1, induction=2, alpha=0.3, seed=2)
    x = source.stream(20_000, seed=3).astype(int)
    induction = set(source.induction_ids().tolist())
    assert not induction & set(source.trigger_ids().tolist())
    repeats = drawn = 0
    repeated_after = {}                        # position of an induction trigger -> whether its follower was a repeat
    for t in range(1, len(x) - 1):
        if x[t] not in induction:
            continue
        earlier = [p for p in range(max(1, t - LOOKBACK), t) if x[p] == x[t]]   # the stream's rules start at 1
        if earlier and not repeated_after[earlier[-1]]:
            assert x[t + 1] == x[earlier[-1] + 1]
            repeated_after[t] = True
            repeats += 1
        else:
            repeated_after[t] = False
            drawn += 1
    assert repeats > 100 and drawn > 100       # both branches exercised
    assert np.isin(x, list(induction)).mean() < 0.2     # no loop takes the stream over


def test_induction_names_parse_and_old_names_keep_their_stream():
    assert corpus_for("bb-8-1-i2").source.induction == 2
    assert np.array_equal(BigramBackcopy(vocab=8, triggers=1).trigger_ids(),
                          BigramBackcopy(vocab=8, triggers=1, induction=2).trigger_ids())
    with pytest.raises(ValueError, match="induction"):
        BigramBackcopy(vocab=8, triggers=1, induction=4)
