"""Hardening: each fault found by trying the CLI as a new user would, reproduced.

1 usage errors (usage line, exit 2); 2 errors that were not StatelabErrors; 3 geometries
that crashed the native library; 4 --overwrite deleting any folder; 5 the manifest seal,
every recorded hash, failed controls exiting non-zero; 6 one writer per study folder and
an edited spec.json; 7 Ctrl-C; 8 temporaries left by killed processes; 9 --threads and a
study spec without cap.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import REPO, STATELAB, one_line_error, run_cli
from statelab.lab.archive import ArchiveError, load_capture, save_capture
from statelab.errors import ConfigError, StatelabError
from statelab.lab.formation import PRESETS, Schedule, form, parse_schedule
from statelab.experiments.frontier_panels import FrontierRunError
from statelab.paths import exclusive_lock
from statelab.experiments.matrix import StudyDir, StudyError, load_spec

# Names new with the hardening are imported inside the tests, so that on a tree without
# them each test fails for its own fault rather than the whole module failing to import.
MAX_TOKENS = 1 << 24  # the documented bound on context, batch, ubatch and submission sizes

TEXT = "def add(a, b):\n    return a + b\n\nprint(add(2, 3))"  # a short prompt (about 20 tokens)


def _write_tiny_spec(folder: Path, name: str, cap: int | None = 8, extra: str = "", file: str | None = None) -> Path:
    lines = [f'name = "{name}"', "threads = 1", "repeats = 1", 'prompts = ["HumanEval/2"]',
             'selectors = ["EARLY", "LATE"]', 'directions = ["A->R"]']
    if cap is not None:
        lines.append(f"cap = {cap}")
    p = folder / f"{file or name}.toml"
    p.write_text("\n".join(lines) + f"\n{extra}\n[arms]\nA = \"A\"\nR = \"R\"\n")
    return p


def _seal(m: dict) -> str:
    """The documented seal: sha256 of the manifest's canonical form (every field but the
    seal, keys sorted, no whitespace, ASCII)."""
    body = {k: v for k, v in m.items() if k != "seal"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _temp_prefix(target: Path, pid: int) -> str:
    """The documented name of a temporary for ``target``: ``.NAME.HOST-PID.``."""
    return f".{target.name}.{socket.gethostname()}-{pid}."


def _edit_manifest(folder: Path, edit, reseal: bool = True) -> None:
    """Apply ``edit`` to a capture's manifest; ``reseal`` as a consistent forgery would."""
    m = json.loads((folder / "manifest.json").read_text())
    edit(m)
    if reseal:
        m["seal"] = _seal(m)
    (folder / "manifest.json").write_text(json.dumps(m, indent=2, sort_keys=True))


# ------------------------------------------------------------------ 1. usage errors

USAGE = [("nosuchcmd",), ("generate", "hi"), ("capture",), ("continue", "CAP", "--cap", "abc"),
         ("generate", "-p", "hi", "--bogus"), ("generate", "-p", "hi", "--threads", "-3"),
         ("study", "run")]


