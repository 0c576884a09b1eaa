"""The CLI commands that had no test of their own, each run once on the real model with
few tokens: continue, sham, sweep, replay, audit layouts|backends|e1, study report|minimal,
spec campaign|masks, and campaign.run_campaign in process."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

from conftest import one_line_error, run_cli
from statelab.lab.archive import load_capture

pytestmark = pytest.mark.model
TEXT = "def add(a, b):\n    return a + b\n\nprint(add(2, 3))"


@pytest.fixture(scope="module")
def a_capture(tmp_path_factory):
    d = tmp_path_factory.mktemp("cmd") / "a"
    r = run_cli("capture", d, "-p", TEXT, "-s", "A")
    assert r.returncode == 0, r.stderr
    return d


def test_continue_equals_the_natural_continuation(a_capture):
    cont = run_cli("continue", a_capture, "--cap", "8", "--json")
    nat = run_cli("generate", "-p", TEXT, "--schedule", "A", "--cap", "8", "--json")
    assert cont.returncode == 0 and nat.returncode == 0, cont.stderr + nat.stderr
    c, n = json.loads(cont.stdout), json.loads(nat.stdout)
    assert c["tokens"] == n["tokens"] and len(c["tokens"]) == c["length"] >= 1
    assert c["label"].endswith("via receiver on cpu")
    one_line_error(run_cli("continue", a_capture, "--backend", "vulkan", "--cap", "2"), "error: ")


def test_sham_reproduces_the_natural_endpoint(a_capture):
    r = run_cli("sham", a_capture, "--cap", "8")
    assert r.returncode == 0, r.stderr
    assert "sham equals the natural endpoint" in r.stdout


def test_sweep_classes_on_cpu(tmp_path):
    """On CPU (the pinned x86-64-v3 build), a prefill forms ubatch 512's state bitwise unless its last
    micro-batch holds one row: HumanEval/2 (81 tokens) at ubatch 3 and 64+rest (81 = 27·3 = 64 + 17)
    forms A's, at ubatch 4 (20·4 + 1) another, and token by token (R) a third."""
    out = tmp_path / "sweep.json"
    r = run_cli("sweep", "-H", "2", "--schedules", "A,ub3,64+rest,ub4,R", "--cap", "4", "--json", out,
                "--out", tmp_path / "run")
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert [row["schedule"] for row in res["rows"]] == ["A", "ub3", "64+rest", "ub4", "R"]
    classes = [sorted(c) for c in res["state_classes"]]
    assert sorted(classes) == [["64+rest", "A", "ub3"], ["R"], ["ub4"]]
    assert "state classes:" in r.stdout
    assert json.loads((tmp_path / "run" / "sweep.json").read_text()) == [res]  # the run folder of the engine


def test_replay_of_a_layer(tmp_path):
    r = run_cli("replay", "-p", TEXT, "--layer", "0", "--q", "4", "--threads", "1", "--out", tmp_path / "rep")
    assert r.returncode == 0, r.stderr
    md = (tmp_path / "rep" / "report.md").read_text()
    assert md.strip() == r.stdout.strip()  # the report is what was printed
    assert "## Attention operands replayed as MQ / PQ / QB" in md
    assert "PQ vs QB replay bitwise equal at every stage: True" in md
    one_line_error(run_cli("replay", "-p", TEXT, "--layer", "99"), "layer")


def test_audit_layouts_quick(tmp_path):
    r = run_cli("audit", "layouts", "--quick", "--out", tmp_path / "lay")
    assert r.returncode == 0, r.stdout[-2000:]
    ds = xr.load_dataset(tmp_path / "lay" / "results.nc")
    assert ds.attrs["passed"] == 1 and ds.sizes["layout"] == 3
    assert (tmp_path / "lay" / "report.md").read_text().strip() in r.stdout


def test_audit_backends_on_cpu(tmp_path):
    r = run_cli("audit", "backends", "--q", "1,4", "--n-kv", "32", "--out", tmp_path / "adm")
    assert r.returncode == 0, r.stderr
    md = (tmp_path / "adm" / "report.md").read_text()
    assert "CPU" in md and "QB" in md
    one_line_error(run_cli("audit", "backends", "--n-kv", "0"), "--n-kv must be >= 1")


def test_audit_e1_one_layer(tmp_path):
    r = run_cli("audit", "e1", "-p", TEXT, "--layers", "first", "--phases", "prefill", "--q", "1,4",
                "--no-replay", "--threads", "1", "--out", tmp_path / "e1")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "e1" / "results.nc").is_file()
    caps_ = sorted(p.name for p in (tmp_path / "e1" / "captures").iterdir())
    assert caps_ and all(n.startswith("L0_prefill_q") for n in caps_)


# ------------------------------------------------------------------ study report / minimal


@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory):
    from statelab.experiments.matrix import run_study

    root = tmp_path_factory.mktemp("study")
    spec = root / "tiny.toml"
    spec.write_text('name = "tiny"\nthreads = 1\ncap = 32\nrepeats = 1\nprompts = ["HumanEval/13"]\n'
                    'selectors = ["EARLY", "LATE"]\ndirections = ["R->A"]\n[arms]\nA = "A"\nR = "R"\n')
    s = run_study(spec, root / "out", "local", 2)
    assert s.ran == 2 and s.failed == 0
    return spec, root / "out"


