"""A real distributed run: `dask scheduler` and two `dask worker` processes on 127.0.0.1
(separate process groups, no LocalCluster), `statelab study run studies/ci.toml --executor
dask://127.0.0.1:PORT`, one worker killed (its whole process group: nanny, worker and the
cell it was running) while the study runs, and the same records, results and report as the
local executor: the golden files of the CI study (tests/golden/ci.json), which
tests/test_golden.py holds the local executor to."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from golden_outputs import assert_golden
from statelab.experiments.matrix.results import load_dataset
from statelab.experiments.matrix.spec import load_spec
from statelab.experiments.log import CellLog

REPO = Path(__file__).resolve().parents[1]
CI = REPO / "studies" / "ci.toml"
CLI = [sys.executable, "-m", "statelab.cli"]
VOLATILE = {"timing", "pid", "host"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("STATELAB_THREADS", "1")
    return env


def _start(args: list[str], log: Path, cwd: Path) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "dask", *args], cwd=cwd, env=_env(), stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait(timeout=30)


def _lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _cell_children(worker: subprocess.Popen) -> list[psutil.Process]:
    """The cell processes (`python -m statelab.experiments.worker`) below a `dask worker` process."""
    try:
        kids = psutil.Process(worker.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for k in kids:
        try:
            if "statelab.experiments.worker" in " ".join(k.cmdline()):
                out.append(k)
        except psutil.NoSuchProcess:
            pass
    return out


def _records(out: Path) -> dict[str, dict]:
    return {r["key"]: {k: v for k, v in r.items() if k not in VOLATILE}
            for r in CellLog(out / "cells.jsonl").records()}


@pytest.mark.cli
@pytest.mark.timeout(3600)  # its own deadlines: 900 s for the kill, 1800 s per study run
@pytest.mark.model
@pytest.mark.slow
def test_ci_study_on_a_real_dask_cluster_survives_a_killed_worker(tmp_path):
    from distributed import Client

    port = _free_port()
    addr = f"127.0.0.1:{port}"
    logs = tmp_path / "logs"
    logs.mkdir()
    procs = [_start(["scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
                    logs / "scheduler.log", tmp_path)]
    try:
        for name in ("w1", "w2"):
            procs.append(_start(["worker", f"tcp://{addr}", "--name", name, "--nworkers", "1", "--nthreads", "1",
                                 "--no-dashboard", "--local-directory", str(tmp_path / name)],
                                logs / f"{name}.log", tmp_path))
        with Client(f"tcp://{addr}", timeout="60s") as c:
            c.wait_for_workers(2, timeout=120)
            assert len(c.scheduler_info()["workers"]) == 2
        victim, survivor = procs[1], procs[2]

        out = tmp_path / "dask"
        with open(logs / "study.log", "w") as f:
            study = subprocess.Popen(CLI + ["study", "run", str(CI), "--out", str(out), "--executor",
                                            f"dask://{addr}", "--workers", "2"],
                                     cwd=REPO, env=_env(), stdout=f, stderr=subprocess.STDOUT)
        # kill the first worker while it runs a cell, after a few cells have been recorded
        cells = out / "cells.jsonl"
        deadline = time.monotonic() + 900
        killed_cell = None
        while study.poll() is None and time.monotonic() < deadline:
            if _lines(cells) >= 3:
                running = _cell_children(victim)
                if running:
                    killed_cell = running[0]
                    tree = psutil.Process(victim.pid).children(recursive=True)
                    _kill_group(victim)  # a lost machine: nanny, worker and the cell it runs
                    for p in tree:
                        try:
                            p.kill()
                        except psutil.NoSuchProcess:
                            pass
                    break
            time.sleep(0.05)
        assert killed_cell is not None, "no cell was caught running on the worker:\n" + (logs / "study.log").read_text()
        gone, alive = psutil.wait_procs([killed_cell], timeout=30)
        assert not alive, "the killed worker's cell process survived"
        n_at_kill = _lines(cells)
        assert n_at_kill < 32
        rc = study.wait(timeout=1800)
        log = (logs / "study.log").read_text()
        assert rc == 0, log
        assert survivor.poll() is None  # the other worker carried the rest of the study
        assert "32 cells run (0 failed)" in log, log

        got = _records(out)
        spec = load_spec(CI)
        assert set(got) == set(spec.cell_keys()) and all(r["status"] == "ok" for r in got.values())
        # the cell lost with the killed worker was run again elsewhere, once: no duplicate lines
        assert _lines(cells) == 32

        # the same records, results and report as the local executor: the golden CI study, which
        # tests/test_golden.py holds the local executor to (no second run of the study here)
        assert_golden(out, "ci", " on the Dask cluster")
        assert np.isin(load_dataset(out / "results.nc").klass.values, ["B", "C", "D"]).all()
        runs = [json.loads(x) for x in (out / "runs.jsonl").read_text().splitlines()]
        assert runs[-1]["executor"] == f"dask://{addr}" and runs[-1]["failed"] == 0
    finally:
        for p in reversed(procs):
            _kill_group(p)
