"""One writer per output: two real processes racing on one new output (seeded): exactly one
succeeds and the other is refused in one line, the output is the winner's; without
--overwrite an existing output is never moved or replaced; refused commands leave a folder
as it was; ``study findings --out`` writes only its own folders.  Plus the small refusals
(``findings-run --limit -1``, ``--source-backend``) and the fork-server folders of killed runs."""
from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, STATELAB, one_line_error, run_cli
from tiny_study import PROMPT, tiny_study

RACES = int(os.environ.get("STATELAB_WRITER_RACES", "3"))
SEED = int(os.environ.get("STATELAB_WRITER_SEED", "4"))


def snapshot(folder: Path) -> dict:
    """Every entry under ``folder`` (hidden ones too) with its content hash."""
    return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir")
            for p in sorted(folder.rglob("*"))}


# ----------------------------------------------------------------------------- without a model


def test_rename_noreplace_never_replaces(tmp_path):
    from statelab.paths import rename_noreplace

    (tmp_path / "a").write_text("new")
    (tmp_path / "b").write_text("old")
    with pytest.raises(FileExistsError):
        rename_noreplace(tmp_path / "a", tmp_path / "b")
    assert (tmp_path / "b").read_text() == "old" and (tmp_path / "a").exists()
    (tmp_path / "d1").mkdir()
    (tmp_path / "d2").mkdir()  # even an empty folder (a plain rename would replace it)
    with pytest.raises(FileExistsError):
        rename_noreplace(tmp_path / "d1", tmp_path / "d2")
    rename_noreplace(tmp_path / "a", tmp_path / "c")
    assert (tmp_path / "c").read_text() == "new" and not (tmp_path / "a").exists()


