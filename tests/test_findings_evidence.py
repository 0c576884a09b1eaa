"""Independent evidence in the findings tables: folding byte-identical arms, active and
degenerate panels, the top-1 condition before the frontier (synthetic records and a real
panel's full logits), and the committed tables regenerated from the committed records alone."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from statelab.analysis import findings as F
from statelab.experiments.findings_inputs import load_runs
from statelab.report.findings import write

REPO = Path(__file__).resolve().parents[1]


def _run(arm_hashes: dict, directions: list[str]):
    """A RunData stand-in: one task whose arms have the given (kv, logits) hashes."""
    arms = {a: {"kv": kv, "logits": lg} for a, (kv, lg) in arm_hashes.items()}
    return SimpleNamespace(arms=list(arm_hashes), controls={"T": {"arms": arms}}, name="r",
                           spec={"normalized": {"directions": directions}},
                           directions={d: tuple(d.split("->")) for d in directions})


def test_identical_arms_fold_and_their_directions_with_them():
    run = _run({"A": ("a", "x"), "B": ("b", "y"), "C": ("b", "y")}, ["A->B", "B->A", "A->C", "C->A"])
    assert F.arm_folds(run) == {"T": {"A": "A", "B": "B", "C": "B"}}
    assert F.direction_folds(run) == {"T": {"A->B": "A->B", "B->A": "B->A", "A->C": "A->B", "C->A": "B->A"}}
    # equal states but different initial logits: not the same cross, nothing folds
    run = _run({"A": ("a", "x"), "B": ("b", "y"), "C": ("b", "z")}, ["A->B", "A->C", "B->C"])
    assert F.direction_folds(run)["T"] == {"A->B": "A->B", "A->C": "A->C", "B->C": "B->C"}
    # a direction between two arms that fold into one is a cross of a state into itself
    run = _run({"A": ("a", "x"), "B": ("a", "x")}, ["A->B"])
    assert F.direction_folds(run)["T"] == {"A->B": None}


def test_panel_classes_and_margin_accounting():
    active = {"scores": [0.5, 0.25, -0.125, 1.0]}
    degenerate = {"scores": [0.5, 0.5, -0.125, -0.125]}
    assert F.panel_class(active) == "active" and F.panel_class(degenerate) == "degenerate"
    # output 0 holds (eps 0), output 1 fails in one arm (BOTH: margin 0.4, not > 2 * 0.2), output 2 holds
    rec = {"steps": {"before": 3, "positions": [0, 1, 2], "eps_inf": [0.0, 0.2, 0.1],
                     "margin": [[1.0, 1.0, 0.3], [1.0, 1.0, 0.9], [1.0, 2.0, 0.5], [1.0, 0.4, 0.21]]}}
    full = {"steps": {"before": 1, "positions": [0], "eps_inf": [0.0], "margin": [[1.0], [1.0], [1.0], [1.0]]}}
    m = F.margin_summary([rec, full, {"scores": [0, 0, 0, 0]}])
    assert (m["panels"], m["panels_with_steps"], m["panels_all_steps_recorded"], m["panels_with_a_step"]) == (3, 2, 2, 2)
    assert (m["steps"], m["steps_holding"], m["panels_holding_everywhere"]) == (4, 3, 1)
    assert (m["steps_from_1"], m["steps_from_1_holding"], m["panels_from_1"]) == (2, 1, 1)
    assert m["panels_holding_everywhere_from_1"] == 0


@pytest.mark.model
def test_step_margins_are_those_of_the_full_logits(model, he, base_config):
    """The panel record's per-output margins and eps_inf before t*, recomputed here from the
    four arms' full FP32 logit traces."""
    from statelab.analysis import frontier as FR
    from statelab.experiments.findings_run import step_margins
    from statelab.experiments.frontier_panels import run_panels
    from statelab.lab.formation import PRESETS, form
    from statelab.selection import Selector, Term

    p = he("HumanEval/2")
    donor, recip = form(model, p, PRESETS["A"], base_config), form(model, p, PRESETS["R"], base_config)
    comps = (Selector("K5", (Term(component="K", layers=(5,)),)), Selector("V5", (Term(component="V", layers=(5,)),)))
    pr = run_panels(model, donor, recip, {"P": comps}, 6)
    traces = [FR.ArmTrace(arm, 0, pr.runs[rid].tokens, pr.runs[rid].trace, model.sha256, recip.prompt_sha256,
                          trace_id=rid) for arm, rid in pr.arms["P"].items()]
    ds = FR.analyse_panel("HumanEval/2", "R", "P", "A->R", traces, components=("K5", "V5"))
    st = step_margins(ds)
    t_star = int(ds["t_star"].values.ravel()[0])
    assert st["before"] == (t_star if t_star >= 0 else 6) and st["positions"] == list(range(st["before"]))
    logits = {arm: pr.runs[rid].trace for arm, rid in pr.arms["P"].items()}
    x = np.stack([logits[a][: st["before"]].astype(np.float64) for a in ("EMPTY", "C1", "C2", "BOTH")])
    top = np.sort(x, axis=-1)
    assert np.array_equal(np.asarray(st["margin"]), top[..., -1] - top[..., -2])
    eps = np.max(np.abs(x[:, None] - x[None, :]), axis=(0, 1, 3))
    assert np.array_equal(np.asarray(st["eps_inf"]), eps)
    assert st["eps_inf"][0] == 0.0  # output 0: every arm starts from the recipient's initial logits


