"""The margins chapter: Table 5 read through Lemma 1 (the thresholds and their gating, on synthetic margins), and
the chapter on the published tables."""
import numpy as np
import pandas as pd
import pytest

from sinkbook.chapters import vl_margins as C
from sinkbook.core.claims import NOT_COMPARABLE
from sinkbook.measures import regression as R


def _by_id(finding):
    return {c.id: c for c in finding.claims}


TABLE5 = pd.DataFrame({"pair": ["A", "B", "C", "D", "E", "F", "G"],
                       "qk": ["per-head", "per-head", "none", "none", "none", "layerwise", "layerwise"],
                       "g_base": [2.0, 2.0, 1.0, 1.0, 1.3, 0.3, 1.2],
                       "b_gap": [1.8, 2.3, 4.0, 3.5, 2.6, 3.4, 4.0]})
TABLE5["g_minus_b"] = (TABLE5.g_base - TABLE5.b_gap).round(2)
PUBLISHED = {"lemma1_check_empirical_text": 0.069, "lemma1_check_bound_text": 0.069}


def _margins(**changes) -> pd.DataFrame:
    t5 = TABLE5.copy()
    for pair, margin in changes.items():
        t5.loc[t5.pair == pair, "g_minus_b"] = margin
    return t5


def test_table5_split_holds_when_the_margins_read_as_the_paper_says():
    claims = _by_id(C.table5_finding(TABLE5, PUBLISHED))
    assert claims["table5_margin_split"].holds is True
    assert claims["table5_layerwise_strongly_negative"].holds is True
    assert claims["table5_margin_split"].kind == "recomputed"
    arithmetic = [claims[i] for i in ("table5_margin_arithmetic", "strong_sink_threshold")]
    assert all((c.kind, c.origin) == ("recomputed", "ours") and "paper's arithmetic" in c.statement for c in arithmetic)
    assert claims["table5_margin_split"].origin == "ours"            # the two thresholds are ours
    assert not any(i.startswith("lemma1_") for i in claims)           # Lemma 1 is claimed in the theorems chapter


def test_the_sensitivity_note_reports_where_the_split_stops_holding():
    finding = C.table5_finding(TABLE5, PUBLISHED)
    by_class = {qk: list(TABLE5.g_minus_b[TABLE5.qk == qk]) for qk in ("per-head", "none")}
    note = next(n for n in finding.notes if n.startswith("How the verdict moves"))
    assert f"{max(by_class['none']):+.2f} nat or above" in note
    assert f"{max(abs(m) for m in by_class['per-head']):.2f} nat or more" in note


@pytest.mark.parametrize("changes, why", [
    ({"A": 0.9}, "a per-head margin that is clearly positive is not near zero"),
    ({"B": -0.7}, "a per-head margin in the moderately negative band is not near zero"),
    ({"E": -0.8}, "a no-QK-norm margin above -1 nat is not strongly negative"),
])
def test_table5_split_fails_on_a_variant_that_breaks_the_rule(changes, why):
    claims = _by_id(C.table5_finding(_margins(**changes), PUBLISHED))
    assert claims["table5_margin_split"].holds is False, why


def test_table5_layerwise_claim_fails_and_gates():
    assert _by_id(C.table5_finding(_margins(G=-0.6), PUBLISHED))["table5_layerwise_strongly_negative"].holds is False
    no_layerwise = TABLE5[TABLE5.qk != "layerwise"]
    claims = _by_id(C.table5_finding(no_layerwise, PUBLISHED))
    assert claims["table5_layerwise_strongly_negative"].holds == NOT_COMPARABLE
    no_per_head = TABLE5[TABLE5.qk != "per-head"]
    assert _by_id(C.table5_finding(no_per_head, PUBLISHED))["table5_margin_split"].holds == NOT_COMPARABLE


def test_margin_thresholds_follow_lemma1():
    assert [C.margin_reading(m) for m in (0.5, -0.5, -0.51, -1.0, 0.6)] == [
        "near zero", "near zero", "moderately negative", "strongly negative", "positive"]
    # near zero keeps the bound sigma(-m) in its linear part around 1/2; strongly negative lets the
    # non-sink keys take at least sigma(1) of the mass
    assert abs(float(R.lemma1_bound(0, C.NEAR_ZERO_NATS)) - 0.5) < 0.125
    assert float(R.lemma1_bound(0, -C.STRONGLY_NEGATIVE_NATS)) == pytest.approx(1 / (1 + np.exp(-1)))


def test_the_chapter_reads_every_published_table():
    chapter = C.VLMarginsChapter(C.PROFILES.resolve("quick"))
    results = chapter.results()
    assert [f for f in chapter.FINDINGS] == ["table5", "trajectories", "derived_numbers"]
    assert {c.kind for c in results["claims"]} <= {"recomputed", "math"}
    assert {c.id for c in results["claims"]} >= {"table5_margin_split", "table14_ranges", "table9_plateau"}
