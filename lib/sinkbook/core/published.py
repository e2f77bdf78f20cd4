"""The VL paper's published tables, as transcribed in ``data/vl_paper/`` (see its README for provenance).

Every value is read as printed; nothing here derives a statistic. ``six_pairs`` joins the tables that describe
the paper's six pairs (Tables 1, 2, 6 and 10) and adds the one quantity the counts of Table 2 give more finely
than the printed deltas: the IFEval change (gained - lost) / 541.

Source: Choi, Kim, Kim, arXiv 2609.00746 (the VL paper).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from .paths import REPO_ROOT, need_checkout

DATA_DIR = REPO_ROOT / "data" / "vl_paper"
TABLE_FILES = {
    1: "table01_pairs.csv", 2: "table02_ifeval_prompts.csv", 3: "table03_modality.csv",
    4: "table04_cross_task.csv", 5: "table05_margins.csv", 6: "table06_knowledge_format.csv",
    8: "table08_extended.csv", 9: "table09_calibration_n.csv", 10: "table10_lopo.csv",
    11: "table11_panel17.csv", 12: "table12_panel9.csv", 13: "table13_thirds.csv",
    14: "table14_trajectory.csv",
}
IFEVAL_PROMPTS = 541          # Table 2: the IFEval set each backbone is scored on
S_HALF_WIDTH = 0.005          # S is printed with two decimals
DELTA_HALF_WIDTH = 0.05       # task deltas are printed with one decimal
PRINT_1DP, PRINT_2DP, PRINT_3DP = 0.05, 0.005, 0.0005   # half the last digit of a value printed with 1-3 decimals
# task name -> column of the six-pair frame (Table 6) and column of Table 4
SIX_TASK_COLUMNS = {"IFEval": "ifeval", "EQ-Bench": "eq_bench", "GSM8K": "gsm8k", "GPQA-D": "gpqa"}
TABLE4_COLUMNS = {"IFEval": "ifeval", "EQ-Bench": "eq_bench", "GSM8K": "gsm8k", "GPQA-D": "gpqa_d"}


class DataError(ValueError):
    """A published-data file is missing or malformed; the message says which and what to do."""


def load_table(number: int, data_dir: str | Path | None = None) -> pd.DataFrame:
    """One published table as a DataFrame (values as printed, ``source_table`` column checked)."""
    if number not in TABLE_FILES:
        raise DataError(f"no transcription of VL-paper Table {number}; available: {sorted(TABLE_FILES)}")
    path = Path(data_dir or DATA_DIR) / TABLE_FILES[number]
    if not path.exists():
        if data_dir is None:
            need_checkout(f"the VL paper's Table {number} (data/vl_paper)")
        raise DataError(f"{path} is missing: restore it from git (`git checkout -- {path.relative_to(REPO_ROOT)}`)"
                        if path.is_relative_to(REPO_ROOT) else f"{path} is missing")
    df = pd.read_csv(path)
    if "source_table" not in df.columns:
        raise DataError(f"{path.name} has no source_table column; every published-data file must cite its table")
    expected = f"Table {number}"
    wrong = df.loc[df["source_table"] != expected, "source_table"].unique()
    if len(wrong):
        raise DataError(f"{path.name}: source_table should read {expected!r}, found {list(wrong)}")
    return df


def load_published_statistics(data_dir: str | Path | None = None) -> dict[str, float]:
    """Statistics the paper prints in table footers or in its text (the 2.54 pt error, the S >= 2 rule, ...)."""
    path = Path(data_dir or DATA_DIR) / "published_statistics.csv"
    if not path.exists():
        if data_dir is None:
            need_checkout("the VL paper's published statistics (data/vl_paper)")
        raise DataError(f"{path} is missing: restore it from git")
    df = pd.read_csv(path)
    return dict(zip(df["statistic"], df["value"].astype(float)))


def six_pairs(data_dir: str | Path | None = None) -> pd.DataFrame:
    """The six pairs of Tables 1/2/6/10 in one frame: S, the four task deltas, counts, reference, QK class.

    ``delta_ifeval_counts`` is the IFEval change recomputed from Table 2's counts, (gained - lost) / 541,
    which is what the one-decimal IFEval deltas are rounded from.
    """
    t1, t2, t6, t10 = (load_table(n, data_dir) for n in (1, 2, 6, 10))
    t6 = t6[t6["pair"] != "Mean"]
    df = t10.merge(t1[["pair", "reference_llm", "panel"]], on="pair", validate="1:1")
    df = df.merge(t6[["pair", *SIX_TASK_COLUMNS.values()]], on="pair", validate="1:1")
    df = df.merge(t2[["pair", "lost", "gained", "both_pass", "both_fail", "net_pct"]], on="pair", validate="1:1")
    if len(df) != 6:
        raise DataError(f"expected the six pairs of Table 10 in Tables 1, 2 and 6, matched {len(df)}")
    if not np.allclose(df["actual_delta"], df["ifeval"]):
        raise DataError("Table 10 and Table 6 disagree on the IFEval deltas; check the transcriptions")
    df["delta_ifeval_counts"] = 100.0 * (df["gained"] - df["lost"]) / IFEVAL_PROMPTS
    df["headline"] = df["panel"] == "headline"
    df["vlm_family"] = df["pair"].map(vlm_family)
    return df


def vlm_family(pair: str) -> str:
    """The VLM vendor line a pair belongs to (Qwen-VL, InternVL, LLaVA, Molmo, ...)."""
    for prefix, family in (("Qwen", "Qwen-VL"), ("InternVL", "InternVL"), ("LLaVA", "LLaVA"),
                           ("Molmo", "Molmo"), ("Ovis", "Ovis"), ("MiniCPM", "MiniCPM"), ("Idefics", "Idefics")):
        if pair.startswith(prefix):
            return family
    raise DataError(f"no VLM family known for pair {pair!r}; extend sinkbook.core.published.vlm_family")


def reference_family(reference_llm: str) -> str:
    """Reference-LLM family as the paper counts them (Qwen, Olmo, Mistral, Llama-3.1, plus OLMoE)."""
    for prefix, family in (("Qwen", "Qwen"), ("OLMoE", "OLMoE"), ("Olmo", "Olmo"), ("Mistral", "Mistral"),
                           ("Llama", "Llama-3.1")):
        if reference_llm.startswith(prefix):
            return family
    raise DataError(f"no family known for reference LLM {reference_llm!r}")


GRADIENT_SINKS_0P3B = REPO_ROOT / "data" / "gradient_sinks_paper" / "reported_0p3b.csv"


def reported_0p3b(path: str | Path | None = None) -> dict[str, tuple[float, float]]:
    """{quantity: (baseline, V-scale)} as the paper reports them at 0.3B."""
    if path is None and not GRADIENT_SINKS_0P3B.exists():
        need_checkout("the gradient-sinks paper's reported values (data/gradient_sinks_paper)")
    table = pd.read_csv(path or GRADIENT_SINKS_0P3B)
    return {r.quantity: (float(r.baseline), float(r.vscale)) for r in table.itertuples()}


def vl_paper_tables() -> dict:
    """Every table the predictor chapter reads: "six" (``six_pairs``), "published" (the statistics printed in the
    text) and the numbered tables (Table 4 indexed by its row label)."""
    tables = {"six": six_pairs(), "published": load_published_statistics(),
              **{n: load_table(n) for n in (2, 3, 4, 5, 6, 8, 9, 11, 12, 14)}}
    tables[4] = tables[4].set_index("row")
    return tables


def margin_series(six: pd.DataFrame, t5: pd.DataFrame, t11: pd.DataFrame) -> dict:
    """The Table 5 margin against the IFEval change: the six pairs (exact deltas), and the seven Table 5 pairs
    (printed deltas, MolmoE-1B's from Table 11)."""
    margin6 = t5.merge(six[["pair", "delta_ifeval_counts"]], on="pair")
    printed = dict(zip(t11.pair, t11.delta_ifeval)) | dict(zip(six.pair, six.ifeval))
    margin7 = t5[t5.pair.isin(printed)]
    return {("six, margin G-B", "IFEval"): (margin6.g_minus_b, margin6.delta_ifeval_counts),
            ("seven, margin G-B", "IFEval"): (margin7.g_minus_b, margin7.pair.map(printed))}


def rank_series(six: pd.DataFrame, t5: pd.DataFrame, t11: pd.DataFrame, t12: pd.DataFrame) -> dict:
    """(panel, task) -> (x, y): every rank correlation the chapter reports an interval for."""
    series = {("six", task): (six.s, six.delta_ifeval_counts if task == "IFEval" else six[col])
              for task, col in SIX_TASK_COLUMNS.items()}
    series[("17 pairs", "IFEval")] = (t11.s, t11.delta_ifeval)
    for task, col in (("IFEval", "delta_ifeval"), ("GSM8K", "delta_gsm8k"), ("EQ-Bench", "delta_eq_bench"),
                      ("GPQA-D", "delta_gpqa_d")):
        series[("9 pairs", task)] = (t12.s, t12[col])
    return series | margin_series(six, t5, t11)