@pytest.mark.parametrize("kept", [pytest.param("cuda", marks=pytest.mark.slow), pytest.param("cpu", marks=pytest.mark.slow),
                                  "vulkan", "cpu-paper"])
def test_committed_tables_regenerate_from_the_committed_records(tmp_path, kept):
    """docs/findings/KEPT: findings.md, findings.json and contrasts.md again, byte for byte,
    from docs/findings/KEPT/run alone (no captures, no results.nc, no model)."""
    import shutil

    src = REPO / "docs" / "findings" / kept
    shutil.copytree(src / "run", tmp_path / kept / "run")
    write(load_runs([tmp_path / kept / "run"]), tmp_path / kept)
    for name in ("findings.md", "findings.json", "contrasts.md"):
        assert (tmp_path / kept / name).read_bytes() == (src / name).read_bytes(), name


def test_paper_sweep_has_nineteen_distinct_schedules_and_refuses_short_prompts():
    from statelab.errors import ConfigError
    from statelab.lab.formation import paper_sweep

    s = paper_sweep(160)
    assert len(s) == 19 and len({x.name for x in s}) == 19
    assert [x.name for x in s[:4]] == ["A", "B", "C", "R"] and "(n-1)+1" in {x.name for x in s}
    subs = {x.name: tuple(x.submissions(160)) for x in s}
    assert len(set(subs.values()) | {(x.n_ubatch,) for x in s}) > 1 and subs["129+rest"] == (129, 31) and subs["(n-1)+1"] == (159, 1)
    with pytest.raises(ConfigError, match="more than 130 tokens"):
        paper_sweep(130)


def test_sweep_table_classes_and_denominators():
    from statelab.experiments.partition import sweep_table

    def res(prompt, states, ends, diffs):
        rows = [{"schedule": n, "n_prompt": 140, "first_diff": d, "length": 32} for n, d in zip("ABCR", diffs)]
        return {"prompt": prompt, "rows": rows, "state_classes": states, "endpoint_classes": ends}

    r1 = res("p1", [["A", "B", "C"], ["R"]], [["A", "B", "C", "R"]], [None, None, None, None])
    r2 = res("p2", [["A"], ["B", "C"], ["R"]], [["A", "R"], ["B", "C"]], [None, 7, 7, None])
    md = sweep_table([r1, r2])
    assert "| p1 | 140 | 2 | 1 | 0/0 (=) | 0/0 (=) | 0/0 (=) | 1/0 (=) |" in md
    assert "| p2 | 140 | 3 | 2 | 0/0 (=) | 1/1 (7) | 1/1 (7) | 2/0 (=) |" in md
    assert "more than one state class: 2 / 2" in md and "more than one endpoint class: 1 / 2" in md
    assert "Of the 6 (prompt, schedule other than A) pairs: 2 form another state than A and keep its endpoint" in md


