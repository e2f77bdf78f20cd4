"""Compare two folders of results files claim by claim: the counts per chapter and kind, and every claim whose
verdict or shown value changed (with its interval and effect of interest where it has one).

    python scripts/compare_results.py BEFORE_DIR AFTER_DIR [--markdown out.md]

Used for the before/after lists of a refactor (nothing may move) or of a change of rules (every move explained).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sinkbook.book.results import OUTCOMES, load_all_results, outcome
from sinkbook.core.claims import KINDS, Claim, missing_effects, signed


def counts(results: list[dict]) -> dict[tuple[str, str], dict[str, int]]:
    """{(chapter, kind): {verdict: n}} over the claims that are not must-hold checks; checks under 'checks'."""
    out = {}
    for doc in results:
        for kind in KINDS:
            mine = [c for c in doc["claims"] if c["kind"] == kind]
            if mine:
                row = {o: sum(outcome(c) == o for c in mine if not c.get("must_hold")) for o in OUTCOMES}
                row["checks"] = sum(bool(c.get("must_hold")) for c in mine)
                out[(doc["chapter"], kind)] = row
    return out


def _effect(c: dict) -> str:
    e, i = c.get("effect"), c.get("interest")
    if not e:
        return ""
    text = f"{signed(e['estimate'])} [{signed(e['low'])}, {signed(e['high'])}] {e.get('units', '')}".rstrip()
    return text + (f"; interest {i['value']:g} ({i['source']})" if i else "")


def changes(before: list[dict], after: list[dict]) -> list[dict]:
    """One row per claim id whose verdict or value differs, or that exists on one side only."""
    old = {c["id"]: (d["chapter"], c) for d in before for c in d["claims"]}
    new = {c["id"]: (d["chapter"], c) for d in after for c in d["claims"]}
    rows = []
    for cid in sorted(set(old) | set(new)):
        (ch_a, a), (ch_b, b) = old.get(cid, (None, None)), new.get(cid, (None, None))
        va, vb = (outcome(a) if a else "absent"), (outcome(b) if b else "absent")
        if a and b and va == vb and a["our_value"] == b["our_value"]:
            continue
        rows.append({"chapter": ch_b or ch_a, "id": cid, "before": va, "after": vb,
                     "value before": a["our_value"] if a else "", "value after": b["our_value"] if b else "",
                     "effect after": _effect(b) if b else ""})
    return rows


def bare_statistical(results: list[dict]) -> list[str]:
    """Ids of claims decided by a paired test without an effect and effect of interest."""
    fields = {f for f in Claim.__dataclass_fields__}
    claims = [Claim(**{k: v for k, v in c.items() if k in fields}) for d in results for c in d["claims"]]
    return [c.id for c in missing_effects(claims)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--markdown", type=Path, help="also write the comparison as markdown here")
    args = parser.parse_args(argv)
    for folder in (args.before, args.after):
        if not folder.is_dir() or not any(folder.glob("*.json")):
            parser.error(f"{folder} holds no results files (*.json): build the chapters first")
    before, after = load_all_results(args.before), load_all_results(args.after)
    lines = ["| chapter | kind | before (holds / does not / inconclusive / not comparable; checks) | after |",
             "|---|---|---|---|"]
    a, b = counts(before), counts(after)
    for key in sorted(set(a) | set(b)):
        show = lambda r: (" / ".join(str(r[o]) for o in OUTCOMES) + f"; {r['checks']}") if r else "absent"
        lines.append(f"| {key[0]} | {key[1]} | {show(a.get(key))} | {show(b.get(key))} |")
    moved = changes(before, after)
    lines += ["", f"{len(moved)} claim(s) changed verdict or value:", ""]
    lines += [f"- `{r['id']}` ({r['chapter']}): {r['before']} -> {r['after']}; "
              f"{r['value before']} -> {r['value after']}" + (f"; {r['effect after']}" if r["effect after"] else "")
              for r in moved]
    bare = bare_statistical(after)
    if bare:
        lines += ["", "Decided by a paired test without an effect of interest: " + ", ".join(bare)]
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
