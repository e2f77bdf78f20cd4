"""The claim model, rules, settings and the results file the book assembles."""
import json

import pytest

from sinkbook.book.results import claims_markdown, headline, load_all_results, tally, write_results
from sinkbook.core.claims import (INCONCLUSIVE, NOT_COMPARABLE, Claim, Finding, MissingEffect, MustHoldFailed, Rule,
                                  check, claim, slug)
from sinkbook.core.profiles import Profiles, SettingsError


def _claims():
    return [Claim("a", "measured", "VL paper, Table 5", "margin positive", 0.3, 0.31, "|d| <= 0.05", True),
            Claim("b", "recomputed", "OutRo, Table 7", "overhead", 1.11, 1.3, "<= 1.10", False),
            Claim("c", "measured", "GS paper, Sec. 5", "R_GS drop", 40, 3.0, "qualitative", NOT_COMPARABLE),
            Claim("d", "math", "ours", "identity", 0, 0.0, "== 0", True, must_hold=True, origin="ours")]


def test_results_file_round_trip(tmp_path):
    path = write_results("demo", {"profile": "quick"}, _claims(), models=[{"spec": "tiny-llama"}], directory=tmp_path)
    doc = json.loads(path.read_text())
    assert {"chapter", "parameters", "models", "packages", "git_commit", "created", "claims"} <= set(doc)
    assert [c["holds"] for c in doc["claims"]] == [True, False, NOT_COMPARABLE, True]
    results = load_all_results(tmp_path)
    rows = {r["kind"]: r for r in tally(results)}
    assert rows["measured"]["holds"] == 1 and rows["measured"][NOT_COMPARABLE] == 1
    assert rows["recomputed"]["does not hold"] == 1 and rows["math"]["checks passed"] == "1/1"
    assert rows["math"]["holds"] == 0                       # a must-hold check is not counted as a claim
    text = headline(results)
    assert text.startswith("**Measured on models run here:** 2 claims (1 holds, 0 does not hold, 0 inconclusive, "
                           "1 not comparable)")
    assert "recomputed from the papers' published tables:** 1 claims (0 holds, 1 does not hold" in text
    table = claims_markdown(results)
    assert "| demo | measured | 1 | 0 | 0 | 1 | 0/0 |" in table
    assert "### demo" in table and table.count("| VL paper, Table 5 |") == 1


def test_failed_must_hold_raises_after_the_file_is_written(tmp_path):
    bad = Claim("x", "math", "ours", "identity", 0, 1e-3, "== 0", False, must_hold=True, origin="ours")
    with pytest.raises(MustHoldFailed, match="identity"):
        write_results("demo", {}, [*_claims(), bad], directory=tmp_path)
    assert (tmp_path / "demo.json").exists()


@pytest.mark.parametrize("kwargs, message", [
    (dict(holds="maybe"), "holds must be"), (dict(kind="guess"), "kind must be"), (dict(id="Bad-Id"), "snake_case"),
    (dict(origin="them"), "origin must be"), (dict(holds=NOT_COMPARABLE, must_hold=True), "cannot be")])
def test_claim_rejects_malformed_fields(kwargs, message):
    fields = dict(id="a", kind="measured", source="s", statement="t", paper_value=1, our_value=1, rule="r", holds=True)
    with pytest.raises(ValueError, match=message):
        Claim(**{**fields, **kwargs})


def test_a_paired_test_without_its_effect_is_refused_after_the_file_is_written(tmp_path):
    bare = Claim("p", "measured", "VL paper", "IFEval falls", 3.0, 1.2, "McNemar p < 0.05", True)
    with pytest.raises(MissingEffect, match="p are decided by a paired test.*statistical"):
        write_results("demo", {}, [*_claims(), bare], directory=tmp_path)
    assert [c["id"] for c in json.loads((tmp_path / "demo.json").read_text())["claims"]][-1] == "p"
    write_results("demo", {}, _claims(), directory=tmp_path)       # the same file without it passes


def test_duplicate_claim_ids_rejected(tmp_path):
    c = _claims()[0]
    with pytest.raises(ValueError, match="duplicate"):
        write_results("demo", {}, [c, c], directory=tmp_path)


