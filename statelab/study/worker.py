"""A fresh process for one cell: ``python -m statelab.study.worker`` reads a task (JSON) on
stdin and prints one result line ``STATELAB_CELL <json>`` on stdout.  Any failure becomes a
failed record (exit status 0); a crash leaves no result line and the caller records it."""
from __future__ import annotations

import json
import sys
import time

MARKER = "STATELAB_CELL "


def main() -> int:
    t0 = time.perf_counter()
    task = json.loads(sys.stdin.read())
    from .cells import failed_record, run_cell

    try:
        rec = run_cell(task)
    except Exception as e:  # reported as a failed cell, never silently dropped
        rec = failed_record(task, f"{type(e).__name__}: {e}")
    rec.setdefault("timing", {})["process_s"] = time.perf_counter() - t0
    sys.stdout.write(MARKER + json.dumps(rec, sort_keys=True) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
