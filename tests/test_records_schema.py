"""Durable logs read back against a schema: an edited cells.jsonl record (a field dropped, a
wrong type, a class changed) gives one line naming the file, the line and the field on
report and on resume, never a KeyError traceback; spec n_ctx checked at load."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from statelab.experiments.matrix import CellLog, StudyError
from statelab.experiments.records import CAMPAIGN_BLOCK, STUDY_CELL, STUDY_VALUES

OK = {"key": "p|EARLY|A->R|0", "spec_hash": "h", "status": "ok", "prompt": "p", "selector": "EARLY",
      "direction": "A->R", "repeat": 0, "donor": "A", "recipient": "R", "klass": "D", "first_diff_recipient": None,
      "first_diff_donor": 3, "selected_bytes": 10, "share": 0.5, "total_value_bytes": 20, "changed_bytes": 0,
      "max_abs": 0.0, "l2": 0.0, "l2_rel": 0.0, "first_differing_layer": None, "verified": True,
      "endpoint": {"tokens": [1, 2], "eog": False}, "endpoint_sha256": "x", "length": 2, "stop_reason": "cap",
      "eog": False, "donor_kv_sha256": "a", "recipient_kv_sha256": "b"}


def _log(tmp_path, *recs) -> CellLog:
    p = tmp_path / "cells.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return CellLog(p, STUDY_CELL, STUDY_VALUES, error=StudyError)


def test_valid_records_pass(tmp_path):
    failed = {k: OK[k] for k in ("key", "spec_hash", "prompt", "selector", "direction", "repeat")}
    log = _log(tmp_path, OK, {**failed, "status": "failed", "error": "boom"})
    assert [r["status"] for r in log.records()] == ["ok", "failed"] and log.lines == [1, 2]


@pytest.mark.parametrize("edit, needle", [
    (lambda r: r.pop("klass"), "line 2: the ok record lacks the field 'klass'"),
    (lambda r: r.update(repeat="0"), "line 2: field 'repeat' is '0', expected an integer"),
    (lambda r: r.update(selected_bytes=True), "line 2: field 'selected_bytes' is True, expected an integer"),
    (lambda r: r.update(share=None), "line 2: field 'share' is None, expected an integer or a number"),
    (lambda r: r.update(klass="E"), "line 2: field 'klass' is 'E', expected one of ['B', 'C', 'D']"),
    (lambda r: r.update(status="done"), "line 2: field 'status' is 'done'"),
    (lambda r: r.pop("status"), "line 2: the record lacks the field 'status'"),
])
def test_an_edited_record_is_named_by_file_line_and_field(tmp_path, edit, needle):
    bad = dict(OK)
    edit(bad)
    log = _log(tmp_path, OK, bad)
    with pytest.raises(StudyError) as e:
        log.records()
    msg = str(e.value)
    assert str(log.path) in msg and needle in msg and "\n" not in msg


def test_a_line_that_is_not_an_object(tmp_path):
    with pytest.raises(StudyError, match="line 1: a record must be a JSON object"):
        _log(tmp_path, [1, 2]).records()


def test_campaign_blocks_have_their_schema(tmp_path):
    from statelab.errors import ConfigError

    p = tmp_path / "blocks.jsonl"
    p.write_text(json.dumps({"key": "block-0", "status": "ok", "spec_hash": "h", "records": {}}) + "\n")
    with pytest.raises(ConfigError, match="line 1: field 'records' is {}, expected a list"):
        CellLog(p, CAMPAIGN_BLOCK, error=ConfigError).records()


# --------------------------------------------------------------------------- a real study


def _spec(tmp_path: Path, cap=8, n_ctx=None) -> Path:
    p = tmp_path / "tiny.toml"
    extra = f"n_ctx = {n_ctx}\n" if n_ctx else ""
    p.write_text(f'name = "tiny"\ncap = {cap}\nrepeats = 1\nthreads = 1\nprompts = ["HumanEval/2"]\n'
                 f'selectors = ["ALL"]\ndirections = ["A->R"]\n{extra}[arms]\nA = "A"\nR = "R"\n')
    return p


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    from statelab.experiments.matrix import run_study

    root = tmp_path_factory.mktemp("rec")
    spec = _spec(root)
    s = run_study(spec, root / "out", "local", 1)
    assert s.ran == 1 and s.failed == 0
    return spec, root / "out"


def _edited(study, tmp_path, edit) -> Path:
    import shutil

    spec, out = study
    dst = tmp_path / "out"
    shutil.copytree(out, dst)
    lines = (dst / "cells.jsonl").read_text().splitlines()
    recs = [json.loads(x) for x in lines]
    edit(recs[0])
    (dst / "cells.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return dst


def _one_line(r, *needles):
    from statelab.errors import StatelabError

    assert isinstance(r.exception, StatelabError), (r.exception, r.output)
    msg = str(r.exception)
    assert "\n" not in msg.strip()
    for n in needles:
        assert n in msg, msg


def _cli(*args):
    from typer.testing import CliRunner

    from statelab.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.mark.model
def test_report_and_resume_refuse_a_record_missing_a_field(study, tmp_path):
    out = _edited(study, tmp_path, lambda r: r.pop("changed_bytes"))
    _one_line(_cli("study", "report", out), "cells.jsonl: line 1: the ok record lacks the field 'changed_bytes'")
    _one_line(_cli("study", "run", study[0], "--out", out, "--workers", "1"),
              "cells.jsonl: line 1: the ok record lacks the field 'changed_bytes'")


@pytest.mark.model
def test_report_refuses_a_class_edited_in_valid_json(study, tmp_path):
    r = _cli("study", "report", study[1])
    assert r.exit_code == 0, r.output
    rec = json.loads((study[1] / "cells.jsonl").read_text().splitlines()[0])
    other = {"B": "C", "C": "D", "D": "C"}[rec["klass"]]
    out = _edited(study, tmp_path, lambda r: r.update(klass=other))
    _one_line(_cli("study", "report", out), "cells.jsonl: line 1: field 'klass' is", f"is class {rec['klass']!r}")
    out2 = _edited(study, tmp_path / "b", lambda r: r["endpoint"]["tokens"].append(7))
    _one_line(_cli("study", "report", out2), "line 1: field 'endpoint_sha256' does not match")


@pytest.mark.model
def test_a_study_spec_whose_prompt_and_cap_exceed_n_ctx_is_refused_before_any_work(tmp_path):
    from statelab.experiments.matrix import run_study

    spec = _spec(tmp_path, cap=200, n_ctx=256)  # HumanEval/2 has ~130 tokens
    with pytest.raises(StudyError, match=r"HumanEval/2 has \d+ tokens \+ cap 200 = \d+ positions, more than "
                                         r"n_ctx=256"):
        run_study(spec, tmp_path / "out", "local", 1)
    assert not (tmp_path / "out" / "cells.jsonl").exists()


@pytest.mark.model
def test_a_campaign_spec_whose_prompt_and_cap_exceed_n_ctx_is_refused_at_load(tmp_path):
    from statelab.errors import ConfigError
    from statelab.experiments.campaign import CampaignSpec

    p = tmp_path / "c.toml"
    p.write_text('prompts = ["HumanEval/2"]\narms = ["R", "C_QB"]\nk = 3\ncap = 200\nn_ctx = 256\n')
    with pytest.raises(ConfigError, match=r"prompt HumanEval/2 \(\d+ tokens\) \+ cap \(200\) \+ verify rows \(4\) "
                                          r"exceed n_ctx=256"):
        CampaignSpec.load(p)
    p.write_text('prompts = ["HumanEval/2"]\narms = ["R", "C_QB"]\nk = 3\ncap = 16\nn_ctx = 256\n')
    assert CampaignSpec.load(p).spec_config().n_ctx == 256


def test_findings_logs_have_their_schema(tmp_path):
    from statelab.analysis.findings import FindingsInputError
    from statelab.experiments.findings_inputs import _log

    rec = {"key": "t", "task": "p", "selector": "L0", "direction": "A->R", "spec_hash": "h", "status": "ok",
           "found": True, "layers": [0], "n_layers": 1, "n_positions": 1, "selected_bytes": 4, "share": 0.1,
           "evaluations": 3}
    p = tmp_path / "minimal.jsonl"
    p.write_text(json.dumps(rec) + "\n")
    assert [r["key"] for r in _log(p, "h")] == ["t"]
    rec.pop("n_layers")
    p.write_text(json.dumps(rec) + "\n")
    with pytest.raises(FindingsInputError, match="minimal.jsonl: line 1: the ok record lacks the field 'n_layers'"):
        _log(p, "h")


def test_the_kept_cuda_run_validates():
    """The study folder kept in docs (a real CUDA run): every cell record passes the schema and
    every ok cell's class agrees with its endpoint and its prompt's natural endpoints."""
    import gzip

    from statelab.experiments.records import check_study_cell_against_controls

    run = Path(__file__).resolve().parents[1] / "docs" / "findings" / "cuda" / "run"
    spec = json.loads((run / "spec.json").read_text())
    controls = {}
    for p in (run / "controls").glob("*.json"):
        c = json.loads(p.read_text())
        controls[c["prompt"]] = c
    from statelab.experiments.records import check_record

    n = 0
    with gzip.open(run / "cells.jsonl.gz", "rt") as f:
        for i, line in enumerate(f, 1):
            rec = check_record(json.loads(line), STUDY_CELL, "cells.jsonl", i, StudyError, STUDY_VALUES)
            if rec["status"] == "ok" and rec["spec_hash"] == spec["spec_hash"]:
                check_study_cell_against_controls(rec, controls, "cells.jsonl", i, StudyError)
                n += 1
    assert n > 20000


def test_campaign_n_ctx_is_part_of_what_blocks_measured(tmp_path):
    from statelab.experiments.campaign import CampaignSpec, campaign_hash

    spec = CampaignSpec(prompts=["HumanEval/3"], arms=["R", "M_QB"])
    assert spec.n_ctx == 1024 and spec.spec_config().n_ctx == 1024
    other = CampaignSpec(**{**spec.__dict__, "n_ctx": 2048})
    assert other.spec_config().n_ctx == 2048 and campaign_hash(other, None) != campaign_hash(spec, None)