def test_rules_word_and_test_together():
    rule = Rule.at_most(0.05, "share")
    assert rule.text == "share <= 0.05" and rule(0.05) and not rule(0.06)
    assert Rule.between(10, 100, "median R_GS")(10) and not Rule.between(10, 100)(100.5)
    assert Rule.close_to(0.881, 0.0005, why="3 decimals").text == "|ours - 0.881| <= 0.0005 (3 decimals)"


def test_claim_builder_gates_on_its_precondition_and_never_contradicts_its_verdict():
    rule = Rule.above(1.0, "median R_GS")
    held = claim("x", "measured", "paper", "a gradient sink", "10-100", 2.0, rule)
    gated = claim("y", "measured", "paper", "a gradient sink", "10-100", 2.0, rule, precondition=(False, "no sink"))
    failed = claim("z", "measured", "paper", "a gradient sink", "10-100", float("nan"), rule)
    assert held.holds is True and held.verdict().startswith("Holds: a gradient sink")
    assert gated.holds == NOT_COMPARABLE and "no sink" in gated.verdict() and gated.verdict().startswith("Not comparable")
    assert failed.holds == NOT_COMPARABLE and "nan, not a number" in failed.verdict()
    import numpy as np
    assert claim("w", "measured", "paper", "s", 1, np.float32("inf"), rule).holds == NOT_COMPARABLE
    assert check("v", "identity", float("nan"), Rule.at_most(0.0)).holds is False   # a check of our code fails
    assert check("k", "identity", 0.0, Rule.at_most(0.0)).must_hold
    assert Finding("t", claims=[held, gated]).verdicts == [held.verdict(), gated.verdict()]
    assert slug("smollm2-135m-instruct") == "smollm2_135m_instruct" and slug("0.1b") == "x0_1b"


def test_profiles_resolve_overrides_and_refuse_what_they_do_not_know():
    profiles = Profiles({"quick": dict(n=2, models=["tiny-llama"]), "default": dict(n=10, models=["a"]),
                         "gpu": dict(n=50, models=["a"])})
    s = profiles.resolve("quick", device="cpu", n=None, models=("tiny-qwen2",))
    assert s.n == 2 and s.models == ["tiny-qwen2"] and s.as_dict()["profile"] == "quick"
    with pytest.raises(SettingsError, match="unknown profile 'fast'; choose one of quick, default, gpu"):
        profiles.resolve("fast")
    with pytest.raises(SettingsError, match=r"unknown parameter\(s\) \['steps'\]"):
        profiles.resolve("quick", steps=3)
    with pytest.raises(SettingsError, match="should be like"):
        profiles.resolve("quick", n="many")
    with pytest.raises(SettingsError, match="device"):
        profiles.resolve("quick", device="tpu")
    with pytest.raises(ValueError, match="missing"):
        Profiles({"quick": {}, "default": {}})


def test_a_rule_that_raises_stops_instead_of_failing_the_claim():
    # a value of the wrong type is a bug in the chapter, never a claim that "does not hold"
    with pytest.raises(TypeError):
        claim("x", "measured", "paper", "a gradient sink", "10-100", "none found", Rule.above(1.0, "median R_GS"))
    gated = claim("y", "measured", "paper", "a gradient sink", "10-100", "none found", Rule.above(1.0),
                  precondition=(False, "no sink"))                 # a gated claim never runs its rule
    assert gated.holds == NOT_COMPARABLE


def _statistical_claims():
    from sinkbook.core.claims import Effect, Interest, statistical
    interest = Interest(2.0, "paper: Table X, +2 pt", "pt")
    effect = lambda low, high: Effect((low + high) / 2, low, high, 0.95, "exact McNemar, Agresti-Min interval", 100,
                                      1, "pt")
    return [statistical("up", "paper", "x goes up", "+2 pt", effect(0.5, 4.0), interest),
            statistical("maybe", "paper", "y goes up", "+2 pt", effect(-1.0, 3.0), interest),
            statistical("no", "paper", "z goes up", "+2 pt", effect(-4.0, -1.0), interest)]