@pytest.mark.parametrize("args", USAGE, ids=" ".join)
def test_usage_error_prints_the_usage_line_and_exits_2(args):
    r = run_cli(*args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.lstrip().startswith("Usage: "), r.stderr
    assert "Error: " in r.stderr


# ------------------------------------------------------------------ 2. errors that were not StatelabErrors


def test_codec_selector_and_frontier_errors_are_statelab_errors():
    from statelab.analysis.frontier import FrontierError
    from statelab.kvstate import KVFormatError, KVState
    from statelab.selection import SelectorError

    for cls in (KVFormatError, SelectorError, FrontierError):
        assert issubclass(cls, StatelabError) and issubclass(cls, ValueError)  # old `except ValueError` still works
    with pytest.raises(StatelabError, match="(?i)magic|truncat|bytes"):
        KVState.parse(b"\x00\x01")


def test_selector_file_that_is_not_utf8(tmp_path):
    (tmp_path / "BAD.toml").write_bytes(b"\xff\xfe[[term]]\n")
    spec = _write_tiny_spec(tmp_path, "s").read_text().replace('"LATE"', '"BAD.toml"')
    (tmp_path / "s.toml").write_text(spec)
    one_line_error(run_cli("study", "run", tmp_path / "s.toml", "--out", tmp_path / "out"), "BAD.toml",
                   "not UTF-8")
    assert not (tmp_path / "out").exists()


def test_derive_draft_without_a_layer_count():
    one_line_error(run_cli("spec", "run", "-H", "2", "--cap", "4", "--draft", "derive:abc"), "derive:N")


@pytest.fixture(scope="module")
def caps(tmp_path_factory):
    """Captures made by the CLI: HumanEval/13 with A and with R (their natural endpoints part at output
    20 on the CPU build), and a short text prompt with A."""
    root = tmp_path_factory.mktemp("caps")
    out = {"A": root / "a", "R": root / "r", "short": root / "short"}
    for args in ((out["A"], "-H", "13", "-s", "A"), (out["R"], "-H", "13", "-s", "R"), (out["short"], "-p", TEXT)):
        r = run_cli("capture", *args)
        assert r.returncode == 0, r.stderr
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.model
def test_diff_of_captures_with_different_cell_counts(caps):
    one_line_error(run_cli("diff", caps["A"], caps["short"]), "(72 and 23 tokens)", "their cells do not correspond")


@pytest.mark.model
def test_truncated_kv_with_recomputed_hashes_is_one_line(caps, tmp_path):
    """kv.bin cut short and every hash of the manifest recomputed to match (and resealed)."""
    d = _copy(caps["A"], tmp_path / "cut")
    blob = (d / "kv.bin").read_bytes()[:-1000]
    (d / "kv.bin").write_bytes(blob)
    sha = hashlib.sha256(blob).hexdigest()

    def edit(m):
        m["files"]["kv.bin"] = m["hashes"]["kv"] = m["kv"]["sha256"] = sha

    _edit_manifest(d, edit)
    one_line_error(run_cli("continue", d, "--cap", "2"), "kv.bin is not a readable state")


@pytest.mark.model
def test_cross_into_a_derived_model_capture(caps, tmp_path):
    """The recipient formed by an 8-layer copy of the model: a one-line refusal."""
    small = tmp_path / "first8.gguf"
    assert run_cli("model", "derive", small, "--layers", "8").returncode == 0
    rec = tmp_path / "rec8"
    r = run_cli("capture", rec, "-H", "2", "--model", small)
    assert r.returncode == 0, r.stderr
    one_line_error(run_cli("cross", caps["A"], rec, "--cap", "2"), "a state does not cross models")


# ------------------------------------------------------------------ 3. geometry bounds


@pytest.mark.parametrize("schedule", ["ub4294967297", "ub3000000000", "4294967297+rest", "128+rest@ub99999999999"])
def test_huge_schedules_are_refused_before_the_native_library(tmp_path, schedule):
    out = tmp_path / "c"
    one_line_error(run_cli("capture", out, "-H", "2", "-s", schedule), f"..{MAX_TOKENS}")
    assert not out.exists()


def test_geometry_bounds_in_the_library():
    from statelab.runtime import ContextConfig
    from statelab.speculative.transaction import SpecConfig

    for kw in ({"n_ctx": 2**32 + 1024}, {"n_batch": 3_000_000_000, "n_ubatch": 512}, {"n_ubatch": 0},
               {"n_threads": -3}, {"n_threads": 100_000}, {"n_ctx": 1.5}):
        with pytest.raises(ConfigError):
            ContextConfig(**kw)
    for kw in ({"ubatch": 2**33}, {"threads": -3}, {"k": 2**40}):
        with pytest.raises(ConfigError):
            SpecConfig(**kw)
    with pytest.raises(ConfigError, match="submission size"):
        Schedule("big", (2**31, -1), 512)
    with pytest.raises(ConfigError, match="n_ubatch"):
        parse_schedule("ub16777217")
    assert parse_schedule(f"ub{MAX_TOKENS}").n_ubatch == MAX_TOKENS
    from statelab.limits import MAX_TOKENS as bound

    assert bound == MAX_TOKENS


def test_n_ctx_beyond_32_bits_is_one_line():
    one_line_error(run_cli("generate", "-p", "hi", "--cap", "2", "--n-ctx", "4294967297"), "n_ctx")


@pytest.mark.model
def test_largest_ubatch_runs_like_the_whole_prompt_and_one_more_is_refused(model, base_config, he):
    """ubatch 2^24 is accepted and llama.cpp caps it at n_ctx: one micro-batch, as A's 512;
    2^24 + 1 is refused before any context is made."""
    big = form(model, he("HumanEval/2"), parse_schedule(f"ub{MAX_TOKENS}"), base_config)
    a = form(model, he("HumanEval/2"), PRESETS["A"], base_config)
    assert big.blob == a.blob and big.logits.tobytes() == a.logits.tobytes()
    with pytest.raises(ConfigError, match="n_ubatch"):
        form(model, he("HumanEval/2"), parse_schedule(f"ub{MAX_TOKENS + 1}"), base_config)


# ------------------------------------------------------------------ 4. --overwrite


def test_overwrite_refuses_a_folder_that_is_not_a_capture(tmp_path):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "notes.txt").write_text("keep me")
    one_line_error(run_cli("capture", d, "-p", TEXT, "--overwrite"), "refusing to overwrite", "not a verified")
    assert (d / "notes.txt").read_text() == "keep me"


