"""The one runner of every experiment kind.

:func:`run` does the same steps for every kind, in this order:

    claim the run folder    one writer at a time (OUT/.lock), a second one refused at once
    spec hash check         a folder of another spec is refused (OUT/spec.json)
    the kind's preparation  captures, controls, a drafter, refused arms... (``Kind.prepare``);
                            OUT/spec.json is written once it succeeded (``Run.claim``)
    plan                    the spec -> task dicts with a ``key`` (and the withheld ones)
    skip                    what the durable log already holds (``Kind.done``)
    execute                 every pending task as a unit of :mod:`.executors`; each result is
                            made durable by the kind (``Kind.accept``) before anything else
    compile                 the durable records -> results and report (no model)

and returns ONE :class:`Summary`, reporting through ONE :class:`Progress` protocol.  A kind is
a short declaration (:class:`Kind`) registered in :data:`statelab.experiments.kinds.KINDS`.
"""
from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from statelab.experiments.executors import Unit, check_executor, execute, probe_executor
from statelab.experiments.folder import RunFolder


class Progress:
    """The progress protocol of every kind (no output); the CLI passes a rich bar or lines."""

    def phase(self, text: str) -> None: ...

    def start(self, total: int, done: int, withheld: int) -> None: ...

    def advance(self, record: dict) -> None: ...

    def finish(self) -> None: ...


@dataclass
class Summary:
    """What every run returns.  ``counts``: the kept results by status (``ran`` is their sum);
    ``outputs``: what the kind's compile step returned (datasets, tables, paths); ``complete``
    False when a budget left tasks for the next run (then nothing is compiled)."""
    kind: str
    out: Path
    spec_hash: str
    resumed: bool
    planned: int
    withheld: int
    skipped: int  # held by the durable log before this run
    ran: int
    failed: int
    seconds: float
    units_seconds: float
    complete: bool = True
    report: Path | None = None
    results: Path | None = None
    page: Path | None = None  # what the caller's page(out, summary) wrote, under the folder's lock
    executor_startup_s: float = 0.0
    counts: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)

    @property
    def cells_seconds(self) -> float:
        return self.units_seconds

    @property
    def cells_per_minute(self) -> float:
        return 60.0 * self.ran / self.units_seconds if self.units_seconds > 0 else 0.0


@dataclass
class Run:
    """One run of a kind, as its steps see it: the spec, the claimed folder, the executor and
    the caller's options; ``state`` is the kind's own scratch space between its steps."""
    kind: "Kind"
    spec: object
    folder: RunFolder
    executor: str
    workers: int
    lanes: int
    progress: Progress
    options: dict
    spec_hash: str = ""
    record: dict | None = None  # what OUT/spec.json holds
    resumed: bool = False
    claimed: bool = False
    state: dict = field(default_factory=dict)

    @property
    def out(self) -> Path:
        return self.folder.root

    def claim(self) -> bool:
        """Write OUT/spec.json (once; a resumed folder keeps its own).  True when resuming."""
        if not self.claimed:
            self.resumed = self.folder.claim(self.spec_hash, self.record)
            self.claimed = True
        return self.resumed


def _nothing(run: Run) -> None:
    return None


@dataclass(frozen=True)
class Kind:
    """An experiment kind as the engine runs it.

    name        the kind's name (the fork server and the docs list kinds by it)
    unit_module the module of its unit function (the fork server imports it before forking)
    error       the one-line error class of its user errors
    load_spec   a spec path (or object) -> the validated spec
    folder      (spec, out or None) -> its RunFolder (the default output folder when None)
    identity    Run -> (spec hash, spec.json record); may refuse the folder first
    plan        Run -> (tasks, withheld tasks); every task has a unique ``key``
    done        Run -> the keys the durable log already holds
    unit        Run -> the :class:`.executors.Unit` a task runs as
    accept      (Run, result) -> the record kept (made durable here), or None (not kept)
    compile     Run -> outputs dict ({"report", "results", ...}), or None when incomplete
    prepare     Run -> None: the kind's own work before planning (captures, controls)
    stop        Run -> a stop test for the local executor (a time budget), or None
    create      the folder may be made (False: an existing folder of another kind's run)
    compile_phase  the progress phase shown before compiling (None: none)
    runs_log    append one line per run to OUT/runs.jsonl (executor, counts, timings)
    """
    name: str
    unit_module: str
    error: type[Exception]
    load_spec: Callable
    folder: Callable
    identity: Callable
    plan: Callable
    done: Callable
    unit: Callable
    accept: Callable
    compile: Callable
    prepare: Callable = _nothing
    stop: Callable = _nothing
    create: bool = True
    compile_phase: str | None = None
    runs_log: bool = False
    batch_ok: bool = False


