"""Where the units of an experiment run.  Every executor runs each unit (a study cell, a
frontier unit, a campaign block) in a FRESH process whose llama.cpp context has decoded
nothing else, so results do not depend on the executor:

  local            (default) a pre-imported fork server (:mod:`.forkserver`) forks one child
                   per unit, N at a time; the child loads the model itself.  With one worker
                   and a ``stop`` test it is the serial mode of timed campaigns: one unit at
                   a time, in order, in the calling thread
  local-spawn      a pool of N threads in the runner, each starting one new interpreter per
                   unit (``python -m statelab.experiments.worker``): the interpreter start
                   and the imports are paid per unit
  batch            (study cells only) N threads, each starting one new interpreter per
                   (prompt, direction, repeat) that runs all its selectors with the model
                   loaded once, one context per configuration cleared before each cell,
                   and crosses byte-identical inputs once (``python -m
                   statelab.experiments.matrix.batch``); the repeats of a coordinate never
                   share a process.  With ``lanes`` L > 1 a batch is a whole repeat and L
                   cells run at once in it, each lane in its own contexts: the shape for a
                   GPU (one process, one CUDA context, L streams; N processes on one GPU
                   time-slice it).  Each cell's context holds nothing of another cell
                   (cleared), but the cells of a batch share the process (and its model)
  dask-local       a ``distributed.LocalCluster`` of N worker processes (one thread each);
                   each Dask task starts the unit's new interpreter on its worker
  dask://HOST:PORT a ``distributed.Client`` to a running scheduler; the workers must see the
                   output folder (captures) at the same path and have statelab installed

A kind says how its units run with a :class:`Unit`: the function (``module:function``, a
task dict in, a JSON-able dict out), the record of a unit whose process gave none, and the
environment its processes need.  The runner receives results one by one, in completion
order, on its own thread.
"""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, as_completed, wait
from dataclasses import dataclass, field

from statelab.errors import ConfigError
from statelab.experiments import lifeline
from statelab.experiments.forkserver import ForkServer
from statelab.experiments.worker import MARKER, STARTED

EXECUTORS = ("local", "local-spawn", "batch", "dask-local")
_DASK_ADDR = re.compile(r"^dask://(?P<host>[^:/\s]+):(?P<port>\d{1,5})$")


@dataclass(frozen=True)
class Unit:
    """How one kind's tasks run in fresh processes."""
    fn: str  # "module:function", importable in the fork server and in a new interpreter
    failed: Callable[[dict, str], dict]  # the record of a task whose process gave no result
    env: dict = field(default_factory=dict)  # variables the unit's process needs (STATELAB_THREADS...)
    batch: str | None = None  # module run as ``python -m`` for a batch of tasks (the batch executor)
    batch_key: Callable[[dict, int], tuple] | None = None  # (task, lanes) -> tasks with one key share a batch


def check_executor(executor: str, workers: int, error: type[Exception] = ConfigError,
                   batch_ok: bool = False, lanes: int = 1) -> str:
    """The executor name, checked before any work (``batch_ok``: the kind's units can run in
    batches, i.e. its ``Unit`` has ``batch`` and ``batch_key``)."""
    if not isinstance(workers, int) or workers < 1:
        raise error(f"--workers must be a positive integer, got {workers!r}")
    if not isinstance(lanes, int) or lanes < 1:
        raise error(f"--lanes must be a positive integer, got {lanes!r}")
    if lanes > 1 and executor != "batch":
        raise error("--lanes needs the batch executor (cells at once in one batch process)")
    if executor == "batch" and not batch_ok:
        raise error("the batch executor runs study cells only: use local, local-spawn or a Dask executor")
    if executor in EXECUTORS:
        return executor
    m = _DASK_ADDR.match(executor or "")
    if m and 0 < int(m.group("port")) < 65536:
        return executor
    raise error(f"unknown executor {executor!r}: use {', '.join(EXECUTORS)} or dask://HOST:PORT")


def _address(executor: str) -> str:
    m = _DASK_ADDR.match(executor)
    return f"tcp://{m.group('host')}:{m.group('port')}"


def probe_executor(executor: str, error: type[Exception] = ConfigError) -> None:
    """Fail early (before any model work) when a Dask scheduler cannot be reached."""
    if not executor.startswith("dask://"):
        return
    from distributed import Client  # optional and heavy: only the Dask executors need it

    try:
        Client(_address(executor), timeout="10s").close()
    except OSError as e:
        raise error(f"cannot reach the Dask scheduler at {executor}: {e}") from None


def _timed(rec: dict, **timing) -> dict:
    rec.setdefault("timing", {}).update(timing)
    return rec


