"""The phase-mask experiment (paper 3.5, S1.2) as a kind of the engine: which phase masks of a
drafting arm reproduce R on every prompt and repeat, and the inclusion-minimal ones (a subset
lattice).  Each request is a block in a fresh worker process (:mod:`.spec_run`'s unit), one at
a time; every finished block is appended to ``OUT/blocks.jsonl`` and skipped when the same
experiment runs again in the same folder."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from statelab.errors import ConfigError
from statelab.experiments import engine
from statelab.experiments.engine import Kind, Summary
from statelab.experiments.folder import RunFolder, normalized_hash
from statelab.experiments.log import CellLog, first_ok
from statelab.experiments.records import CAMPAIGN_BLOCK
from statelab.experiments.spec_run import BLOCK, identity_fields, qualify_records
from statelab.paths import atomic_write_text
from statelab.speculative.transaction import Arm, SpecConfig, check_mask

SPEC_FORMAT = "statelab.masks-spec/1"  # OUT/spec.json of a phase-mask folder


@dataclass
class MaskSpec:
    """One phase-mask experiment: ``draft`` is the resolved drafter text
    (:func:`.spec_run.resolve_draft`), ``prompts`` prompt specs."""
    prompts: list[str]
    draft: str | None
    masks: list[int] = field(default_factory=lambda: list(range(16)))
    repeats: int = 2
    k: int = 3
    ubatch: int = 4
    cap: int = 128
    arm: str = "C_QB"
    backend: str = "cpu"
    threads: int = 0
    model: str | None = None

    def validate(self) -> "MaskSpec":
        self.masks = [check_mask(m) for m in self.masks]
        if not self.prompts:
            raise ConfigError("the phase-mask experiment needs at least one prompt")
        Arm.parse(self.arm)
        if self.repeats < 1:
            raise ConfigError(f"--repeats must be >= 1, got {self.repeats}")
        return self


def mask_lattice(passing: dict[int, bool]):
    """Subset lattice of the 4-bit masks (networkx DiGraph, edge a -> a|bit) and the
    inclusion-minimal passing masks (no passing proper subset)."""
    import networkx as nx

    g = nx.DiGraph()
    for m in range(16):
        g.add_node(m, passes=passing.get(m))
        for bit in (1, 2, 4, 8):
            if not m & bit:
                g.add_edge(m, m | bit)
    ok = {m for m, v in passing.items() if v}
    minimal = sorted(m for m in ok if not any(a in ok for a in nx.ancestors(g, m)))
    return g, minimal


def plan(spec: MaskSpec) -> list[dict]:
    """Per prompt: one R request, then every mask's ``repeats`` requests of the arm."""
    jobs = []
    base = asdict(SpecConfig(k=spec.k, ubatch=spec.ubatch, mask=3, cap=spec.cap, backend=spec.backend,
                             threads=spec.threads))
    model = None if spec.model is None else str(spec.model)
    for p in spec.prompts:
        jobs.append({"session": 0, "block": len(jobs), "prompt": p, "arm": "R", "repeats": 1, "cfg": base,
                     "model": model, "draft": None, "mask": -1, "key": f"{p}:R"})
        for m in spec.masks:
            for rep in range(spec.repeats):
                jobs.append({"session": rep, "block": len(jobs), "prompt": p, "arm": spec.arm, "repeats": 1,
                             "cfg": {**base, "mask": int(m)}, "model": model, "draft": spec.draft, "mask": int(m),
                             "key": f"{p}:mask{m}:{rep}"})
    return jobs


def tabulate(spec: MaskSpec, records: list[dict]) -> dict:
    """The blocks' records (each with its ``mask``) -> qualification, per mask and prompt
    whether every request reproduced R, the passing masks and the inclusion-minimal ones."""
    records = qualify_records(records)
    table = {}
    for m in spec.masks:
        rs = [r for r in records if r.get("mask") == m]
        table[int(m)] = {p: bool(got) and all(got) for p in spec.prompts
                         for got in [[r["qualified"] for r in rs if r["spec"] == p]]}
    passing = {m: all(v.values()) for m, v in table.items()}
    _g, minimal = mask_lattice(passing)
    return {"table": table, "passing": passing, "minimal": minimal, "records": records}