def test_panel_repeats_are_their_own_targets_and_compared_not_counted():
    from statelab.experiments.findings_run import FindingsError, run_findings, target_key

    t = {"task": "T", "selector": "L3", "direction": "A->B"}
    assert target_key(t) == "T|L3|A->B" and target_key(t, 1) == "T|L3|A->B|r1"
    with pytest.raises(FindingsError, match="--repeats is for panels"):
        run_findings("nowhere", "minimal", 10, repeats=2)
    base = {"status": "ok", "task": "T", "direction": "A->B", "t_star": 3, "tokens": [1, 2, 2, 1],
            "scores": [0.5, 0.25, 0.125, 1.0], "interaction": 0.125, "token_a": 1, "token_b": 2}
    panels = [{**base, "selector": "L3", "repeat": 0}, {**base, "selector": "L3", "repeat": 1},
              {**base, "selector": "L4", "repeat": 0}, {**base, "selector": "L4", "repeat": 1, "scores": [0.5] * 4}]
    run = _run({"A": ("a", "x"), "B": ("b", "y")}, ["A->B"])
    run.panels = panels
    assert F.repeat_agreement([run]) == {"compared": 2, "agree": 1}
    assert len(F.independent_records(run, panels)) == 2  # the second repeat is compared, not counted


def test_skeleton_state_geometry_is_checked():
    """A kept run folder has no captures: the skeleton's geometry comes from the recorded
    total value bytes, and a total that does not fit is refused in one line."""
    st = F.skeleton_state(160, 30, 3_686_400)  # SmolLM2: 30 layers, 192-wide F16 K and V rows
    assert st.k[0].shape == (160, 192) and st.v[0].shape == (192, 160) and st.v_trans
    from statelab.selection import Selector, Term, select

    sel = select(Selector("L3K", (Term(component="K", layers=(3,)),)), st)
    assert sel.selected_bytes == 160 * 192 * 2 and sel.total_bytes == 3_686_400
    with pytest.raises(F.FindingsInputError, match="do not fit"):
        F.skeleton_state(160, 30, 3_686_401)


def test_findings_run_independent_targets_leave_out_the_folded_directions():
    """`study findings-run --independent` on the kept CUDA run: C forms B's state on every
    prompt there, so A->C and C->A repeat A->B and B->A and their 491 class-B cells are left out;
    the 491 left are exactly the independent ones the tables count."""
    from collections import Counter

    from statelab.experiments.findings_run import class_b_targets, independent_targets

    run = load_runs([REPO / "docs" / "findings" / "cuda" / "run"])[0]
    targets = class_b_targets(run.ds)
    kept = independent_targets(targets, run.spec, run.controls)
    by = Counter(t["direction"] for t in targets)
    assert set(by) == {"A->B", "B->A", "A->C", "C->A"}
    assert Counter(t["direction"] for t in kept) == {"A->B": by["A->B"], "B->A": by["B->A"]}
    assert kept == [t for t in targets if F.independent(run, t["task"], t["direction"])]
    assert len(kept) == F.class_b_count(run) < F.class_b_count(run, folded=True) == len(targets)


@pytest.mark.slow
def test_the_from_scratch_cuda_run_equals_the_kept_one_and_its_time_regenerates(capsys):
    """docs/findings/cuda/scratch (the whole CUDA study again on a bare H200, 2026-12-04): every
    cell, independent panel and minimal search equals the kept run's record on every field both
    hold but where and how long it ran, and where its time went is read from its records."""
    import importlib.util

    def tool(name):
        spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / "device" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    kept, scratch = REPO / "docs" / "findings" / "cuda" / "run", REPO / "docs" / "findings" / "cuda" / "scratch"
    compare = tool("compare_runs")
    for kind, n in (("cells", 21504), ("panels", 491), ("minimal", 491)):
        _, n_new, common, differ = compare.compare(kept, scratch, kind)
        assert (n_new, common, differ) == (n, n, []), kind
    assert tool("findings_time").main([str(scratch)]) == 0
    out = capsys.readouterr().out
    committed = (scratch / "time.txt").read_text()
    for line in out.splitlines():  # the record-derived lines of the session's printout, digit for digit
        head = line.split(" (")[0].split(";")[0]
        assert head in committed, line


def test_the_vulkan_findings_study_is_the_cuda_one_on_another_backend():
    """studies/findings-vulkan.toml (issue 27 item 5) asks for the CUDA study's cells exactly:
    the same prompts, selectors, arms, directions, repeats and cap, only the backend differs."""
    from statelab.experiments.matrix.spec import load_spec

    cuda, vk = load_spec(REPO / "studies" / "findings-cuda.toml"), load_spec(REPO / "studies" / "findings-vulkan.toml")
    assert (cuda.backend, vk.backend) == ("cuda", "vulkan") and vk.name == "findings-vulkan"
    assert len(vk.cell_keys()) == len(cuda.cell_keys()) == 21504
    na, nb = cuda.normalized(), vk.normalized()
    assert {k for k in na if na[k] != nb.get(k)} == {"name", "backend"}
    assert vk.hash != cuda.hash