def test_study_report_recompiles_the_same_results(tiny_study):
    _, out = tiny_study
    before = xr.load_dataset(out / "results.nc")
    report = (out / "report.md").read_text()
    (out / "results.nc").unlink()
    r = run_cli("study", "report", out)
    assert r.returncode == 0, r.stderr
    assert "2 of 2 cells done" in r.stdout
    xr.testing.assert_identical(xr.load_dataset(out / "results.nc"), before)
    assert (out / "report.md").read_text() == report
    one_line_error(run_cli("study", "report", out.parent / "nowhere"), "not a study output folder")


def test_study_minimal_finds_a_selection_that_reproduces_the_donor(tiny_study, model, tmp_path):
    from statelab.analysis.classes import endpoint_class
    from statelab.lab.intervene import subset_cross
    from statelab.lab.receiver import Endpoint
    from statelab.selection import Selector, Term, select
    from statelab.experiments.matrix import StudyDir

    spec, out = tiny_study
    js = tmp_path / "min.json"
    r = run_cli("study", "minimal", spec, "-p", "HumanEval/13", "-d", "R->A", "--out", out, "--json", js)
    assert r.returncode == 0, r.stderr
    res = json.loads(js.read_text())
    assert res["source"] == f"captures of {out}" and res["evaluations"] == len(res["trials"])
    assert res["found"], "ALL reproduces the distinguishable donor, so some selection does"
    # the reported selection, checked independently: a subset cross that reproduces the donor
    sdir = StudyDir(out)
    donor, recip = (load_capture(sdir.capture_dir("HumanEval/13", a)) for a in ("R", "A"))
    ctl = sdir.read_controls("HumanEval/13")
    sel = select(Selector("m", (Term(layers=tuple(res["layers"]), positions=tuple(res["positions"])),)), recip.state)
    assert sel.selected_bytes == res["selected_bytes"]
    ep, _ = subset_cross(model, donor, recip, sel, 32)
    nat_d, nat_r = (Endpoint.from_dict(ctl["arms"][a]["natural"]) for a in ("R", "A"))
    assert endpoint_class(ep, nat_d, nat_r) == "B"
    one_line_error(run_cli("study", "minimal", spec, "-p", "HumanEval/3", "-d", "R->A"), "not one of the study's")


# ------------------------------------------------------------------ speculative campaign and masks

CAMPAIGN = """prompts = ["HumanEval/2"]
arms = ["R", "M_QB", "C_QB"]
sessions = 2
repeats = 1
k = 3
ubatch = 4
cap = 8
threads = 1
draft = "self"
ratios = [["R", "M_QB"], ["R", "C_QB"]]
resamples = 200
"""


def _check_campaign(out: Path, records: list[dict], arms=("R", "M_QB", "C_QB"), sessions: int = 2) -> None:
    assert len(records) == len(arms) * sessions and {r["arm"] for r in records} == set(arms)
    # on CPU the QB layout reproduces the reference R (its 4-row blocks equal four 1-row decodes)
    assert all(r["qualified"] for r in records), [(r["arm"], r["first_diff"]) for r in records]
    rows = json.loads((out / "contrasts.json").read_text())
    assert [r["ratio"] for r in rows] == [f"R/{a}" for a in arms[1:]]
    for row in rows:
        assert row["qualified"] and row["sessions"] == sessions
        assert row["lower"] <= row["estimate"] <= row["upper"]
    ds = xr.load_dataset(out / "results.nc")
    assert dict(ds.sizes) == {"session": sessions, "prompt": 1, "arm": len(arms), "request": 1}
    assert np.isfinite(ds.seconds.values).all() and (ds.qualified.values == 1).all()
    assert "## Request-time ratios" in (out / "report.md").read_text()


def test_run_campaign_in_process(tmp_path):
    from statelab.experiments.campaign import CampaignSpec, run_campaign

    p = tmp_path / "c.toml"
    p.write_text(CAMPAIGN)
    res = run_campaign(CampaignSpec.load(p), tmp_path / "out")
    _check_campaign(tmp_path / "out", res.outputs["records"])
    assert res.outputs["report"] == (tmp_path / "out" / "report.md").read_text()


def test_spec_campaign_cli(tmp_path):
    p = tmp_path / "c.toml"  # one session, R and M_QB: two worker processes
    p.write_text(CAMPAIGN.replace('"R", "M_QB", "C_QB"', '"R", "M_QB"').replace("sessions = 2", "sessions = 1")
                 .replace(', ["R", "C_QB"]', ""))
    r = run_cli("spec", "campaign", p, "--out", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert "## Request-time ratios" in r.stdout
    _check_campaign(tmp_path / "out", json.loads((tmp_path / "out" / "records.json").read_text()), ("R", "M_QB"), 1)
    bad = tmp_path / "bad.toml"
    bad.write_text(CAMPAIGN.replace('"R", "M_QB", "C_QB"', '"M_QB"'))
    one_line_error(run_cli("spec", "campaign", bad, "--out", tmp_path / "bad"), "reference arm R")


def test_spec_masks_cli(tmp_path):
    r = run_cli("spec", "masks", "--tasks", "HumanEval/2", "--masks", "0,3", "--repeats", "1", "--cap", "8",
                "--threads", "1", "--out", tmp_path / "m")
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "m" / "masks.json").read_text())
    assert set(res["table"]) == {"0", "3"}
    assert res["passing"]["3"] is True  # target prefill and continuation under QB reproduce R on CPU
    assert 3 in res["minimal"] or 0 in res["minimal"]
    assert "| 3 | TPTC-- |" in (tmp_path / "m" / "masks.md").read_text()
    one_line_error(run_cli("spec", "masks", "--masks", "3-x"), "--masks")
