"""Where cells run.  Every executor runs each cell in a FRESH process
(``python -m statelab.study.worker``), so results do not depend on the executor:

  local            a pool of N threads in the runner, each starting one subprocess per cell
  dask-local       a ``distributed.LocalCluster`` of N worker processes (one thread each);
                   each Dask task starts the cell's subprocess on its worker
  dask://HOST:PORT a ``distributed.Client`` to a running scheduler; the workers must see the
                   study folder (captures) at the same path and have statelab installed
  batch            N threads, each starting one process per (prompt, direction, repeat) that
                   runs all its selectors with the model loaded once and crosses byte-identical
                   selections once (``python -m statelab.study.batch``); repeats never share
                   a process

The runner receives results one by one, in completion order, on its own thread.
"""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterable

from .spec import StudyError

_DASK_ADDR = re.compile(r"^dask://(?P<host>[^:/\s]+):(?P<port>\d{1,5})$")


def check_executor(executor: str, workers: int) -> str:
    if not isinstance(workers, int) or workers < 1:
        raise StudyError(f"--workers must be a positive integer, got {workers!r}")
    if executor in ("local", "dask-local", "batch"):
        return executor
    m = _DASK_ADDR.match(executor or "")
    if m and 0 < int(m.group("port")) < 65536:
        return executor
    raise StudyError(f"unknown executor {executor!r}: use local, batch, dask-local or dask://HOST:PORT")


def _address(executor: str) -> str:
    m = _DASK_ADDR.match(executor)
    return f"tcp://{m.group('host')}:{m.group('port')}"


def probe_executor(executor: str) -> None:
    """Fail early (before controls) when a Dask scheduler cannot be reached."""
    if not executor.startswith("dask://"):
        return
    from distributed import Client

    try:
        Client(_address(executor), timeout="10s").close()
    except OSError as e:
        raise StudyError(f"cannot reach the Dask scheduler at {executor}: {e}") from None


def run_cell_subprocess(task: dict, timeout: float | None = None) -> dict:
    """Run one cell in a new Python process and return its record (never raises)."""
    from .cells import failed_record
    from .worker import MARKER

    t0 = time.perf_counter()
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    try:
        proc = subprocess.run([sys.executable, "-m", "statelab.study.worker"], input=json.dumps(task),
                              capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return failed_record(task, f"the cell's process ran past {timeout} s and was killed")
    except OSError as e:
        return failed_record(task, f"cannot start the cell's process: {e}")
    rec = None
    for line in proc.stdout.splitlines():
        if line.startswith(MARKER):
            try:
                rec = json.loads(line[len(MARKER):])
            except ValueError:
                rec = None
    if rec is None:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        return failed_record(task, f"the cell's process exited with status {proc.returncode} without a result: "
                                   f"{tail}")
    rec.setdefault("timing", {})["subprocess_s"] = time.perf_counter() - t0
    return rec


def run_batch_subprocess(tasks: list[dict], on_result: Callable[[dict], None]) -> None:
    """Run a batch of cells in one new process (:mod:`statelab.study.batch`), passing each
    record on as its line arrives; cells without a record become failed records."""
    from .cells import failed_record
    from .worker import MARKER

    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    pending = {t["key"]: t for t in tasks}
    try:
        proc = subprocess.Popen([sys.executable, "-m", "statelab.study.batch"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    except OSError as e:
        for t in tasks:
            on_result(failed_record(t, f"cannot start the batch process: {e}"))
        return
    with proc:
        import threading

        err_lines: list[str] = []
        reader = threading.Thread(target=lambda: err_lines.extend(proc.stderr), daemon=True)
        reader.start()
        proc.stdin.write(json.dumps(tasks))
        proc.stdin.close()
        for line in proc.stdout:
            if not line.startswith(MARKER):
                continue
            try:
                rec = json.loads(line[len(MARKER):])
            except ValueError:
                continue
            if pending.pop(rec.get("key"), None) is not None:
                on_result(rec)
        proc.wait()
        reader.join(timeout=5)
    tail = " | ".join("".join(err_lines).strip().splitlines()[-3:])
    for t in pending.values():
        on_result(failed_record(t, f"the batch process exited with status {proc.returncode} before this cell: {tail}"))


def _run_batches(tasks: list[dict], workers: int, on_result: Callable[[dict], None]) -> None:
    import threading
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from .batch import batch_key

    groups: dict[tuple, list[dict]] = {}
    for t in tasks:
        groups.setdefault(batch_key(t), []).append(t)
    lock = threading.Lock()

    def deliver(rec: dict) -> None:
        with lock:  # the runner's log is written by one thread at a time
            on_result(rec)

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="statelab-batch") as pool:
        futs = [pool.submit(run_batch_subprocess, g, deliver) for g in groups.values()]
        try:
            for f in as_completed(futs):
                f.result()
        except BaseException:
            for f in futs:
                f.cancel()
            raise


def _run_local(tasks: list[dict], workers: int, on_result: Callable[[dict], None]) -> None:
    from concurrent.futures import ThreadPoolExecutor, as_completed

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="statelab-cell") as pool:
        futs = [pool.submit(run_cell_subprocess, t) for t in tasks]
        try:
            for f in as_completed(futs):
                on_result(f.result())
        except BaseException:
            for f in futs:
                f.cancel()
            raise


def _run_dask(tasks: list[dict], workers: int, on_result: Callable[[dict], None], address: str | None) -> dict:
    from distributed import Client, LocalCluster, as_completed

    from .cells import failed_record

    t0 = time.perf_counter()
    cluster = None
    if address is None:
        cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None,
                               silence_logs=logging.CRITICAL)
        client = Client(cluster)
    else:
        try:
            client = Client(address, timeout="20s")
        except OSError as e:
            raise StudyError(f"cannot reach the Dask scheduler at {address}: {e}") from None
    t1 = time.perf_counter()
    try:
        futs = {client.submit(run_cell_subprocess, t, key=f"statelab-cell-{i}-{t['spec_hash'][:8]}-{time.time_ns()}",
                              pure=False): t for i, t in enumerate(tasks)}
        for f in as_completed(list(futs)):
            try:
                rec = f.result()
            except Exception as e:  # the Dask task itself failed (worker lost...)
                rec = failed_record(futs[f], f"dask task failed: {type(e).__name__}: {e}")
            on_result(rec)
        t2 = time.perf_counter()
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
    return {"startup_s": t1 - t0, "shutdown_s": time.perf_counter() - t2}


def execute(tasks: Iterable[dict], executor: str, workers: int, on_result: Callable[[dict], None]) -> dict:
    """Run the tasks; returns the executor's own overhead: {"startup_s", "shutdown_s"}."""
    tasks = list(tasks)
    executor = check_executor(executor, workers)
    if not tasks:
        return {"startup_s": 0.0, "shutdown_s": 0.0}
    if executor == "local":
        _run_local(tasks, workers, on_result)
        return {"startup_s": 0.0, "shutdown_s": 0.0}
    if executor == "batch":
        _run_batches(tasks, workers, on_result)
        return {"startup_s": 0.0, "shutdown_s": 0.0}
    if executor == "dask-local":
        return _run_dask(tasks, workers, on_result, None)
    return _run_dask(tasks, workers, on_result, _address(executor))
