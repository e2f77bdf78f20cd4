import json

import pytest

from sinkbook.results import NOT_COMPARABLE, Claim, claims_markdown, load_all_results, write_results


def test_results_file_round_trip(tmp_path):
    claims = [Claim("a", "VL paper, Table 5", "margin positive", 0.3, 0.31, "|d| <= 0.05", True),
              Claim("b", "OutRo, Table 7", "overhead", 1.11, 1.3, "<= 1.10", False),
              Claim("c", "GS paper, Sec. 5", "R_GS drop", 40, 3.0, "qualitative", NOT_COMPARABLE)]
    path = write_results("demo", {"profile": "quick"}, claims, models=[{"spec": "tiny-llama"}], results_dir=tmp_path)
    doc = json.loads(path.read_text())
    assert {"chapter", "parameters", "models", "packages", "git_commit", "created", "claims"} <= set(doc)
    assert [c["holds"] for c in doc["claims"]] == [True, False, NOT_COMPARABLE]
    table = claims_markdown(load_all_results(tmp_path))
    assert table.startswith("1 claims hold, 1 do not, 1 are not comparable")
    assert "| demo | 1 | 1 | 1 | tiny-llama | quick |" in table
    assert "### demo" in table and table.count("| VL paper, Table 5 |") == 1


def test_claim_rejects_other_verdicts():
    with pytest.raises(ValueError):
        Claim("a", "s", "t", 1, 1, "r", "maybe")


def test_duplicate_claim_ids_rejected(tmp_path):
    c = Claim("a", "s", "t", 1, 1, "r", True)
    with pytest.raises(ValueError, match="duplicate"):
        write_results("demo", {}, [c, c], results_dir=tmp_path)
