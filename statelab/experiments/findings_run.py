"""Model work behind the findings tables, over a finished study folder: minimal sufficient
selections and frontier panels for the study's class-B cells (paper S5.1-S5.3).

A *class-B cell* is a (task, selector, direction) coordinate whose repeats all reproduce the
donor.  Its selection is read back as a box (layers x component x position range) from its
actual byte mask on the recipient's state and checked to be that mask byte for byte.

* ``minimal``: :func:`statelab.analysis.classes.minimal_sufficient_selection` inside the cell's box
  (the cell's component; layers, then positions), each candidate a real subset cross.
* ``panels``: a 2x2 frontier panel whose BOTH arm is the cell's selection: C1/C2 are its K
  and V parts when it spans both components, else the lower and upper halves of its
  position range (a one-position single-component cell has no panel).

Each target is one unit of the engine (:mod:`statelab.experiments.executors`, the fork server):
a fresh process loads the model and reads and verifies the captures; the subset crosses of a
search decode in one context per configuration, cleared before each (``runtime.ContextPool``),
and stop at the first output that leaves the donor's endpoint (the oracle's question); those
of a panel each get a new context and decode to the cap (their traces are the panel).
Targets are ordered so that every task and direction is served in turn (named selectors
before single-layer ones); no new target starts once the time budget is spent; every result is appended as one JSON line (durably) to
``OUT/findings/minimal.jsonl`` or ``OUT/findings/panels.jsonl`` under the study folder's
writer lock.  Running again resumes:
finished targets are skipped.  One process repeat per target (say so where reported).
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from statelab.analysis import frontier as F
from statelab.analysis.results import load_results
from statelab.errors import ConfigError
from statelab.experiments import engine
from statelab.experiments import lanes as batch_lanes
from statelab.experiments.engine import Kind, Summary
from statelab.experiments.executors import Unit
from statelab.experiments.lanes import CellCache
from statelab.experiments.frontier_panels import panel_dataset, run_panels
from statelab.experiments.matrix.cells import plan
from statelab.experiments.records import FINDINGS_TARGET
from statelab.experiments.log import CellLog
from statelab.experiments.minimal import box_selector, search_minimal
from statelab.experiments.naming import Direction
from statelab.experiments.matrix.store import StudyDir
from statelab.lab.receiver import Endpoint
from statelab.runtime import ContextPool, Model, prepare_backend
from statelab.selection import select

KINDS = ("minimal", "panels")


class FindingsError(ConfigError):
    """A findings request that cannot be served, stated in one line."""


def log_path(out, kind: str) -> Path:
    return Path(out) / "findings" / f"{kind}.jsonl"


def class_b_targets(ds, named_first: bool = True) -> list[dict]:
    """(task, selector, direction) coordinates whose repeats all reproduce the donor, ordered
    round-robin over (task, direction) with selectors in spec order (named before
    ``L``-numbered single-layer selectors when ``named_first``)."""
    k = ds["klass"].transpose("task", "selector", "direction", "repeat").values.astype(str)
    all_b = np.all(k == "B", axis=-1)
    sels = [str(s) for s in ds.selector.values]
    order = sorted(range(len(sels)), key=lambda j: (named_first and _is_layer(sels[j]), j))
    groups = []
    for it, t in enumerate(ds.task.values):
        for jd, d in enumerate(ds.direction.values):
            groups.append([{"task": str(t), "selector": sels[js], "direction": str(d)}
                           for js in order if all_b[it, js, jd]])
    out, depth = [], 0
    while any(depth < len(g) for g in groups):
        out.extend(g[depth] for g in groups if depth < len(g))
        depth += 1
    return out


def independent_targets(targets: list[dict], spec: dict, controls: dict) -> list[dict]:
    """The targets of independent directions only: a direction whose donor and recipient arms
    fold into other arms (equal K/V and initial-logits sha256 of the natural captures:
    :func:`statelab.analysis.findings.direction_folds`) repeats another direction's crosses
    byte for byte, so its panels and searches repeat that direction's and the findings tables
    leave them out."""
    from statelab.analysis.findings import RunData, direction_folds, independent

    directions = {d: tuple(Direction.parse(d)) for d in spec["normalized"]["directions"]}
    run = RunData(Path("."), spec["normalized"]["name"], spec, controls, None, [], directions=directions)
    dfolds = direction_folds(run)
    return [t for t in targets if independent(run, t["task"], t["direction"], dfolds)]


def _is_layer(name: str) -> bool:
    return len(name) >= 3 and name[0] == "L" and name[1:3].isdigit() and not name.startswith("L0_") and name != "L0"


def target_key(t: dict, repeat: int = 0) -> str:
    """A target's log key; a panel's process repeat r > 0 is its own target (``...|r1``)."""
    return f"{t['task']}|{t['selector']}|{t['direction']}" + (f"|r{repeat}" if repeat else "")


def mask_box(selection, state) -> dict | None:
    """The box (layers, component, [lo, hi) positions) a selection covers, or None when the
    mask is empty.  The caller checks that the box selects exactly the same bytes."""
    k_layers = np.array([m.any() for m in selection.k])
    v_layers = np.array([m.any() for m in selection.v])
    layers = np.flatnonzero(k_layers | v_layers)
    if layers.size == 0:
        return None
    comp = "KV" if k_layers.any() and v_layers.any() else ("K" if k_layers.any() else "V")
    cells = np.zeros(len(state.positions), dtype=bool)
    for m in selection.k:
        if m.any():
            cells |= m.reshape(m.shape[0], -1).any(axis=1)
    for m in selection.v:
        if m.any():
            cells |= (m.any(axis=0) if selection.v_trans else m.reshape(m.shape[0], -1).any(axis=1))
    pos = np.asarray(state.positions)[cells]
    return {"layers": [int(x) for x in layers], "component": comp,
            "positions": [int(pos.min()), int(pos.max()) + 1]}


# ------------------------------------------------------------------ one target's process


@dataclass
class _Env:
    """What a target runs with: the model, the captures and selectors read once (a
    :class:`CellCache`, shared by the lanes of a batch process) and the caller's contexts."""
    model: Model
    cache: CellCache
    contexts: ContextPool


