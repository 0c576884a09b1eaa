"""The partition study / sweep and the phase-mask experiment as kinds of the engine
(``experiments.partition.PARTITION``, ``experiments.masks.MASKS``): a run interrupted after
its first unit resumes with what the durable log holds and runs only the rest, and the
records a unit's fresh process returns are the ones the same functions give in this process
(real model, few tokens)."""
from __future__ import annotations

import json

import pytest

from statelab.errors import ConfigError
from statelab.experiments import engine

pytestmark = pytest.mark.model


class StopAfter(engine.Progress):
    """Ctrl-C after ``n`` records were made durable (what an interrupted run leaves)."""

    def __init__(self, n: int):
        self.n, self.seen = n, []

    def advance(self, record):
        self.seen.append(record["key"])
        if len(self.seen) >= self.n:
            raise KeyboardInterrupt


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_sweep_resumes_and_gives_the_in_process_records(tmp_path, model, base_config):
    from statelab import prompts
    from statelab.experiments.partition import PartitionSpec, run_partition, sweep, sweep_schedules

    spec = PartitionSpec(["HumanEval/2", "HumanEval/3"], "sweep", schedules="A,ub4,R", cap=2, threads=1)
    out = tmp_path / "sweep"
    with pytest.raises(KeyboardInterrupt):
        run_partition(spec, out, progress=StopAfter(1))
    assert [r["key"].split("@")[0] for r in _lines(out / "units.jsonl")] == ["HumanEval/2"]
    assert not (out / "report.md").exists()  # nothing compiled from half a run

    res = run_partition(spec, out)
    assert (res.kind, res.resumed, res.skipped, res.ran, res.complete) == ("partition", True, 1, 1, True)
    assert len(_lines(out / "units.jsonl")) == 2
    p = prompts.resolve("HumanEval/3")  # the prompt the resumed run ran
    here = sweep(model, p, sweep_schedules(model, p, spec.schedules), base_config, spec.cap)
    assert json.dumps(res.outputs["records"][1]) == json.dumps(here)  # the same record (hashes included), in order
    assert [sorted(c) for c in here["state_classes"]] == [["A", "ub4"], ["R"]]  # ubatch 1 forms another state
    assert res.outputs["markdown"] == (out / "report.md").read_text()
    assert json.loads((out / "sweep.json").read_text()) == res.outputs["records"]

    again = run_partition(spec, out)  # everything held: nothing runs, the same report
    assert (again.skipped, again.ran) == (2, 0) and again.outputs["markdown"] == res.outputs["markdown"]
    with pytest.raises(ConfigError, match="different spec"):
        run_partition(PartitionSpec(["HumanEval/2"], "sweep", schedules="A,R", cap=4, threads=1), out)


def test_partition_study_unit_equals_the_in_process_study(tmp_path, model, base_config):
    from statelab import prompts
    from statelab.experiments.partition import (PartitionSpec, markdown_table, partition_dataset, prompt_record,
                                                run_partition, study_prompt)
    from statelab.lab.formation import PRESETS

    spec = PartitionSpec(["HumanEval/2"], "study", {"A": "A", "R": "R"}, cap=6, threads=1)
    res = run_partition(spec, tmp_path / "study")
    here = prompt_record(study_prompt(model, prompts.resolve("HumanEval/2"), {"A": PRESETS["A"], "R": PRESETS["R"]},
                                      base_config, 6, trace=True))
    assert json.dumps(res.outputs["records"][0]) == json.dumps(here)  # keys in order: the report's columns
    assert res.outputs["rows"] == here["rows"] and res.outputs["markdown"] == markdown_table(here["rows"])
    assert res.outputs["rows"][0]["shams_ok"] is True and res.outputs["rows"][0]["pair"] == "A/R"
    assert res.outputs["dataset"].identical(partition_dataset([here], "cpu", 6))
    assert int(res.outputs["dataset"].sizes["layer"]) == model.info.n_layer


def test_masks_resume_and_report_what_an_uninterrupted_run_reports(tmp_path):
    from statelab.experiments.masks import MaskSpec, run_masks

    def spec():
        return MaskSpec(["HumanEval/2"], "self", [0, 3], repeats=1, cap=6, threads=1)

    whole = run_masks(spec(), tmp_path / "whole")
    out = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        run_masks(spec(), out, progress=StopAfter(2))
    assert [r["key"] for r in _lines(out / "blocks.jsonl")] == ["HumanEval/2:R", "HumanEval/2:mask0:0"]
    res = run_masks(spec(), out)
    assert (res.kind, res.resumed, res.skipped, res.ran) == ("masks", True, 2, 1)
    assert res.outputs["markdown"] == whole.outputs["markdown"] == (out / "masks.md").read_text()
    assert res.outputs["passing"][3] is True  # target prefill and continuation under QB reproduce R on CPU
    strip = lambda rs: [(r["arm"], r["mask"], r["tokens"], r["qualified"]) for r in rs]  # noqa: E731
    assert strip(res.outputs["records"]) == strip(whole.outputs["records"])
    assert json.loads((out / "masks.json").read_text())["minimal"] == res.outputs["minimal"]
    with pytest.raises(ConfigError, match="different spec"):
        run_masks(MaskSpec(["HumanEval/2"], "self", [3], repeats=1, cap=6, threads=1), out)


def test_the_installed_build_is_part_of_a_partition_runs_identity(monkeypatch):
    """A sweep's default folder resumes only on the same native build: its identity holds the
    installed build's key, read without importing llama_cpp."""
    import subprocess
    import sys

    from statelab.runtime.native import installed_build_key

    key = installed_build_key()
    assert key != "unknown" and len(key) >= 12
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", "/elsewhere")
    assert installed_build_key() == key + "@/elsewhere"
    code = "import sys; from statelab.runtime.native import installed_build_key as k; k(); print('llama_cpp' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "False"


def test_an_empty_schedule_list_is_the_default_sweep():
    """`sweep --schedules ""` is the default sweep (it reached the schedule maker without a model)."""
    from statelab.experiments.partition import PartitionSpec

    for text in ("", "  "):
        assert PartitionSpec(["HumanEval/2"], "sweep", schedules=text).validate().schedules is None
    assert PartitionSpec(["HumanEval/2"], "sweep", schedules="A,R").validate().schedules == "A,R"
