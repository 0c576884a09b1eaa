"""The selector matrix as a kind of the engine (:data:`MATRIX`): controls per prompt (the
kind's preparation), then every pending cell in a fresh process, each finished cell appended
durably; compiled at the end.  Also :func:`minimal_selection` (``study minimal``)."""
from __future__ import annotations

from pathlib import Path

from statelab import prompts as prompts_mod
from statelab.experiments import engine
from statelab.experiments.engine import Kind, Progress, Run, Summary
from statelab.experiments.matrix.cells import CELL, plan
from statelab.experiments.matrix.controls import run_controls
from statelab.experiments.matrix.results import compile_study
from statelab.experiments.matrix.spec import StudyError, StudySpec, check_prompts_fit, load_spec
from statelab.experiments.matrix.store import StudyDir
from statelab.experiments.minimal import search_minimal
from statelab.lab.archive import ArchiveError, load_capture
from statelab.lab.intervene import natural
from statelab.lab.receiver import Endpoint
from statelab.runtime import ContextConfig, Model, prepare_backend


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


def _identity(run: Run) -> tuple[str, dict]:
    return run.spec.hash, run.spec.record()


def _prepare(run: Run) -> None:
    """The model loaded once: every prompt fits, then (spec.json written) each prompt's
    controls, formed again only where the folder holds none of this spec."""
    spec, sdir, rep = run.spec, run.folder, run.progress
    rep.phase("loading the model")
    prepare_backend(spec.backend)
    model = Model(spec.model_path, backend=spec.backend)
    try:
        check_prompts_fit(spec, model)
        resumed = run.claim()
        base = ContextConfig(backend=spec.backend, n_ctx=spec.n_ctx, n_threads=spec.threads)
        controls = {}
        finished = sdir.log().done(spec.hash) if resumed else {}
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
    run.state["controls"] = controls
    run.state["log"] = sdir.log()


def _accept(run: Run, rec: dict) -> dict:
    run.state["log"].append(rec)
    return rec


def _compile(run: Run) -> dict:
    ds, md = compile_study(run.out, lock=False)  # this process holds the lock
    return {"dataset": ds, "markdown": md, "report_path": run.folder.report_path,
            "results_path": run.folder.results_path}


MATRIX = Kind(
    "matrix", "statelab.experiments.matrix.cells", StudyError, load_spec,
    folder=lambda spec, out: StudyDir(out if out is not None else default_out(spec)),
    identity=_identity, prepare=_prepare,
    plan=lambda run: plan(run.folder.read_spec(), run.folder, run.state["controls"]),
    done=lambda run: run.state["log"].done(run.spec.hash), unit=lambda run: CELL, accept=_accept,
    compile=_compile, compile_phase="compiling results", runs_log=True, batch_ok=True)


def run_study(spec_path, out=None, executor: str = "local", workers: int = 2, reporter: Progress | None = None,
              spec: StudySpec | None = None, on_compiled=None, lanes: int = 1) -> Summary:
    """Run (or resume) a study through the engine; ``on_compiled(out, dataset, report)`` runs
    once the results are compiled, still holding the folder's writer lock (e.g. the HTML page
    and its figures).  ``lanes``: cells at once in each batch process (batch executor only)."""
    page = (lambda folder, s: on_compiled(folder, s.outputs["dataset"], s.outputs["markdown"])) if on_compiled else None
    return engine.run(MATRIX, spec if spec is not None else spec_path, out, executor, workers, lanes, reporter,
                      page=page)


def _prompt_id(prompt: str) -> str:
    """The id a prompt spec gets (``file:``/``chat:`` ids are the file name; nothing is read)."""
    kind, _, rest = prompt.partition(":")
    if kind in ("file", "chat") and rest:
        return f"{kind}:{Path(rest).name}"
    return prompts_mod.resolve(prompt).id


def minimal_selection(spec_path, prompt: str, direction: str, out=None, refine: bool = True, progress=None) -> dict:
    """Search a small sufficient selection (layers, then a position range) for one prompt
    and direction with :func:`statelab.experiments.minimal.search_minimal`, evaluating each
    candidate by a real subset cross (in this process, model loaded once).  Reuses
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
        m = search_minimal(model, donor, recip, nat_d, nat_r, spec.cap, range(spec.n_layer), (0, n_pos),
                           refine=refine, on_trial=progress)
        res, final = m.result, m.selection
        return {"prompt": p.id, "direction": d.label, "source": source, "found": res.found,
                "layers": m.layers, "positions": list(res.positions), "n_prompt": n_pos,
                "selected_bytes": final.selected_bytes, "share": final.share,
                "evaluations": res.n_evaluations, "trials": m.trials}
    finally:
        model.close()