@pytest.mark.model
def test_overwrite_replaces_only_a_verified_capture(caps, tmp_path):
    d = _copy(caps["short"], tmp_path / "cap")
    r = run_cli("capture", d, "-p", TEXT, "-s", "R", "--overwrite")
    assert r.returncode == 0, r.stderr
    assert load_capture(d).schedule.name == "R"
    (d / "notes.txt").write_text("mine")  # a capture folder holding a user's file: not replaced
    one_line_error(run_cli("capture", d, "-p", TEXT, "--overwrite"), "refusing to overwrite")
    assert (d / "notes.txt").exists()
    (d / "notes.txt").unlink()
    raw = bytearray((d / "logits.npy").read_bytes())
    raw[-1] ^= 1
    (d / "logits.npy").write_bytes(bytes(raw))  # a damaged capture is kept for inspection
    one_line_error(run_cli("capture", d, "-p", TEXT, "--overwrite"), "refusing to overwrite", "sha256 mismatch")
    # the library refuses to replace a folder with files its archive does not list
    good = load_capture(caps["short"])
    other = _copy(caps["short"], tmp_path / "other")
    (other / "extra.bin").write_bytes(b"x")
    with pytest.raises(ArchiveError, match="does not list"):
        save_capture(good, other, overwrite=True)
    assert (other / "extra.bin").exists()


# ------------------------------------------------------------------ 5. the manifest, sealed


@pytest.mark.model
def test_a_bit_flip_in_every_byte_of_the_manifest_is_refused(caps, tmp_path):
    """The scan of the issue: one single-bit flip per byte of manifest.json (bit i mod 8 of
    byte i, so every bit position is hit), each read back through the archive's reader."""
    import tempfile

    from statelab.lab.archive import manifest_seal, read_manifest

    shm = Path("/dev/shm")
    work = Path(tempfile.mkdtemp(dir=shm)) if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path
    try:
        d = _copy(caps["A"], work / "flip")
        raw = (d / "manifest.json").read_bytes()
        original = read_manifest(d, "statelab.capture/2")
        assert original["seal"] == manifest_seal(original) == _seal(original)
        accepted = []
        for i in range(len(raw)):
            b = bytearray(raw)
            b[i] ^= 1 << (i % 8)
            (d / "manifest.json").write_bytes(bytes(b))
            try:
                m = read_manifest(d, "statelab.capture/2")
            except ArchiveError:
                continue
            accepted.append(i)
            assert m == original, f"the flip in byte {i} changed the manifest's content and was accepted"
    finally:
        if work != tmp_path:
            shutil.rmtree(work)
    # only spellings of the same content can read back (1e-05 as 1E-05, \u00e9 as \u00E9)
    assert len(accepted) <= len(raw) // 100, accepted