def run_spawned(unit: Unit, task: dict, timeout: float | None = None) -> dict:
    """Run one unit in a new Python process and return its result (never raises)."""
    t0 = time.perf_counter()
    env = lifeline.child_env({**os.environ, **unit.env})
    env.setdefault("PYTHONUNBUFFERED", "1")
    try:
        proc = subprocess.run([sys.executable, "-m", "statelab.experiments.worker"],
                              input=json.dumps({"fn": unit.fn, "task": task}), capture_output=True, text=True,
                              errors="replace", env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return unit.failed(task, f"the unit's process ran past {timeout} s and was killed")
    except OSError as e:
        return unit.failed(task, f"cannot start the unit's process: {e}")
    if proc.returncode == -signal.SIGINT:  # Ctrl-C reached the unit: an interruption, not a failed unit
        raise KeyboardInterrupt
    rec = None
    for line in proc.stdout.splitlines():
        if line.startswith(MARKER):
            try:
                rec = json.loads(line[len(MARKER):])
            except ValueError:
                rec = None
    if rec is None:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        return unit.failed(task, f"the unit's process exited with status {proc.returncode} without a result: {tail}")
    return _timed(rec, subprocess_s=time.perf_counter() - t0)


def run_forked(server: ForkServer, unit: Unit, task: dict, timeout: float | None = None) -> dict:
    """Run one unit in a child forked from the fork server; its result (never raises)."""
    rec, info = server.run(unit.fn, task, env=unit.env, timeout=timeout)
    if rec is None and info.exit == -signal.SIGINT:  # Ctrl-C reached the unit: an interruption, not a failed unit
        raise KeyboardInterrupt
    if rec is None:
        return unit.failed(task, info.error)
    return _timed(rec, fork_s=info.fork_s, process_s=info.run_s, subprocess_s=info.wall_s)


def run_batch(unit: Unit, tasks: list[dict], on_result: Callable[[dict], None],
              interrupted: threading.Event | None = None, lanes: int = 1) -> None:
    """Run a batch of tasks in one new process (``python -m unit.batch``: a JSON list of tasks
    on stdin, one marked record line per task on stdout as it finishes), passing each record
    on as its line arrives.  If the process dies, the tasks it had started (``STARTED``
    lines) become failed records and those it never started run in a new process, as long as
    each process finishes at least one task; otherwise they fail too."""
    todo = list(tasks)
    while todo:
        started, results, code, tail = _batch_process(unit, todo, on_result, lanes)
        if interrupted is not None and interrupted.is_set():
            return  # the run was interrupted (Ctrl-C reached the batch too): its cells stay pending
        if code == -signal.SIGINT:  # Ctrl-C reached the batch first: an interruption, not failed cells
            raise KeyboardInterrupt
        left = [t for t in todo if t["key"] not in results]
        never = [t for t in left if t["key"] not in started]
        for t in left:
            if t["key"] in started or not results:
                on_result(unit.failed(t, tail if code is None else (
                    f"the batch process exited with status {code} "
                    f"{'during' if t['key'] in started else 'before'} this cell: {tail}")))
        todo = never if results else []


def _batch_process(unit: Unit, tasks: list[dict], on_result: Callable[[dict], None], lanes: int):
    """One batch process over ``tasks``: (keys started, keys with a record, exit status, stderr tail)."""
    env = lifeline.child_env({**os.environ, **unit.env})
    env.setdefault("PYTHONUNBUFFERED", "1")
    pending = {t["key"]: t for t in tasks}
    started: set[str] = set()
    results: set[str] = set()
    try:
        proc = subprocess.Popen([sys.executable, "-m", unit.batch, "--lanes", str(lanes)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                                env=env)
    except OSError as e:
        return started, results, None, f"cannot start the batch process: {e}"
    with proc:
        err_lines: list[str] = []
        reader = threading.Thread(target=lambda: err_lines.extend(proc.stderr), daemon=True)
        reader.start()
        try:
            proc.stdin.write(json.dumps(tasks))
            proc.stdin.close()
        except BrokenPipeError:  # the process died before reading its tasks: reported below
            pass
        for line in proc.stdout:
            try:
                if line.startswith(STARTED):
                    started.add(json.loads(line[len(STARTED):]))
                    continue
                if not line.startswith(MARKER):
                    continue
                rec = json.loads(line[len(MARKER):])
            except ValueError:
                continue
            if pending.pop(rec.get("key"), None) is not None:
                results.add(rec["key"])
                on_result(rec)
        proc.wait()
        reader.join(timeout=5)
    return started, results, proc.returncode, " | ".join("".join(err_lines).strip().splitlines()[-3:])


def _run_batches(unit: Unit, tasks: list[dict], workers: int, on_result: Callable[[dict], None],
                 lanes: int = 1) -> None:
    groups: dict[tuple, list[dict]] = {}
    for t in tasks:
        groups.setdefault(unit.batch_key(t, lanes), []).append(t)
    lock = threading.Lock()
    interrupted = threading.Event()

    def deliver(rec: dict) -> None:
        with lock:  # the runner's log is written by one thread at a time
            if not interrupted.is_set():
                on_result(rec)

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="statelab-batch") as pool:
        futs = [pool.submit(run_batch, unit, g, deliver, interrupted, lanes) for g in groups.values()]
        try:
            for f in as_completed(futs):
                f.result()
        except BaseException:
            interrupted.set()
            for f in futs:
                f.cancel()
            raise


def _run_pool(run_one: Callable[[dict], dict], tasks: list[dict], workers: int,
              on_result: Callable[[dict], None], stop: Callable[[], bool] | None = None) -> None:
    """Run the tasks on ``workers`` threads, in order, results in completion order.  With
    ``stop``, a task is only started while ``stop()`` is False (the first always starts);
    the tasks never started are simply not run."""
    queue = list(reversed(tasks))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="statelab-unit") as pool:
        pending: set = set()
        try:
            while queue or pending:
                while queue and len(pending) < workers and (stop is None or len(queue) == len(tasks) or not stop()):
                    pending.add(pool.submit(run_one, queue.pop()))
                if not pending:
                    break
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for f in finished:
                    on_result(f.result())
        except BaseException:
            for f in pending:
                f.cancel()
            raise


