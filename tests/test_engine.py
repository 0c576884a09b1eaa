"""The one engine (statelab.experiments.engine) on a toy kind whose unit is ``builtins:dict``
(a fresh process returns its task as the result): folder claim and lock, spec hash check,
the durable log, resume, the one summary and the one progress protocol; and the table of
kinds the fork server preloads from."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from statelab.errors import ConfigError
from statelab.experiments import engine
from statelab.experiments.executors import Unit
from statelab.experiments.folder import RunFolder, normalized_hash
from statelab.experiments.log import CellLog
from statelab.paths import exclusive_lock


class ToyError(ConfigError):
    pass


def _toy(n_tasks: int, withheld: int = 0) -> engine.Kind:
    def identity(run):
        norm = {"toy": run.spec["name"], "n": n_tasks}
        return normalized_hash(norm), {"format": "toy/1", "spec_hash": normalized_hash(norm), "normalized": norm}

    def prepare(run):
        run.state["log"] = CellLog(run.out / "units.jsonl", error=ToyError)

    def plan(run):
        tasks = [{"key": f"u{i}", "status": "ok", "spec_hash": run.spec_hash, "value": i} for i in range(n_tasks)]
        return tasks, [{"key": f"w{i}"} for i in range(withheld)]

    def accept(run, rec):
        run.state["log"].append(rec)
        return rec

    def compile_(run):
        recs = run.state["log"].records()
        return {"total": sum(r["value"] for r in recs), "report_path": run.out / "units.jsonl"}

    return engine.Kind("toy", "builtins", ToyError, load_spec=lambda p: {"name": str(p)},
                       folder=lambda spec, out: RunFolder(out, "toy/1", ToyError, "toy"), identity=identity,
                       prepare=prepare, plan=plan, done=lambda run: run.state["log"].done(run.spec_hash),
                       unit=lambda run: Unit("builtins:dict", lambda task, error: {**task, "status": "failed"}),
                       accept=accept, compile=compile_)


class Recorder(engine.Progress):
    def __init__(self):
        self.calls = []

    def start(self, total, done, withheld):
        self.calls.append(("start", total, done, withheld))

    def advance(self, record):
        self.calls.append(("advance", record["key"]))

    def finish(self):
        self.calls.append(("finish",))


def test_run_claims_logs_resumes_and_summarises(tmp_path):
    out = tmp_path / "run"
    prog = Recorder()
    s = engine.run(_toy(3, withheld=1), {"name": "a"}, out, progress=prog, page=lambda o, s: o / "page.html")
    assert (s.kind, s.resumed, s.planned, s.withheld, s.skipped, s.ran, s.failed, s.complete) == \
        ("toy", False, 4, 1, 0, 3, 0, True)
    assert s.outputs["total"] == 0 + 1 + 2 and s.report == out / "units.jsonl" and s.page == out / "page.html"
    assert s.counts == {"ok": 3}
    assert prog.calls[0] == ("start", 4, 0, 1) and prog.calls[-1] == ("finish",)
    assert sorted(c[1] for c in prog.calls if c[0] == "advance") == ["u0", "u1", "u2"]
    assert RunFolder(out, "toy/1", ToyError, "toy").read_spec()["spec_hash"] == s.spec_hash
    assert len(CellLog(out / "units.jsonl").records()) == 3

    again = engine.run(_toy(3), {"name": "a"}, out)  # everything held by the durable log
    assert (again.resumed, again.skipped, again.ran, again.outputs["total"]) == (True, 3, 0, 3)
    assert len(CellLog(out / "units.jsonl").records()) == 3


def test_another_spec_and_a_second_writer_are_refused(tmp_path):
    out = tmp_path / "run"
    engine.run(_toy(1), {"name": "a"}, out)
    with pytest.raises(ToyError, match="holds a toy run of a different spec"):
        engine.run(_toy(2), {"name": "a"}, out)
    with exclusive_lock(out / ".lock", ToyError, "test holder"):
        with pytest.raises(ToyError, match="in use by another statelab process"):
            engine.run(_toy(1), {"name": "a"}, out)
    with pytest.raises(ToyError, match="unknown executor"):
        engine.run(_toy(1), {"name": "a"}, tmp_path / "other", executor="threads")
    assert not (tmp_path / "other").exists()  # refused before the folder was made


def test_every_kind_is_registered_with_its_unit_module():
    from statelab.experiments import kinds

    assert sorted(kinds.KINDS) == ["campaign", "findings", "frontier", "masks", "matrix", "partition"]
    run = SimpleNamespace(spec=SimpleNamespace(threads=0))
    for k in kinds.KINDS.values():
        assert k.unit(run).fn.partition(":")[0] == k.unit_module, k.name
    assert kinds.unit_modules() == list(dict.fromkeys(k.unit_module for k in kinds.KINDS.values()))


@pytest.mark.model
def test_a_campaign_folder_from_before_spec_json_resumes_and_gets_one(tmp_path):
    """A campaign folder holding only blocks (written before campaign folders had a spec.json)
    resumes under the engine's folder check and gets its spec.json, of the blocks' hash."""
    import json

    from statelab.experiments.campaign import CampaignSpec, run_campaign

    spec = CampaignSpec(prompts=["HumanEval/3"], arms=["R", "C_QB"], sessions=1, repeats=1, cap=6, threads=1,
                        draft="ngram", ratios=[])
    spec.validate()
    first = run_campaign(spec, tmp_path, budget_s=1e-9)  # one block, then the budget is spent
    (tmp_path / "spec.json").unlink()
    res = run_campaign(spec, tmp_path)
    assert res.complete and (res.skipped, res.ran) == (1, 1)
    assert json.loads((tmp_path / "spec.json").read_text())["spec_hash"] == first.spec_hash == res.spec_hash
    assert {json.loads(ln)["spec_hash"] for ln in (tmp_path / "blocks.jsonl").read_text().splitlines()} == {res.spec_hash}
