"""Where a findings run's time went, from its records: the cells' cross parts, the panels' and
minimal searches' seconds on a lane.  Reads a live run folder (cells.jsonl, findings/*.jsonl)
or a kept one (docs/findings/cuda/run: the same files gzipped):

    python benchmarks/device/findings_time.py docs/findings/cuda/run
    python benchmarks/device/findings_time.py RUN --phases T0 T1 T2 T3 T4 --shape "1 process x 8 lanes"

``--phases``: the wall clock (seconds) at the start, after the study run, the panels, the
minimal searches and the tables (benchmarks/device/findings_cuda.sh passes them).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from statelab.experiments.findings_inputs import jsonl as records  # plain or gzipped JSON lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--phases", type=float, nargs=5, metavar=("T0", "T1", "T2", "T3", "T4"))
    ap.add_argument("--shape", default="", help="the processes and lanes, for the first line")
    a = ap.parse_args(argv)
    if not a.run.is_dir():
        print(f"error: {a.run}: no such run folder", file=sys.stderr)
        return 2
    runs = records(a.run / "runs.jsonl")
    last = runs[-1] if runs else {}
    ok = [c for c in records(a.run / "cells.jsonl") if c.get("status") == "ok"]
    ran = [c for c in ok if not c.get("same_cross_as")]
    cross = [c["timing"]["cross_s"] for c in ran if "timing" in c]
    split = [c for c in ran if "cross_decode_s" in c.get("timing", {})]  # cells that record the parts of their cross
    cells_s, n_last = float(last.get("cells_seconds", 0.0)), last.get("cells_ran", 0)
    line = (f"last study run: cells phase {cells_s:.0f} s for {n_last} cells "
            f"({60 * n_last / cells_s if cells_s else 0:.0f} cells/min{', ' + a.shape if a.shape else ''})")
    if a.phases:
        t0, t1 = a.phases[:2]
        line += f"; {t1 - t0:.0f} s wall, controls, captures and compile {t1 - t0 - cells_s:.0f} s"
    print(line)
    if cross:
        print(f"cells: {len(ok)} ok, {len(ok) - len(ran)} shared a cross with byte-identical inputs (not run again); "
              f"subset cross median {statistics.median(cross):.3f} s, sum {sum(cross):.0f} s")
    if split:
        parts = {k: sum(c["timing"].get(f"cross_{k}", 0.0) for c in split)
                 for k in ("mix_s", "context_s", "import_s", "decode_s", "account_s")}
        tokens = sum(c["length"] for c in split)
        whole = sum(c["timing"]["cross_s"] for c in split)
        print(f"inside the crosses of the {len(split)} cells that record their parts (summed over lanes): "
              + ", ".join(f"{k[:-2]} {100 * v / whole:.1f} %" for k, v in parts.items())
              + f"; {tokens} tokens decoded, {1000 * parts['decode_s'] / tokens:.2f} ms per token per lane, "
              f"import {parts['import_s'] / len(split):.3f} s per cross")
    if a.phases:
        t0, t1, t2, t3, t4 = a.phases
        print(f"frontier panels: {t2 - t1:.0f} s; minimal searches: {t3 - t2:.0f} s; findings tables: {t4 - t3:.0f} s; "
              f"total {t4 - t0:.0f} s")
    for kind in ("panels", "minimal"):  # every record of the run folder, this session's and earlier ones
        done = [r for r in records(a.run / "findings" / f"{kind}.jsonl") if r.get("status") == "ok"]
        if done:
            line = f"{kind}: {len(done)} ok, median {statistics.median(r['seconds'] for r in done):.1f} s each on a lane"
            if kind == "minimal":
                line += (f", median {statistics.median(r['evaluations'] for r in done):.0f} evaluations, "
                         f"{statistics.median(r['seconds'] / r['evaluations'] for r in done):.2f} s per evaluation")
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