_W: dict = {}  # the unit's process (fork server): its one _Env


def _load_model(job: dict) -> Model:
    prepare_backend(job["backend"])
    model = Model(job["model_path"], backend=job["backend"])
    if model.sha256 != job["model_sha256"]:
        model.close()
        raise FindingsError(f"model {model.sha256[:12]} is not the study's {job['model_sha256'][:12]}")
    return model


def _env(job: dict) -> _Env:
    if "env" not in _W:
        model = _load_model(job)
        _W["env"] = _Env(model, CellCache(), ContextPool(model))
    return _W["env"]


def _cell_selection(job: dict, env: _Env):
    """The cell's selection on the recipient, its box and the box's own selection."""
    recip = env.cache.capture(job["recipient_capture"])
    sel = select(env.cache.selector(job["selector_source"], job["selector_dirs"]), recip.state)
    box = mask_box(sel, recip.state)
    if box is None:
        return sel, None, None
    boxed = select(box_selector("box", box["layers"], box["component"], box["positions"]), recip.state)
    return sel, box, boxed


def _minimal_job(job: dict, env: _Env) -> dict:
    t0 = time.perf_counter()
    model = env.model
    donor, recip = env.cache.capture(job["donor_capture"]), env.cache.capture(job["recipient_capture"])
    nat_d, nat_r = Endpoint.from_dict(job["natural_donor"]), Endpoint.from_dict(job["natural_recipient"])
    sel, box, boxed = _cell_selection(job, env)
    rec = {k: job[k] for k in ("key", "task", "selector", "direction", "spec_hash")}
    if box is None or not boxed.equals(sel):
        return {**rec, "status": "skipped", "reason": "the selection is not one box of layers x component x positions"}
    comp = box["component"]
    # the search stays inside the cell's box; the oracle asks "the donor's endpoint?": decoding
    # stops at the first output that leaves it (exact: an endpoint that left it cannot be the donor's)
    m = search_minimal(model, donor, recip, nat_d, nat_r, job["cap"], box["layers"], box["positions"], comp,
                       contexts=env.contexts, follow=nat_d.tokens)
    res, final_layers, final = m.result, m.layers, m.selection
    return {**rec, "status": "ok", "found": bool(res.found), "start": box, "start_bytes": int(sel.selected_bytes),
            "layers": final_layers, "component": comp, "positions": list(res.positions),
            "n_layers": len(final_layers), "n_positions": int(res.positions[1] - res.positions[0]),
            "selected_bytes": int(final.selected_bytes), "share": float(final.share),
            "evaluations": res.n_evaluations, "seconds": time.perf_counter() - t0, "pid": os.getpid()}


