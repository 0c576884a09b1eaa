"""One process for a batch of cells: ``python -m statelab.experiments.matrix.batch [--lanes L]``
reads a JSON list of tasks on stdin, loads the model once and prints one ``STATELAB_UNIT
<json>`` line per cell (``worker.MARKER``) as it finishes (flushed), so the runner appends
each cell durably while the batch goes on.

The ``batch`` executor (:mod:`statelab.experiments.executors`) groups a study's cells by
(prompt, direction, repeat), or by repeat with lanes (:func:`cells.batch_key`); the repeats
of a coordinate always run in different processes (process repeats stay independent).
Within a batch the verified captures and selectors are read once, a cross whose inputs are
byte-identical to one already run is not run again (its record names the cell that ran,
``same_cross_as``), and each lane keeps one context per configuration, cleared before every
cell (``runtime.ContextPool``).  With ``--lanes L`` L threads run cells at once, each with
its own contexts over the one model: on a GPU one process (one CUDA context) then keeps the
device busy with L streams, where L processes would time-slice it.  With lanes, ggml-cuda's
CUDA graphs are turned off (``GGML_CUDA_DISABLE_GRAPHS``, unless set): with them several
contexts decoding in threads aborted on the H200.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import time

from statelab.experiments.matrix.cells import CellCache, failed_record, run_cell
from statelab.experiments.worker import MARKER, STARTED
from statelab.runtime import ContextPool, Model


def run_tasks(tasks: list[dict], lanes: int, emit, started=None) -> None:
    """Run ``tasks`` on ``lanes`` threads sharing one model and one :class:`CellCache`;
    ``emit(record)`` is called once per task (under a lock), in completion order, and
    ``started(key)`` (under the same lock) when a lane takes a task.  If ``emit`` raises (the
    reader is gone), no lane starts another task."""
    t0 = time.perf_counter()
    cache, lock, stop = CellCache(), threading.Lock(), threading.Event()
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for t in tasks:
        todo.put(t)
    model, load_error = None, None
    if tasks:  # one model per study: loaded once, and a failed load is not retried for every cell
        try:
            model = Model(tasks[0]["model"], backend=tasks[0]["backend"])
        except Exception as e:
            load_error = e

    def lane() -> None:
        pool = None
        try:
            while not stop.is_set():
                try:
                    task = todo.get_nowait()
                except queue.Empty:
                    return
                if started is not None:
                    with lock:
                        started(task["key"])
                t1 = time.perf_counter()
                try:
                    if load_error is not None:
                        raise load_error
                    pool = pool or ContextPool(model)
                    rec = run_cell(task, model=model, cache=cache, contexts=pool)
                except Exception as e:  # reported as a failed cell, never silently dropped
                    rec = failed_record(task, f"{type(e).__name__}: {e}")
                # the cell's wall time in its batch process (what a cell's own process costs elsewhere)
                rec.setdefault("timing", {})["process_s"] = rec["timing"]["subprocess_s"] = time.perf_counter() - t1
                rec["timing"]["batch_started_s"] = t1 - t0
                with lock:
                    try:
                        emit(rec)
                    except Exception:  # nobody reads the records any more: stop every lane
                        stop.set()
                        return
        finally:
            if pool is not None:
                pool.close()

    threads = [threading.Thread(target=lane, name=f"statelab-lane-{i}", daemon=True) for i in range(max(1, lanes))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if model is not None:
        model.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m statelab.experiments.matrix.batch")
    ap.add_argument("--lanes", type=int, default=1, help="cells at once, each lane in its own contexts")
    args = ap.parse_args(argv)
    if args.lanes > 1:
        # ggml-cuda's CUDA graphs are not safe with several contexts decoding in threads: on the
        # H200 16 lanes aborted at ggml-cuda.cu:2658 (GGML_ASSERT(stat == cudaSuccess)) after
        # about 10,000 cells, and ran without a failure with graphs off (docs/findings.md)
        os.environ.setdefault("GGML_CUDA_DISABLE_GRAPHS", "1")
    tasks = json.loads(sys.stdin.read())

    def emit(rec: dict) -> None:
        sys.stdout.write(MARKER + json.dumps(rec, sort_keys=True) + "\n")
        sys.stdout.flush()

    def started(key: str) -> None:  # the runner reruns cells never started if this process dies
        sys.stdout.write(STARTED + json.dumps(key) + "\n")
        sys.stdout.flush()

    run_tasks(tasks, args.lanes, emit, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