HASH_FIELDS = ("files/kv.bin", "files/tokens.npy", "files/logits.npy", "hashes/kv", "hashes/tokens", "hashes/logits",
               "kv/sha256", "kv/components/L0.K", "kv/components/L29.V", "kv/components/meta")


@pytest.mark.model
def test_every_recorded_hash_is_checked(caps, tmp_path):
    """Each hash the manifest records, set to another value (manifest resealed), is refused."""
    for field in HASH_FIELDS:
        d = _copy(caps["A"], tmp_path / field.replace("/", "_"))

        def edit(m):
            *path, last = field.split("/")
            node = m
            for k in path:
                node = node[k]
            assert last in node
            node[last] = "0" * 64

        _edit_manifest(d, edit)
        with pytest.raises(ArchiveError):
            load_capture(d)
            pytest.fail(f"a capture whose manifest records another {field} was accepted")


@pytest.mark.model
def test_edited_token_count_or_ubatch_is_refused(caps, tmp_path):
    for name, edit in (("n_tokens", lambda m: m["prompt"].update(n_tokens=m["prompt"]["n_tokens"] - 1)),
                       ("n_ubatch", lambda m: m["schedule"].update(n_ubatch=64))):
        d = _copy(caps["A"], tmp_path / name)
        _edit_manifest(d, edit, reseal=False)
        one_line_error(run_cli("sham", d, "--cap", "2"), "does not match its seal")
        _edit_manifest(d, lambda m: None)  # resealed: the inconsistency itself is named
        with pytest.raises(ArchiveError, match="prompt tokens|disagrees with the context"):
            load_capture(d)


@pytest.mark.model
def test_a_failed_sham_control_exits_non_zero(caps, tmp_path):
    """An R capture relabelled as A (manifest resealed, identity made consistent): the sham
    restores R's state, the natural path re-forms with A; on CPU their endpoints part within 32."""
    d = _copy(caps["R"], tmp_path / "relabelled")

    def edit(m):
        m["schedule"].update(name="A", n_ubatch=512, n_batch=512)
        m["identity"]["context"].update(n_ubatch=512, n_batch=512)

    _edit_manifest(d, edit)
    r = run_cli("sham", d, "--cap", "32")
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "FAILED CONTROL: sham differs from natural at output" in r.stdout


# ------------------------------------------------------------------ 6. one writer per study folder


def test_a_second_writer_is_refused(tmp_path):
    spec = _write_tiny_spec(tmp_path, "tiny")
    out = tmp_path / "out"
    with StudyDir(out).writer():
        one_line_error(run_cli("study", "run", spec, "--out", out), "in use by another statelab process",
                       f"pid {os.getpid()}")
        with pytest.raises(StudyError, match="in use"):
            with StudyDir(out).writer():
                pass
    assert not out.exists()  # the lock's folder, left empty, is removed with it


def test_edited_spec_json_is_refused(tmp_path):
    spec_path = _write_tiny_spec(tmp_path, "tiny")
    out = tmp_path / "out"
    out.mkdir()
    rec = load_spec(spec_path).record()
    rec["normalized"]["cap"] = 4  # the edit of the issue: normalized.cap
    (out / "spec.json").write_text(json.dumps(rec, indent=2, sort_keys=True))
    for args in (("study", "run", spec_path, "--out", out), ("study", "report", out)):
        one_line_error(run_cli(*args), "spec.json", "does not match its hash")
    with pytest.raises(StudyError, match="does not match its hash"):
        StudyDir(out).read_spec()