def panel_components(box: dict) -> tuple[tuple, tuple] | None:
    """(C1, C2) boxes of the panel whose union is ``box``: K and V parts, else the position
    halves; None when the box cannot be split (one component, one position)."""
    if box["component"] == "KV":
        return ((box["layers"], "K", box["positions"], "K"), (box["layers"], "V", box["positions"], "V"))
    lo, hi = box["positions"]
    if hi - lo < 2:
        return None
    mid = lo + (hi - lo) // 2
    return ((box["layers"], box["component"], (lo, mid), f"pos[{lo},{mid})"),
            (box["layers"], box["component"], (mid, hi), f"pos[{mid},{hi})"))


def _panel_job(job: dict, env: _Env) -> dict:
    t0 = time.perf_counter()
    model = env.model
    donor, recip = env.cache.capture(job["donor_capture"]), env.cache.capture(job["recipient_capture"])
    sel, box, boxed = _cell_selection(job, env)
    rec = {k: job[k] for k in ("key", "task", "selector", "direction", "spec_hash")} | {"repeat": job.get("repeat", 0)}
    if box is None or not boxed.equals(sel):
        return {**rec, "status": "skipped", "reason": "the selection is not one box of layers x component x positions"}
    comps = panel_components(box)
    if comps is None:
        return {**rec, "status": "skipped", "reason": "one component at one position: no two-part split"}
    (l1, c1, p1, n1), (l2, c2, p2, n2) = comps
    s1, s2 = box_selector(n1, l1, c1, p1), box_selector(n2, l2, c2, p2)
    panel = job["selector"]  # the panel is named after the cell's selector (its BOTH arm)
    pr = run_panels(model, donor, recip, {panel: (s1, s2)}, job["cap"], contexts=env.contexts)
    ds = panel_dataset(pr, panel, job["task"], job["recipient"], job["direction"], (n1, n2), model.sha256,
                       recip.prompt_sha256)
    row = F.frontier_rows(ds)[0]
    row.pop("recipient", None)
    row.pop("panel", None)
    return {**rec, "status": "ok", "components": [n1, n2], "box": box,
            "selected_bytes": {k: v["selected_bytes"] for k, v in pr.imports[panel].items()},
            **{k: v for k, v in row.items() if k not in rec}, "steps": step_margins(ds),
            "seconds": time.perf_counter() - t0, "pid": os.getpid()}


def step_margins(ds) -> dict:
    """The top-1 condition at every output before the frontier t* (every shared output when the
    panel has none), from the four arms' full-vocabulary logits: per output, ``eps_inf`` (the
    largest absolute logit difference between any two arms) and each arm's top-1 minus top-2
    margin (arms EMPTY, C1, C2, BOTH), so that ``m > 2 eps_inf`` can be checked without the
    traces.  Outputs where not all four vectors exist are left out (``positions`` says which)."""
    c = ds.isel(task=0, recipient=0, panel=0, direction=0, repeat=0)
    ts = int(c["t_star"])
    end = ts if ts >= 0 else int(c["last_position"]) + 1
    pos = np.flatnonzero(c["complete"].values[:end])
    margin = c["margin"].transpose("arm", "position").values[:, pos]
    return {"before": end, "positions": [int(p) for p in pos],
            "eps_inf": [float(x) for x in c["eps_inf"].values[pos]],
            "margin": [[float(x) for x in m] for m in margin]}


