"""benchmarks/device/upgrade_run.py on the kept CUDA findings run as it was before its carry-over
(its chat: prompts recorded under the identity of their rendered text): carried over to this
code's identities only when each prompt renders to the recorded text, then the study folder's
hash check accepts it.  tests/data/upgrade-run/ is that run's spec.json as kept until
2026-12-03 (commit a1fa1bf), with 2 of its 24 controls, its first 50 cell records and 5 search
records: the kept run itself has since been carried over on the H200."""
from __future__ import annotations

import gzip
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from statelab.errors import ConfigError
from statelab.experiments.matrix.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
KEPT = Path(__file__).resolve().parent / "data" / "upgrade-run"
SPEC = REPO / "studies" / "findings-cuda.toml"

_s = importlib.util.spec_from_file_location("upgrade_run", REPO / "benchmarks" / "device" / "upgrade_run.py")
upgrade_run = importlib.util.module_from_spec(_s)
_s.loader.exec_module(upgrade_run)


def _copy(tmp_path: Path) -> Path:
    """The kept run as it was: spec.json, controls, cell and search records."""
    run = tmp_path / "run"
    shutil.copytree(KEPT / "controls", run / "controls")
    shutil.copy(KEPT / "spec.json", run / "spec.json")
    (run / "findings").mkdir()
    shutil.copy(KEPT / "findings" / "minimal.jsonl.gz", run / "findings" / "minimal.jsonl.gz")
    (run / "cells.jsonl").write_bytes(gzip.decompress((KEPT / "cells.jsonl.gz").read_bytes()))
    return run


def _texts(run: Path) -> dict:
    return {f.relative_to(run).as_posix(): (gzip.decompress(f.read_bytes()) if f.suffix == ".gz" else f.read_bytes())
            for f in run.rglob("*") if f.is_file()}


@pytest.mark.model
def test_kept_run_carried_to_this_codes_hash(tmp_path):
    run = _copy(tmp_path)
    old = json.loads((run / "spec.json").read_text())["spec_hash"]
    spec = load_spec(SPEC)
    assert old != spec.hash  # the reason for the script: the kept run is refused as it is
    before = _texts(run)
    h_old, h_new, carried = upgrade_run.upgrade(run, str(SPEC))
    assert (h_old, h_new) == (old, spec.hash)
    # the hash the H200 carried the whole kept run to (docs/findings/cuda/run) is this one
    assert json.loads((REPO / "docs" / "findings" / "cuda" / "run" / "spec.json").read_text())["spec_hash"] == h_new
    assert sorted(carried) == sorted(p.id for p in spec.prompts if p.id.startswith("chat:"))
    after = _texts(run)
    assert set(after) == set(before)
    for name, data in after.items():
        assert old.encode() not in data
        if name != "spec.json":  # every other byte as it was, the hash aside
            assert data == before[name].replace(old.encode(), spec.hash.encode())
    rec = json.loads(after["spec.json"])
    assert rec["spec_hash"] == spec.hash and rec["normalized"] == json.loads(json.dumps(spec.normalized()))
    # the study folder's own check now accepts it, and a second upgrade changes nothing
    from statelab.experiments.folder import normalized_hash
    assert normalized_hash(rec["normalized"]) == rec["spec_hash"]
    assert upgrade_run.upgrade(run, str(SPEC))[2] == []


@pytest.mark.model
def test_a_prompt_that_renders_otherwise_is_refused_and_nothing_written(tmp_path):
    run = _copy(tmp_path)
    rec = json.loads((run / "spec.json").read_text())
    chat = next(p for p in rec["normalized"]["prompts"] if p["id"].startswith("chat:"))
    chat["sha256"] = "0" * 64
    (run / "spec.json").write_text(json.dumps(rec))
    before = _texts(run)
    with pytest.raises(ConfigError, match=f"prompt {chat['id']} renders to"):
        upgrade_run.upgrade(run, str(SPEC))
    assert _texts(run) == before


def test_another_spec_is_refused(tmp_path):
    run = _copy(tmp_path)
    before = _texts(run)
    with pytest.raises(ConfigError, match="differs in more than the prompt identities"):
        upgrade_run.upgrade(run, str(REPO / "studies" / "findings-cpu.toml"))
    assert _texts(run) == before
