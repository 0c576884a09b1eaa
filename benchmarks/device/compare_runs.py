"""Two runs of one findings study, record for record: the cells, frontier panels and minimal
searches that both hold (by key), compared on every field both records carry except where and
how long they ran and which cell of a process ran a shared cross (pid, host, timing, seconds,
same_cross_as).  A from-scratch run against the kept one:

    python benchmarks/device/compare_runs.py docs/findings/cuda/run NEW_RUN [--timing-copy DEST]

A run folder is a live one (cells.jsonl, findings/*.jsonl) or a kept one (the same gzipped).
``--timing-copy DEST``: write NEW_RUN's records as a kept folder of where its time went
(spec.json, runs.jsonl, controls/, findings/*.jsonl.gz, and cells.jsonl.gz holding each cell's
key, coordinates, class, endpoint sha256, length, shared cross and timing, without the
endpoint tokens and state figures the kept run already holds), for
benchmarks/device/findings_time.py.  Exit 1 when a compared record differs.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from statelab.experiments.findings_inputs import jsonl as records  # plain or gzipped JSON lines
from statelab.experiments.log import first_ok

VOLATILE = {"pid", "host", "timing", "seconds", "same_cross_as"}  # see the module's text
KINDS = {"cells": "cells.jsonl", "panels": "findings/panels.jsonl", "minimal": "findings/minimal.jsonl"}
TIMING_FIELDS = ("key", "status", "prompt", "selector", "direction", "repeat", "klass", "length",
                 "endpoint_sha256", "same_cross_as", "pid", "timing")


def compare(a: Path, b: Path, kind: str) -> tuple[int, int, int, list[str]]:
    """(records of a, of b, keys in both, a line for each that differs), the first successful
    record per key (a resumed run may hold later ones)."""
    ra, rb = (first_ok(records(run / KINDS[kind])) for run in (a, b))
    common = sorted(set(ra) & set(rb))
    differ = []
    for c in common:
        x, y = ra[c], rb[c]
        fields = (set(x) & set(y)) - VOLATILE
        bad = sorted(f for f in fields if x[f] != y[f])
        if bad:
            differ.append(f"{kind} {c}: {', '.join(bad)}")
    return len(ra), len(rb), len(common), differ


def timing_copy(run: Path, dest: Path) -> None:
    """``run``'s records as a kept folder of where its time went (see the module's text), written
    beside ``dest`` and renamed into place."""
    tmp = Path(tempfile.mkdtemp(prefix=".timing-", dir=dest.parent))
    try:
        for f in ("spec.json", "runs.jsonl"):
            shutil.copy2(run / f, tmp / f)
        shutil.copytree(run / "controls", tmp / "controls")
        (tmp / "findings").mkdir()
        with gzip.GzipFile(tmp / "cells.jsonl.gz", "wb", compresslevel=9, mtime=0) as out:
            for r in records(run / "cells.jsonl"):
                slim = {k: r[k] for k in TIMING_FIELDS if k in r}
                slim["timing"] = {k: round(v, 6) for k, v in r.get("timing", {}).items()}
                out.write((json.dumps(slim, sort_keys=True) + "\n").encode())
        for kind in ("panels", "minimal"):
            rows = records(run / KINDS[kind])
            with gzip.GzipFile(tmp / "findings" / f"{kind}.jsonl.gz", "wb", compresslevel=9, mtime=0) as out:
                for r in rows:
                    out.write((json.dumps(r, sort_keys=True) + "\n").encode())
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kept", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--timing-copy", type=Path, metavar="DEST")
    a = ap.parse_args(argv)
    for run in (a.kept, a.new):
        if not (run / "spec.json").is_file():
            print(f"error: {run}: not a study run folder (no spec.json)", file=sys.stderr)
            return 2
    ha, hb = (json.loads((r / "spec.json").read_text()).get("spec_hash") for r in (a.kept, a.new))
    if ha != hb:
        print(f"error: the runs are of different specs ({str(ha)[:12]} and {str(hb)[:12]})", file=sys.stderr)
        return 2
    print(f"spec {ha[:12]}: {a.kept} against {a.new}")
    bad = 0
    for kind in KINDS:
        na, nb, common, differ = compare(a.kept, a.new, kind)
        print(f"{kind}: {na} and {nb} records, {common} keys in both, {common - len(differ)} equal")
        for line in differ[:5]:
            print("  differs: " + line)
        bad += len(differ)
    if a.timing_copy:
        timing_copy(a.new, a.timing_copy)
        print(f"timing copy: {a.timing_copy}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