_JOBS = {"minimal": _minimal_job, "panels": _panel_job}


def failed_job(job: dict, error: str) -> dict:
    return {k: job[k] for k in ("key", "task", "selector", "direction", "spec_hash")} | {
        "status": "failed", "error": " ".join(str(error).split())[:500]}


def run_job(job: dict) -> dict:
    """One target in its own process (the engine's unit function)."""
    try:
        return _JOBS[job["kind"]](job, _env(job))
    except Exception as e:  # a failed target is recorded, never silently dropped
        return failed_job(job, f"{type(e).__name__}: {e}")


def lane_job(job: dict, model, cache: CellCache, contexts: ContextPool) -> dict:
    """One target on a lane of a batch process (``--lanes``): the model and the captures are
    the process's, the contexts the lane's; a target whose lane comes free after the budget's
    deadline is not started (status ``not_started``, not logged; the first target of a run
    has no deadline: every run makes progress)."""
    if job["deadline"] is not None and time.time() >= job["deadline"]:
        return {k: job[k] for k in ("key", "task", "selector", "direction", "spec_hash")} | {"status": "not_started"}
    return _JOBS[job["kind"]](job, _Env(model, cache, contexts))


JOB = Unit("statelab.experiments.findings_run:run_job", failed_job,
           batch="statelab.experiments.findings_run", batch_key=lambda job, lanes: (job["group"],))


# ------------------------------------------------------------------ driver


def _identity(run) -> tuple[str, None]:
    """The study folder's own spec (nothing is claimed: the folder is the study's)."""
    run.state["spec"] = spec = run.folder.read_spec()
    return spec["spec_hash"], None


def _prepare(run) -> None:
    out, spec, kind = run.out, run.state["spec"], run.options["what"]
    ds = load_results(run.folder.results_path)
    if ds.attrs.get("spec_hash") != spec["spec_hash"]:
        raise FindingsError(f"{out}: results.nc is not compiled from this spec.json; run `statelab study report`")
    controls = run.folder.all_controls()
    tasks, _ = plan(spec, run.folder, controls)
    targets = class_b_targets(ds)
    if run.options["independent"]:
        targets = independent_targets(targets, spec, controls)
    run.state.update(by_cell={(t["prompt"], t["selector"], t["direction"]): t for t in tasks if t["repeat"] == 0},
                     targets=targets, deadline=time.perf_counter() + run.options["budget_s"],
                     log=CellLog(log_path(out, kind), FINDINGS_TARGET[kind], error=FindingsError))


def _done(run) -> set[str]:
    """Targets this spec's log holds as finished (ok, or skipped as not a box)."""
    if "done" not in run.state:
        run.state["done"] = {r["key"] for r in run.state["log"].records()
                             if r.get("spec_hash") == run.spec_hash and r.get("status") in ("ok", "skipped")}
    return run.state["done"]


