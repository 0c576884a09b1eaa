"""Where a cycle without proposals loses to R's one-token step: the same tokens decoded one
per call in R's context and in a drafting arm's, each way of calling, side by side in one
process.

    .venv/bin/python benchmarks/plain_cycle.py [SPEC] [--prompt P] [--arm C_QB] [--rounds N] [--backend B] [--cap N]

SPEC (default studies/spec-cuda-panel.toml) gives the backend, model, context and verify
rows; P (default the spec's first prose prompt) the prompt.  R runs the request once (its
output is the token stream every variant then decodes, teacher-forced after the same
prefill).  Variants, per token (median over the continuation, then over ``--rounds``):

  R step             R's context (ubatch 1), ``Transaction._step``: decode([tok]) + greedy_row
  ARM ctx, step      the drafting arm's context (ubatch k_max + 1, its layout set per call by
                     the phase guard), the same one-token step
  ARM ctx, batch     the same context, the multi-row verify's call for one row: a numpy batch
                     with logits "all", synchronize, argmax_rows
  ARM ctx, no guard  the one-token step with the layout set once (no per-call set and restore)
  ARM plain cycle    a whole request of the arm whose gate declines every proposal (the
                     calibration says rows are dear): every cycle one row, the loop's own host
                     work included (t_cycle / committed)
  ARM shadow plain   a whole request under a shadow gate held plain (its drafter asked for the
                     shadow proposals): ``plain runs`` runs the plain regime as one loop of
                     R's step that also settles and asks for the shadow proposals
                     (Transaction._plain_run), ``general
                     cycle`` each through the general loop (Transaction.plain_runs False);
                     ``outside the decode call``: (t_cycle - t_verify) / committed, the host work
  DRAFTER proposal   a model-free drafter's lookup alone, once at every output position of R's
                     output (the median); a session drafter's corpus is empty here (these runs
                     do not learn), so this is the request's own lookup

Not a device claim on its own: run it on the device whose ratios it explains.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from statelab import prompts
from statelab.errors import script_main
from statelab.experiments.campaign import CampaignSpec
from statelab.experiments.spec_run import load_runner, resolve_draft
from statelab.runtime import layouts, prepare_backend
from statelab.speculative.drafters import ShadowGate, VerifyCosts
from statelab.speculative.transaction import Arm, Counters, Transaction


def _forced(ctx, guard, toks: np.ndarray, out: np.ndarray, how: str) -> float:
    """Median seconds per token of decoding ``out`` one per call after prefilling ``toks``."""
    ctx.clear()
    tx_t = []
    with guard.scope(ctx, "target"):
        ctx.decode(toks, 0)
    guard.phase["target"] = "continuation"
    pos = len(toks)
    held = guard.scope(ctx, "target") if how == "no guard" else None
    if held is not None:
        held.__enter__()
    try:
        for tok in out[:-1]:
            t0 = time.perf_counter()
            if how == "batch":
                with guard.scope(ctx, "target"):
                    ctx.decode(np.asarray([tok], dtype=np.int32), pos, logits="all")
                    ctx.synchronize()
                ctx.argmax_rows(1)
            elif how == "no guard":
                ctx.decode([int(tok)], pos)
                ctx.greedy_row(-1)
            else:
                with guard.scope(ctx, "target"):
                    ctx.decode([int(tok)], pos)
                ctx.greedy_row(-1)
            tx_t.append(time.perf_counter() - t0)
            pos += 1
    finally:
        if held is not None:
            held.__exit__(None, None, None)
    return statistics.median(tx_t)


def _shadow_plain(runner, arm: Arm, toks: np.ndarray, cfg, costs: VerifyCosts, plain_runs: bool):
    """(endpoint tokens, t_cycle / committed, (t_cycle - t_verify) / committed) of one request
    under a shadow gate held plain, with Transaction.plain_runs as given."""
    t, d = runner.contexts(arm)
    try:
        tx = Transaction(arm, t, d, cfg.k, cfg.mask, drafter=runner.drafter, k_max=cfg.k_max,
                         fixed_rows=cfg.fixed_rows, gate=ShadowGate(costs, dwell=10 ** 9, start_drafting=False))
        tx.plain_runs = plain_runs
        tx.run(toks, min(8, cfg.cap))  # the warm-up request, as Runner.run(warmup=True)
        tx.c = Counters()
        ep = tx.run(toks, cfg.cap)
    finally:
        t.close()
        if d is not None:
            d.close()
    n = max(tx.c.committed, 1)
    return ep.tokens, tx.c.t_cycle / n, (tx.c.t_cycle - tx.c.t_verify) / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", nargs="?", default="studies/spec-cuda-panel.toml")
    ap.add_argument("--prompt", help="a prompt spec (default: the spec's first chat prompt)")
    ap.add_argument("--arm", default="C_QB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", help="the spec's backend replaced")
    ap.add_argument("--cap", type=int, help="the spec's cap replaced")
    a = ap.parse_args()
    spec = CampaignSpec.load(a.spec, backend=a.backend, cap=a.cap)
    cfg = spec.spec_config()
    prepare_backend(spec.backend)
    text = a.prompt or next((p for p in spec.prompts if p.startswith("chat:")), spec.prompts[0])
    runner = load_runner(spec.model, resolve_draft(spec.model, spec.draft), cfg)
    p = prompts.resolve(text, spec.model, spec.backend)
    toks = np.asarray(runner.tm.tokenize(p.text), dtype=np.int32)
    arm = Arm.parse(a.arm)
    rows = cfg.rows
    dear = VerifyCosts(same=(1e-6,) + (1.0,) * (rows - 1), change=(1e-6,) + (1.0,) * (rows - 1))
    res: dict[str, list[float]] = {}
    out = None
    for _ in range(a.rounds):
        r = runner.run("R", p, warmup=True)
        out = r.endpoint.tokens
        res.setdefault("R request (t_cycle / committed)", []).append(r.counters.t_cycle / max(r.counters.committed, 1))
        runner.costs = {a.arm: dear}
        c = runner.run(a.arm, p, warmup=True)
        runner.costs = {}
        if c.endpoint.tokens.tolist() != out.tolist():
            raise SystemExit(f"{a.arm} with every proposal declined did not reproduce R on {p.id}")
        res.setdefault(f"{a.arm} plain cycle (t_cycle / committed)", []).append(
            c.counters.t_cycle / max(c.counters.committed, 1))
        res.setdefault(f"{a.arm} plain cycle, verify call only", []).append(
            c.counters.t_verify / max(c.counters.verify_calls, 1))
        for fast, how in ((True, "plain runs"), (False, "general cycle")):
            got, per, host = _shadow_plain(runner, arm, toks, cfg, dear, fast)
            if got.tolist() != out.tolist():
                raise SystemExit(f"{a.arm} under a shadow gate held plain did not reproduce R on {p.id}")
            res.setdefault(f"{a.arm} shadow plain, {how} (t_cycle / committed)", []).append(per)
            res.setdefault(f"{a.arm} shadow plain, {how}, outside the decode call", []).append(host)
        for name, which, how in (("R step", Arm.parse("R"), "step"), (f"{a.arm} ctx, step", arm, "step"),
                                 (f"{a.arm} ctx, batch", arm, "batch"), (f"{a.arm} ctx, no guard", arm, "no guard")):
            t, d = runner.contexts(which)
            try:
                guard = Transaction(which, t, d, cfg.k, cfg.mask, drafter=runner.drafter if which.draft else None,
                                    k_max=cfg.k_max).guard
                res.setdefault(name, []).append(_forced(t, guard, toks, out, how))
            finally:
                t.close()
                if d is not None:
                    d.close()
    if runner.drafter is not None and not runner.drafter.needs_model:  # one lookup at every output position
        hist = np.concatenate([toks, out]).astype(np.int32)
        lookups = []
        for L in range(len(toks) + 1, len(hist)):
            t0 = time.perf_counter()
            runner.drafter.propose(hist[:L], cfg.rows - 1)
            lookups.append(time.perf_counter() - t0)
        res[f"{runner.drafter.text} proposal (its lookup alone, per cycle)"] = [statistics.median(lookups)]
    base = statistics.median(res["R step"])
    print(f"{p.id} ({len(toks)} prompt tokens, {len(out) - 1} continued), {spec.backend}, arm {a.arm} "
          f"(ubatch {cfg.target_ubatch}, layout patch {layouts.available()}), {a.rounds} rounds\n")
    print("| variant | ms per token | x R step |\n|---|---|---|")
    for name, xs in res.items():
        m = statistics.median(xs)
        print(f"| {name} | {1e3 * m:.3f} | {m / base:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(script_main(main))
