"""The drafting loop of C_QB simulated offline with a cost table: what the proposal gate
decides, cycle by cycle, and what each request would cost on the device whose verify costs
the table holds (no device: a simulation, not a measurement).

    .venv/bin/python benchmarks/gate_offline.py [SPEC] [--costs benchmarks/costs/h200-smollm2.toml]
        [--host MS] [--r-host MS] [--refs FILE] [--prompts]

The reference outputs come from the M_QB arm on CPU, which reproduces R there (as in
benchmarks/ngram_offline.py); ``--refs FILE`` keeps them (JSON, keyed by prompt, model and
cap) so a second run needs no decode.  Each request then replays the transaction's loop
(statelab/speculative/transaction.py, ``_speculate``) with the project's own NgramDrafter
(the spec's drafter; a session drafter remembers the outputs of the prompts before it, in
the spec's order, as a campaign session does), AdaptiveK and Gate: the proposal, the gate's
choice, the fixed-rows padding, acceptance against the reference, k's update and the
gate's update.  Pricing: a call of r rows costs ``same[r-1]`` after a call of r rows and
``change[r-1]`` after any other (the first call follows the prefill: a change), plus
``host`` per cycle; R costs ``same[0] + r_host`` per token.  R/C per prompt, the geometric
mean over each group's prompts (code, prose) and over all (the campaign's estimator with
one session).  Arms: each gate of GATES (statelab/speculative/drafters.py), and no gate (every proposal).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from statelab import prompts
from statelab.errors import ConfigError, script_main
from statelab.experiments.campaign import CampaignSpec, prompt_tags
from statelab.runtime import Model
from statelab.speculative.drafters import GATES, NgramDrafter, VerifyCosts, make_gate, resolve
from statelab.speculative.transaction import AdaptiveK, Runner, cycle_proposal, proposal_length, verify_plan


@dataclass(frozen=True)
class CostTable:
    """Seconds: a verify call by rows and shape history, host work per C cycle and per R step."""
    same: np.ndarray
    change: np.ndarray
    host: float
    r_host: float

    @classmethod
    def load(cls, path: str, host_ms: float | None = None, r_host_ms: float | None = None) -> CostTable:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cost table {path}: {e}") from None
        try:
            same = np.asarray(raw["same"], dtype=float) * 1e-3
            change = np.asarray(raw["change"], dtype=float) * 1e-3
            host = float(raw.get("host", 0.0) if host_ms is None else host_ms) * 1e-3
            r_host = host if r_host_ms is None and "r_host" not in raw else \
                float(raw["r_host"] if r_host_ms is None else r_host_ms) * 1e-3
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"cost table {path}: needs same and change (ms by rows 1..R), host ms: {e}") from None
        if same.ndim != 1 or same.shape != change.shape or min(same.min(), change.min()) <= 0 or min(host, r_host) < 0:
            raise ConfigError(f"cost table {path}: same and change need one positive ms per row count, host >= 0")
        return cls(same, change, host, r_host)

    def verify_costs(self) -> VerifyCosts:
        """What the gate's calibration would have measured on that device."""
        return VerifyCosts(tuple(self.same.tolist()), tuple(self.change.tolist()))

    def call(self, rows: int, prev_rows: int) -> float:
        return float(self.same[rows - 1] if rows == prev_rows else self.change[rows - 1])


@dataclass
class Cycles:
    calls: int = 0
    rows: int = 0
    changes: int = 0
    proposed: int = 0
    accepted: int = 0
    declined: int = 0
    seconds: float = 0.0


def accepted(props: np.ndarray, want: np.ndarray) -> int:
    """How many of ``props`` agree with ``want`` (the target's choices) before the first
    disagreement; a proposal past ``want``'s end counts as rejected there."""
    agree = props[:len(want)] == want
    return len(want) if agree.all() else int(np.argmin(agree))


def replay(prompt: np.ndarray, out: np.ndarray, drafter: NgramDrafter, kp: AdaptiveK, gate,
           table: CostTable, rows_fixed: int | None, cap: int) -> Cycles:
    """The cycles of one request when the target's greedy choices are `out` (its first token
    comes from the prefill), decided as Transaction._speculate decides them."""
    hist = np.concatenate([prompt, out]).astype(np.int32)
    n0, n, prev, c = len(prompt), 1, 0, Cycles()
    drafter.start(prompt)
    if gate is not None:
        gate.start()
        gate.declined = 0
    while n < len(out):  # out ends where the request ends (EOG or the cap)
        full, key = cycle_proposal(drafter, gate, hist, n0 + n, proposal_length(kp, bool(rows_fixed), cap - n))
        p, rows = verify_plan(gate, key, full, hist, n0 + n, prev, rows_fixed)
        props = full[:p]
        seconds = table.call(rows, prev) + table.host
        c.seconds += seconds
        c.calls, c.rows, c.changes = c.calls + 1, c.rows + rows, c.changes + (rows != prev)
        before, prev = prev, rows
        m = accepted(props, out[n:n + p])
        kp.update(p, m)
        if gate is not None:
            gate.update(key, p, m, rows, before, seconds)
        c.proposed, c.accepted = c.proposed + p, c.accepted + m
        n += m + 1
    c.declined = gate.declined if gate is not None else 0
    return c


