"""Run a study: validate, claim the output folder, controls per prompt, then every pending
cell in a fresh process, appending each finished cell durably; compile at the end."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from statelab import prompts as prompts_mod
from statelab.analysis.classes import endpoint_class, minimal_sufficient_selection
from statelab.experiments.executors import check_executor, execute, probe_executor
from statelab.experiments.matrix.cells import CELL, plan
from statelab.experiments.matrix.controls import run_controls
from statelab.experiments.matrix.results import compile_study
from statelab.experiments.matrix.spec import StudyError, StudySpec, check_prompts_fit, load_spec
from statelab.experiments.matrix.store import CellLog, StudyDir
from statelab.experiments.records import STUDY_CELL, STUDY_VALUES
from statelab.lab.archive import ArchiveError, load_capture
from statelab.lab.intervene import natural, subset_cross
from statelab.lab.receiver import Endpoint
from statelab.runtime import ContextConfig, Model, prepare_backend
from statelab.selection import Selector, Term, select


class Reporter:
    """Progress hooks (no output); the CLI passes a rich progress bar."""

    def phase(self, text: str) -> None: ...

    def start(self, total: int, done: int, withheld: int) -> None: ...

    def advance(self, record: dict) -> None: ...

    def finish(self) -> None: ...


@dataclass
class RunSummary:
    out: Path
    spec_hash: str
    resumed: bool
    planned: int
    withheld: int
    skipped: int  # finished in an earlier run
    ran: int
    failed: int
    seconds: float
    cells_seconds: float
    report: Path
    results: Path
    executor_startup_s: float = 0.0  # Dask cluster/client start, inside cells_seconds
    page: Path | None = None  # what on_compiled returned (report.html), written under the lock

    @property
    def cells_per_minute(self) -> float:
        return 60.0 * self.ran / self.cells_seconds if self.cells_seconds > 0 else 0.0


def default_out(spec: StudySpec) -> Path:
    return Path("runs") / "studies" / spec.name


def check_states_of_finished_cells(prompt_id: str, ctl: dict, finished) -> None:
    """Controls formed again (the captures were missing or damaged: a folder carried to another
    machine without its captures, say) must give the K/V states that the prompt's finished
    cells crossed, byte for byte (sha256), or those cells describe other states: refused."""
    kv = {arm: rec["kv"] for arm, rec in ctl["arms"].items()}
    for r in finished:
        if r.get("prompt") != prompt_id:
            continue
        for role in ("donor", "recipient"):
            arm, sha = r.get(role), r.get(f"{role}_kv_sha256")
            if arm in kv and sha and sha != kv[arm]:
                raise StudyError(
                    f"{prompt_id}: arm {arm} formed again gives K/V {kv[arm][:12]}, but the finished cell "
                    f"{r['key']} crossed {sha[:12]} (another machine, build or backend): resume it where it ran, "
                    "or start a new output folder")


def _controls_current(sdir: StudyDir, spec: StudySpec, prompt) -> dict | None:
    ctl = sdir.read_controls(prompt.id)
    if ctl is None or ctl.get("spec_hash") != spec.hash:
        return None
    try:  # every arm's capture verifies (a damaged or older-format capture is formed again)
        for a in spec.arms:
            load_capture(sdir.capture_dir(prompt.id, a))
    except ArchiveError:
        return None
    return ctl


def run_study(spec_path, out=None, executor: str = "local", workers: int = 2, reporter: Reporter | None = None,
              spec: StudySpec | None = None, on_compiled=None, lanes: int = 1) -> RunSummary:
    """Run (or resume) a study; ``on_compiled(out, dataset, report)`` runs once the results are
    compiled, still holding the folder's writer lock (e.g. the HTML page and its figures).
    ``lanes``: cells at once in each batch process (batch executor only)."""
    rep = reporter or Reporter()
    t0 = time.perf_counter()
    spec = spec or load_spec(spec_path)  # every spec error surfaces here, before the folder is touched
    check_executor(executor, workers, StudyError, batch_ok=True, lanes=lanes)
    sdir = StudyDir(out if out is not None else default_out(spec))
    with sdir.writer():  # one writer per folder; a second one is refused here
        return _run_locked(spec, sdir, executor, workers, rep, t0, on_compiled, lanes)


def _run_locked(spec: StudySpec, sdir: StudyDir, executor: str, workers: int, rep: Reporter,
                t0: float, on_compiled=None, lanes: int = 1) -> RunSummary:
    sdir.check(spec.hash)
    probe_executor(executor, StudyError)

    rep.phase("loading the model")
    prepare_backend(spec.backend)
    model = Model(spec.model_path, backend=spec.backend)
    try:
        check_prompts_fit(spec, model)
        resumed = sdir.claim(spec)
        base = ContextConfig(backend=spec.backend, n_ctx=spec.n_ctx, n_threads=spec.threads)
        controls = {}
        finished = CellLog(sdir.cells_path, STUDY_CELL, STUDY_VALUES).done(spec.hash) if resumed else {}
        for p in spec.prompts:
            ctl = _controls_current(sdir, spec, p) if resumed else None
            if ctl is None:
                rep.phase(f"controls {p.id}")
                ctl = run_controls(model, spec, p, sdir, base)
                check_states_of_finished_cells(p.id, ctl, finished.values())
                sdir.write_controls(p.id, ctl)
            controls[p.id] = ctl
    finally:
        model.close()

    spec_record = sdir.read_spec()
    tasks, withheld = plan(spec_record, sdir, controls)
    log = CellLog(sdir.cells_path, STUDY_CELL, STUDY_VALUES)
    done = log.done(spec.hash)
    todo = [t for t in tasks if t["key"] not in done]
    rep.start(total=len(tasks) + len(withheld), done=len(tasks) - len(todo), withheld=len(withheld))
    counts = {"ran": 0, "failed": 0}

    def on_result(rec: dict) -> None:
        log.append(rec)  # durable before anything else sees it
        counts["ran"] += 1
        if rec.get("status") != "ok":
            counts["failed"] += 1
        rep.advance(rec)

    tc = time.perf_counter()
    overhead = {"startup_s": 0.0}
    try:
        overhead = execute(todo, CELL, executor, workers, on_result, error=StudyError, lanes=lanes)
    finally:
        cells_seconds = time.perf_counter() - tc
        rep.finish()
        with open(sdir.root / "runs.jsonl", "a") as f:
            f.write(json.dumps({"started": time.time() - (time.perf_counter() - t0), "executor": executor,
                                "workers": workers, "lanes": lanes, "cells_ran": counts["ran"],
                                "failed": counts["failed"],
                                "cells_seconds": cells_seconds, "executor_overhead": overhead,
                                "pid": os.getpid()}) + "\n")
    rep.phase("compiling results")
    ds, md = compile_study(sdir.root, lock=False)  # this process holds the lock
    page = on_compiled(sdir.root, ds, md) if on_compiled else None
    return RunSummary(out=sdir.root, spec_hash=spec.hash, resumed=resumed, planned=len(tasks) + len(withheld),
                      withheld=len(withheld), skipped=len(tasks) - len(todo), ran=counts["ran"],
                      failed=counts["failed"], seconds=time.perf_counter() - t0, cells_seconds=cells_seconds,
                      report=sdir.report_path, results=sdir.results_path,
                      executor_startup_s=overhead.get("startup_s", 0.0), page=page)


def _prompt_id(prompt: str) -> str:
    """The id a prompt spec gets (``file:``/``chat:`` ids are the file name; nothing is read)."""
    kind, _, rest = prompt.partition(":")
    if kind in ("file", "chat") and rest:
        return f"{kind}:{Path(rest).name}"
    return prompts_mod.resolve(prompt).id


def minimal_selection(spec_path, prompt: str, direction: str, out=None, refine: bool = True, progress=None) -> dict:
    """Search a small sufficient selection (layers, then a position range) for one prompt
    and direction with :func:`statelab.analysis.classes.minimal_sufficient_selection`, evaluating
    each candidate by a real subset cross (in this process, model loaded once).  Reuses
    the study's archived captures when ``out`` holds them; otherwise forms them."""
    spec = load_spec(spec_path)
    p = next((q for q in spec.prompts if q.id == _prompt_id(prompt)), None) if prompt else None
    if p is None:
        raise StudyError(f"prompt {prompt!r} is not one of the study's prompts ({', '.join(spec.task_ids)})")
    d = next((x for x in spec.directions if x.label == direction.replace(" ", "")), None)
    if d is None:
        raise StudyError(f"direction {direction!r} is not one of the study's ({', '.join(spec.direction_labels)})")
    prepare_backend(spec.backend)
    model = Model(spec.model_path, backend=spec.backend)
    try:
        check_prompts_fit(spec, model)
        sdir = StudyDir(out) if out is not None else None
        ctl = sdir.read_controls(p.id) if sdir is not None and sdir.spec_path.is_file() else None
        if ctl is not None and ctl.get("spec_hash") == spec.hash and ctl.get("passed"):
            donor, recip = (load_capture(sdir.capture_dir(p.id, a)) for a in (d.donor, d.recipient))
            nat_d = Endpoint.from_dict(ctl["arms"][d.donor]["natural"])
            nat_r = Endpoint.from_dict(ctl["arms"][d.recipient]["natural"])
            source = f"captures of {sdir.root}"
        else:
            base = ContextConfig(backend=spec.backend, n_ctx=spec.n_ctx, n_threads=spec.threads)
            donor, nat_d = natural(model, p, spec.arms[d.donor], base, spec.cap)
            recip, nat_r = natural(model, p, spec.arms[d.recipient], base, spec.cap)
            source = "freshly formed captures"
        if nat_d.same(nat_r):
            raise StudyError(f"{p.id}: the natural endpoints of {d.donor} and {d.recipient} coincide within cap "
                             f"{spec.cap}; there is no distinguishable donor endpoint to reproduce")
        n_pos = recip.n_prompt
        trials = []

        def evaluate(layers, positions) -> bool:
            sel = select(Selector("candidate", (Term(layers=tuple(layers), positions=tuple(positions)),)), recip.state)
            ep, acc = subset_cross(model, donor, recip, sel, spec.cap)
            k = endpoint_class(ep, nat_d, nat_r)
            trials.append({"layers": list(layers), "positions": list(positions), "klass": k,
                           "selected_bytes": sel.selected_bytes, "changed_bytes": acc.changed_bytes})
            if progress is not None:
                progress(trials[-1])
            return k == "B"

        res = minimal_sufficient_selection(evaluate, spec.n_layer, (0, n_pos), refine=refine)
        final = select(Selector("minimal", (Term(layers=res.layers, positions=res.positions),)), recip.state)
        return {"prompt": p.id, "direction": d.label, "source": source, "found": res.found,
                "layers": list(res.layers), "positions": list(res.positions), "n_prompt": n_pos,
                "selected_bytes": final.selected_bytes, "share": final.share,
                "evaluations": res.n_evaluations, "trials": trials}
    finally:
        model.close()