def test_study_spec_without_cap_is_refused(tmp_path):
    with pytest.raises(StudyError, match=r"missing required key\(s\) cap"):
        load_spec(_write_tiny_spec(tmp_path, "nocap", cap=None), check_model=False)


@pytest.fixture(scope="module")
def raced(tmp_path_factory):
    """Two `study run` processes on one folder, specs differing only in cap, the second
    started while the first runs: (first spec, folder, first result, second result)."""
    root = tmp_path_factory.mktemp("race")
    s8, s4 = _write_tiny_spec(root, "tiny"), _write_tiny_spec(root, "tiny", cap=4, file="tiny4")
    out = root / "out"
    first = subprocess.Popen(STATELAB + ["study", "run", str(s8), "--out", str(out), "--workers", "1"], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / "spec.json").exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    second = run_cli("study", "run", s4, "--out", out, "--workers", "1")
    o, e = first.communicate(timeout=600)
    return s8, out, subprocess.CompletedProcess(first.args, first.returncode, o, e), second


@pytest.mark.cli
@pytest.mark.model
def test_two_runs_on_one_folder_one_is_refused(raced):
    _, out, first, second = raced
    assert first.returncode == 0, first.stderr
    one_line_error(second, "in use by another statelab process", str(out))
    recs = [json.loads(x) for x in (out / "cells.jsonl").read_text().splitlines()]
    assert sorted(r["key"] for r in recs) == ["HumanEval/2|EARLY|A->R|0", "HumanEval/2|LATE|A->R|0"]
    assert {r["spec_hash"] for r in recs} == {StudyDir(out).read_spec()["spec_hash"]}
    assert StudyDir(out).read_spec()["normalized"]["cap"] == 8


# ------------------------------------------------------------------ 7. Ctrl-C


def _mapped(pid: int, path: str) -> bool:
    try:
        return path in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _unit_mapped(pid: int, path: str) -> bool:
    """Whether a process below ``pid`` (the sweep's unit: the engine runs each prompt in a fresh
    process) has the model mapped; the command itself maps it only briefly, to make the schedules."""
    import psutil

    try:
        below = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return False
    return any(_mapped(p.pid, path) for p in below)


@pytest.mark.cli
@pytest.mark.model
def test_ctrl_c_exits_130_with_one_line(tmp_path):
    from statelab.models import default_model_path

    proc = subprocess.Popen(STATELAB + ["sweep", "-H", "2", "--cap", "128", "--out", str(tmp_path / "sweep")],
                            cwd=REPO,  # a minute of work
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    model_file = str(Path(default_model_path()).resolve())
    deadline = time.monotonic() + 60
    while not _unit_mapped(proc.pid, model_file) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # sweeping by now
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (proc.returncode, err)
    assert "Traceback" not in err and [ln for ln in err.splitlines() if ln.strip()] == ["interrupted"]


# ------------------------------------------------------------------ 8. temporaries of killed processes


def _killed_while_writing(code: str, target: Path) -> Path:
    """Run ``code`` (it prints "ready" mid-write, then sleeps) in a child, SIGKILL it, and
    return the temporary it left beside ``target``."""
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), str(target)], cwd=REPO,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    child.kill()
    child.wait()
    left = [p for p in target.parent.iterdir() if p.name.startswith(f".{target.name}.")]
    assert len(left) == 1 and left[0].name.startswith(_temp_prefix(target, child.pid)), left
    return left[0]


CAPTURE_KILLED = """
    import os, sys, time
    from statelab.lab import archive
    def stuck(fd):
        print("ready", flush=True)
        time.sleep(60)
    os.fsync = stuck  # killed after writing the first file of the temporary folder
    archive.write_files_atomic(sys.argv[1], {"kv.bin": b"x" * 100}, {"format": archive.FORMAT})
"""

