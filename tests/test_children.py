"""Children die with their parent: a study runner killed alone (SIGKILL, no chance to clean up)
leaves no process behind (the fork server and its forked cells, or the batch processes),
and the next run removes the fork-server folder the killed one left."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil
import pytest

from conftest import REPO, STATELAB
from tiny_study import tiny_study

pytestmark = [pytest.mark.model, pytest.mark.slow]



def _gone(pids, timeout=5.0) -> list[int]:
    """The pids still running (zombies count as ended) after waiting up to ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    left.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _descendants_when(runner: psutil.Process, enough, timeout=90.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            kids = runner.children(recursive=True)
        except psutil.NoSuchProcess:
            break
        if enough(kids):
            return kids
        time.sleep(0.05)
    pytest.fail("the runner never started the expected processes")


@pytest.mark.parametrize("executor", ["local", "batch"])
def test_killing_the_runner_leaves_no_process(tmp_path, executor):
    spec = tmp_path / "tiny.toml"
    spec.write_text(tiny_study(cap=24, selectors=("ALL", "EMPTY"), directions=("A->R", "R->A")))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "STATELAB_THREADS": "1", "TMPDIR": str(tmp)}
    args = STATELAB + ["study", "run", str(spec), "--out", str(tmp_path / "out"), "--executor", executor,
                       "--workers", "2"]
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=REPO,
                         start_new_session=True)
    try:
        runner = psutil.Process(p.pid)
        if executor == "local":  # the fork server and at least one forked cell (a grandchild)
            kids = _descendants_when(runner, lambda ks: any(k.ppid() != p.pid for k in ks))
        else:  # the batch processes
            kids = _descendants_when(runner, lambda ks: len(ks) >= 2)
        pids = [k.pid for k in kids]
        os.kill(p.pid, signal.SIGKILL)  # the runner alone: its children get no signal from here
        p.wait()
        left = _gone(pids)
        assert not left, f"still running after the runner's kill -9: {left}"
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if executor == "local":
        stale = [d.name for d in tmp.iterdir() if d.name.startswith(f"statelab-fork-{p.pid}-")]
        assert stale, "the killed runner's fork-server folder (the check below needs one)"
        r = subprocess.run(args, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
        assert r.returncode == 0, r.stderr
        assert not [d for d in tmp.iterdir() if d.name.startswith(f"statelab-fork-{p.pid}-")]
