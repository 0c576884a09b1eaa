"""The CLI package: command modules registered in help order, a start that loads no heavy
library, and the library functions the commands call (output folders, backends, choices,
sweep schedules, shams against the natural path, operator replay report)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import xarray as xr

from conftest import REPO, run_cli
from statelab.errors import ConfigError, one_of
from statelab.experiments.masks import write_masks
from statelab.experiments.partition import sweep_schedules
from statelab.lab.archive import ArchiveError, check_capture_dest
from statelab.runtime.native import BACKENDS, check_backend

COMMANDS = ["doctor", "generate", "capture", "continue", "sham", "cross", "diff", "import-state", "export-state",
            "sweep", "demo", "replay", "locate", "slot", "study", "model", "spec", "frontier", "audit"]


def test_commands_stand_in_help_order_and_the_start_is_light():
    code = ("import sys, typer; from statelab.cli import app; "
            "print(list(typer.main.get_command(app).commands)); "
            "print([m for m in ('xarray', 'matplotlib', 'llama_cpp', 'pandas') if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    names, heavy = r.stdout.strip().splitlines()
    assert eval(names) == COMMANDS  # the order `statelab --help` lists them in
    assert eval(heavy) == []


def test_one_of_and_check_backend():
    assert one_of(BACKENDS) == "cpu, cuda or vulkan"
    assert one_of(["MQ"]) == "MQ" and one_of(("MQ", "PQ")) == "MQ or PQ"
    assert check_backend("cpu") == "cpu"
    with pytest.raises(ConfigError, match="unknown backend 'gpu'; choose one of cpu, cuda or vulkan"):
        check_backend("gpu")


def test_check_capture_dest(tmp_path):
    check_capture_dest(tmp_path / "new")  # free: nothing to say
    check_capture_dest(tmp_path / "new", overwrite=True)
    (tmp_path / "other").mkdir()
    with pytest.raises(ArchiveError, match="output already exists"):
        check_capture_dest(tmp_path / "other")
    with pytest.raises(ArchiveError, match="refusing to overwrite"):  # a folder that is no capture stays
        check_capture_dest(tmp_path / "other", overwrite=True)
    assert (tmp_path / "other").is_dir()


def test_explicit_sweep_schedules_need_no_model():
    s = sweep_schedules(None, None, "A,ub4,16+rest")
    assert [x.name for x in s] == ["A", "ub4", "16+rest"] and s[1].n_ubatch == 4


def test_audit_report_and_masks_are_written_whole(tmp_path):
    from statelab.audit.outputs import write_report

    ds = xr.Dataset({"x": ("i", np.arange(3))})
    paths = write_report(tmp_path / "a", "# r\n", ds)
    assert [p.name for p in paths] == ["report.md", "results.nc"]
    with xr.open_dataset(paths[1]) as back:
        assert back.x.values.tolist() == [0, 1, 2]
    assert write_report(tmp_path / "b", "# only\n") == [tmp_path / "b" / "report.md"]
    res = {"records": [{"mask": 3}], "table": {3: {"p": True}}, "passing": {3: True}, "minimal": [3]}
    (tmp_path / "m").mkdir()
    write_masks(tmp_path / "m", res, "| mask |\n")
    got = json.loads((tmp_path / "m" / "masks.json").read_text())
    assert list(got) == ["table", "passing", "minimal", "records"]  # records last
    assert (tmp_path / "m" / "masks.md").read_text() == "| mask |\n"
    assert not [p for p in tmp_path.rglob("*") if ".tmp" in p.name]


@pytest.mark.model
def test_sham_control_and_replay_report(tmp_path, model):
    from statelab import prompts
    from statelab.audit.replay import replay_layer, replay_report
    from statelab.experiments.partition import sham_control
    from statelab.lab.formation import form, parse_schedule
    from statelab.runtime import ContextConfig

    m, base = model, ContextConfig(n_threads=1)
    p = prompts.resolve("text:def add(a, b):\n    return a + b")
    c = form(m, p, parse_schedule("ub4"), base)
    ep, fd = sham_control(m, c, 4)
    assert fd is None and ep.length == 4
    toks = m.tokenize(p.text)
    with pytest.raises(ConfigError, match="unknown attention layout 'ZZ'; choose one of MQ, PQ or QB"):
        replay_layer(m, toks, 0, 2, "ZZ", base)
    rows, cap, lay = replay_layer(m, toks, 0, 2, "mq", base, threads=1)
    assert lay == "MQ" and any(r.status == "qualified" for r in rows)
    assert not any(r.status == "failed" for r in rows)
    md = replay_report("t", rows, cap, threads=1)
    assert md.startswith("# Replay: t\n") and "| MQ | = native | = native | = native |" in md
    # the command prints the same report and writes it
    r = run_cli("replay", "-p", p.text, "--q", "2", "--layer", "0", "--threads", "1", "--out", tmp_path / "r")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "r" / "report.md").read_text().split("\n", 1)[1] == md.split("\n", 1)[1]