ATOMIC_KILLED = """
    import sys, time
    from statelab.paths import atomic_path
    with atomic_path(sys.argv[1]) as tmp:
        tmp.write_bytes(b"half a file")
        print("ready", flush=True)
        time.sleep(60)
"""


@pytest.mark.model
def test_capture_cleans_the_folder_a_killed_capture_left(tmp_path):
    out = tmp_path / "OUT"
    left = _killed_while_writing(CAPTURE_KILLED, out)
    assert left.is_dir() and not out.exists()
    r = run_cli("capture", out, "-p", TEXT)
    assert r.returncode == 0, r.stderr
    assert not left.exists() and load_capture(out).n_prompt > 0
    assert [p.name for p in tmp_path.iterdir()] == ["OUT"]


@pytest.mark.cli
@pytest.mark.model
def test_study_report_cleans_a_results_temporary(raced, tmp_path):
    _, out, _, _ = raced
    folder = _copy(out, tmp_path / "study")
    left = _killed_while_writing(ATOMIC_KILLED, folder / "results.nc")
    live = folder / f"{_temp_prefix(folder / 'results.nc', os.getpid())}keep.tmp"  # this process is alive: kept
    live.write_bytes(b"in progress")
    r = run_cli("study", "report", folder)
    assert r.returncode == 0, r.stderr
    assert not left.exists() and live.exists()


# ------------------------------------------------------------------ 9. small ones


@pytest.mark.model
def test_threads_from_the_environment_are_checked():
    one_line_error(run_cli("generate", "-p", "hi", "--cap", "2", env={"STATELAB_THREADS": "-3"}),
                   "STATELAB_THREADS", "0..512")


def test_frontier_run_folder_has_one_writer(tmp_path):
    """A frontier run folder in use by another process: the second run is refused in one line before it
    writes anything (the holder here is this test process)."""
    out = tmp_path / "fr"
    out.mkdir()
    with exclusive_lock(out / ".lock", FrontierRunError, "test holder"):
        r = run_cli("frontier", "run", REPO / "studies" / "frontier-ci.toml", "--out", out)
    one_line_error(r, "in use by another statelab process", str(out))
    assert sorted(p.name for p in out.iterdir()) == [".lock"]


def test_a_replace_killed_between_its_renames_loses_nothing(tmp_path):
    """A writer killed after moving the old archive aside and before renaming the new one into place
    leaves no dest: the next write puts the old version back before it decides anything."""
    from statelab.lab.archive import read_verified, write_files_atomic
    from statelab.paths import REPLACED

    dest = tmp_path / "arch"
    write_files_atomic(dest, {"a.bin": b"old"}, {"format": "statelab.test/1"})
    dead = f".{dest.name}.{socket.gethostname()}-{2**22 + 12345}."  # no such pid on Linux (pid_max <= 2**22)
    os.replace(dest, tmp_path / (dead + REPLACED))
    (tmp_path / (dead + "half")).mkdir()  # the new version's folder, complete or not
    with pytest.raises(ArchiveError, match="output already exists"):
        write_files_atomic(dest, {"a.bin": b"new"}, {"format": "statelab.test/1"})
    assert read_verified(dest, "statelab.test/1")[1]["a.bin"] == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["arch"]
    write_files_atomic(dest, {"a.bin": b"new"}, {"format": "statelab.test/1"}, overwrite=True)
    assert read_verified(dest, "statelab.test/1")[1]["a.bin"] == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["arch"]


def test_atomic_writes_get_the_mode_of_an_ordinary_file(tmp_path):
    import os
    import stat

    from statelab.paths import atomic_write_text

    umask = os.umask(0o022)
    os.umask(umask)
    f = atomic_write_text(tmp_path / "table.md", "x")
    assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask  # not the 0600 of a temporary file
