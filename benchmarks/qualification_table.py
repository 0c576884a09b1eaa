"""Markdown table of `statelab spec run --json` files: per prompt, each arm's verdict against R.

    python benchmarks/qualification_table.py OUT/spec_gemma3_he*.json

A cell is "=" when the arm reproduced R's complete endpoint, else the first differing output.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def main(paths: list[str]) -> str:
    rows, arms = [], []
    for p in paths:
        recs = json.loads(Path(p).read_text())
        for r in recs:
            if r["arm"] not in arms:
                arms.append(r["arm"])
        rows.append((recs[0]["prompt"], {r["arm"]: r for r in recs}))
    rows.sort(key=lambda r: (len(r[0]), r[0]))  # HumanEval/2 before HumanEval/10
    shown = [a for a in arms if a != "R"]
    out = ["| prompt | R length | " + " | ".join(shown) + " |", "| --- | --- | " + " | ".join("---" for _ in shown) + " |"]
    for prompt, by in rows:
        cells = ["" if a not in by else "=" if by[a]["qualified"] else f"differs at {by[a]['first_diff']}"
                 for a in shown]
        out.append(f"| {prompt} | {by['R']['length']} | " + " | ".join(cells) + " |")
    total = [sum(bool(by.get(a, {}).get("qualified")) for _, by in rows) for a in shown]
    out.append("| qualified | | " + " | ".join(f"{t} of {len(rows)}" for t in total) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    print(main(sys.argv[1:]))