def test_the_paper_protocol_study_with_the_papers_ten_selectors_differs_only_in_its_selectors():
    """studies/findings-cpu-paper10.toml (issue 27 item 3) is findings-cpu-paper.toml with the paper's ten
    selectors (S5.1) and the EMPTY/ALL controls: the same prompts (all longer than 128 tokens, so B has a
    remainder), arms A, B, C and R, six directions, two repeats and full endpoints (cap 256)."""
    from statelab.experiments.matrix.spec import load_spec

    full, ten = (load_spec(REPO / "studies" / f"findings-cpu-{n}.toml") for n in ("paper", "paper10"))
    nf, nt = full.normalized(), ten.normalized()
    assert {k for k in nf if nf[k] != nt.get(k)} == {"name", "selectors"}
    names = [s["name"] if isinstance(s, dict) else s for s in nt["selectors"]]
    assert sorted(names) == sorted(["EMPTY", "ALL", "L0_K", "L0_V", "L0", "K_ALL", "V_ALL", "EARLY", "MIDDLE",
                                    "LATE", "PREFIX", "TAIL"])
    assert len(ten.cell_keys()) == 24 * 12 * 6 * 2 and nt["cap"] == 256 and set(nt["arms"]) == set("ABCR")


@pytest.mark.parametrize("folder, n_cells", [("partial", 16256), ("run", 21504)])
def test_vulkan_run_b_and_c_form_a_state_unless_the_last_micro_batch_is_a_matrix_vector_one(folder, n_cells):
    """docs/findings/vulkan/partial (the H200's Vulkan device, 2026-12-04, 16,256 of 21,504 cells
    before the machine was given back, kept compactly by benchmarks/device/partial_run.py) and
    docs/findings/vulkan/run (an H100's Vulkan device, 2026-12-07, the whole study with its panels and
    searches, the run folder the tables regenerate from): B (128 + rest) and C (ubatch 128) form one state on every
    prompt, and A's exactly where the rest exceeds ggml-vulkan's 8 matrix-vector columns; every
    recorded cell of a prompt with one state imports the recipient's own bytes (class D), and the
    two other prompts have all their cells, each repeat-agreeing."""
    import gzip
    import json

    d = REPO / "docs" / "findings" / "vulkan" / folder
    spec = json.loads((d / "spec.json").read_text())["normalized"]
    run_folder = (d / "controls").is_dir()  # one control per file, every cell's whole record
    if run_folder:
        controls = [json.loads(p.read_text()) for p in sorted((d / "controls").glob("*.json"))]
        compact = [json.loads(x) for x in gzip.open(d / "cells.jsonl.gz")]
    else:  # partial_run.py's compact copy: the whole records of the two-state prompts apart
        controls = [json.loads(x) for x in gzip.open(d / "controls.jsonl.gz")]
        compact = [json.loads(x) for x in gzip.open(d / "cells-compact.jsonl.gz")]
    assert len(controls) == len(spec["prompts"]) == 24 and all(c["passed"] for c in controls)
    one_state = set()
    for c in controls:
        kv = {arm: c["arms"][arm]["kv"] for arm in "ABC"}
        assert kv["B"] == kv["C"] and c["arms"]["B"]["logits"] == c["arms"]["C"]["logits"], c["prompt"]
        assert (kv["A"] == kv["B"]) == (c["n_prompt"] - 128 > 8), (c["prompt"], c["n_prompt"])
        if kv["A"] == kv["B"]:
            one_state.add(c["prompt"])
    assert len(one_state) == 22
    mine = [c for c in compact if c["key"].split("|")[0] in one_state]
    assert mine and all(c["klass"] == "D" and c["changed_bytes"] == 0 for c in mine)
    full = ([c for c in compact if c["key"].split("|")[0] not in one_state] if run_folder
            else [json.loads(x) for x in gzip.open(d / "cells-unequal.jsonl.gz")])
    per_prompt = len(spec["selectors"]) * len(spec["directions"]) * spec["repeats"]
    assert len(full) == 2 * per_prompt and len(compact) == len(mine) + len(full) == n_cells
    classes: dict = {}
    for r in full:
        assert r["prompt"] not in one_state and r["status"] == "ok"
        classes.setdefault((r["prompt"], r["selector"], r["direction"]), set()).add(r["klass"])
    assert all(len(k) == 1 for k in classes.values())