def test_inconclusive_is_counted_apart_and_numbers_stay_numbers(tmp_path):
    write_results("demo", {"profile": "quick"}, [*_claims(), *_statistical_claims()], directory=tmp_path)
    results = load_all_results(tmp_path)
    doc = results[0]
    maybe = next(c for c in doc["claims"] if c["id"] == "maybe")
    assert maybe["holds"] == INCONCLUSIVE and maybe["effect"]["low"] == -1.0 and maybe["interest"]["value"] == 2.0
    assert isinstance(maybe["effect"]["detectable"], float) and "could detect" in maybe["caveat"]
    rows = {r["kind"]: r for r in tally(results)}
    assert (rows["measured"]["holds"], rows["measured"]["does not hold"], rows["measured"][INCONCLUSIVE],
            rows["measured"][NOT_COMPARABLE]) == (2, 1, 1, 1)
    assert headline(results).startswith("**Measured on models run here:** 5 claims (2 holds, 1 does not hold, "
                                        "1 inconclusive, 1 not comparable)")
    table = claims_markdown(results)
    assert "| chapter | kind | holds | does not hold | inconclusive | not comparable |" in table
    assert "| demo | measured | 2 | 1 | 1 | 1 | 0/0 |" in table
    assert "*inconclusive*" in table and "effect of interest 2 pt (paper: Table X, +2 pt)" in table


def test_summary_figure_draws_every_verdict(tmp_path):
    from sinkbook.book.results import summary_figure
    write_results("demo", {}, [*_claims(), *_statistical_claims()], directory=tmp_path / "r")
    path = summary_figure(load_all_results(tmp_path / "r"), tmp_path / "f.svg")
    assert "inconclusive" in path.read_text()                    # the legend names all four verdicts


def test_an_unknown_verdict_in_a_results_file_is_refused():
    from sinkbook.book.results import outcome
    with pytest.raises(ValueError, match="unknown verdict"):
        outcome({"id": "a", "holds": "maybe"})


def test_the_inconclusive_box_shows_the_caveat_and_the_effect_of_interest():
    from sinkbook.book.display import verdict_html
    up, maybe, _ = _statistical_claims()
    box = verdict_html(maybe)
    assert "class='sinkbook-verdict inconclusive'" in box and ">Inconclusive<" in box
    assert "could detect" in box and "effect of interest <strong>2 pt</strong>" in box and "paper: Table X" in box
    assert "[-1, +3]" in box                                        # the effect with its interval
    assert "class='sinkbook-verdict holds'" in verdict_html(up)
    assert "rgba(" in box and "color:#1" not in box                 # text inherits the theme's colour (dark mode)


def test_a_claim_id_in_two_results_files_stops_the_build_in_one_line(tmp_path, monkeypatch):
    from sinkbook.book import build
    from sinkbook.book.results import claim_id_clashes
    c = _claims()[0]
    write_results("one", {}, [c], directory=tmp_path)
    write_results("two", {}, [c, _claims()[1]], directory=tmp_path)
    assert claim_id_clashes(load_all_results(tmp_path)) == {"a": ["one", "two"]}
    with pytest.raises(SystemExit) as stop:
        build.check_claim_ids(tmp_path)
    message = str(stop.value)
    assert "\n" not in message and "a (one, two)" in message and "b (" not in message
    assert {p.name for p in tmp_path.glob("*.json")} == {"one.json", "two.json"}      # nothing computed is lost
    write_results("two", {}, [_claims()[1]], directory=tmp_path)
    build.check_claim_ids(tmp_path)                                                     # claimed once: passes

    # the build itself runs the check after its chapters and before it stages the book
    write_results("two", {}, [c], directory=tmp_path)
    where = {"stage": tmp_path / "stage", "html_parent": tmp_path, "html": tmp_path / "html",
             "logs": tmp_path / "logs", "results": tmp_path}
    monkeypatch.setattr(build, "paths", lambda profile: where)
    monkeypatch.setattr(build, "check_toc", lambda: None)
    monkeypatch.setattr(build, "execute_chapter", lambda *a, **k: (True, 0.0, ""))
    monkeypatch.setattr(build, "stage_book", lambda stage: pytest.fail("the book was staged despite the clash"))
    with pytest.raises(SystemExit, match="a \\(one, two\\)"):
        build._build("quick", None, "cpu")
    assert (tmp_path / "one.json").exists() and (tmp_path / "two.json").exists()


