"""Reused contexts and shared crosses on the real model (CPU): a context of a ContextPool,
cleared before each cross, gives the endpoints of new contexts bitwise; the ``follow``
stop decodes only while the output follows the given tokens; a batch process with lanes
runs a cross whose inputs are byte-identical to another cell's once and records it as
``same_cross_as``, with the same record a per-cell process gives."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import run_cli
from statelab.lab.formation import PRESETS
from statelab.lab.intervene import natural, subset_cross
from statelab.runtime import ContextPool
from statelab.selection import load_selector, select

pytestmark = pytest.mark.model
CAP = 40


@pytest.fixture(scope="module")
def a_r(model, base_config, he):
    p = he("HumanEval/13")  # A and R differ here: first natural difference at output 20 (CPU build)
    return {name: natural(model, p, PRESETS[name], base_config, CAP) for name in ("A", "R")}


def test_pooled_context_gives_the_new_context_endpoints(model, a_r):
    (ca, nat_a), (cr, nat_r) = a_r["A"], a_r["R"]
    assert not nat_a.same(nat_r)
    sels = {name: select(load_selector(name), cr.state) for name in ("EMPTY", "ALL", "EARLY", "LATE")}
    fresh = {name: subset_cross(model, ca, cr, s, CAP)[0] for name, s in sels.items()}
    with ContextPool(model) as pool:
        # every cross after the first decodes in a context that has just decoded another one
        pooled = {name: subset_cross(model, ca, cr, s, CAP, contexts=pool)[0] for name, s in sels.items()}
        again = subset_cross(model, ca, cr, sels["EARLY"], CAP, contexts=pool)[0]
        assert pool.created == 1
    for name in sels:
        assert pooled[name].same(fresh[name]), name
    assert again.same(fresh["EARLY"])
    assert fresh["EMPTY"].same(nat_r) and fresh["ALL"].same(nat_a)  # sham and whole-KV cross


def test_follow_stops_at_the_first_output_that_leaves(model, a_r):
    (ca, nat_a), (cr, nat_r) = a_r["A"], a_r["R"]
    first = int(np.flatnonzero(nat_a.tokens[:len(nat_r.tokens)] != nat_r.tokens[:len(nat_a.tokens)])[0])
    empty = select(load_selector("EMPTY"), cr.state)
    left = subset_cross(model, ca, cr, empty, CAP, follow=nat_a.tokens)[0]  # R's endpoint, following A's
    assert left.stop_reason == "left" and left.length == first + 1
    assert np.array_equal(left.tokens[:first], nat_a.tokens[:first]) and left.tokens[first] != nat_a.tokens[first]
    kept = subset_cross(model, ca, cr, empty, CAP, follow=nat_r.tokens)[0]  # following its own endpoint
    assert kept.same(nat_r) and kept.stop_reason == nat_r.stop_reason


def test_lanes_share_byte_identical_crosses(tmp_path):
    """Arms A and C form the same state on an 81-token prompt (one ubatch either way), so the
    cells A->R and C->R cross the same bytes into R, and every selection of A->C imports C's
    own state: with lanes each of these crosses runs once."""
    spec = tmp_path / "same.toml"
    spec.write_text('name = "same-cross"\nbackend = "cpu"\nthreads = 1\ncap = 16\nrepeats = 1\n'
                    'prompts = ["HumanEval/2"]\nselectors = ["EMPTY", "ALL", "LATE"]\n'
                    'directions = ["A->R", "C->R", "A->C"]\n[arms]\nA = "A"\nC = "C"\nR = "R"\n')
    runs = {}
    for name, extra in (("lanes", ("--executor", "batch", "--workers", "1", "--lanes", "2")),
                        ("local", ("--executor", "local", "--workers", "2"))):
        r = run_cli("study", "run", spec, "--out", tmp_path / name, *extra, env={"STATELAB_THREADS": "1"})
        assert r.returncode == 0, r.stderr
        runs[name] = {c["key"]: c for c in map(json.loads, (tmp_path / name / "cells.jsonl").read_text().splitlines())}
    lanes, local = runs["lanes"], runs["local"]
    assert len(lanes) == len(local) == 9
    shared = [c for c in lanes.values() if c.get("same_cross_as")]
    assert len(shared) == 5 and len({c["pid"] for c in lanes.values()}) == 1
    into_r = [c for c in shared if c["direction"] != "A->C"]
    assert len(into_r) == 3
    for c in into_r:  # one selection from the other arm of the same bytes
        first = lanes[c["same_cross_as"]]
        assert first["selector"] == c["selector"] and {first["direction"], c["direction"]} == {"A->R", "C->R"}
        assert c["donor_kv_sha256"] == first["donor_kv_sha256"] and c["timing"]["cross_s"] == 0.0
    self_cross = [c for c in lanes.values() if c["direction"] == "A->C"]
    assert {c["donor_kv_sha256"] for c in self_cross} == {self_cross[0]["recipient_kv_sha256"]}
    ran = [c for c in self_cross if not c.get("same_cross_as")]
    assert len(ran) == 1 and all(c["same_cross_as"] == ran[0]["key"] for c in self_cross if c is not ran[0])
    assert {c["klass"] for c in self_cross} == {"D"} and all(c["changed_bytes"] == 0 for c in self_cross)
    assert not any(c.get("same_cross_as") for c in local.values())  # one process per cell: nothing shared
    drop = {"timing", "pid", "same_cross_as"}
    for key, c in local.items():
        assert {k: v for k, v in lanes[key].items() if k not in drop} == {k: v for k, v in c.items() if k not in drop}


def test_cell_cache_makes_each_value_once_and_forgets_failures():
    import threading
    import time

    from statelab.experiments.matrix.cells import CellCache

    cache, calls = CellCache(), []

    def slow():
        calls.append(1)
        time.sleep(0.05)
        return "v"

    got = []
    threads = [threading.Thread(target=lambda: got.append(cache.get("k", slow))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and sorted(got) == [("v", False)] * 5 + [("v", True)]

    def boom():
        raise ValueError("no")

    with pytest.raises(ValueError):
        cache.get("bad", boom)
    assert cache.get("bad", lambda: 3) == (3, True)  # a failure is not kept


@pytest.mark.parametrize("args, needle", [
    (("--executor", "batch", "--lanes", "0"), "--lanes must be a positive integer"),
    (("--executor", "local", "--lanes", "2"), "--lanes needs the batch executor"),
])
def test_lanes_errors_are_one_line(tmp_path, args, needle):
    from conftest import one_line_error

    spec = tmp_path / "s.toml"
    spec.write_text('name = "s"\ncap = 4\nprompts = ["HumanEval/2"]\nselectors = ["EMPTY"]\ndirections = ["A->R"]\n'
                    '[arms]\nA = "A"\nR = "R"\n')
    one_line_error(run_cli("study", "run", spec, "--out", tmp_path / "o", *args), needle)
    assert not (tmp_path / "o").exists()  # refused before the folder is touched


def test_resume_without_captures_checks_the_states_of_finished_cells(tmp_path):
    """A study folder carried without its captures (another device session, say) resumes
    when the controls formed again give the states its finished cells crossed, byte for
    byte; when they do not, it is refused in one line."""
    import shutil

    spec = tmp_path / "carry.toml"
    spec.write_text('name = "carry"\nbackend = "cpu"\nthreads = 1\ncap = 4\nrepeats = 1\n'
                    'prompts = ["HumanEval/2"]\nselectors = ["EMPTY", "ALL"]\ndirections = ["A->R"]\n'
                    '[arms]\nA = "A"\nR = "R"\n')
    out = tmp_path / "run"
    assert run_cli("study", "run", spec, "--out", out, env={"STATELAB_THREADS": "1"}).returncode == 0
    cells = (out / "cells.jsonl").read_text()
    shutil.rmtree(out / "captures")
    r = run_cli("study", "run", spec, "--out", out, env={"STATELAB_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    assert (out / "cells.jsonl").read_text() == cells  # nothing ran again: the same states
    first = json.loads(cells.splitlines()[0])
    (out / "cells.jsonl").write_text(cells.replace(first["recipient_kv_sha256"], "0" * 64))
    shutil.rmtree(out / "captures")
    r = run_cli("study", "run", spec, "--out", out, env={"STATELAB_THREADS": "1"})
    last = r.stderr.strip().splitlines()[-1]  # after the progress lines (loading, controls)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert last.startswith("error:") and "formed again gives K/V" in last and "another machine" in last, r.stderr



def test_batch_lanes_report_a_model_that_does_not_load_once_per_cell(tmp_path):
    from statelab.experiments.matrix.batch import run_tasks

    tasks = [{"key": f"k{i}", "spec_hash": "s", "prompt": "p", "selector": "EMPTY", "direction": "A->R",
              "repeat": 0, "model": str(tmp_path / "missing.gguf"), "backend": "cpu"} for i in range(5)]
    got, started = [], []
    run_tasks(tasks, 2, got.append, started.append)
    assert sorted(started) == sorted(r["key"] for r in got) == [f"k{i}" for i in range(5)]
    assert all(r["status"] == "failed" and "missing.gguf" in r["error"] for r in got)
