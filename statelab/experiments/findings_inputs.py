"""A study folder read as the findings' input (:class:`statelab.analysis.findings.RunData`):
its spec.json, controls, results (compiled from the cell records where only those are kept),
the ``findings/*.jsonl`` records, and the selectors' byte masks on each task's recipient state
(from the archived captures, or from a skeleton state checked against the recorded bytes)."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

from statelab.analysis.findings import FindingsInputError, RunData, skeleton_state
from statelab.analysis.results import load_results
from statelab.experiments.log import first_ok
from statelab.experiments.matrix.controls import ALL, EMPTY
from statelab.experiments.matrix.results import _lattice_masks, compile_dataset
from statelab.experiments.matrix.store import StudyDir
from statelab.experiments.naming import Direction
from statelab.resources import data_dir
from statelab.selection import load_selector, select


def jsonl(path: Path) -> list[dict]:
    """The JSON lines of ``path`` or, where only that exists, of ``path.gz`` (a kept run
    folder stores its logs compressed); none if neither exists."""
    gz = path.with_name(path.name + ".gz")
    if path.is_file():
        text = path.read_text()
    elif gz.is_file():
        text = gzip.decompress(gz.read_bytes()).decode()
    else:
        return []
    if text and not text.endswith("\n"):  # a line a killed writer left unfinished is not a record
        text = text[:text.rfind("\n") + 1]
    try:
        return [json.loads(ln) for ln in text.splitlines() if ln.strip()]
    except ValueError:
        raise FindingsInputError(f"{path}: a line is not valid JSON (the log was edited?)") from None


def _log(path: Path, spec_hash: str) -> list[dict]:
    from statelab.experiments.records import FINDINGS_TARGET, check_record

    out: dict[str, dict] = {}
    for i, r in enumerate(jsonl(path), 1):
        check_record(r, FINDINGS_TARGET[path.name.split(".")[0]], path, i, FindingsInputError)
        if r.get("spec_hash") == spec_hash:
            out[r["key"]] = r  # the latest record of a target wins (a failed one retried)
    return list(out.values())


def load_run(out) -> RunData:
    """A study folder: a live one with compiled results (``results.nc`` from this
    ``spec.json``), or a kept one without captures or results (``spec.json``, ``controls/``,
    ``cells.jsonl.gz``, ``findings/*.jsonl[.gz]``, as in ``docs/findings/cuda/run``), whose
    results are compiled from the cell records in memory."""
    root = Path(out)
    if not (root / "spec.json").is_file():
        raise FindingsInputError(f"{root}: not a study folder (no spec.json)")
    sdir = StudyDir(root)
    spec = sdir.read_spec()
    controls = sdir.all_controls()
    records = jsonl(sdir.cells_path)
    if sdir.results_path.is_file():
        ds = load_results(sdir.results_path)
        if ds.attrs.get("spec_hash") != spec["spec_hash"]:
            raise FindingsInputError(f"{root}: results.nc was compiled from another spec; run `statelab study report`")
    elif records:
        ds = compile_dataset(spec, first_ok(records, spec["spec_hash"]), records, controls)
    else:
        raise FindingsInputError(f"{root}: no results.nc and no cell records; run `statelab study report {root}` first")
    run = RunData(root, spec["normalized"]["name"], spec, controls, ds,
                  [r for r in records if r.get("spec_hash") == spec["spec_hash"]],
                  _log(root / "findings" / "minimal.jsonl", spec["spec_hash"]),
                  _log(root / "findings" / "panels.jsonl", spec["spec_hash"]),
                  {d: tuple(Direction.parse(d)) for d in spec["normalized"]["directions"]})
    run.masks_for = lambda task: _masks(run, task)
    return run


def masks_from_records(run: RunData, task: str) -> dict:
    """Byte masks of the spec's selectors on the skeleton of ``task``'s recipient state, each
    checked against the selected bytes every cell of the task recorded (the check fails
    loudly if the skeleton's geometry is not the state's)."""
    recs = [r for r in run.records if r.get("prompt") == task and r.get("status") == "ok"]
    if not recs:
        raise FindingsInputError(f"{run.root}: no cell records of {task} to read its state geometry from")
    state = skeleton_state(int(run.controls[task]["n_prompt"]), int(run.spec["n_layer"]),
                           int(recs[0]["total_value_bytes"]))
    here = data_dir("selectors")
    dirs = [here] + [Path(d) for d in run.spec.get("selector_dirs", []) if Path(d).is_dir()]
    masks, sizes = {}, {}
    for s in run.spec["normalized"]["selectors"]:
        src = str(run.spec.get("selector_sources", {}).get(s["name"], ""))
        # the recorded source is a path of the machine that ran the study: read the same file
        # from this checkout's selectors/ (its description must be the recorded one)
        local = here / src.rsplit("/selectors/", 1)[1] if "/selectors/" in src else None
        sel = load_selector(local if local is not None and local.is_file() else s["name"], search_dirs=dirs)
        if sel.describe() != s["terms"]:
            raise FindingsInputError(f"selector {s['name']} changed since the study ran")
        m = select(sel, state)
        masks[s["name"]], sizes[s["name"]] = m.to_flat(), int(m.selected_bytes)
    for ctl in (EMPTY, ALL):
        masks.setdefault(ctl.name, select(ctl, state).to_flat())
    bad = [r["key"] for r in recs if r["selector"] in sizes and int(r["selected_bytes"]) != sizes[r["selector"]]]
    if bad:
        raise FindingsInputError(f"{task}: the skeleton state does not reproduce the recorded selected bytes "
                                 f"({len(bad)} cells, e.g. {bad[0]})")
    return masks


def _masks(run: RunData, task: str) -> dict:
    if StudyDir(run.root).capture_dir(task, Direction.parse(run.spec["normalized"]["directions"][0]).recipient).is_dir():
        return _lattice_masks(StudyDir(run.root), run.spec, task, run.controls)
    return masks_from_records(run, task)


def load_runs(folders) -> list[RunData]:
    """Every study folder of a findings request (two folders of one study are refused)."""
    runs = [load_run(d) for d in folders]
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise FindingsInputError(f"two folders hold the same study ({', '.join(names)})")
    return runs