def test_an_output_that_appears_meanwhile_is_never_replaced(tmp_path, monkeypatch):
    """Another writer's capture appears after the existence check and before the rename: the
    archive writer refuses, leaves that capture as it is and removes its own temporary."""
    import statelab.lab.archive as archive
    from statelab.lab.archive import ArchiveError, write_files_atomic

    dest = tmp_path / "cap"
    real = archive.tempfile.mkdtemp

    def other_writer_first(*a, **kw):
        dest.mkdir()
        (dest / "manifest.json").write_text('{"other": true}')
        return real(*a, **kw)

    monkeypatch.setattr(archive.tempfile, "mkdtemp", other_writer_first)
    with pytest.raises(ArchiveError, match="output already exists"):
        write_files_atomic(dest, {"x.bin": b"1"}, {"format": "statelab.capture/2"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cap"]
    assert (dest / "manifest.json").read_text() == '{"other": true}'


def test_output_lock_refuses_a_second_writer_and_leaves_nothing(tmp_path):
    from statelab.errors import StatelabError
    from statelab.paths import output_lock

    out = tmp_path / "o"
    with output_lock(out, StatelabError):
        with pytest.raises(StatelabError, match="in use by another statelab process"):
            with output_lock(out, StatelabError):
                pass
    assert list(tmp_path.iterdir()) == []  # the lock file went with the lock
    with output_lock(out, StatelabError):  # and can be taken again
        pass
    (tmp_path / ".o-lock").write_text("pid 1 on a killed writer")  # left by a killed writer: taken over
    with output_lock(out, StatelabError):
        pass
    assert list(tmp_path.iterdir()) == []


def test_a_refused_folder_writer_leaves_the_folder_as_it_was(tmp_path):
    """A run folder writer that is refused (here: not a run folder) removes the lock file it made."""
    from statelab.experiments.folder import RunFolder
    from statelab.errors import StatelabError

    other = tmp_path / "other"
    other.mkdir()
    (other / "data.txt").write_text("mine")
    before = snapshot(other)
    with pytest.raises(StatelabError, match="not empty"):
        with RunFolder(other, "x/1", StatelabError, "study").writer() as f:
            f.claim("h" * 64, {"format": "x/1"})
    assert snapshot(other) == before


def test_fork_server_folders_of_dead_runners_are_removed(tmp_path):
    from statelab.experiments.forkserver import remove_stale_folders

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"statelab-fork-{dead.pid}-abc"
    live = tmp_path / f"statelab-fork-{os.getpid()}-def"
    legacy = tmp_path / "statelab-fork-xyz"  # no owner recorded: left alone
    for d in (stale, live, legacy):
        d.mkdir()
        (d / "server.log").write_text("log")
    assert remove_stale_folders(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists() and legacy.exists()


def test_findings_run_limit_must_not_be_negative(tmp_path):
    from statelab.experiments.findings_run import FindingsError, run_findings

    with pytest.raises(FindingsError, match="--limit must be 0 or more"):
        run_findings(tmp_path, "minimal", 10.0, limit=-1)


# ----------------------------------------------------------------------------- real processes


def _start(args):
    return subprocess.Popen(STATELAB + [str(a) for a in args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO, env={**os.environ, "STATELAB_THREADS": "1"})


@pytest.mark.model
@pytest.mark.parametrize("command", ["capture", "import-state"])
def test_two_writers_of_one_new_output(tmp_path, command, cli):
    """Two processes write one new capture at nearly the same moment (seeded offsets): exactly
    one succeeds, the other is refused in one line, and the capture is the winner's."""
    from statelab.lab.archive import load_capture

    rng = random.Random(SEED + (command == "import-state"))
    src = tmp_path / "src"
    if command == "import-state":
        r = cli("capture", src / "a", "-p", PROMPT)
        assert r.returncode == 0, r.stderr
        r = cli("export-state", src / "a", src / "a.bin")
        assert r.returncode == 0, r.stderr
    for i in range(RACES):
        out = tmp_path / f"out{i}"
        if command == "capture":  # two different states: the survivor tells whose it is
            argv = [["capture", out, "-p", PROMPT, "-s", "A"], ["capture", out, "-p", PROMPT, "-s", "R"]]
        else:  # the same file, told apart by the prompt id each one records
            argv = [["import-state", src / "a.bin", out, "-p", PROMPT], ["import-state", src / "a.bin", out]]
        first = _start(argv[0])
        time.sleep(rng.uniform(0.0, 0.4))
        second = _start(argv[1])
        results = [p.communicate(timeout=120) + (p.returncode,) for p in (first, second)]
        codes = sorted(r[2] for r in results)
        assert codes == [0, 2], results
        winner = [k for k, r in enumerate(results) if r[2] == 0][0]
        loser = results[1 - winner]
        lines = [ln for ln in loser[1].splitlines() if ln.strip()]
        assert len(lines) == 1 and "Traceback" not in loser[1], loser[1]
        assert "output already exists" in lines[0] or "in use by another statelab process" in lines[0], lines[0]
        cap = load_capture(out)  # whole and verified
        if command == "capture":
            assert cap.schedule.name == ("A", "R")[winner]
        else:
            assert (cap.prompt_id == "imported:a.bin") == (winner == 1)
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.model
def test_export_without_overwrite_keeps_an_existing_file(tmp_path, cli):
    r = cli("capture", tmp_path / "a", "-p", PROMPT)
    assert r.returncode == 0, r.stderr
    (tmp_path / "s.bin").write_bytes(b"someone else's")
    one_line_error(cli("export-state", tmp_path / "a", tmp_path / "s.bin"), "output already exists")
    assert (tmp_path / "s.bin").read_bytes() == b"someone else's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "s.bin"]


@pytest.mark.model
def test_source_backend_is_one_of_the_backends(tmp_path, cli):
    one_line_error(cli("import-state", tmp_path / "none.bin", tmp_path / "o", "--source-backend", "gpu"),
                   "unknown backend 'gpu'", "cpu, cuda or vulkan")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def study_and_capture(tmp_path_factory):
    d = tmp_path_factory.mktemp("writers")
    spec = d / "tiny.toml"
    spec.write_text(tiny_study())
    r = run_cli("study", "run", spec, "--out", d / "study", "--workers", "1", env={"STATELAB_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    r = run_cli("capture", d / "cap", "-p", PROMPT, env={"STATELAB_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    return d


@pytest.mark.model
@pytest.mark.slow
def test_refused_commands_leave_a_capture_as_it_was(study_and_capture, cli):
    """study run / frontier run --out, study report and study findings --out on a capture folder
    are refused in one line and leave it as it was: a capture --overwrite then still works."""
    d = study_and_capture
    cap = d / "cap"
    before = snapshot(cap)
    for args, needle in (
            (["study", "run", d / "tiny.toml", "--out", cap], "holds no spec.json"),
            (["frontier", "run", REPO / "studies" / "frontier-ci.toml", "--out", cap], "no spec.json"),
            (["study", "report", cap], "spec.json"),
            (["study", "findings", d / "study", "--out", cap], "not a findings folder")):
        one_line_error(cli(*args), needle)
        assert snapshot(cap) == before, args
    r = cli("capture", cap, "-p", PROMPT, "--overwrite")
    assert r.returncode == 0, r.stderr


@pytest.mark.model
@pytest.mark.slow
def test_findings_writes_only_its_own_folders(study_and_capture, cli):
    d = study_and_capture
    out = d / "findings"
    r = cli("study", "findings", d / "study", "--out", out)
    assert r.returncode == 0, r.stderr
    assert json.loads((out / ".statelab-findings").read_text())["format"] == "statelab.findings-folder/1"
    r = cli("study", "findings", d / "study", "--out", out)  # its own folder: written again
    assert r.returncode == 0, r.stderr
    before = snapshot(d / "study")
    one_line_error(cli("study", "findings", d / "study", "--out", d / "study"), "one of the study folders read")
    assert snapshot(d / "study") == before
    other = d / "notes"
    other.mkdir()
    (other / "mine.txt").write_text("x")
    one_line_error(cli("study", "findings", d / "study", "--out", other), "not a findings folder")
    assert sorted(p.name for p in other.iterdir()) == ["mine.txt"]
    assert not [p for p in d.iterdir() if p.name.endswith("lock")]


@pytest.mark.model
def test_benchmark_scripts_report_statelab_errors_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "speculative.py"), str(tmp_path / "none.toml"),
                        "--no-write"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2, r.stderr
    assert [ln for ln in r.stderr.splitlines() if ln.strip()] == [f"error: campaign spec not found: {tmp_path / 'none.toml'}"]
