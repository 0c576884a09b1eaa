"""Ctrl-C at random moments (seeded) into real CLI processes: every run ends with exit 130
and one line ``interrupted`` (or exit 0 with its whole output, when it had finished before
the signal), never a traceback, a death by signal or a native crash; nothing half-written
is left and the next run works.

The signal goes to the command's whole process group, as a terminal's Ctrl-C does (a study's
fork server and cells receive it too).  ``STATELAB_SIGINT_RUNS`` sets the number of
interrupts per command (default 3; the issue's campaign is 50)."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO, STATELAB
from tiny_study import PROMPT, tiny_study

RUNS = int(os.environ.get("STATELAB_SIGINT_RUNS", "3"))
SEED = int(os.environ.get("STATELAB_SIGINT_SEED", "29"))
# the interpreter's own start (before any statelab code runs and can install its handler)
# takes tens of milliseconds, more on a busy machine: the moments begin after it
EARLIEST = 0.25

pytestmark = [pytest.mark.model, pytest.mark.slow]


def _env():
    return {**os.environ, "STATELAB_THREADS": "1", "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get(
        "PYTHONPATH", "")}


def _run(args, delay=None, timeout=120):
    """Run the CLI in its own process group; with ``delay``, Ctrl-C (SIGINT to the group)
    after that many seconds.  (returncode, stdout, stderr, whether the signal was sent)."""
    p = subprocess.Popen(STATELAB + [str(a) for a in args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=_env(), cwd=REPO, start_new_session=True)
    sent = False
    if delay is not None:
        try:
            p.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGINT)
            sent = True
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    if sent:  # no process of the group may outlive the command
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.killpg(p.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            os.killpg(p.pid, signal.SIGKILL)
            pytest.fail(f"processes of {args[0]} outlived it after Ctrl-C")
    return p.returncode, out, err, sent


def _check_ended_well(name, rc, out, err, baseline_out):
    assert "Traceback" not in err and "Exception ignored" not in err, f"{name}: {err}"
    assert rc >= 0, f"{name}: died by signal {-rc}: {err}"
    assert rc in (0, 130), f"{name}: exit {rc}: {err}"
    lines = [ln for ln in err.splitlines() if ln.strip()]
    if rc == 130:
        assert lines and lines[-1] == "interrupted", f"{name}: {err}"
        assert lines.count("interrupted") == 1, f"{name}: {err}"
        assert not any(ln.startswith("error") for ln in lines), f"{name}: {err}"
    else:  # finished before the signal: the whole output
        assert len(out.splitlines()) == len(baseline_out.splitlines()), f"{name}: exit 0 with output {out!r}"
        assert "interrupted" not in lines, f"{name}: {err}"


def _no_temporaries(folder: Path):
    left = [p.name for p in folder.iterdir() if p.name.startswith(".")]
    assert not left, f"temporaries left in {folder}: {left}"


def _verified_or_absent(path: Path):
    from statelab.lab.archive import load_capture

    if path.exists():
        load_capture(path)  # a capture that is there is whole


def _campaign(name, make_args, after, tmp: Path, rng: random.Random, rerun_args=None):
    """Baseline run (its time sets the range of moments), RUNS interrupted runs, then a
    clean rerun; ``after(i, rc)`` checks what run i left."""
    t0 = time.monotonic()
    rc, base_out, err, _ = _run(make_args("base"))
    base_s = time.monotonic() - t0
    assert rc == 0, f"{name} baseline: {err}"
    outcomes = []
    for i in range(RUNS):
        delay = rng.uniform(EARLIEST, base_s * 1.1)
        rc, out, err, sent = _run(make_args(i), delay)
        _check_ended_well(f"{name} #{i} at {delay:.2f}s", rc, out, err, base_out)
        after(i, rc)
        outcomes.append(rc)
    rc, out, err, _ = _run(rerun_args or make_args("rerun"))
    assert rc == 0, f"{name} rerun after interrupts: {err}"
    return base_out, outcomes


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    d = tmp_path_factory.mktemp("sigint-src")
    for args in (["capture", d / "a", "-p", PROMPT, "-s", "A"], ["capture", d / "r", "-p", PROMPT, "-s", "R"],
                 ["export-state", d / "a", d / "a.bin"]):
        rc, _, err, _ = _run(args)
        assert rc == 0, err
    return d


def test_sigint_capture_and_import(tmp_path, sources):
    rng = random.Random(SEED)
    out = tmp_path / "out"
    out.mkdir()

    def after(i, rc):
        _no_temporaries(out)
        _verified_or_absent(out / f"c{i}")
        _verified_or_absent(out / f"i{i}")
        if rc == 0:
            assert (out / f"c{i}").is_dir() or (out / f"i{i}").is_dir()

    _campaign("capture", lambda i: ["capture", out / f"c{i}", "-p", PROMPT, "-s", "R"], after, tmp_path, rng)
    _campaign("import-state", lambda i: ["import-state", sources / "a.bin", out / f"i{i}", "-p", PROMPT,
                                         "--logits", "recompute"], after, tmp_path, rng)


def test_sigint_continue_cross_spec(tmp_path, sources):
    rng = random.Random(SEED + 1)
    for name, args in (("continue", ["continue", sources / "a", "--cap", "4"]),
                       ("cross", ["cross", sources / "a", sources / "r", "--cap", "4"]),
                       ("spec run", ["spec", "run", "-p", PROMPT, "--arms", "R,M_QB", "--cap", "4", "--threads", "1"])):
        base, _ = _campaign(name, lambda i, a=args: a, lambda i, rc: None, tmp_path, rng)
        assert base.strip()
    _no_temporaries(sources)


def test_sigint_study_run(tmp_path):
    rng = random.Random(SEED + 2)
    spec = tmp_path / "tiny.toml"
    spec.write_text(tiny_study())

    def after(i, rc):
        _no_temporaries_study(tmp_path / "runs" / str(i))

    last = tmp_path / "runs" / str(RUNS - 1)  # the rerun resumes the last interrupted folder to a whole study
    _campaign("study run", lambda i: ["study", "run", spec, "--out", tmp_path / "runs" / str(i), "--workers", "1"],
              after, tmp_path, rng, rerun_args=["study", "run", spec, "--out", last, "--workers", "1"])
    assert (last / "results.nc").is_file() and (last / "report.md").is_file()
    left = [p for p in Path(os.environ.get("TMPDIR", "/tmp")).glob("statelab-fork-*")
            if _owner_dead(p.name)]
    assert not left, left


def _owner_dead(name: str) -> bool:
    pid = name[len("statelab-fork-"):].split("-", 1)[0]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _no_temporaries_study(folder: Path):
    if not folder.exists():
        return
    for p in folder.rglob(".*"):
        assert p.name == ".lock", f"temporary left in the study folder: {p}"
