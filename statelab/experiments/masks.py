"""The phase-mask experiment (paper 3.5, S1.2): which phase masks of a drafting arm reproduce
R on every prompt and repeat, and the inclusion-minimal ones (a subset lattice), each request
a block in a fresh worker process (:mod:`.spec_run`)."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from statelab.experiments.spec_run import qualify_records, run_requests
from statelab.paths import atomic_write_text
from statelab.speculative.transaction import SpecConfig, check_mask


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


def phase_mask_experiment(model_path, draft, prompts_: list[str], masks=range(16), repeats: int = 2, k: int = 3,
                          ubatch: int = 4, cap: int = 128, arm: str = "C_QB", backend: str = "cpu",
                          threads: int = 0, progress=None) -> dict:
    """Which masks reproduce R on every prompt and repeat; inclusion-minimal ones."""
    for m in masks:
        check_mask(m)
    jobs = []
    base = asdict(SpecConfig(k=k, ubatch=ubatch, mask=3, cap=cap, backend=backend, threads=threads))
    for p in prompts_:
        jobs.append({"session": 0, "block": len(jobs), "prompt": p, "arm": "R", "repeats": 1, "cfg": base,
                     "model": model_path, "draft": None, "mask": -1})
        for m in masks:
            for rep in range(repeats):
                jobs.append({"session": rep, "block": len(jobs), "prompt": p, "arm": arm, "repeats": 1,
                             "cfg": {**base, "mask": int(m)}, "model": model_path, "draft": draft, "mask": int(m)})
    records = run_requests(jobs, progress)
    for r in records:
        r["mask"] = jobs[r["block"]]["mask"]  # block = the job's index
    records = qualify_records(records)
    table = {}
    for m in masks:
        rs = [r for r in records if r.get("mask") == m]
        table[int(m)] = {p: bool(got) and all(got) for p in prompts_
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
