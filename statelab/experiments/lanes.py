"""Several units at once in ONE process: the body of a batch process (``python -m
statelab.experiments.matrix.batch`` for study cells, ``python -m
statelab.experiments.findings_run`` for the findings follow-ups; see
:func:`statelab.experiments.executors.run_batch`).

A JSON list of tasks arrives on stdin; the model is loaded once; ``--lanes L`` threads take
tasks in order, each lane with its own contexts (``runtime.ContextPool``) over the one model
and one :class:`CellCache` shared by all lanes; one ``STATELAB_UNIT <json>`` line is printed
per task as it finishes (flushed) and one ``STATELAB_STARTED <key>`` line when a lane takes a
task (a process that dies fails only the tasks it had started).  On a GPU one process (one
CUDA context) keeps the device busy with L streams, where L processes would time-slice it.
With lanes, ggml-cuda's CUDA graphs are turned off (``GGML_CUDA_DISABLE_GRAPHS``, unless
set): with them several contexts decoding in threads aborted on the H200.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from statelab.experiments import lifeline
from statelab.experiments.worker import MARKER, STARTED
from statelab.lab.archive import load_capture
from statelab.runtime import ContextPool
from statelab.selection import load_selector


class CellCache:
    """What one batch process keeps between its units, safe to share by its lanes (threads):
    each value is made once (:meth:`get`; others asking for it meanwhile wait for it), so
    the verified captures, the selectors, the captures' hashes and the crosses already run
    are read or computed once per process.  A value whose making raised is not kept."""

    def __init__(self):
        self._lock = threading.Lock()
        self._values: dict = {}

    def get(self, key, make):
        """(value, made_here): made_here is True for the caller that computed it."""
        with self._lock:
            fut = self._values.get(key)
            mine = fut is None
            if mine:
                fut = self._values[key] = Future()
        if mine:
            try:
                fut.set_result(make())
            except BaseException as e:
                with self._lock:
                    del self._values[key]
                fut.set_exception(e)
        return fut.result(), mine

    def capture(self, path: str):
        """The capture at ``path``, read, verified and parsed once per process (the lanes share it)."""
        def read():
            c = load_capture(path)
            _ = c.state  # the parsed K/V, made here under the once-only rule
            return c
        return self.get(("capture", path), read)[0]

    def selector(self, source: str, search_dirs):
        """The selector file ``source``, read once per process."""
        return self.get(("selector", source), lambda: load_selector(source, search_dirs=search_dirs))[0]


# work(task, model, cache, contexts) -> record; failed(task, message) -> record; load(task) -> Model
Work = Callable[[dict, object, CellCache, ContextPool], dict]


def run_tasks(tasks: list[dict], lanes: int, emit, started=None, *, work: Work,
              failed: Callable[[dict, str], dict], load: Callable[[dict], object]) -> None:
    """Run ``tasks`` on ``lanes`` threads sharing one model (``load(tasks[0])``) and one
    :class:`CellCache`; ``emit(record)`` is called once per task (under a lock), in completion
    order, and ``started(key)`` (under the same lock) when a lane takes a task.  A failed
    model load fails every task with its message (it is not retried per task).  If ``emit``
    raises (the reader is gone), no lane starts another task."""
    t0 = time.perf_counter()
    cache, lock, stop = CellCache(), threading.Lock(), threading.Event()
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for t in tasks:
        todo.put(t)
    model, load_error = None, None
    if tasks:
        try:
            model = load(tasks[0])
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
                    rec = work(task, model, cache, pool)
                except Exception as e:  # reported as a failed unit, never silently dropped
                    rec = failed(task, f"{type(e).__name__}: {e}")
                # the unit's wall time in its batch process (what its own process costs elsewhere)
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


def main(prog: str, argv, *, work: Work, failed: Callable[[dict, str], dict], load: Callable[[dict], object]) -> int:
    """A batch process: tasks from stdin, marked records on stdout (see the module text)."""
    lifeline.die_with_parent()  # the runner's kill -9 ends this process too
    ap = argparse.ArgumentParser(prog=f"python -m {prog}")
    ap.add_argument("--lanes", type=int, default=1, help="units at once, each lane in its own contexts")
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

    def started(key: str) -> None:  # the runner reruns units never started if this process dies
        sys.stdout.write(STARTED + json.dumps(key) + "\n")
        sys.stdout.flush()

    run_tasks(tasks, args.lanes, emit, started, work=work, failed=failed, load=load)
    return 0
