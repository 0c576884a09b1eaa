"""Which operands of an E1 run's frozen captures are equal across the attention layouts, from
the capture manifests alone (each operand's sha256 over its type, extents, strides and values):

    python benchmarks/device/e1_operands.py docs/cuda/synth/e1/qwen3-8b-q8_0/captures

Prints, per (layer, phase, q) with q >= 2, the operands whose hashes differ for each pair of
layouts, and a count per (operand, pair) over every such context.
"""
from __future__ import annotations

import itertools
import json
import sys
from collections import Counter
from pathlib import Path


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: e1_operands.py CAPTURES_DIR (an E1 output's captures/ folder)", file=sys.stderr)
        return 2
    by = {}
    for m in sorted(Path(argv[0]).glob("*/manifest.json")):
        d = json.loads(m.read_text())
        by.setdefault((d["layer"], d["phase"], d["q"]), {})[d["layout"]] = {
            k: v["sha256"] for k, v in d["operands"].items()}
    counts, n = Counter(), 0
    print("| layer | phase | q | " + " | ".join(f"{a}-{b} differ in" for a, b in itertools.combinations("MQ PQ QB".split(), 2))
          + " |\n|---|---|---|---|---|---|")
    for (layer, phase, q), lay in sorted(by.items()):
        if q < 2 or len(lay) < 2:
            continue
        n += 1
        cells = []
        for a, b in itertools.combinations(sorted(lay), 2):
            diff = [k for k in lay[a] if lay[a][k] != lay[b].get(k)]
            counts.update((k, f"{a}-{b}") for k in diff)
            cells.append(", ".join(diff) or "none")
        print(f"| {layer} | {phase} | {q} | " + " | ".join(cells) + " |")
    print(f"\n{n} contexts with q >= 2; (operand, pair) differing in: "
          + (", ".join(f"{k} {p} {c}" for (k, p), c in sorted(counts.items())) or "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
