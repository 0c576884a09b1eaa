"""Compile a study folder into an xarray Dataset (``results.nc``) and a Markdown report.

Needs no model: everything comes from ``spec.json``, ``controls/*.json``, ``cells.jsonl``
and, for the selector lattice and magnitude separability, the archived captures.

Dataset dims: task, selector, direction, repeat.  Variables (all deterministic; timing
stays in cells.jsonl): klass (B/C/D, "" without a result), status (ok / failed / withheld /
pending), first_diff_recipient and first_diff_donor (-1: equal endpoints, -2: no result),
selected_bytes, changed_bytes, length (-1: no result), share, max_abs, l2, l2_rel (NaN: no
result), endpoint_sha256, stop_reason.
"""
from __future__ import annotations

import json
import statistics

import numpy as np
import xarray as xr

from statelab.analysis.classes import (class_matrix_markdown, magnitude_separability, non_monotone_pairs,
                                       repeat_agreement, selector_lattice)
from statelab.experiments.naming import Direction
from statelab.analysis.results import load_results
from statelab.paths import atomic_write_netcdf, atomic_write_text
from statelab.experiments.matrix.spec import StudyError, cell_key
from statelab.experiments.log import first_ok
from statelab.experiments.matrix.store import StudyDir
from statelab.experiments.records import check_study_cell_against_controls
from statelab.lab.archive import load_capture
from statelab.selection import load_selector, select
from statelab.experiments.matrix.controls import ALL, EMPTY

INT_VARS = ("first_diff_recipient", "first_diff_donor", "selected_bytes", "changed_bytes", "length")
FLOAT_VARS = ("share", "max_abs", "l2", "l2_rel")
STR_VARS = ("klass", "status", "endpoint_sha256", "stop_reason")
DETERMINISTIC = ("klass", "status", *INT_VARS, *FLOAT_VARS, "endpoint_sha256", "stop_reason")

_ATTRS = {
    "klass": "endpoint class of the subset cross: B reproduces the donor's natural endpoint, C a third "
             "trajectory, D keeps the recipient's ('' without a result)",
    "status": "ok, failed (no successful record yet), withheld (the prompt's controls failed) or pending",
    "first_diff_recipient": "first differing output vs the recipient's natural endpoint (-1 equal, -2 no result)",
    "first_diff_donor": "first differing output vs the donor's natural endpoint (-1 equal, -2 no result)",
    "selected_bytes": "K/V value bytes the selector names in the recipient's real state (-1 no result)",
    "changed_bytes": "bytes that actually changed in the recipient's state (-1 no result)",
    "length": "generated tokens of the cross's endpoint (-1 no result)",
    "share": "selected bytes / all K/V value bytes",
    "max_abs": "largest absolute change of an imported value",
    "l2": "L2 norm of the change",
    "l2_rel": "L2 norm of the change relative to the recipient state's norm",
    "endpoint_sha256": "sha256 of the endpoint's int32 tokens and EOG flag",
    "stop_reason": "eog, cap or ctx",
}


def _coords(norm: dict) -> dict:
    return {"task": [p["id"] for p in norm["prompts"]], "selector": [s["name"] for s in norm["selectors"]],
            "direction": list(norm["directions"]), "repeat": list(range(norm["repeats"]))}


def load_state(out) -> tuple[StudyDir, dict, dict, list[dict], dict[str, dict]]:
    sdir = StudyDir(out)
    spec = sdir.read_spec()
    controls = sdir.all_controls()
    log = sdir.log()
    records = log.records()  # each checked against the schema: one line naming file, line and field
    for line, rec in zip(log.lines, records):
        if rec["status"] == "ok" and rec["spec_hash"] == spec["spec_hash"]:
            check_study_cell_against_controls(rec, controls, sdir.cells_path, line, StudyError)
    return sdir, spec, controls, records, first_ok(records, spec["spec_hash"])


