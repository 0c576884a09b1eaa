"""The fork server (statelab.experiments.forkserver): one forked child per unit, results,
environment, crashes, timeouts and shutdown.  Synthetic units (standard-library functions);
the real-model units run through it in test_study, test_frontier_run and test_golden."""
import os
import time

import pytest

from statelab.experiments.forkserver import ForkServer, ForkServerError


@pytest.fixture(scope="module")
def server():
    with ForkServer(preload=["json"]) as s:
        yield s


def test_each_unit_runs_in_its_own_child_with_its_result(server):
    (a, ia), (b, ib) = server.run("os:getenv", "HOME"), server.run("os:getenv", "HOME")
    assert a == b == os.environ.get("HOME")
    assert ia.pid and ib.pid and ia.pid != ib.pid and os.getpid() not in (ia.pid, ib.pid)
    assert ia.exit == 0 and ia.error is None and ia.fork_s is not None and ia.fork_s < ia.wall_s


def test_environment_reaches_the_child_only(server):
    res, _ = server.run("os:getenv", "STATELAB_FORK_TEST", env={"STATELAB_FORK_TEST": "yes"})
    assert res == "yes"
    assert server.run("os:getenv", "STATELAB_FORK_TEST")[0] is None


def test_an_exception_and_a_crash_become_errors_not_results(server):
    res, info = server.run("os:abort", [])  # wrong call: TypeError inside the child
    assert res is None and info.error.startswith("TypeError") and info.exit == 1
    res, info = server.run("os:_exit", 7)  # the process ends without a result
    assert res is None and info.exit == 7 and "exited with status 7 without a result" in info.error


def test_a_unit_past_its_timeout_is_killed(server):
    t0 = time.perf_counter()
    res, info = server.run("time:sleep", 60, timeout=1.0)
    assert res is None and "ran past 1.0 s" in info.error and info.exit == -9
    assert time.perf_counter() - t0 < 30
    assert server.run("os:getenv", "HOME")[0] == os.environ.get("HOME")  # still serving


def test_closed_server_refuses_and_bad_preload_is_one_error():
    s = ForkServer(preload=["json"]).start()
    s.close()
    res, info = s.run("os:getenv", "HOME")
    assert res is None and "not running" in info.error
    with pytest.raises(ForkServerError, match="did not start"):
        ForkServer(preload=["statelab_no_such_module"]).start()


def test_default_server_preloads_every_kind_without_a_backend():
    """The children of the default server find statelab's unit modules, numpy, xarray and
    llama_cpp imported, and no llama.cpp backend initialised (CUDA/Vulkan must start in
    the child)."""
    from statelab.experiments.kinds import unit_modules

    want = ["numpy", "xarray", "llama_cpp", *unit_modules()]
    with ForkServer() as s:
        res, info = s.run("statelab.experiments.forkserver:child_state", {"modules": want})
    assert info.error is None, info.error
    assert res == {"imported": want, "backend_initialised": False}


def test_batch_process_crash_fails_only_the_started_cells(tmp_path):
    """A batch process that dies fails the cells it had started; the cells it never started
    run in a new process (as long as each process finishes one); a process that finishes
    none fails them all."""
    from statelab.experiments.executors import Unit, run_batch
    from statelab.experiments.worker import MARKER, STARTED

    (tmp_path / "fake_batch.py").write_text(
        "import json, os, sys\n"
        f"M, S = {MARKER!r}, {STARTED!r}\n"
        "for t in json.loads(sys.stdin.read()):\n"
        "    print(S + json.dumps(t['key']), flush=True)\n"
        "    if t.get('crash') and not os.path.exists(t['crash']):\n"
        "        open(t['crash'], 'w').close()\n"
        "        os.abort()\n"
        "    print(M + json.dumps({'key': t['key'], 'status': 'ok', 'pid': os.getpid()}), flush=True)\n")
    unit = Unit("x:y", lambda t, e: {"key": t["key"], "status": "failed", "error": e},
                env={"PYTHONPATH": str(tmp_path)}, batch="fake_batch")
    flag = str(tmp_path / "crashed-once")
    tasks = [{"key": "a"}, {"key": "b", "crash": flag}, {"key": "c"}, {"key": "d"}]
    got = []
    run_batch(unit, tasks, got.append)
    by = {r["key"]: r for r in got}
    assert len(got) == 4 and [by[k]["status"] for k in "abcd"] == ["ok", "failed", "ok", "ok"]
    assert "during this cell" in by["b"]["error"] and by["a"]["pid"] != by["c"]["pid"] == by["d"]["pid"]

    flag2 = str(tmp_path / "crashed-first")
    got = []
    run_batch(unit, [{"key": "x", "crash": flag2}, {"key": "y"}], got.append)
    by = {r["key"]: r for r in got}
    assert by["x"]["status"] == by["y"]["status"] == "failed"
    assert "during this cell" in by["x"]["error"] and "before this cell" in by["y"]["error"]
