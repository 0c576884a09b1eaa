"""A fresh process for one cell.  The default executors fork it from the pre-imported fork
server (:mod:`statelab.experiments.forkserver`, function :func:`cell_record`); the spawn
and Dask executors start ``python -m statelab.study.worker``, which reads a task (JSON) on
stdin and prints one result line ``STATELAB_CELL <json>`` on stdout.  Any failure becomes a
failed record (exit status 0); a crash leaves no result line and the caller records it."""
from __future__ import annotations

import json
import sys
import time

from .cells import failed_record, run_cell

MARKER = "STATELAB_CELL "


def cell_record(task: dict) -> dict:
    """One cell's record; any failure becomes a failed record (what both the fork server's
    children and ``python -m statelab.study.worker`` run)."""
    try:
        return run_cell(task)
    except Exception as e:  # reported as a failed cell, never silently dropped
        return failed_record(task, f"{type(e).__name__}: {e}")


def main() -> int:
    t0 = time.perf_counter()
    task = json.loads(sys.stdin.read())
    rec = cell_record(task)
    rec.setdefault("timing", {})["process_s"] = time.perf_counter() - t0
    sys.stdout.write(MARKER + json.dumps(rec, sort_keys=True) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