def _plan(run) -> tuple[list[dict], list]:
    """The pending targets, every target's repeat 0 first, then repeat 1, ... (at most
    ``limit``), with what their processes load; with lanes, the batch each runs in."""
    spec, done, opt = run.state["spec"], _done(run), run.options
    jobs = []
    for r in range(opt["repeats"]):
        for t in run.state["targets"]:
            task = run.state["by_cell"].get((t["task"], t["selector"], t["direction"]))
            if task is None or target_key(t, r) in done:
                continue
            jobs.append({**{k: task[k] for k in ("donor_capture", "recipient_capture", "natural_donor",
                                                 "natural_recipient", "selector_source", "selector_dirs",
                                                 "recipient", "spec_hash")},
                         "cap": int(task["cap"]), "key": target_key(t, r), "repeat": r, **t})
    if opt.get("limit") is not None:
        jobs = jobs[:opt["limit"]]
    missing = sorted({p for j in jobs for p in (j["donor_capture"], j["recipient_capture"]) if not Path(p).exists()})
    if missing:  # a run folder kept without its captures (docs/findings/*/run): nothing to cross
        raise FindingsError(f"{run.out}: {len(missing)} capture(s) of the pending targets are not here "
                            f"(first: {missing[0]}); `statelab study run SPEC --out {run.out}` forms them again "
                            "and keeps the finished cells")
    norm = spec["normalized"]
    process = {"kind": opt["what"], "model_path": spec["model_path"], "backend": norm["backend"],
               "model_sha256": norm["model_sha256"]}
    if run.lanes > 1:
        wall_deadline = time.time() + (run.state["deadline"] - time.perf_counter())
        # a repeat's targets run in batch processes of their own: repeats never share a process
        jobs = [{**j, **process, "group": j["repeat"] * run.workers + i % run.workers,
                 "deadline": wall_deadline if i else None} for i, j in enumerate(jobs)]
    else:
        jobs = [{**j, **process} for j in jobs]
    return jobs, []


def _accept(run, rec: dict) -> dict | None:
    if rec["status"] == "not_started":  # its lane came free after the deadline
        return None
    run.state["log"].append(rec)
    return rec


def _stop(run):
    if run.lanes > 1:
        return None
    deadline = run.state["deadline"]
    return lambda: time.perf_counter() >= deadline


def _compile(run) -> dict:
    return {"targets": len(run.state["targets"]) * run.options["repeats"], "done_before": len(run.state["done"]),
            "not_started": len(run.state["todo"]) - sum(run.state["counts"].values())}


FINDINGS = Kind(
    "findings", "statelab.experiments.findings_run", FindingsError, load_spec=Path,
    folder=lambda out, _out: StudyDir(out), identity=_identity, prepare=_prepare, plan=_plan, done=_done,
    unit=lambda run: JOB, accept=_accept, stop=_stop, compile=_compile, create=False, batch_ok=True)


def run_findings(out, kind: str, budget_s: float, workers: int = 2, limit: int | None = None,
                 progress=None, lanes: int = 1, repeats: int = 1, independent: bool = False) -> Summary:
    """Run ``kind`` (minimal | panels) for the class-B cells of the study folder ``out``
    within ``budget_s`` seconds of wall time (no new target starts after it); resumes.
    ``lanes`` L > 1: ``workers`` batch processes, each loading the model once and running L
    targets at once on threads, each lane in its own contexts (the GPU shape, as the study's
    ``--lanes``); otherwise one forked process per target, ``workers`` at a time.  ``repeats``
    (panels only): every panel again in other processes, repeat r in batch processes of its own
    (log key ``...|rR``), for repeat-level contrasts.  ``independent``: only the targets of
    directions that are not folded into another (:func:`independent_targets`).  The summary's ``counts`` are the results
    by status; ``outputs``: targets, done_before, not_started."""
    if kind not in KINDS:
        raise FindingsError(f"unknown findings kind {kind!r}: use {' or '.join(KINDS)}")
    if not budget_s > 0 or workers < 1 or lanes < 1 or repeats < 1:
        raise FindingsError("the budget must be positive seconds, --workers, --lanes and --repeats at least 1")
    if repeats > 1 and kind != "panels":
        raise FindingsError("--repeats is for panels (a minimal search is one process's answer)")
    if limit is not None and limit < 0:
        raise FindingsError(f"--limit must be 0 or more targets, got {limit}")
    if not StudyDir(out).results_path.is_file():
        raise FindingsError(f"{out}: no results.nc; run `statelab study run` (or `study report`) first")
    return engine.run(FINDINGS, Path(out), out, "batch" if lanes > 1 else "local", workers, lanes, progress,
                      what=kind, budget_s=budget_s, limit=limit, repeats=repeats, independent=independent)


if __name__ == "__main__":  # a batch process of targets (run_findings with lanes)
    sys.exit(batch_lanes.main("statelab.experiments.findings_run", sys.argv[1:], work=lane_job, failed=failed_job,
                              load=_load_model))
