"""Each statistical claim of a results folder read two ways: by the book's verdict rule (its results file) and by
a significance test alone, the rule the book used before (holds when the 95% interval excludes zero on the paper's
side, does not hold otherwise; for a non-inferiority claim, holds unless the interval lies wholly against the paper).
Same data, two rules: every difference is the rule's, none is the runs'.

    python measurements/verdict-rule/significance_reading.py RESULTS.json [RESULTS.json ...]
"""
from __future__ import annotations

import sys
from pathlib import Path

from sinkbook.book.results import outcome
from sinkbook.core.claims import NOT_COMPARABLE, label, signed


def significance_only(c: dict) -> str:
    e, i = c["effect"], c.get("interest") or {}
    if c["holds"] == NOT_COMPARABLE:
        return label(NOT_COMPARABLE)
    if i.get("non_inferiority"):
        return label(e["high"] >= 0)
    return label(e["low"] > 0)


def main(*files: str) -> int:
    import json
    rows = []
    for doc in (json.loads(Path(f).read_text()) for f in files):
        for c in doc["claims"]:
            if not c.get("effect") or c.get("must_hold"):
                continue
            before, after = significance_only(c), outcome(c)
            if before != after:
                e, i = c["effect"], c.get("interest") or {}
                rows.append(f"- `{c['id']}` ({doc['chapter']}): {before} -> {after}; "
                            f"{signed(e['estimate'], '.3g')} [{signed(e['low'], '.3g')}, {signed(e['high'], '.3g')}] "
                            f"{e.get('units', '')}; interest {i.get('value', float('nan')):g}"
                            f"{' (non-inferiority margin)' if i.get('non_inferiority') else ''}: {i.get('source', '')}")
    print(f"{len(rows)} statistical claim(s) whose verdict differs between a significance test alone and the "
          f"verdict rule:")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
