"""Findings at scale: the analysis on synthetic records (separability, non-monotone pairs with
their masks, denominators), chat prompts, selector patterns, the batch executor, and the whole
path on a real model through the CLI (studies/findings-ci.toml)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

from conftest import one_line_error, run_cli
from statelab.analysis import findings as F
from statelab.experiments.findings_run import class_b_targets, mask_box, panel_components

REPO = Path(__file__).resolve().parents[1]
CI = REPO / "studies" / "findings-ci.toml"


# ------------------------------------------------------------------ separability


def test_best_threshold_exhaustive_matches_brute_force():
    rng = np.random.default_rng(7)
    for _ in range(50):
        x = rng.integers(0, 6, size=9).astype(float)  # ties on purpose
        y = rng.random(9) < 0.5
        got = F.best_threshold(x, y)
        brute = min(min(int(np.sum((x > t) != y)), int(np.sum((x < t) != y)))
                    for t in np.concatenate([[-1.0], np.unique(x) + 0.5, np.unique(x) - 0.5]))
        assert got["errors"] == brute
        assert got["error_rate"] == brute / 9
        rule = (x > got["threshold"]) if got["orientation"] == "diverging_above" else (x < got["threshold"])
        assert int(np.sum(rule != y)) == got["errors"]


def test_best_threshold_separable_and_one_label():
    r = F.best_threshold([0.1, 0.2, 0.9, 1.0], [False, False, True, True])
    assert r["separable"] and r["both_labels"] and r["orientation"] == "diverging_above"
    assert 0.2 < r["threshold"] < 0.9
    r = F.best_threshold([3.0, 1.0], [True, False])
    assert r["errors"] == 0
    one = F.best_threshold([0.1, 0.5], [True, True])
    assert not one["both_labels"] and one["errors"] == 0
    bad = F.best_threshold([0.5, 0.5, 0.1], [True, False, False])  # a tie across labels
    assert bad["errors"] == 1 and not bad["separable"]
    down = F.best_threshold([0.1, 0.2, 0.9], [True, True, False])  # separable only by a decreasing rule
    assert down["errors"] == 0 and down["orientation"] == "diverging_below" and down["errors_increasing"] == 1


def test_separability_table_verdicts_and_denominators():
    rows = [{"run": "r", "task": f"t{i}", "pair": "A/R", "diverges": d, "max_abs": m, "l2_rel": m / 10,
             "first_differing_layer": float(L), "natural_first_diff": None}
            for i, (d, m, L) in enumerate([(True, 0.5, 1), (False, 0.7, 1), (True, 0.9, 2), (False, 0.1, 3)])]
    rows.append({**rows[0], "run": "s", "task": "x", "diverges": True})
    table = F.separability_table(rows)
    r = {(t["run"], t["magnitude"]): t for t in table}
    assert r[("r", "max abs d")]["n"] == 4 and r[("r", "max abs d")]["errors"] == 1
    assert r[("r", "max abs d")]["verdict"] == "not separable"
    assert r[("r", "first differing layer")]["errors"] == 1
    assert r[("s", "L2 rel")]["verdict"] == "undecided (one label only)"


# ------------------------------------------------------------------ natural pairs


def _run(arms_natural: dict, kv: dict, name="r", arms=("A", "R")) -> F.RunData:
    prompts = sorted(arms_natural)
    spec = {"spec_hash": "h", "normalized": {"name": name, "arms": {a: {} for a in arms}, "backend": "cpu",
                                             "prompts": [{"id": p} for p in prompts]}}
    controls = {p: {"arms": {a: {"natural": {"tokens": arms_natural[p][a], "eog": False}, "kv": kv[p][a]}
                             for a in arms}} for p in prompts}
    return F.RunData(Path("."), name, spec, controls, xr.Dataset(), [])


def test_divergence_and_agreement_denominators():
    nat = {"p1": {"A": [1, 2], "B": [1, 2], "C": [1, 3]}, "p2": {"A": [5], "B": [5], "C": [5]},
           "p3": {"A": [7, 8], "B": [7, 9], "C": [7, 9]}}
    kv = {"p1": {"A": "x", "B": "y", "C": "y"}, "p2": {"A": "s", "B": "s", "C": "s"},
          "p3": {"A": "u", "B": "v", "C": "v"}}
    run = _run(nat, kv, arms=("A", "B", "C"))
    table = {r["pair"]: r for r in F.divergence_table(F.natural_pairs(run))}
    assert set(table) == {"A/B", "A/C", "B/C"}
    ab = table["A/B"]
    assert (ab["inputs"], ab["diverging"], ab["unequal_states"], ab["agree_unequal_states"]) == (3, 1, 2, 1)
    assert ab["equal_states"] == 1 and ab["diverge_equal_states"] == 0
    bc = table["B/C"]  # p1: same state, different endpoints: counted where it must be 0
    assert bc["diverge_equal_states"] == 1 and bc["equal_states"] == 3


# ------------------------------------------------------------------ non-monotone pairs


def test_non_monotone_pairs_carry_inclusion_proof():
    n = 64
    base = np.zeros(n, bool)
    small = base.copy(); small[:4] = True
    mid = base.copy(); mid[:16] = True
    large = base.copy(); large[:40] = True
    other = base.copy(); other[50:] = True
    same_as_mid = mid.copy()
    masks = {"EMPTY": base, "S": small, "M": mid, "M2": same_as_mid, "L": large, "O": other}
    outcomes = {"EMPTY": "D", "S": "B", "M": "D", "M2": "D", "L": "B", "O": "C"}
    pairs, examined = F.non_monotone_in(masks, outcomes)
    got = {(p["small"], p["large"]) for p in pairs}
    assert got == {("S", "M"), ("S", "M2")}  # S in M (D), S in L (B: monotone), O unrelated
    assert examined == 3  # S<M, S<M2, S<L
    for p in pairs:
        assert p["small_outside_large"] == 0
        assert p["small_values"] == 4 and p["large_values"] == 16
        assert p["small_mask_sha256"] != p["large_mask_sha256"]
    assert pairs[0]["large_mask_sha256"] == pairs[1]["large_mask_sha256"]  # identical masks, same hash


def test_agreed_classes_blank_where_repeats_disagree():
    k = np.array([[["B", "B"], ["B", "C"]], [["D", "D"], ["", ""]]])  # task x selector x (direction=1) x repeat
    ds = xr.Dataset({"klass": (("task", "selector", "direction", "repeat"), k[:, :, None, :])},
                    coords={"task": ["t1", "t2"], "selector": ["S1", "S2"], "direction": ["A->R"], "repeat": [0, 1]})
    a = F.agreed_classes(ds)
    assert a.sel(task="t1", selector="S1").item() == "B"
    assert a.sel(task="t1", selector="S2").item() == ""
    assert a.sel(task="t2", selector="S2").item() == ""
    targets = class_b_targets(ds)
    assert [t["selector"] for t in targets] == ["S1"]


def test_panel_components_split():
    kv = {"layers": [3], "component": "KV", "positions": [0, 9]}
    (c1, c2) = panel_components(kv)
    assert c1[1] == "K" and c2[1] == "V"
    k = {"layers": [3, 4], "component": "K", "positions": [10, 20]}
    (c1, c2) = panel_components(k)
    assert c1[2] == (10, 15) and c2[2] == (15, 20) and c1[1] == c2[1] == "K"
    assert panel_components({"layers": [1], "component": "V", "positions": [5, 6]}) is None


# ------------------------------------------------------------------ spec pieces


@pytest.mark.model  # the spec's chat: prompts are rendered with the model's template
def test_selector_patterns_expand_and_unmatched_is_one_line(tmp_path):
    from statelab.experiments.matrix import StudyError, load_spec

    spec = load_spec(REPO / "studies" / "findings-cpu.toml", check_model=False)
    names = list(spec.selectors)
    assert len(names) == 112 and names[22:25] == ["L00", "L00_K", "L00_V"] and names[-1] == "L29_V"
    p = tmp_path / "s.toml"
    p.write_text('cap = 8\nprompts = ["HumanEval/2"]\nselectors = ["nothing/*.toml"]\ndirections = ["A->R"]\n'
                 '[arms]\nA = "A"\nR = "R"\n')
    with pytest.raises(StudyError, match="matches no .toml file"):
        load_spec(p, check_model=False)


@pytest.mark.model
def test_chat_prompt_uses_the_model_template(tmp_path):
    from statelab import prompts

    f = tmp_path / "m.txt"
    f.write_text("Hello there")
    p = prompts.resolve(f"chat:{f}")
    assert p.id == "chat:m.txt"
    assert "Hello there" in p.text and p.text != "Hello there"
    assert p.text.rstrip().endswith("assistant")  # the assistant turn is opened
    assert prompts.resolve(f"chat:{f}").sha256 == p.sha256


# ------------------------------------------------------------------ the whole path


@pytest.mark.model
def test_findings_path_on_real_model(tmp_path):
    run = tmp_path / "run"
    r = run_cli("study", "run", CI, "--out", run, "--executor", "batch", "--workers", "2",
                env={"STATELAB_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    cells = [json.loads(x) for x in (run / "cells.jsonl").read_text().splitlines()]
    assert len(cells) == 64 and all(c["status"] == "ok" for c in cells)
    # one process per (prompt, direction, repeat): 8 batches, repeats never share a process
    pids = {(c["prompt"], c["direction"], c["repeat"]): set() for c in cells}
    for c in cells:
        pids[(c["prompt"], c["direction"], c["repeat"])].add(c["pid"])
    assert all(len(v) == 1 for v in pids.values())
    assert len({next(iter(v)) for v in pids.values()}) == 8
    # a cross is named by the bytes it imports: every selection that changes no byte (HumanEval/4,
    # 117 tokens: TAIL selects nothing; on this host A and R also agree in layer 1 there) imports the
    # recipient's own state, as EMPTY does, and is crossed once per batch
    shared = [c for c in cells if c.get("same_cross_as")]
    assert shared == [c for c in cells if c["changed_bytes"] == 0 and c["selector"] != "EMPTY"]
    assert ("HumanEval/4", "TAIL") in {(c["prompt"], c["selector"]) for c in shared}
    assert len(shared) % 4 == 0  # both directions and both repeats of each such selection
    for c in shared:
        assert c["same_cross_as"].split("|")[1] == "EMPTY"
        first = next(x for x in cells if x["key"] == c["same_cross_as"])
        assert c["endpoint_sha256"] == first["endpoint_sha256"] and c["repeat"] == first["repeat"]

    for kind, n in (("panels", 2), ("minimal", 1)):
        r = run_cli("study", "findings-run", run, "--kind", kind, "--budget", "300", "--workers", "2",
                    "--limit", n, env={"STATELAB_THREADS": "1"})
        assert r.returncode == 0, r.stderr
        recs = [json.loads(x) for x in (run / "findings" / f"{kind}.jsonl").read_text().splitlines()]
        assert len(recs) == n and all(x["status"] in ("ok", "skipped") for x in recs), recs
    # the same targets on lanes (one process, 2 threads, the model loaded once) give the same records
    lanes_run = tmp_path / "lanes"
    shutil.copytree(run, lanes_run, ignore=shutil.ignore_patterns("findings"))
    for kind, n in (("panels", 2), ("minimal", 1)):
        r = run_cli("study", "findings-run", lanes_run, "--kind", kind, "--budget", "300", "--workers", "1",
                    "--lanes", "2", "--limit", n, env={"STATELAB_THREADS": "1"})
        assert r.returncode == 0, r.stderr
        got = [json.loads(x) for x in (lanes_run / "findings" / f"{kind}.jsonl").read_text().splitlines()]
        ref = [json.loads(x) for x in (run / "findings" / f"{kind}.jsonl").read_text().splitlines()]
        assert len({g["pid"] for g in got if "pid" in g}) <= 1
        timeless = lambda rs: sorted(({k: v for k, v in x.items() if k not in ("seconds", "pid", "timing")}
                                      for x in rs), key=lambda x: x["key"])
        assert timeless(got) == timeless(ref)
    mins = [json.loads(x) for x in (run / "findings" / "minimal.jsonl").read_text().splitlines()]
    for m in mins:
        if m["status"] == "ok":
            assert m["found"] and set(m["layers"]) <= set(m["start"]["layers"])
            assert m["selected_bytes"] <= m["start_bytes"]

    # a run folder kept without its captures (as docs/findings/*/run): refused in one line, no log begun
    bare = tmp_path / "bare"
    shutil.copytree(run, bare, ignore=shutil.ignore_patterns("captures", "findings"))
    r = run_cli("study", "findings-run", bare, "--kind", "panels", "--budget", "30", "--workers", "1")
    one_line_error(r, "of the pending targets are not here")
    assert not (bare / "findings").exists()

    out = tmp_path / "findings"
    r = run_cli("study", "findings", run, "--out", out)
    assert r.returncode == 0, r.stderr
    md = (out / "findings.md").read_text()
    data = json.loads((out / "findings.json").read_text())
    div = data["divergence"][0]
    # cap 16: HumanEval/4 diverges (first difference at 6), the long chat message agrees
    assert (div["pair"], div["inputs"], div["diverging"]) == ("A/R", 2, 1)
    sep = [s for s in data["separability"] if s["magnitude"] == "L2 rel"][0]
    assert sep["both_labels"] and sep["n"] == 2
    assert "## 4. Non-monotone sufficiency" in md and "2 / " in md
    assert {p.name for p in (out / "figures").iterdir()} >= {"classes-findings-ci.png", "interaction.png",
                                                             "minimal-sizes.png"}
    ds = xr.open_dataset(out / "findings.nc")
    assert ds.sizes["row"] == 2
    ds.close()
    full = xr.open_dataset(run / "results.nc").load()
    compact = xr.open_dataset(out / "findings-ci-results.nc").load()
    assert (compact.klass.values.astype(str) == full.klass.values.astype(str)).all()
    assert np.array_equal(compact.l2_rel.values, full.l2_rel.values, equal_nan=True)
    assert (out / "findings-ci-report.md").read_text() == (run / "report.md").read_text()


def test_findings_cli_errors_are_one_line(tmp_path):
    r = run_cli("study", "findings", tmp_path, "--out", tmp_path / "o")
    one_line_error(r, "not a study folder")
    r = run_cli("study", "findings-run", tmp_path, "--kind", "panels", "--budget", "10")
    one_line_error(r, "no results.nc")
    r = run_cli("study", "findings-run", tmp_path, "--kind", "other", "--budget", "10")
    one_line_error(r, "unknown findings kind")


def test_mask_box_reads_a_selection_back():
    from statelab.selection import Selection

    pos = np.arange(6)
    k = [np.zeros((6, 4), bool) for _ in range(3)]
    v = [np.zeros((4, 6), bool) for _ in range(3)]  # transposed V: features x cells
    k[1][2:5] = True
    v[1][:, 2:5] = True
    sel = Selection(k, v, (2,) * 3, (2,) * 3, True)

    class S:
        positions = pos

    assert mask_box(sel, S) == {"layers": [1], "component": "KV", "positions": [2, 5]}
    sel2 = Selection([np.zeros((6, 4), bool)] * 3, v, (2,) * 3, (2,) * 3, True)
    assert mask_box(sel2, S)["component"] == "V"
    empty = Selection([np.zeros((6, 4), bool)] * 3, [np.zeros((4, 6), bool)] * 3, (2,) * 3, (2,) * 3, True)
    assert mask_box(empty, S) is None


def test_a_lane_past_the_deadline_starts_no_target():
    import time

    from statelab.experiments.findings_run import lane_job
    from statelab.experiments.lanes import CellCache

    job = {"key": "HumanEval/2|ALL|A->R", "task": "HumanEval/2", "selector": "ALL", "direction": "A->R",
           "spec_hash": "h", "kind": "minimal", "deadline": time.time() - 1}
    assert lane_job(job, None, None, None) == {k: job[k] for k in ("key", "task", "selector", "direction",
                                                                   "spec_hash")} | {"status": "not_started"}
    with pytest.raises(KeyError, match="donor_capture"):  # no deadline (a run's first target): it starts
        lane_job({**job, "deadline": None}, None, CellCache(), None)
