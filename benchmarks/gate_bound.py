"""The most any proposal gate could give with a campaign's drafter, from that campaign's records:
R's outputs replayed through the drafter (its session cache in the order the session ran its
requests), and the cheapest schedule of plain and drafting cycles over them, chosen knowing
which proposals the target accepts (a dynamic programme over positions and verify shapes).
No device: the prices are the run's own measured means, and the replay of "no gate" with the
same prices is printed beside the measured no-gate run as the check of that pricing; the run's
own gate, replayed through benchmarks/gate_offline.py's loop at the same prices, is printed
beside its measurement (a schedule the bound ranges over, so never above it).

    .venv/bin/python benchmarks/gate_bound.py RUN [--nogate RUN] [--plain-x X | --plain-ms MS] [--draft-ms MS]
        [--change-ms MS] [--prompts]

RUN: a campaign folder with spec.toml and blocks.jsonl.gz (e.g. docs/cuda/gates/2026-12-07-h100/shadow).
Prices, per cycle (defaults from the records: ``--nogate`` RUN's mean drafting cycle, RUN's R
step as the plain cycle times ``--plain-x``, the calibration's shape-change surcharge):
a plain cycle (one-row decode), a drafting cycle (the fixed k_max + 1 rows), and the extra
cost of a call whose shape differs from the previous call's.  Each prompt's C time is the
records' time outside the cycles (prefill, set-up) plus the priced cycles; R's is measured.
Ratios are geometric means over sessions and prompts, as the campaign's estimator.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from statelab import prompts
from statelab.errors import ConfigError, script_main
from statelab.experiments.campaign import CampaignSpec, prompt_tags
from statelab.runtime import Model
from statelab.speculative.drafters import GATES, NgramDrafter, check_gate, resolve
from statelab.speculative.transaction import AdaptiveK

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gate_offline import CostTable, accepted, replay  # noqa: E402  (the simulator's loop: the code's gate, cycle by cycle)


def load_run(folder: str) -> tuple[CampaignSpec, list[dict], list[dict]]:
    """(spec, records, calibrations) of a campaign folder."""
    d = Path(folder)
    if not (d / "spec.toml").is_file() or not (d / "blocks.jsonl.gz").is_file():
        raise ConfigError(f"{folder}: not a campaign folder (needs spec.toml and blocks.jsonl.gz)")
    spec = CampaignSpec.load(str(d / "spec.toml"), backend="cpu")
    recs, cal = [], []
    with gzip.open(d / "blocks.jsonl.gz", "rt") as f:
        for line in f:
            b = json.loads(line)
            recs += b["records"]
            if "costs" in b:
                cal.append(b["costs"])
    if not recs:
        raise ConfigError(f"{folder}: no records")
    return spec, recs, cal


def accepted_runs(prompt: np.ndarray, out: np.ndarray, drafter: NgramDrafter, k: int, cap: int) -> np.ndarray:
    """a[n]: how many of the drafter's tokens (k of them, or what the cap leaves) the target
    accepts when n tokens are committed (out[0] is the prefill's)."""
    hist = np.concatenate([prompt, out]).astype(np.int32)
    n0, a = len(prompt), np.zeros(len(out), dtype=np.int64)
    drafter.start(prompt)
    for n in range(1, len(out)):
        props = drafter.propose(hist[:n0 + n], min(k, cap - n))
        a[n] = accepted(props, out[n:n + len(props)])
    return a


def nogate(a: np.ndarray, draft: float, change: float) -> tuple[float, int]:
    """(seconds, cycles) when every cycle drafts (one shape: the first call after the prefill changes it)."""
    n, t, c = 1, change, 0
    while n < len(a):
        t, c, n = t + draft, c + 1, n + a[n] + 1
    return t, c


def best(a: np.ndarray, plain: float, draft: float, change: float) -> tuple[float, int, int]:
    """(seconds, cycles, drafting cycles) of the cheapest schedule: at each position a plain
    cycle (one token) or a drafting cycle (1 + a[n] tokens), a call of another shape than the
    last costing ``change`` more (shape 0 plain, 1 drafting, 2 the prefill's: both change it)."""
    N = len(a)
    cost = np.zeros((N + 1, 3))  # cost[n, s]: the rest from n committed with the last call of shape s
    pick = np.zeros((N + 1, 3), dtype=np.int8)
    for n in range(N - 1, 0, -1):
        nxt = min(n + 1 + a[n], N)
        for s in (0, 1, 2):
            p = plain + change * (s != 0) + cost[n + 1, 0]
            d = draft + change * (s != 1) + cost[nxt, 1]
            cost[n, s], pick[n, s] = (p, 0) if p <= d else (d, 1)
    n, s, cycles, drafts = 1, 2, 0, 0
    while n < N:
        d = int(pick[n, s])
        cycles, drafts = cycles + 1, drafts + d
        n, s = (n + 1, 0) if d == 0 else (min(n + 1 + a[n], N), 1)
    return float(cost[1, 2]), cycles, drafts


def run_table(plain: float, draft: float, change: float, rows: int) -> CostTable:
    """The run's prices as the simulator's cost table: one row a plain cycle, ``rows`` rows a drafting
    cycle (rows between interpolated; unused with a fixed verify shape), host work inside them."""
    same = np.interp(np.arange(1, rows + 1), [1, rows], [plain, draft])
    return CostTable(same, same + change, 0.0, 0.0)


def geo(x) -> float:
    return float(np.exp(np.mean(np.log(np.asarray(x, dtype=float)))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run", help="campaign folder (spec.toml, blocks.jsonl.gz) whose R outputs and prefill times are used")
    ap.add_argument("--nogate", default=None, help="the same panel's no-gate campaign folder: its drafting cycle price and the check")
    ap.add_argument("--plain-x", type=float, default=1.067, help="a plain cycle's cost as a multiple of RUN's R step "
                    "(default 1.067: benchmarks/plain_cycle.py on the H100 at c296a4a, the plain runs against "
                    "R's step: docs/cuda/gates/2026-12-07-h100-c296a4a/plain_cycle.txt)")
    ap.add_argument("--plain-ms", type=float, default=None, help="a plain cycle, ms (overrides --plain-x)")
    ap.add_argument("--draft-ms", type=float, default=None, help="a drafting cycle, ms (default: the no-gate run's mean)")
    ap.add_argument("--change-ms", type=float, default=None, help="a shape change's extra cost, ms (default: the calibration's)")
    ap.add_argument("--prompts", action="store_true", help="each prompt's figures too")
    a = ap.parse_args()
    spec, recs, cal = load_run(a.run)
    ng = load_run(a.nogate) if a.nogate else None
    drafter = resolve(spec.draft)
    if not isinstance(drafter, NgramDrafter):
        raise ConfigError(f"the bound replays the n-gram drafter; the spec's drafter is {spec.draft!r}")
    cfg = spec.spec_config()
    k = cfg.k_max if cfg.fixed_rows else cfg.k

    def per_cycle(rs, arm, count):  # mean seconds of one cycle (R: one step per committed token)
        c = [r for r in rs if r["arm"] == arm]
        return sum(r["t_cycle"] for r in c) / max(sum(r[count] for r in c), 1)

    r_step = per_cycle(recs, "R", "committed")
    if a.draft_ms is None and ng is None:
        raise ConfigError("give --nogate RUN (the no-gate campaign of the same panel) or --draft-ms")
    draft = a.draft_ms * 1e-3 if a.draft_ms is not None else per_cycle(ng[1], "C_QB", "cycles")
    plain = a.plain_ms * 1e-3 if a.plain_ms is not None else a.plain_x * r_step
    if a.change_ms is not None:
        change = a.change_ms * 1e-3
    elif cal:
        change = float(np.mean([np.mean(np.subtract(c["change"], c["same"])) for c in cal]))
    else:
        raise ConfigError(f"{a.run}: no calibration record; give --change-ms")

    model = Model(spec.model)
    toks = {}
    for text, key in spec.prompt_table():
        toks[key] = np.asarray(model.tokenize(prompts.resolve(text, spec.model).text), dtype=np.int32)
    tags = prompt_tags(spec)
    sessions = defaultdict(list)  # session -> its C_QB records in the order it ran them (the session cache's order)
    for r in sorted((r for r in recs if r["arm"] == "C_QB"), key=lambda r: r["request"]):
        sessions[r["session"]].append(r)
    r_rec = {(r["session"], r["key"]): r for r in recs if r["arm"] == "R"}
    ng_rec = {(r["session"], r["key"]): r for r in ng[1] if r["arm"] == "C_QB"} if ng else {}
    gate_name = check_gate(spec.gate)
    table = run_table(plain, draft, change, cfg.rows)
    rows = defaultdict(lambda: defaultdict(list))  # key -> figure -> per session
    for s, cs in sorted(sessions.items()):
        drafter.forget()
        for c in cs:
            key = c["key"]
            if key not in toks or (s, key) not in r_rec:
                raise ConfigError(f"{a.run}: C_QB record of {key} (session {s}) has no prompt in the spec or no R record")
            r = r_rec[(s, key)]
            out = np.asarray(r["tokens"], dtype=np.int32)
            acc = accepted_runs(toks[key], out, drafter, k, cfg.cap)
            if gate_name:  # the run's own gate through the simulator's loop, at the same prices
                g = GATES[gate_name](table.verify_costs())
                sim = replay(toks[key], out, drafter, AdaptiveK(cfg.k, cfg.k_max), g, table,
                             cfg.rows if cfg.fixed_rows else None, cfg.cap)
            drafter.remember(out)
            outside = c["seconds"] - c["t_cycle"]
            t_best, cyc, drafts = best(acc, plain, draft, change)
            t_off, _ = nogate(acc, draft, change)
            f = rows[key]
            f["measured"].append(r["seconds"] / c["seconds"])
            if gate_name:
                f[f"{gate_name} gate, replayed"].append(r["seconds"] / (outside + sim.seconds))
            f["bound"].append(r["seconds"] / (outside + t_best))
            f["nogate, priced"].append(r["seconds"] / (outside + t_off))
            # the continuation alone (R's prefill runs one token per call, C_QB's batched under QB)
            f["measured, continuation only"].append(r["t_cycle"] / c["t_cycle"])
            f["bound, continuation only"].append(r["t_cycle"] / t_best)
            f["plain only"].append(r["seconds"] / (outside + change + plain * (len(out) - 1)))
            if (s, key) in ng_rec:
                f["nogate, measured"].append(r["seconds"] / ng_rec[(s, key)]["seconds"])
            f["tokens/call (bound)"].append((len(out) - 1) / cyc)
            f["drafting share (bound)"].append(drafts / cyc)
            f["R's prefill (share of its request)"].append(1.0 - r["t_cycle"] / r["seconds"])
            f["first token accepted (share of positions)"].append(float(np.sum(acc[1:] > 0)) / max(len(acc) - 1, 1))

    stats = {"tokens/call (bound)", "drafting share (bound)", "R's prefill (share of its request)",
             "first token accepted (share of positions)"}  # per-prompt figures that are not R/C_QB ratios
    figs = [f for f in next(iter(rows.values())) if f not in stats]
    keys = list(rows)
    print(f"{a.run}: {len(keys)} prompts, {len(sessions)} sessions, {spec.draft}, k {k}, cap {cfg.cap}; prices per cycle: "
          f"plain {1e3 * plain:.3f} ms ({plain / r_step:.3f}x R's step of {1e3 * r_step:.3f}), drafting {1e3 * draft:.3f} ms, "
          f"shape change +{1e3 * change:.3f} ms; replayed, not measured (except the columns so named)\n")
    groups = sorted({tags[k_] for k_ in keys})
    print(f"| R/C_QB | panel | {' | '.join(groups)} | lowest prompt | below 1.0 |")
    print("|---" * (4 + len(groups)) + "|")
    for f in figs:
        per = np.array([geo(rows[k_][f]) for k_ in keys])
        g = [geo(per[[tags[k_] == t for k_ in keys]]) for t in groups]
        low = int(np.argmin(per))
        print(f"| {f} | {geo(per):.3f} | {' | '.join(f'{x:.3f}' for x in g)} | {per[low]:.3f} ({keys[low]}) | "
              f"{int((per < 1).sum())} of {len(keys)} |")
    tpc = np.mean([np.mean(rows[k_]["tokens/call (bound)"]) for k_ in keys])
    share = np.mean([np.mean(rows[k_]["drafting share (bound)"]) for k_ in keys])
    hit = np.mean([np.mean(rows[k_]["first token accepted (share of positions)"]) for k_ in keys])
    pre = np.mean([np.mean(rows[k_]["R's prefill (share of its request)"]) for k_ in keys])
    print(f"\nbound: {tpc:.2f} tokens per call, {share:.2f} of its cycles drafting; positions whose proposal has its "
          f"first token accepted: {hit:.3f}; R's prefill (one token per call): {pre:.3f} of its request time")
    if a.prompts:
        cols = list(next(iter(rows.values())))
        print(f"\n| prompt | {' | '.join(cols)} |\n|---{'|---' * len(cols)}|")
        for k_ in keys:
            print(f"| {k_} | {' | '.join(f'{np.mean(rows[k_][c]):.3f}' for c in cols)} |")


if __name__ == "__main__":
    sys.exit(script_main(main))