def run(kind: Kind, spec, out=None, executor: str = "local", workers: int = 1, lanes: int = 1,
        progress: Progress | None = None, page=None, **options) -> Summary:
    """Run (or resume) ``spec`` as ``kind`` (a :class:`Kind`, e.g. ``kinds.KINDS[name]``) into
    ``out``; ``page(out, summary)`` runs once the results are compiled, still holding the
    folder's lock (the HTML page).  ``options``: the kind's own settings (a time budget, a
    limit...)."""
    t0 = time.perf_counter()
    prog = progress or Progress()
    spec = kind.load_spec(spec) if isinstance(spec, (str, os.PathLike)) else spec  # spec errors before the folder
    check_executor(executor, workers, kind.error, batch_ok=kind.batch_ok, lanes=lanes)
    folder = kind.folder(spec, out)
    with folder.writer(create=kind.create):  # one writer per folder; a second one is refused here
        r = Run(kind, spec, folder, executor, workers, lanes, prog, options)
        r.spec_hash, r.record = kind.identity(r)
        r.resumed = folder.check(r.spec_hash) if r.record is not None else True
        probe_executor(executor, kind.error)
        kind.prepare(r)
        if r.record is not None:
            r.claim()
        return _execute(kind, r, t0, page)


def _execute(kind: Kind, r: Run, t0: float, page) -> Summary:
    tasks, withheld = kind.plan(r)
    done = kind.done(r)
    todo = [t for t in tasks if t["key"] not in done]
    r.progress.start(total=len(tasks) + len(withheld), done=len(tasks) - len(todo), withheld=len(withheld))
    counts: Counter = Counter()  # the kept results by status

    def on_result(res: dict) -> None:
        rec = kind.accept(r, res)  # durable before anything else sees it
        if rec is None:
            return
        counts[rec.get("status", "ok")] += 1
        r.progress.advance(rec)

    unit: Unit = kind.unit(r)
    tc = time.perf_counter()
    overhead = {"startup_s": 0.0}
    ran = lambda: sum(counts.values())  # noqa: E731
    try:
        overhead = execute(todo, unit, r.executor, r.workers, on_result, stop=kind.stop(r), error=kind.error,
                           lanes=r.lanes)
    finally:
        units_seconds = time.perf_counter() - tc
        r.progress.finish()
        if kind.runs_log:
            with open(r.out / "runs.jsonl", "a") as f:
                f.write(json.dumps({"started": time.time() - (time.perf_counter() - t0), "executor": r.executor,
                                    "workers": r.workers, "lanes": r.lanes, "cells_ran": ran(),
                                    "failed": ran() - counts["ok"] - counts["skipped"],
                                    "cells_seconds": units_seconds, "executor_overhead": overhead,
                                    "pid": os.getpid()}) + "\n")
    r.state.update(todo=todo, tasks=tasks, counts=counts)
    if kind.compile_phase:
        r.progress.phase(kind.compile_phase)
    outputs = kind.compile(r)
    s = Summary(kind=kind.name, out=r.out, spec_hash=r.spec_hash, resumed=r.resumed,
                planned=len(tasks) + len(withheld), withheld=len(withheld), skipped=len(tasks) - len(todo),
                ran=ran(), failed=ran() - counts["ok"] - counts["skipped"],
                seconds=time.perf_counter() - t0, units_seconds=units_seconds, complete=outputs is not None,
                executor_startup_s=overhead.get("startup_s", 0.0), counts=dict(counts), outputs=outputs or {})
    s.report, s.results = s.outputs.get("report_path"), s.outputs.get("results_path")
    if page is not None and s.complete:
        s.page = page(r.out, s)
    return s
