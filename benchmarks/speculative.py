"""Speculative request-time ratios on this machine, qualified arms only, and the cost of a
verify call by its number of rows.

    .venv/bin/python benchmarks/speculative.py [SPEC] [--draft D] [--k K] [--k-max K] [--sessions N] [--ubatch U]
                                               [--rows] [--no-write] [--out DIR] [--budget S]

SPEC defaults to studies/spec-cpu.toml; studies/spec-cpu-ngram.toml and
studies/spec-cuda-ngram.toml (the H200 table, one command) use the model-free n-gram
drafter.  Runs `statelab spec campaign` (fresh worker process per block, counterbalanced
order, sessions, percentile bootstrap of session log contrasts) and writes its
qualification, drafting-cycle and ratio tables into docs/benchmarks.md (section
speculative-<backend>[-ngram]).  An arm that does not reproduce R is not timed.

--rows adds the verify-cost sweep: in one context of the spec's first drafting arm's
layout, the median time of one decode call of r rows (r = 1 .. k_max+1) with logits for
every row and the vectorised greedy choice, when every call has the same shape (the graph
is reused) and when the shape changes from call to call (rebuilt), plus the cache removal.
Goals from the issue: R/C_QB >= 1.5 with the n-gram drafter on the H200, 100% qualification.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _report import machine, update_section

from statelab.errors import script_main
from statelab.experiments.campaign import CampaignSpec, run_campaign
from statelab.runtime.layouts import Layout
from statelab.speculative.drafters import is_ngram
from statelab.speculative.transaction import Arm

GOAL = ("R", "C_QB", 1.5)
PANEL_GOALS = {"panel": 1.8, "prose": 1.5, "lowest prompt": 1.0}  # issue 25 item 6 (a spec named *panel*)


def rows_sweep(spec: CampaignSpec, rounds: int = 40) -> str:
    """Median ms of one verify call by rows: fixed shape (graph reused) against a changing shape,
    in the drafting arm's layout, and beside it the unrepaired multi-query layout MQ (same rows,
    same build): the difference is what the phase-scoped repair itself costs."""
    from statelab.runtime import prepare_backend

    cfg = spec.spec_config()
    arm = next((Arm.parse(a) for a in spec.arms if Arm.parse(a).draft), Arm.parse("C_QB"))
    layout = arm.layout if Layout(arm.layout).needs_patch else "MQ"
    prepare_backend(spec.backend)
    rmax = cfg.rows
    layouts_run = [layout] + (["MQ"] if layout != "MQ" else [])
    runs = {lay: _rows_one_layout(spec, cfg, lay, rounds) for lay in layouts_run}
    fixed, changing, rm = runs[layout]
    one = fixed[1]
    lines = [f"Verify-call cost by rows ({spec.backend}, layout {layout}, ubatch {cfg.target_ubatch}, "
             f"{rounds} calls per shape after two warm-up calls; decode + logits for every row + vectorised "
             f"greedy choice; median ms):\n",
             "| rows | same shape every call (ms) | x one row | shape changes every call (ms) | x one row |"
             + ("" if layout == "MQ" else " MQ same shape (ms) | MQ x one row | repair share |"),
             "|---|---|---|---|---|" + ("" if layout == "MQ" else "---|---|---|")]
    for r in range(1, rmax + 1):
        ch = statistics.median(changing.get(r, [float("nan")]))
        row = f"| {r} | {1e3 * fixed[r]:.3f} | {fixed[r] / one:.2f} | {1e3 * ch:.3f} | {ch / one:.2f} |"
        if layout != "MQ":
            mq = runs["MQ"][0]
            row += f" {1e3 * mq[r]:.3f} | {mq[r] / mq[1]:.2f} | {1 - mq[r] / fixed[r]:.1%} |"
        lines.append(row)
    lines.append(f"\nCache removal after a call (llama_memory_seq_rm): median {1e6 * statistics.median(rm):.1f} us.")
    if layout != "MQ":
        lines.append("MQ: the same calls in the unrepaired layout (not reference-preserving; shown only to split "
                     "the verify cost into the multi-row decode itself and the repair's share = 1 - MQ / "
                     f"{layout}).")
    return "\n".join(lines) + "\n"


def _rows_one_layout(spec: CampaignSpec, cfg, layout: str, rounds: int):
    from statelab import prompts
    from statelab.runtime import Context, ContextConfig, Model, layouts

    model = Model(spec.model, backend=spec.backend)
    rmax = cfg.rows
    ctx = Context(model, ContextConfig(backend=spec.backend, n_ctx=cfg.n_ctx, n_batch=512,
                                       n_ubatch=cfg.target_ubatch, n_threads=cfg.threads))
    try:
        if layout != "MQ":
            layouts.set_max_queries(ctx, cfg.queries)
            layouts.set_layout(ctx, layout)
        toks = model.tokenize(prompts.resolve(spec.prompts[0]).text)
        n0 = len(toks)
        ctx.decode(toks, 0)
        rng = np.random.default_rng(0)
        pad = np.resize(toks, rmax)

        def call(r: int) -> tuple[float, float]:
            t0 = time.perf_counter()
            ctx.decode(pad[:r], n0, logits="all")
            ctx.argmax_rows(r)
            t1 = time.perf_counter()
            ctx.seq_rm(0, n0, -1)
            return t1 - t0, time.perf_counter() - t1

        fixed, rm = {}, []
        for r in range(1, rmax + 1):
            call(r)
            call(r)  # warm: the graph of this shape is built and reused from here on
            ts = [call(r) for _ in range(rounds)]
            fixed[r] = statistics.median(t for t, _ in ts)
            rm += [x for _, x in ts]
        # a random walk that never repeats the previous shape: each step adds 1..rmax-1 modulo rmax
        steps = rng.integers(1, max(rmax, 2), size=rounds * 2)
        shapes = (np.cumsum(steps) + int(rng.integers(rmax))) % rmax + 1
        changing: dict[int, list] = {}
        for r in shapes:  # the previous call had another shape: the graph is rebuilt
            changing.setdefault(int(r), []).append(call(int(r))[0])
    finally:
        ctx.close()
        model.close()
    return fixed, changing, rm


def panel_figures(spec: CampaignSpec, res: dict, goal: dict) -> str:
    """The panel's figures against issue 25's goals: the whole panel, each half, the lowest prompt."""
    ratio = f"{GOAL[0]}/{GOAL[1]}"
    parts = [p for p in res.get("breakdown", []) if p["ratio"] == ratio and p["estimate"] is not None]
    qual = all(r["qualified"] for r in res["records"])
    label = f"{ratio} (ngram, {spec.backend}, panel"
    rows = [(f"{label})", goal["estimate"], goal["lower"], goal["upper"], PANEL_GOALS["panel"])]
    for p in parts:
        if p["scope"] == "group":
            rows.append((f"{label}, {p['name']} half)", p["estimate"], p["lower"], p["upper"],
                         PANEL_GOALS.get(p["name"])))
    per = [p for p in parts if p["scope"] == "prompt"]
    if per:
        low = min(per, key=lambda p: p["estimate"])
        rows.append((f"{label}, lowest prompt {low['name']})", low["estimate"], low["lower"], low["upper"],
                     PANEL_GOALS["lowest prompt"]))
    out = ["| figure | estimate | interval | goal |", "|---|---|---|---|"]
    for name, est, lo, hi, want in rows:
        met = "" if want is None else f">= {want} with 100% qualification: {'met' if qual and est >= want else 'not met'}"
        out.append(f"| {name} | {est:.3f} | [{lo:.3f}, {hi:.3f}] | {met} |")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("spec", nargs="?", default="studies/spec-cpu.toml")
    ap.add_argument("--draft")
    ap.add_argument("--k", type=int)
    ap.add_argument("--k-max", type=int)
    ap.add_argument("--sessions", type=int)
    ap.add_argument("--ubatch", type=int, help="target ubatch (default: the spec's; 0 follows k)")
    ap.add_argument("--rows", action="store_true", help="add the verify-cost sweep by rows")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--out", help="keep the campaign's files here (default: a temporary folder); the same --out "
                                  "resumes an unfinished campaign")
    ap.add_argument("--budget", type=float, help="start no new block after this many seconds; exit 3 if "
                                                "unfinished (run again with the same --out to continue)")
    a = ap.parse_args()
    spec_path = Path(a.spec)
    over = {"draft": a.draft, "k": a.k, "k_max": a.k_max, "sessions": a.sessions, "ubatch": a.ubatch}
    spec = CampaignSpec.load(spec_path, **over)
    opts = "".join(f" --{n.replace('_', '-')} {v}" for n, v in over.items() if v is not None)
    opts += " --rows" if a.rows else ""
    if a.budget is not None and not a.out:
        raise SystemExit("--budget needs --out: an unfinished campaign resumes from its folder")
    with tempfile.TemporaryDirectory() as tmp:
        res = run_campaign(spec, Path(a.out or tmp), budget_s=a.budget)
    if not res.complete:
        print(f"incomplete: {res.skipped + res.ran} of {res.planned} blocks in {a.out}; run the same command again")
        raise SystemExit(3)
    res = res.outputs  # the compiled campaign: records, contrasts, breakdown, report
    ngram = is_ngram(spec.draft)
    body = f"Command: `.venv/bin/python benchmarks/speculative.py {spec_path}{opts}`  \n{machine()}.\n\n"
    goal = next((r for r in res["contrasts"] if r["ratio"] == f"{GOAL[0]}/{GOAL[1]}"), None)
    if ngram and goal is not None:
        arms_q = all(r["qualified"] for r in res["records"])
        est = (f"{goal['estimate']:.3f} | [{goal['lower']:.3f}, {goal['upper']:.3f}]" if goal["qualified"]
               else f"— | {goal['note']}")
        met = goal["qualified"] and goal["estimate"] >= GOAL[2] and arms_q
        body += ("| figure | estimate | interval | goal |\n|---|---|---|---|\n"
                 f"| R/C_QB (ngram, {spec.backend}) | {est} | >= {GOAL[2]} with 100% qualification: "
                 f"{'met' if met else 'not met'} |\n\n")
    panel = "panel" in spec_path.stem
    if panel and goal is not None and goal["qualified"]:
        body += panel_figures(spec, res, goal) + "\n"
    body += res["report"].split("\n", 1)[1].replace("## ", "#### ")
    if a.rows:
        body += "\n#### Verify cost by rows\n\n" + rows_sweep(spec)
    print(body)
    if not a.no_write:
        key = f"speculative-{spec.backend}" + ("-ngram" if ngram else "")
        title = f"Speculative arms ({spec.backend}{', n-gram drafter' if ngram else ''})"
        if panel:  # its own section: the earlier figures stay beside it
            key, title = "speculative-" + spec_path.stem.removeprefix("spec-"), f"Speculative panel ({spec_path.name})"
        update_section(key, title, body)


if __name__ == "__main__":
    sys.exit(script_main(main))
