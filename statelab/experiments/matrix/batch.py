"""One process for a batch of cells: ``python -m statelab.experiments.matrix.batch`` reads a JSON list of
tasks on stdin, loads the model once and prints one ``STATELAB_UNIT <json>`` line per cell (``worker.MARKER``)
as it finishes (flushed), so the runner appends each cell durably while the batch goes on.

The ``batch`` executor (:mod:`statelab.experiments.executors`) groups a study's cells by
(prompt, direction, repeat): every selector of one coordinate runs in one process, and the
repeats of a coordinate always run in different processes (process repeats stay
independent).  Within a batch the verified captures and selectors are read once, and a
selection whose byte mask equals one already crossed on the same captures is not crossed
again (its record names the cell that ran, ``same_mask_as``).
"""
from __future__ import annotations

import json
import sys
import time

from statelab.experiments.matrix.cells import failed_record, run_cell
from statelab.experiments.worker import MARKER
from statelab.runtime import Model


def main() -> int:
    t0 = time.perf_counter()
    tasks = json.loads(sys.stdin.read())
    model, cache, load_error = None, {}, None
    for task in tasks:
        t1 = time.perf_counter()
        try:
            if load_error is not None:  # the model did not load for the first cell: not retried per cell
                raise load_error
            if model is None:
                try:
                    model = Model(task["model"], backend=task["backend"])
                except Exception as e:
                    load_error = e
                    raise
            rec = run_cell(task, model=model, cache=cache)
        except Exception as e:  # reported as a failed cell, never silently dropped
            rec = failed_record(task, f"{type(e).__name__}: {e}")
        # the cell's wall time in its batch process (what a cell's own process costs elsewhere)
        rec.setdefault("timing", {})["process_s"] = rec["timing"]["subprocess_s"] = time.perf_counter() - t1
        rec["timing"]["batch_started_s"] = t1 - t0
        sys.stdout.write(MARKER + json.dumps(rec, sort_keys=True) + "\n")
        sys.stdout.flush()
    if model is not None:
        model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