def mask_markdown(res: dict, prompts_: list[str]) -> str:
    bits = lambda m: "".join(n if m & b else "-" for n, b in (("TP", 1), ("TC", 2), ("DP", 4), ("DC", 8)))
    lines = ["| mask | bits | " + " | ".join(prompts_) + " | all |", "|---|---|" + "---|" * (len(prompts_) + 1)]
    for m, row in sorted(res["table"].items()):
        lines.append(f"| {m} | {bits(m)} | " + " | ".join("Y" if row[p] else "n" for p in prompts_)
                     + f" | {'Y' if res['passing'][m] else 'n'} |")
    lines.append(f"\ninclusion-minimal passing masks: {res['minimal'] or 'none'}\n")
    return "\n".join(lines)


def write_masks(out, res: dict, md: str) -> None:
    """A phase-mask experiment into ``out``: ``masks.md`` and ``masks.json`` (records last)."""
    out = Path(out)
    atomic_write_text(out / "masks.md", md)
    atomic_write_text(out / "masks.json", json.dumps({k: v for k, v in res.items() if k != "records"}
                                                     | {"records": res["records"]}, indent=1, default=str))


# -- the phase-mask experiment as a kind of the engine -----------------------------


def _identity(run) -> tuple[str, dict]:
    spec = run.spec
    fields = identity_fields(spec)
    h = normalized_hash(fields)
    jobs = plan(spec)
    run.state.update(log=CellLog(run.out / "blocks.jsonl", CAMPAIGN_BLOCK, error=ConfigError), jobs=jobs)
    return h, {"format": SPEC_FORMAT, "spec_hash": h, "normalized": fields}


def _accept(run, res: dict) -> dict:
    job = run.state["jobs"][res["block"]]
    if "error" in res:
        raise ConfigError(f"block {job['block']} ({job['arm']} on {job['prompt']}): {res['error']}")
    entry = {"key": job["key"], "status": "ok", "spec_hash": run.spec_hash, "records": res["records"]}
    run.state["log"].append(entry)
    return entry


def _compile(run) -> dict | None:
    jobs = run.state["jobs"]
    done = first_ok(run.state["log"].records(), run.spec_hash)
    records = [dict(r, block=j["block"], mask=j["mask"]) for j in jobs for r in done[j["key"]]["records"]]
    res = tabulate(run.spec, records)
    md = mask_markdown(res, run.spec.prompts)
    write_masks(run.out, res, md)
    return {**res, "markdown": md, "report_path": run.out / "masks.md", "results_path": run.out / "masks.json"}


MASKS = Kind(
    "masks", "statelab.experiments.spec_run", ConfigError, load_spec=lambda spec: spec.validate(),
    folder=lambda spec, out: RunFolder(  # default: one folder per identity, as a partition run's
        Path("runs/masks") / normalized_hash(identity_fields(spec))[:12] if out is None else Path(out), SPEC_FORMAT,
        ConfigError, "phase-mask"),
    identity=_identity, plan=lambda run: (run.state["jobs"], []),
    done=lambda run: run.state["log"].done(run.spec_hash), unit=lambda run: BLOCK, accept=_accept, compile=_compile)


def run_masks(spec: MaskSpec, out=None, progress=None) -> Summary:
    """Run (or resume) a phase-mask experiment in ``out`` (default ``runs/masks/<spec hash>``) through the
    engine, one block at a time in fresh processes; ``outputs``: table, passing, minimal,
    records, markdown (also ``masks.md`` and ``masks.json``)."""
    return engine.run(MASKS, spec.validate(), out, "local", 1, progress=progress)