def compile_dataset(spec: dict, ok: dict[str, dict], records: list[dict], controls: dict[str, dict]) -> xr.Dataset:
    norm = spec["normalized"]
    coords = _coords(norm)
    shape = tuple(len(v) for v in coords.values())
    data = {v: np.full(shape, -2 if v.startswith("first_diff") else -1, np.int64) for v in INT_VARS}
    data.update({v: np.full(shape, np.nan, np.float64) for v in FLOAT_VARS})
    data.update({v: np.full(shape, "", dtype=object) for v in STR_VARS})
    data["status"][...] = "pending"
    failed = {r["key"] for r in records if r.get("status") == "failed" and r.get("spec_hash") == spec["spec_hash"]}
    for it, t in enumerate(coords["task"]):
        ctl = controls.get(t)
        for js, s in enumerate(coords["selector"]):
            for jd, d in enumerate(coords["direction"]):
                for r in coords["repeat"]:
                    idx = (it, js, jd, r)
                    key = cell_key(t, s, d, r)
                    rec = ok.get(key)
                    if rec is None:
                        if ctl is not None and not ctl.get("passed", False):
                            data["status"][idx] = "withheld"
                        elif key in failed:
                            data["status"][idx] = "failed"
                        continue
                    data["status"][idx] = "ok"
                    data["klass"][idx] = rec["klass"]
                    for v in ("first_diff_recipient", "first_diff_donor"):
                        data[v][idx] = -1 if rec[v] is None else int(rec[v])
                    for v in ("selected_bytes", "changed_bytes", "length"):
                        data[v][idx] = int(rec[v])
                    for v in FLOAT_VARS:
                        data[v][idx] = float(rec[v])
                    data["endpoint_sha256"][idx] = rec["endpoint_sha256"]
                    data["stop_reason"][idx] = rec["stop_reason"]
    dims = tuple(coords)
    ds = xr.Dataset({v: (dims, data[v].astype(str) if v in STR_VARS else data[v], {"description": _ATTRS[v]})
                     for v in DETERMINISTIC}, coords=coords)
    ds.attrs.update({"spec_hash": spec["spec_hash"], "study": norm["name"], "model_sha256": norm["model_sha256"],
                     "backend": norm["backend"], "cap": int(norm["cap"]),
                     "arms": json.dumps(norm["arms"], sort_keys=True), "format": "statelab.study.results/1"})
    return ds


load_dataset = load_results  # the one results reader, under the name the study's callers know


# ---------------------------------------------------------------------- report pieces


