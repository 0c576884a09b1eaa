"""The findings folder (``study findings``): ``findings.md``, ``findings.json``,
``contrasts.md``, ``findings.nc``, the studies' compact results and ``figures/*.png``, from
the studies read by :mod:`statelab.experiments.findings_inputs` and the tables of
:mod:`statelab.analysis.findings`."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import xarray as xr

from statelab.analysis.findings import (MAGNITUDES, Findings, FindingsInputError, _ok_panels, agreed_classes,
                                        compute, contrasts_markdown, independent_records, markdown, panel_class)
from statelab.paths import atomic_path, atomic_write_text, output_lock
from statelab.report import figures as fig
from statelab.report.page import write_file


def figures(f: Findings) -> dict[str, bytes]:
    out = {}
    for run in f.runs:
        out[f"classes-{run.name}"] = fig.class_overview(agreed_classes(run.ds), title=f"{run.name}: endpoint classes "
                                                        "(repeat-agreeing; blank: repeats disagree)")
    recs = [r for run in f.runs for r in _ok_panels(run)]
    groups = {k: [r["interaction"] for r in recs if panel_class(r) == k] for k in ("active", "degenerate")}
    out["interaction"] = fig.histograms({f"{k} ({len(v)})": v for k, v in groups.items()}, "interaction I at t*",
                                        f"frontier panels of class-B cells, independent directions "
                                        f"({len(recs)} with a frontier)")
    mins = [r for run in f.runs for r in independent_records(run, run.minimal)
            if r.get("status") == "ok" and r.get("found")]
    out["minimal-sizes"] = fig.histogram([np.log10(max(r["selected_bytes"], 1)) for r in mins],
                                         "log10 bytes of the minimal sufficient selection",
                                         f"minimal sufficient selections ({len(mins)} searches)")
    return out


def write(runs, out) -> tuple[Path, Findings]:
    """Compute the findings of the studies (:class:`RunData`, one per study folder) and write
    ``OUT/findings.md``, ``OUT/findings.json``, ``OUT/findings.nc`` (per-input natural-pair
    table) and ``OUT/figures/*.png``; returns the Markdown path."""
    f = compute(runs)
    out = Path(out)
    _check_out(out, runs)
    out.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(out, FindingsInputError):  # one writer per findings folder
        _check_out(out, runs)
        made = not out.exists()
        out.mkdir(exist_ok=True)
        try:
            atomic_write_text(out / MARKER, json.dumps({"format": MARKER_FORMAT}) + "\n")
        except BaseException:
            if made:
                out.rmdir()
            raise
        return _write(out, runs, f), f


MARKER = ".statelab-findings"  # marks a findings folder as one: only such a folder (or a new one) is written
MARKER_FORMAT = "statelab.findings-folder/1"


def _check_out(out: Path, runs) -> None:
    """Refuse an output folder that is not a findings folder: an existing file, a folder
    holding other things (a capture, a study...) without the findings marker, or one of the
    study folders read."""
    if not out.exists():
        return
    if not out.is_dir() or out.is_symlink():
        raise FindingsInputError(f"{out} exists and is not a folder; name a new --out")
    if any(out.resolve() == r.root.resolve() for r in runs):
        raise FindingsInputError(f"{out} is one of the study folders read; name a new --out")
    read = {r.root.resolve() for r in runs}  # the kept layout: docs/findings/X/run inside docs/findings/X
    names = [p.name for p in out.iterdir() if p.resolve() not in read]
    if not names:
        return
    if not (_json_of(out / MARKER).get("format") == MARKER_FORMAT
            or _LEGACY_KEYS <= set(_json_of(out / "findings.json"))):  # written before the marker existed
        raise FindingsInputError(f"{out} is not a findings folder (it holds other files and no {MARKER}); "
                                 "name a new or empty --out")


_LEGACY_KEYS = {"runs", "natural", "separability", "minimal", "panels"}


def _json_of(path: Path) -> dict:
    try:
        d = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def _write(out: Path, runs, f) -> Path:
    md = markdown(f)
    figs = figures(f)
    (out / "figures").mkdir(exist_ok=True)
    for name, png in figs.items():
        write_file(out / "figures" / f"{name}.png", png)
    md += "\n## Figures\n\n" + "\n".join(f"![{n}](figures/{n}.png)" for n in figs) + "\n"
    atomic_write_text(out / "findings.json", json.dumps(f.as_dict(out), indent=1, sort_keys=True, default=float))
    atomic_write_text(out / "contrasts.md", contrasts_markdown(f))
    if f.natural:
        with atomic_path(out / "findings.nc") as tmp:
            natural_dataset(f).to_netcdf(tmp, engine="netcdf4")
    for run in runs:  # the studies' own results, compact enough to keep beside the tables
        with atomic_path(out / f"{run.name}-results.nc") as tmp:
            compact_results(run.ds, tmp)
        report = run.root / "report.md"
        if report.is_file():
            atomic_write_text(out / f"{run.name}-report.md", report.read_text())
    atomic_write_text(out / "findings.md", md)
    return out / "findings.md"


def compact_results(ds: xr.Dataset, path) -> None:
    """``ds`` as NetCDF with every variable deflated (level 9) and string variables stored as
    fixed-width bytes (HDF5 cannot deflate variable-length strings): the same values, a
    twentieth of the size for a study's results.nc."""
    ds = ds.copy()
    enc = {}
    for v in ds.data_vars:
        if ds[v].dtype.kind in "OU":
            width = max(1, max((len(str(x)) for x in ds[v].values.ravel()), default=1))
            ds[v] = ds[v].astype(f"S{width}")
        enc[v] = {"zlib": True, "complevel": 9}
    ds.to_netcdf(path, engine="netcdf4", encoding=enc)


def natural_dataset(f: Findings) -> xr.Dataset:
    """Per (run, task, arm pair): natural endpoints and states equal, and for the reference
    pairs of the controls the magnitudes of the state difference (NaN where not measured)."""
    sep = {(r["run"], r["task"], r["pair"]): r for r in f.separability_inputs}
    n = len(f.natural)
    data = {"endpoint_same": np.zeros(n, bool), "state_same": np.zeros(n, bool)}
    data.update({v: np.full(n, np.nan) for v, _ in MAGNITUDES})
    for i, r in enumerate(f.natural):
        data["endpoint_same"][i], data["state_same"][i] = r["endpoint_same"], r["state_same"]
        s = sep.get((r["run"], r["task"], r["pair"]))
        for v, _ in MAGNITUDES:
            if s is not None:
                data[v][i] = s[v]
    coords = {"run": ("row", [r["run"] for r in f.natural]), "task": ("row", [r["task"] for r in f.natural]),
              "pair": ("row", [r["pair"] for r in f.natural])}
    return xr.Dataset({k: ("row", v) for k, v in data.items()}, coords=coords,
                      attrs={"format": "statelab.findings/1"})
