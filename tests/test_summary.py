"""The intro's findings summary (sinkbook.book.summary) on synthetic results files: which claims it picks, how it
groups and words them, the numbers and links it prints; and that its declared headline claims still exist."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sinkbook.book import summary as S
from sinkbook.chapters import chapter_names
from sinkbook.core.claims import Effect, Interest, Rule, check, claim, statistical

REPO = Path(__file__).resolve().parents[1]
PAPER = S.Paper("Test paper", "choi2026sinkstrength", (("alpha", "gain_*"), ("alpha", "exact_one"), ("beta", "beta_*")))
INTEREST = Interest(2.0, "ours: test", units="pt")


def _doc(chapter, claims, profile="quick"):
    # through JSON, as the build reads the files: True/False stay bools, the two words stay strings
    return json.loads(json.dumps({"chapter": chapter, "parameters": {"profile": profile},
                                  "claims": [c.as_dict() for c in claims]}))


def _results():
    alpha = [
        claim("gain_model_a", "measured", "p", "A gains <x>", 1.0, 3.25, Rule.above(2)),
        claim("gain_model_b", "measured", "p", "B gains", 1.0, 0.5, Rule.above(2)),
        claim("gain_model_c", "measured", "p", "C gains", 1.0, 0.5, Rule.above(2),
              precondition=(False, "no sink in C")),
        statistical("gain_model_d", "p", "D gains on items", "+3 pt",
                    Effect(0.8, -1.2, 2.9, 0.95, "paired bootstrap", 40, 1, units="pt"), INTEREST),
        statistical("gain_model_e", "p", "E gains on items", "+3 pt",
                    Effect(4.0, 3.1, 5.0, 0.9, "paired bootstrap", 40, 1, units="pt"), INTEREST),
        claim("exact_one", "recomputed", "p", "the exact claim", 7, 7, Rule.at_least(7)),
        claim("not_headline", "measured", "p", "another claim", 1, 1, Rule.at_least(1)),
        check("gain_model_check", "a check of our code", 0.0, Rule.at_most(0)),
    ]
    return [_doc("alpha", alpha)]


def _lines(markdown):
    return re.findall(r'<li class="sinkbook-finding-line ([a-z-]+)" data-chapter="([a-z_]+)" data-claim="([a-z0-9_]+)" '
                      r'data-verdict="([a-z ]+)">(.*?)</li>', markdown)


def test_picks_the_declared_claims_in_order_and_never_a_check():
    picked = [c["id"] for _, c in S.headline_claims(PAPER, _results())]
    assert picked == ["gain_model_a", "gain_model_b", "gain_model_c", "gain_model_d", "gain_model_e", "exact_one"]


def test_groups_by_the_four_verdicts_in_order_and_counts_them():
    md = S.summary_markdown(_results(), papers=(PAPER,))
    lines = _lines(md)
    verdicts = [v for _, _, _, v, _ in lines]
    assert verdicts == ["holds", "holds", "holds", "does not hold", "inconclusive", "not comparable"]
    assert {css for css, *_ in lines} == {"holds", "does-not-hold", "inconclusive", "not-comparable"}
    assert ("6 headline claims, 3 holds, 1 does not hold, 1 inconclusive, 1 not comparable. "
            "Not run in this build: beta.") in md
    assert "{cite:p}`choi2026sinkstrength`" in md
    assert "profile `quick`" in md


def test_each_line_has_its_number_its_qualifier_and_its_links():
    lines = {claim_id: text for _, _, claim_id, _, text in _lines(S.summary_markdown(_results(), papers=(PAPER,)))}
    assert "A gains &lt;x&gt;" in lines["gain_model_a"] and "ours 3.25; paper 1</span>" in lines["gain_model_a"]
    assert "ours 0.5; paper 1</span>" in lines["gain_model_b"]
    assert "no sink in C" in lines["gain_model_c"]
    # statistical claims: the estimate and the interval, and the caveat (what the sample could detect)
    assert "ours +0.8 pt [-1.2, +2.9], 95% interval; paper +3 pt" in lines["gain_model_d"]
    assert "could detect" in lines["gain_model_d"]
    assert "ours +4 pt [+3.1, +5], 90% interval" in lines["gain_model_e"]
    for text in lines.values():
        assert 'href="../chapters/alpha.html"' in text and 'href="../results/alpha.json"' in text


def test_long_numbers_are_cut_and_empty_results_say_so():
    long = [claim("exact_one", "measured", "p", "long", "x", "; ".join(["merge 1.234"] * 40), Rule.true("t"), True)]
    (line,) = _lines(S.summary_markdown([_doc("alpha", long)], papers=(PAPER,)))
    number = re.search(r'sinkbook-finding-number">(.*?)</span>', line[4]).group(1)
    assert number.startswith("ours merge 1.234") and "…" in number and len(number) < S.LONGEST + 30
    assert "No results files yet" in S.summary_markdown([], papers=(PAPER,))


def test_a_paper_with_nothing_run_gets_its_line_and_no_list():
    md = S.summary_markdown([_doc("gamma", [])], papers=(PAPER,))
    assert "0 headline claims" in md and "Not run in this build: alpha, beta." in md
    assert "<ul" not in md


def test_the_book_papers_name_real_chapters_ids_and_references():
    """A pattern must still match an id its chapter module writes (a literal id, or the literal start of an
    f-string id), so renaming a headline claim fails here rather than dropping out of the summary unseen."""
    bib = (REPO / "book" / "references.bib").read_text()
    for paper in S.PAPERS:
        assert f"{{{paper.cite}," in bib, paper.cite
        for chapter, pattern in paper.headline:
            assert chapter in chapter_names(), chapter
            source = (REPO / "lib" / "sinkbook" / "chapters" / f"{chapter}.py").read_text()
            if "*" in pattern:
                stem = pattern.split("*")[0]
                assert re.search(r'f"' + re.escape(stem), source), f"{chapter}: no claim id starts {stem!r}"
            else:
                assert f'"{pattern}"' in source, f"{chapter}: no claim {pattern!r}"


@pytest.mark.parametrize("holds", [True, False, "inconclusive", "not comparable"])
def test_verdict_word_is_the_claim_models(holds):
    from sinkbook.core.claims import label
    assert S.verdict({"holds": holds}) == label(holds)