def references(spec: CampaignSpec, path: str | None) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(prompt key, prompt tokens, R's output) per prompt of the spec, from M_QB on CPU."""
    model = Model(spec.model)
    cache = json.loads(Path(path).read_text()) if path and Path(path).exists() else {}
    runner, out, fresh = None, [], False
    for text, key in spec.prompt_table():
        pr = prompts.resolve(text, spec.model)
        toks = np.asarray(model.tokenize(pr.text), dtype=np.int32)
        ident = hashlib.sha256(f"{key}|{model.path}|{spec.cap}|{pr.sha256}".encode()).hexdigest()[:16]
        if ident not in cache:
            if runner is None:
                runner = Runner(model, None, spec.spec_config())
            cache[ident] = [int(t) for t in runner.run("M_QB", pr).endpoint.tokens]
            fresh = True
        out.append((key, toks, np.asarray(cache[ident], dtype=np.int32)))
    if path and fresh:
        Path(path).write_text(json.dumps(cache))
    return out


def simulate(spec: CampaignSpec, refs, table: CostTable, gate: str | bool) -> list[tuple[str, Cycles]]:
    cfg = spec.spec_config()
    drafter = resolve(spec.draft)
    if not isinstance(drafter, NgramDrafter):
        raise ConfigError(f"the simulation replays the n-gram drafter; the spec's drafter is {spec.draft!r}")
    res = []
    for key, prompt, out in refs:
        c = replay(prompt, out, drafter, AdaptiveK(cfg.k, cfg.k_max), make_gate(gate, table.verify_costs()), table,
                   cfg.rows if cfg.fixed_rows else None, cfg.cap)
        drafter.remember(out)  # the session's next request sees this output (session drafters only)
        res.append((key, c))
    drafter.forget()
    return res


def summary(refs, res, table: CostTable, tags: dict) -> dict:
    r = np.array([(len(o) - 1) * (table.same[0] + table.r_host) for _, _, o in refs])
    cyc = [c for _, c in res]
    ratio = r / np.array([c.seconds for c in cyc])
    keys = np.array([k for k, _ in res])
    group = np.array([tags.get(k, "other") for k in keys])
    geo = {g: float(np.exp(np.mean(np.log(ratio[group == g])))) for g in sorted(set(group))}
    tot = {f: sum(getattr(c, f) for c in cyc) for f in ("calls", "rows", "changes", "proposed", "accepted",
                                                         "declined", "seconds")}
    committed = sum(len(o) - 1 for _, _, o in refs)
    return {"all": float(np.exp(np.mean(np.log(ratio)))), "groups": geo, "ratio": ratio, "keys": keys,
            "low": int(np.argmin(ratio)), "below": int((ratio < 1.0).sum()), "tokens_per_call": committed / tot["calls"],
            "rows_per_call": tot["rows"] / tot["calls"], "changes": tot["changes"],
            "ms_per_cycle": 1e3 * tot["seconds"] / tot["calls"],
            "acceptance": tot["accepted"] / max(tot["proposed"], 1), "declined": tot["declined"]}


def fmt(xs) -> str:
    return " | ".join(f"{x:.3f}" for x in xs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("spec", nargs="?", default="studies/spec-gate-dev.toml")
    ap.add_argument("--costs", default="benchmarks/costs/h200-smollm2.toml")
    ap.add_argument("--host", type=float, default=None, help="ms of host work per C cycle (default: the table's)")
    ap.add_argument("--r-host", type=float, default=None, help="ms of host work per R step (default: the table's)")
    ap.add_argument("--refs", default=None, help="JSON file keeping the reference outputs between runs")
    ap.add_argument("--prompts", action="store_true", help="also each prompt's simulated R/C_QB")
    a = ap.parse_args()
    spec = CampaignSpec.load(a.spec, backend="cpu")
    table = CostTable.load(a.costs, a.host, a.r_host)
    refs = references(spec, a.refs)
    tags = prompt_tags(spec)
    arms = {**{name: simulate(spec, refs, table, name) for name in GATES}, "off": simulate(spec, refs, table, False)}
    sums = {name: summary(refs, res, table, tags) for name, res in arms.items()}
    groups = sorted(next(iter(sums.values()))["groups"])
    print(f"{len(refs)} prompts of {a.spec} ({spec.draft}, k {spec.k}..{spec.k_max or spec.k}, "
          f"{'fixed ' + str(spec.spec_config().rows) + '-row verify' if spec.fixed_rows else 'rows follow k'}, "
          f"cap {spec.cap}), {sum(len(o) - 1 for _, _, o in refs)} tokens after the first; costs {a.costs}, "
          f"host {1e3 * table.host:.3f} ms per cycle, R {1e3 * (table.same[0] + table.r_host):.3f} ms per token; "
          "simulated, not measured\n")
    print(f"| gate | R/C_QB | {' | '.join(groups)} | lowest prompt | below 1.0 | tokens/call | rows/call | "
          "shape changes | ms/cycle | acceptance | declined |")
    print("|---" * (10 + len(groups)) + "|")
    for name, s in sums.items():
        print(f"| {name} | {s['all']:.3f} | {fmt(s['groups'][g] for g in groups)} | "
              f"{s['ratio'][s['low']]:.3f} ({s['keys'][s['low']]}) | {s['below']} | {s['tokens_per_call']:.2f} | "
              f"{s['rows_per_call']:.2f} | {s['changes']} | {s['ms_per_cycle']:.3f} | {s['acceptance']:.3f} | "
              f"{s['declined']} |")
    if a.prompts:
        print(f"\n| prompt | {' | '.join(sums)} |\n|---{'|---' * len(sums)}|")
        for i, key in enumerate(next(iter(sums.values()))["keys"]):
            print(f"| {key} | {fmt(s['ratio'][i] for s in sums.values())} |")


if __name__ == "__main__":
    sys.exit(script_main(main))