def _fmt(v) -> str:
    if v is None:
        return "="
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _table(cols: list[str], rows: list[list]) -> str:
    if not rows:
        return "(none)\n"
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(_fmt(c) for c in r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def controls_section(spec: dict, controls: dict[str, dict]) -> str:
    norm = spec["normalized"]
    rows = []
    for p in norm["prompts"]:
        c = controls.get(p["id"])
        if c is None:
            rows.append([p["id"], "", "", "", "", "", "not run"])
            continue
        shams = all(a["sham_ok"] for a in c["arms"].values())
        archive = all(a["archive_ok"] for a in c["arms"].values())
        pairs = list(c.get("arm_pairs", {}).values())
        nfd = ", ".join(f"{q['reference']}/{q['other']}: {_fmt(q['natural_first_diff'])}" for q in pairs)
        empty = ", ".join(f"{d}: {_fmt(v['empty']['ok'])}" for d, v in c["directions"].items())
        all_ = ", ".join(f"{d}: {_fmt(v['all']['ok'])} ({v['all']['klass']})" for d, v in c["directions"].items())
        rows.append([p["id"], c.get("n_prompt"), nfd, _fmt(shams) + ("" if archive else " (archive NO)"), empty, all_,
                     "pass" if c["passed"] else "WITHHELD: " + "; ".join(c["reasons"])])
    return ("Per prompt, before any cell: natural endpoints of every arm (first differing output of the "
            "natural pair, '=' equal), own-path shams (must equal natural), the EMPTY subset cross (must "
            "reproduce the recipient's natural endpoint and change no byte) and the ALL subset cross (must "
            "equal the whole-KV cross with recipient logits; its class in brackets).\n\n"
            + _table(["task", "prompt tokens", "natural first diff", "shams", "EMPTY", "ALL", "status"], rows))


def bytes_section(ds: xr.Dataset) -> str:
    rows = []
    dirs = [str(d) for d in ds.direction.values]
    for t in ds.task.values:
        for s in ds.selector.values:
            cell = ds.sel(task=t, selector=s)
            ok = cell.status.values == "ok"
            if not ok.any():
                continue
            first = cell.where(cell.status == "ok")
            sb = int(np.nanmax(first.selected_bytes.values))
            row = [t, s, sb, float(np.nanmax(first.share.values)), int(np.nanmax(first.changed_bytes.values))]
            for d in dirs:
                v = first.sel(direction=d)
                row.append(float(np.nanmax(v.l2_rel.values)) if (v.status.values == "ok").any() else None)
            rows.append(row)
    return _table(["task", "selector", "selected bytes", "share", "changed bytes", *[f"L2 rel {d}" for d in dirs]],
                  rows)


def _lattice_masks(sdir: StudyDir, spec: dict, task: str, controls: dict) -> dict:
    """Flat byte masks of the spec's selectors (and the EMPTY/ALL controls) on the
    recipient's real state of ``task``."""
    norm = spec["normalized"]
    recip = Direction.parse(norm["directions"][0]).recipient
    state = load_capture(sdir.capture_dir(task, recip)).state
    masks = {}
    for s in norm["selectors"]:
        sel = load_selector(spec["selector_sources"][s["name"]], search_dirs=spec["selector_dirs"])
        if sel.describe() != s["terms"]:
            raise StudyError(f"selector {s['name']} changed since the study ran")
        m = select(sel, state)
        masks[s["name"]] = m.to_flat()
    for ctl in (EMPTY, ALL):
        if ctl.name not in masks:
            masks[ctl.name] = select(ctl, state).to_flat()
    return masks


def lattice_section(sdir: StudyDir, spec: dict, ds: xr.Dataset, controls: dict) -> str:
    norm = spec["normalized"]
    names = {s["name"] for s in norm["selectors"]}
    lines, found = [], []
    equal_notes = []
    for t in ds.task.values:
        t = str(t)
        ctl = controls.get(t)
        if ctl is None or not ctl.get("passed"):
            continue
        try:
            masks = _lattice_masks(sdir, spec, t, controls)
        except Exception as e:  # a missing capture or a changed selector: say so, keep the report
            lines.append(f"- {t}: lattice not computed ({type(e).__name__}: {e})")
            continue
        lat = selector_lattice(masks)
        if lat.graph["equal"]:
            equal_notes.append(f"{t}: " + ", ".join(f"{a} = {b}" for a, b in lat.graph["equal"]))
        for d in ds.direction.values:
            d = str(d)
            for r in ds.repeat.values:
                outcomes = {}
                for s in ds.selector.values:
                    k = str(ds.klass.sel(task=t, selector=s, direction=d, repeat=r).item())
                    if k:
                        outcomes[str(s)] = k
                c = ctl["directions"][d]
                if "EMPTY" not in names:
                    outcomes["EMPTY"] = "D"  # the passed EMPTY control reproduced the recipient
                if "ALL" not in names:
                    outcomes["ALL"] = c["all"]["klass"]
                for small, large in non_monotone_pairs(lat, outcomes):
                    found.append((t, d, int(r), small, large, outcomes[large]))
    text = ("Inclusion lattice from the actual byte masks on each prompt's real state (EMPTY and ALL "
            "from the controls where the spec does not list them). A pair is non-monotone when the smaller "
            "selection reproduces the donor (B) and a strict superset does not.\n\n")
    if equal_notes:
        text += "Selections with identical masks: " + "; ".join(equal_notes) + ".\n\n"
    grouped: dict[tuple, list] = {}
    for t, d, r, small, large, k in found:
        grouped.setdefault((t, d, small, large, k), []).append(r)
    rows = [[t, d, small, f"{large} ({k})", ",".join(map(str, rs))] for (t, d, small, large, k), rs in grouped.items()]
    text += (_table(["task", "direction", "sufficient (B)", "superset (class)", "repeats"], rows) if rows
             else "No non-monotone pair among these selectors.\n")
    if lines:
        text += "\n" + "\n".join(lines) + "\n"
    return text


def separability_section(spec: dict, controls: dict) -> str:
    mags_l2, mags_max, div, rows = {}, {}, {}, []
    for p in spec["normalized"]["prompts"]:
        c = controls.get(p["id"])
        if c is None:
            continue
        for pair in c.get("arm_pairs", {}).values():
            name = f"{p['id']} {pair['other']} vs {pair['reference']}"
            mags_l2[name], mags_max[name] = pair["l2_rel"], pair["max_abs"]
            div[name] = not pair["natural_same"]
            rows.append([name, pair["changed_bytes"], pair["max_abs"], pair["l2_rel"], pair["first_differing_layer"],
                         pair["natural_first_diff"], "diverges" if div[name] else "stable"])
    text = ("Full-KV differences of the natural states, relative to the reference arm's state norm, against "
            "whether the natural endpoints diverge (paper S5.2).\n\n"
            + _table(["input", "changed bytes", "max \\|d\\|", "L2 rel", "first differing layer", "natural first diff",
                      "endpoint"], rows))
    if not rows:
        return text
    for label, mags in (("L2 rel", mags_l2), ("max |d|", mags_max)):
        res = magnitude_separability(mags, div)["diverging_above"]
        n_div, n_stable = sum(div.values()), len(div) - sum(div.values())
        if res.separable:
            verdict = (f"an increasing one-threshold rule separates them (stable <= {res.threshold:.6g})"
                       if n_div and n_stable else "trivially separable (only one label present: "
                       f"{n_div} diverging, {n_stable} stable)")
        else:
            verdict = (f"NOT separable by an increasing one-threshold rule: {res.counterexample[0]} is stable with a "
                       f"magnitude >= that of diverging {res.counterexample[1]} ({len(res.violations)} violating pairs)")
        text += f"\n- {label}: {verdict}."
    return text + "\n"


def report_markdown(sdir: StudyDir, spec: dict, controls: dict, records: list[dict], ok: dict,
                    ds: xr.Dataset) -> str:
    norm = spec["normalized"]
    status = ds.status.values
    n = {s: int((status == s).sum()) for s in ("ok", "failed", "withheld", "pending")}
    arms = ", ".join(f"{a} = {json.dumps(s['chunks'])} ubatch {s['n_ubatch']}" for a, s in norm["arms"].items())
    head = [f"# Study {norm['name']}", "",
            (spec.get("description") or "").strip(), "",
            f"- spec hash: `{spec['spec_hash']}`",
            f"- model: `{spec['model_path']}` (sha256 {norm['model_sha256'][:16]}, {spec['n_layer']} layers), "
            f"backend {norm['backend']}, threads {norm['threads']}, n_ctx {norm['n_ctx']}",
            f"- arms: {arms}; directions: {', '.join(norm['directions'])}",
            f"- output cap {norm['cap']}; {norm['repeats']} repeats, each in its own process",
            "- selectors: " + ", ".join(f"{s['name']} {s['terms']}" for s in norm["selectors"]),
            f"- cells: {ds.status.size} planned; {n['ok']} done, {n['failed']} failed, {n['withheld']} withheld, "
            f"{n['pending']} pending", ""]
    out = "\n".join(head)
    out += "\n## Controls\n\n" + controls_section(spec, controls)
    out += "\n## Class matrix\n\n"
    if n["ok"]:
        out += class_matrix_markdown(ds)
        d_mask = ds.klass.values == "D"
        d_changed = int(((ds.changed_bytes.values > 0) & d_mask).sum())
        out += f"D requests whose import changed bytes: {d_changed} of {int(d_mask.sum())}.\n"
        agr = repeat_agreement(ds)
        out += "\n## Repeat agreement\n\n"
        out += (f"Repeats agree at {agr.n_agree} of {agr.n_coordinates} coordinates"
                f" (disagree {agr.n_disagree}, incomplete {agr.n_incomplete}).\n")
        if agr.disagreements:
            out += "\n" + _table(["coordinate", "classes"],
                                 [[", ".join(f"{k}={v}" for k, v in row.items() if k != "classes"),
                                   "/".join(row["classes"])] for row in agr.disagreements])
        hashes_agree = 0
        hv = ds.endpoint_sha256.values  # "" without a result
        for idx in np.ndindex(hv.shape[:-1]):
            vals = hv[idx]
            if all(v for v in vals) and len(set(vals)) == 1:
                hashes_agree += 1
        out += f"Complete endpoints (token hashes) agree across repeats at {hashes_agree} coordinates.\n"
    else:
        out += "(no finished cell)\n"
    out += "\n## Selected bytes and distances\n\n" + bytes_section(ds)
    out += "\n## Non-monotone sufficiency\n\n" + lattice_section(sdir, spec, ds, controls)
    out += "\n## Magnitude separability\n\n" + separability_section(spec, controls)
    withheld = sorted({(str(t), c["reasons"] and "; ".join(c["reasons"]))
                       for t, c in controls.items() if not c.get("passed")})
    out += "\n## Withheld and failed\n\n"
    out += (_table(["task", "reason"], [list(w) for w in withheld]) if withheld else "No prompt was withheld.\n")
    fails = {}
    for r in records:
        if r.get("status") == "failed" and r.get("spec_hash") == spec["spec_hash"]:
            fails.setdefault(r["key"], r["error"])
    open_fails = {k: v for k, v in fails.items() if k not in ok}
    out += (f"\nFailed attempts: {len(fails)} ({len(open_fails)} without a later success).\n")
    if open_fails:
        out += "\n" + _table(["cell", "error"], [[k, v[:200]] for k, v in sorted(open_fails.items())])
    timing = [r.get("timing", {}) for r in ok.values()]
    if timing:
        def med(k):
            vals = [t[k] for t in timing if k in t]
            return statistics.median(vals) if vals else float("nan")
        pids = {(r.get("host"), r.get("pid")) for r in ok.values()}
        out += ("\n## Timing\n\n"
                f"Median per cell: process {med('subprocess_s'):.2f} s, model load {med('load_s'):.2f} s, "
                f"subset cross {med('cross_s'):.2f} s. {len(pids)} distinct worker processes for {len(ok)} cells.\n")
    return out


def compile_study(out, lock: bool = True, on_compiled=None) -> tuple[xr.Dataset, str]:
    """Recompile OUT/results.nc and OUT/report.md from the folder; returns (dataset, report).
    With ``lock`` it takes the folder's writer lock (refused while a run writes the folder) and
    calls ``on_compiled(out, dataset, report)`` before releasing it."""
    if lock:
        with StudyDir(out).writer(create=False):
            ds, md = compile_study(out, lock=False)
            if on_compiled:
                on_compiled(out, ds, md)
            return ds, md
    sdir, spec, controls, records, ok = load_state(out)
    ds = compile_dataset(spec, ok, records, controls)
    atomic_write_netcdf(sdir.results_path, ds)
    report = report_markdown(sdir, spec, controls, records, ok, ds)
    atomic_write_text(sdir.report_path, report)
    return ds, report