def _run_dask(unit: Unit, tasks: list[dict], workers: int, on_result: Callable[[dict], None], address: str | None,
              error: type[Exception]) -> dict:
    from distributed import Client, LocalCluster  # optional and heavy: only the Dask executors need it
    from distributed import as_completed as dask_completed

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
            raise error(f"cannot reach the Dask scheduler at {address}: {e}") from None
    t1 = time.perf_counter()
    try:
        futs = {client.submit(run_spawned, unit, t, key=f"statelab-unit-{i}-{time.time_ns()}", pure=False): t
                for i, t in enumerate(tasks)}
        for f in dask_completed(list(futs)):
            try:
                rec = f.result()
            except Exception as e:  # the Dask task itself failed (worker lost...)
                rec = unit.failed(futs[f], f"dask task failed: {type(e).__name__}: {e}")
            on_result(rec)
        t2 = time.perf_counter()
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
    return {"startup_s": t1 - t0, "shutdown_s": time.perf_counter() - t2}


def execute(tasks: Iterable[dict], unit: Unit, executor: str, workers: int, on_result: Callable[[dict], None],
            stop: Callable[[], bool] | None = None, error: type[Exception] = ConfigError, lanes: int = 1) -> dict:
    """Run the tasks; returns the executor's own overhead: {"startup_s", "shutdown_s"}.

    ``stop`` (local executor only) is asked before every task but the first is started; True
    starts no more (every run makes progress).  With one worker this is the serial mode of
    timed campaigns: one unit at a time, in order, in the calling thread."""
    tasks = list(tasks)
    executor = check_executor(executor, workers, error, batch_ok=unit.batch is not None and unit.batch_key is not None,
                              lanes=lanes)
    if stop is not None and executor != "local":
        raise error("a stop test needs the local executor (the fork server)")
    if not tasks:
        return {"startup_s": 0.0, "shutdown_s": 0.0}
    if executor == "local":
        t0 = time.perf_counter()
        with ForkServer() as server:
            t1 = time.perf_counter()
            if stop is not None and workers == 1:
                for i, t in enumerate(tasks):
                    if i and stop():
                        break
                    on_result(run_forked(server, unit, t))
            else:
                _run_pool(lambda t: run_forked(server, unit, t), tasks, workers, on_result, stop)
            t2 = time.perf_counter()
        return {"startup_s": t1 - t0, "shutdown_s": time.perf_counter() - t2}
    if executor == "batch":
        _run_batches(unit, tasks, workers, on_result, lanes)
        return {"startup_s": 0.0, "shutdown_s": 0.0}
    if executor == "local-spawn":
        _run_pool(lambda t: run_spawned(unit, t), tasks, workers, on_result)
        return {"startup_s": 0.0, "shutdown_s": 0.0}
    return _run_dask(unit, tasks, workers, on_result, None if executor == "dask-local" else _address(executor), error)
