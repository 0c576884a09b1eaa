"""Study runner: spec validation, durable cells, kill + resume, executors, report.

The selector lattice and magnitude separability on synthetic results are covered by the
analysis tests; here they run on the real study's byte masks and states.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

from conftest import one_line_error, run_cli
from golden_outputs import assert_golden
from statelab.experiments.matrix import (CellLog, StudyDir, StudyError, compile_study,
                                         load_dataset, load_spec, run_study)
from statelab.experiments.matrix.cells import plan
from statelab.experiments.executors import check_executor

REPO = Path(__file__).resolve().parents[1]
CI = REPO / "studies" / "ci.toml"
CLI = [sys.executable, "-m", "statelab.cli"]


def _spec(tmp_path: Path, name="s", **over) -> Path:
    base = {"cap": 32, "repeats": 1, "threads": 1, "prompts": '["HumanEval/2"]', "selectors": '["EARLY", "LATE"]',
            "directions": '["A->R"]'}
    base.update({k: v for k, v in over.items() if k != "extra"})
    body = "\n".join(f"{k} = {v}" for k, v in base.items())
    p = tmp_path / f"{name}.toml"
    p.write_text(f'name = "{name}"\n{body}\n{over.get("extra", "")}\n[arms]\nA = "A"\nR = "R"\n')
    return p


# ------------------------------------------------------------------ bad input, before any cell


def _refused(tmp_path, spec, *needles, env=None):
    out = tmp_path / "out"
    line = one_line_error(run_cli("study", "run", spec, "--out", out, env=env), *needles)
    assert not out.exists(), "an output folder was created for a refused spec"
    return line


def test_unknown_selector_name(tmp_path):
    _refused(tmp_path, _spec(tmp_path, selectors='["EARLY", "NOPE"]'), "unknown selector 'NOPE'", "known: ")


@pytest.mark.model
def test_layer_beyond_model(tmp_path):
    sel = tmp_path / "sels"
    sel.mkdir()
    (sel / "L40.toml").write_text("[[term]]\nlayers = [40]\ncomponent = \"V\"\n")
    line = _refused(tmp_path, _spec(tmp_path, selectors='["L40"]'), "layer 40", "30 layers",
                    env={"STATELAB_SELECTORS": str(sel)})
    assert line.startswith("error: study spec")


def test_empty_position_range(tmp_path):
    sel = tmp_path / "sels"
    sel.mkdir()
    (sel / "BACKWARDS.toml").write_text("[[term]]\npositions = [64, 32]\n")
    _refused(tmp_path, _spec(tmp_path, selectors='["BACKWARDS"]'), "empty position range [64, 32)",
             env={"STATELAB_SELECTORS": str(sel)})


def test_malformed_toml(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "bad"\nprompts = ["HumanEval/2"\nselectors = ["ALL"]\n')
    _refused(tmp_path, bad, "malformed TOML", "bad.toml")


def test_missing_prompt(tmp_path):
    _refused(tmp_path, _spec(tmp_path, prompts='["HumanEval/2", "HumanEval/999"]'),
             "prompt 'HumanEval/999'", "no such HumanEval problem")


def test_spec_errors_in_library(tmp_path):
    """The other up-front checks, in process (fast)."""
    cases = [
        (dict(directions='["A->X"]'), "names arm 'X'"),
        (dict(directions='["A->A"]'), "same donor and recipient"),
        (dict(repeats="0"), "'repeats' must be an integer >= 1"),
        (dict(selectors="[]"), "'selectors' is empty"),
        (dict(selectors='["EARLY", "EARLY"]'), "more than once"),
        (dict(backend='"metal"'), "unknown backend 'metal'"),
        (dict(extra='colour = "blue"'), "unknown key(s) colour"),
        (dict(prompts='["nonsense"]'), "unknown prompt spec"),
    ]
    for i, (over, needle) in enumerate(cases):
        with pytest.raises(StudyError) as e:
            load_spec(_spec(tmp_path, name=f"s{i}", **over), check_model=False)
        assert needle in str(e.value), (over, str(e.value))
    with pytest.raises(StudyError, match="unknown executor"):
        check_executor("threads", 2, StudyError)
    with pytest.raises(StudyError, match="--workers"):
        check_executor("local", 0, StudyError)
    assert check_executor("dask://10.0.0.1:8786", 1) == "dask://10.0.0.1:8786"


def test_spec_hash_ignores_where_not_what(tmp_path):
    """The hash covers what decides outcomes (here: the cap), not where the spec lives."""
    a = load_spec(_spec(tmp_path, name="same"), check_model=False)
    other = tmp_path / "elsewhere"
    other.mkdir()
    b = load_spec(_spec(other, name="same"), check_model=False)
    c = load_spec(_spec(other, name="same", cap=16), check_model=False)
    assert a.hash == b.hash != c.hash
    assert a.cell_keys() == ["HumanEval/2|EARLY|A->R|0", "HumanEval/2|LATE|A->R|0"]


def test_cell_log_cuts_a_torn_line(tmp_path):
    log = CellLog(tmp_path / "cells.jsonl")
    log.append({"key": "k1", "status": "ok", "spec_hash": "h"})
    log.append({"key": "k2", "status": "failed", "spec_hash": "h", "error": "x"})
    with open(log.path, "a") as f:
        f.write('{"key": "k3", "status": "o')  # a writer killed mid-line
    again = CellLog(log.path)
    assert again.repaired > 0
    assert [r["key"] for r in again.records()] == ["k1", "k2"]
    assert list(again.done("h")) == ["k1"] and again.done("other") == {}
    again.append({"key": "k3", "status": "ok", "spec_hash": "h"})
    assert list(CellLog(log.path).done("h")) == ["k1", "k3"]


# ------------------------------------------------------------------ the CI study, killed and resumed


def _lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.mark.cli
@pytest.mark.model
def test_ci_study_killed_and_resumed(tmp_path):
    out = tmp_path / "ci"
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(CLI + ["study", "run", str(CI), "--out", str(out), "--workers", "2"], cwd=REPO,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    cells = out / "cells.jsonl"
    deadline = time.monotonic() + 300
    while _lines(cells) < 5 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None, (tmp_path / "killed.log").read_text()
    os.killpg(proc.pid, signal.SIGKILL)  # the runner and its cell processes, mid-study
    proc.wait()
    for _ in range(50):
        if not _group_alive(proc.pid):
            break
        time.sleep(0.1)
    assert not _group_alive(proc.pid), "cell processes survived the kill"
    before = cells.read_bytes()
    n_before = before.count(b"\n")
    assert 5 <= n_before < 32 and not (out / "results.nc").exists()

    # a changed spec is refused for this folder
    changed = tmp_path / "ci16.toml"
    changed.write_text(CI.read_text().replace("cap = 32", "cap = 16"))
    one_line_error(run_cli("study", "run", changed, "--out", out), "holds a study run of a different spec", "new --out")

    r = run_cli("study", "run", CI, "--out", out, "--workers", "2")
    assert r.returncode == 0, r.stderr
    assert "resumed" in r.stdout and "already done" in r.stdout

    # durable log: the killed run's whole lines are kept as they were, nothing lost or duplicated
    after = cells.read_bytes()
    kept = before[:before.rfind(b"\n") + 1]
    assert after.startswith(kept)
    recs = [json.loads(x) for x in after.splitlines()]
    assert all(r["status"] == "ok" for r in recs), [r.get("error") for r in recs if r["status"] != "ok"]
    spec = load_spec(CI)
    keys = [r["key"] for r in recs]
    assert len(keys) == len(set(keys)) == 32 and set(keys) == set(spec.cell_keys())
    assert len({(r["host"], r["pid"]) for r in recs}) == 32  # every cell, every repeat: its own process

    sdir = StudyDir(out)
    spec_record = sdir.read_spec()
    controls = sdir.all_controls()
    assert set(controls) == {"HumanEval/13", "HumanEval/4"} and all(c["passed"] for c in controls.values())
    for c in controls.values():
        assert c["arm_pairs"]["A/R"]["natural_first_diff"] is not None  # the arms are distinguishable
        for d in c["directions"].values():
            assert d["empty"]["ok"] and d["all"]["ok"] and d["all"]["mixed_equals_donor"]

    ds = load_dataset(out / "results.nc")
    assert dict(ds.sizes) == {"task": 2, "selector": 4, "direction": 2, "repeat": 2}
    assert (ds.status == "ok").all()
    # EMPTY keeps the recipient's endpoint untouched; ALL reproduces the (distinguishable) donor
    empty, all_ = ds.sel(selector="EMPTY"), ds.sel(selector="ALL")
    assert (empty.klass == "D").all() and (empty.first_diff_recipient == -1).all() and (empty.changed_bytes == 0).all()
    assert (all_.klass == "B").all() and (all_.first_diff_donor == -1).all() and (all_.share == 1.0).all()
    assert (ds.selected_bytes.sel(selector="EARLY") < ds.selected_bytes.sel(selector="ALL")).all()
    assert (ds.klass.sel(repeat=0) == ds.klass.sel(repeat=1)).all()
    assert (ds.endpoint_sha256.sel(repeat=0) == ds.endpoint_sha256.sel(repeat=1)).all()

    # reference: the study uninterrupted, the golden CI study (tests/test_golden.py holds an
    # uninterrupted run to it): the same records, controls, captures, results and report
    tasks, withheld = plan(spec_record, sdir, controls)
    assert not withheld and len(tasks) == 32
    assert_golden(out, "ci", " after the kill and the resume")

    # the report recompiles from cells.jsonl alone, to the same Dataset and text
    report = (out / "report.md").read_text()
    ds2, report2 = compile_study(out)
    xr.testing.assert_identical(ds2, ds)
    assert report2 == report
    for section in ("## Controls", "## Class matrix", "## Repeat agreement", "## Non-monotone sufficiency",
                    "## Magnitude separability", "## Withheld and failed"):
        assert section in report
    assert "Repeats agree at 16 of 16 coordinates" in report
    assert "32 distinct worker processes for 32 cells" in report


@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory):
    """A two-cell study run on the local pool: (spec path, output folder)."""
    root = tmp_path_factory.mktemp("tiny")
    spec = _spec(root, name="tiny", selectors='["EARLY", "LATE"]')
    s = run_study(spec, root / "local", "local", 2)
    assert s.ran == 2 and s.failed == 0 and not s.resumed
    return spec, root / "local"


def _copy_without_cells(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("cells.jsonl", "results.nc", "report.md", "runs.jsonl"))
    return dst


@pytest.mark.model
def test_dask_local_cluster_gives_the_same_records(tiny_study, tmp_path):
    """Same tiny study, same archived captures: local pool and Dask LocalCluster agree."""
    spec, local = tiny_study
    dask_out = _copy_without_cells(local, tmp_path / "dask")
    dsk = run_study(spec, dask_out, "dask-local", 2)
    assert dsk.resumed and dsk.ran == 2 and dsk.failed == 0

    def records(out):
        return {r["key"]: r for r in CellLog(out / "cells.jsonl").records()}

    a, b = records(local), records(dask_out)
    assert set(a) == set(b) == {"HumanEval/2|EARLY|A->R|0", "HumanEval/2|LATE|A->R|0"}
    volatile = {"timing", "pid", "host"}
    for k in a:
        assert {x: v for x, v in a[k].items() if x not in volatile} == {x: v for x, v in b[k].items() if x not in volatile}
    pids = {r["pid"] for r in (*a.values(), *b.values())}
    assert len(pids) == 4 and os.getpid() not in pids
    xr.testing.assert_identical(load_dataset(local / "results.nc"), load_dataset(dask_out / "results.nc"))
    assert np.isin(load_dataset(dask_out / "results.nc").klass.values, ["B", "C", "D"]).all()


@pytest.mark.model
def test_failed_control_withholds_the_prompt(tiny_study, tmp_path, cli):
    """A prompt whose controls failed gets no cell; its cells are recorded as withheld with the reason,
    and `study run` exits 1 saying so."""
    spec, local = tiny_study
    out = _copy_without_cells(local, tmp_path / "withheld")
    ctl_path = StudyDir(out).controls_path("HumanEval/2")
    ctl = json.loads(ctl_path.read_text())
    ctl["passed"], ctl["reasons"] = False, ["arm R: sham differs from the natural endpoint at output 3"]
    ctl_path.write_text(json.dumps(ctl))
    s = run_study(spec, out, "local", 2)
    assert s.ran == 0 and s.withheld == 2 and not CellLog(out / "cells.jsonl").records()
    ds = load_dataset(out / "results.nc")
    assert (ds.status == "withheld").all() and (ds.klass == "").all() and (ds.first_diff_recipient == -2).all()
    report = (out / "report.md").read_text()
    assert "WITHHELD: arm R: sham differs from the natural endpoint at output 3" in report
    assert "0 done, 0 failed, 2 withheld, 0 pending" in report
    r = cli("study", "run", spec, "--out", out)
    assert r.returncode == 1 and "controls failed: 2 cells withheld" in r.stderr, (r.returncode, r.stderr)


def test_spec_as_data_equals_the_same_spec_read_from_toml(tmp_path):
    """A program (the demo) passes a spec as data, no TOML text written and read back: the
    same content gives the same spec and hash as the file; its errors read the same."""
    import tomllib

    from statelab.experiments.demo import arms_for, matrix_spec_data
    from statelab.experiments.matrix.spec import spec_from_data

    data = tomllib.loads(CI.read_text())
    assert spec_from_data(data, CI, check_model=False).hash == load_spec(CI, check_model=False).hash
    with pytest.raises(StudyError, match="unknown key"):
        spec_from_data({**data, "colour": "red"}, CI, check_model=False)
    demo = spec_from_data(matrix_spec_data(None, "cpu", arms_for("cpu"), ["HumanEval/2"], 8, 1),
                          tmp_path / "matrix.toml", check_model=False)
    assert [d.label for d in demo.directions] == ["A->R", "R->A"] and len(demo.selectors) == 12
    assert demo.repeats == 2 and demo.cap == 8 and not (tmp_path / "matrix.toml").exists()