def test_compare_results_lists_every_moved_claim_and_the_counts(tmp_path, capsys):
    import importlib.util
    from sinkbook.core.paths import REPO_ROOT
    spec = importlib.util.spec_from_file_location("compare_results", REPO_ROOT / "scripts" / "compare_results.py")
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    before, after = tmp_path / "before", tmp_path / "after"
    write_results("demo", {}, _claims(), directory=before)
    moved = [c if c.id != "b" else Claim("b", "recomputed", "OutRo, Table 7", "overhead", 1.11, 1.05, "<= 1.10", True)
             for c in _claims()]
    write_results("demo", {}, moved, directory=after)
    assert compare.main([str(before), str(after)]) == 0
    out = capsys.readouterr().out
    assert "| demo | recomputed | 0 / 1 / 0 / 0; 0 | 1 / 0 / 0 / 0; 0 |" in out
    assert "1 claim(s) changed" in out and "- `b` (demo): does not hold -> holds; 1.3 -> 1.05" in out
    with pytest.raises(SystemExit):
        compare.main([str(before), str(tmp_path / "missing")])


def test_items_for_power_scales_with_the_square_of_the_reach():
    from sinkbook.core.claims import items_for_power
    assert items_for_power(100, 2.0, 2.0) == 100                 # already reaches the interest
    assert items_for_power(100, 4.0, 2.0) == 400                 # twice the reach: four times the items
    assert items_for_power(100, 3.0, 2.0) == 225
    assert items_for_power(100, 1.0, 2.0) == 25
    with pytest.raises(ValueError, match="positive"):
        items_for_power(100, 0.0, 2.0)


def test_the_power_table_lists_each_statistical_claim_with_its_reach(tmp_path):
    from sinkbook.book.results import power_markdown
    from sinkbook.core.claims import items_for_power
    from sinkbook.core.claims import Effect, Interest, statistical
    narrow = statistical("sure", "paper", "w goes up", "+2 pt", Effect(1.5, 0.5, 2.5, 0.95, "exact McNemar", 100, 1,
                                                                      "pt"), Interest(2.0, "paper: Table X", "pt"))
    write_results("demo", {}, [*_claims(), *_statistical_claims(), narrow], directory=tmp_path)
    doc = load_all_results(tmp_path)[0]
    table = power_markdown([doc])
    rows = [line for line in table.splitlines() if line.startswith("| demo")]
    assert len(rows) == 4                                          # the three statistical claims, nothing else
    by_statement = {row.split(" | ")[1]: row for row in rows}
    for c in doc["claims"]:
        if c.get("effect"):
            e = c["effect"]
            row = by_statement[c["statement"]]
            assert f"{e['detectable']:.3g} pt" in row and "100 x 1" in row
            expected = "reached" if e["detectable"] <= 2.0 else str(items_for_power(100, e["detectable"], 2.0))
            assert row.rstrip(" |").endswith(expected)
    reached = sum(c["effect"]["detectable"] <= 2.0 for c in doc["claims"] if c.get("effect"))
    assert reached == 1 and table.startswith("1 of 4 statistical claims")
    flat = statistical("flat", "paper", "v goes up", "+2 pt", Effect(0.0, 0.0, 0.0, 0.95, "paired bootstrap", 60, 2,
                                                                     "pt"), Interest(2.0, "paper: Table X", "pt"))
    write_results("flat", {}, [flat], directory=tmp_path / "flat")
    row = power_markdown(load_all_results(tmp_path / "flat")).splitlines()[-1]
    assert row.endswith("| not estimable: no pair differed |")     # a zero-width interval is not power
    assert power_markdown([]).startswith("*No statistical claims")
