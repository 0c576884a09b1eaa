"""Where cells run.  Every executor runs each cell in a FRESH process whose llama.cpp
context has decoded nothing else, so results do not depend on the executor:

  local            (default) a pre-imported fork server (:mod:`statelab.experiments.forkserver`)
                   forks one child per cell, N at a time; the child loads the model itself
  local-spawn      a pool of N threads in the runner, each starting one new interpreter per
                   cell (``python -m statelab.study.worker``): the interpreter start and the
                   imports are paid per cell
  dask-local       a ``distributed.LocalCluster`` of N worker processes (one thread each);
                   each Dask task starts the cell's subprocess on its worker
  dask://HOST:PORT a ``distributed.Client`` to a running scheduler; the workers must see the
                   study folder (captures) at the same path and have statelab installed

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
from concurrent.futures import ThreadPoolExecutor, as_completed

from ..experiments.forkserver import ForkServer
from .cells import failed_record
from .spec import StudyError
from .worker import MARKER

EXECUTORS = ("local", "local-spawn", "dask-local")
CELL_FN = "statelab.study.worker:cell_record"
_DASK_ADDR = re.compile(r"^dask://(?P<host>[^:/\s]+):(?P<port>\d{1,5})$")


def check_executor(executor: str, workers: int) -> str:
    if not isinstance(workers, int) or workers < 1:
        raise StudyError(f"--workers must be a positive integer, got {workers!r}")
    if executor in EXECUTORS:
        return executor
    m = _DASK_ADDR.match(executor or "")
    if m and 0 < int(m.group("port")) < 65536:
        return executor
    raise StudyError(f"unknown executor {executor!r}: use {', '.join(EXECUTORS)} or dask://HOST:PORT")


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


def run_cell_forked(server: ForkServer, task: dict, timeout: float | None = None) -> dict:
    """Run one cell in a child forked from the fork server; its record (never raises)."""
    rec, info = server.run(CELL_FN, task, timeout=timeout)
    if rec is None:
        return failed_record(task, info.error)
    rec.setdefault("timing", {}).update(fork_s=info.fork_s, process_s=info.run_s, subprocess_s=info.wall_s)
    return rec


def _run_pool(run_one: Callable[[dict], dict], tasks: list[dict], workers: int,
              on_result: Callable[[dict], None]) -> None:
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="statelab-cell") as pool:
        futs = [pool.submit(run_one, t) for t in tasks]
        try:
            for f in as_completed(futs):
                on_result(f.result())
        except BaseException:
            for f in futs:
                f.cancel()
            raise


def _run_dask(tasks: list[dict], workers: int, on_result: Callable[[dict], None], address: str | None) -> dict:
    from distributed import Client, LocalCluster, as_completed

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
        t0 = time.perf_counter()
        with ForkServer() as server:
            t1 = time.perf_counter()
            _run_pool(lambda t: run_cell_forked(server, t), tasks, workers, on_result)
            t2 = time.perf_counter()
        return {"startup_s": t1 - t0, "shutdown_s": time.perf_counter() - t2}
    if executor == "local-spawn":
        _run_pool(run_cell_subprocess, tasks, workers, on_result)
        return {"startup_s": 0.0, "shutdown_s": 0.0}
    if executor == "dask-local":
        return _run_dask(tasks, workers, on_result, None)
    return _run_dask(tasks, workers, on_result, _address(executor))
