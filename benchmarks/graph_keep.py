"""Patch 0008 (graphs kept per ubatch shape) A/B in one process: the gate calibration's verify cost
by rows, same shape and shape changed, with 0 and with N kept graphs, side by side, then one request
of the drafting arm each way (qualified against R, request-time ratio R / arm).

    .venv/bin/python benchmarks/graph_keep.py [SPEC] [--prompt P] [--keep N] [--calls C] [--backend B]

SPEC defaults to studies/spec-cuda-panel.toml (its first chat prompt unless --prompt).
"""
from __future__ import annotations

import argparse
import dataclasses

from statelab import prompts
from statelab.errors import script_main
from statelab.experiments.campaign import CampaignSpec
from statelab.experiments.spec_run import load_runner, resolve_draft
from statelab.runtime import prepare_backend


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", nargs="?", default="studies/spec-cuda-panel.toml")
    ap.add_argument("--prompt")
    ap.add_argument("--arm", default="C_QB")
    ap.add_argument("--keep", type=int, default=4)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--backend")
    a = ap.parse_args()
    spec = CampaignSpec.load(a.spec, backend=a.backend)
    prepare_backend(spec.backend)
    text = a.prompt or next((p for p in spec.prompts if p.startswith("chat:")), spec.prompts[0])
    base = spec.spec_config()
    runner = load_runner(spec.model, resolve_draft(spec.model, spec.draft), base)
    p = prompts.resolve(text, spec.model, spec.backend)
    keeps = (0, a.keep)
    costs = {}
    for n in keeps:
        runner.cfg = dataclasses.replace(base, graph_keep=n)
        costs[n] = runner.measure_verify_costs(a.arm, p, calls=a.calls)
    print(f"Verify call by rows ({spec.backend}, {a.arm}'s layout, {a.calls} calls each, median ms), {p.id}:\n")
    print("| rows | same, keep 0 | changed, keep 0 | same, keep %d | changed, keep %d | changed keep 0 / keep %d |"
          % (a.keep, a.keep, a.keep))
    print("|---|---|---|---|---|---|")
    c0, c1 = costs[0], costs[a.keep]
    for r in range(len(c0.same)):
        print(f"| {r + 1} | {1e3 * c0.same[r]:.3f} | {1e3 * c0.change[r]:.3f} | {1e3 * c1.same[r]:.3f} | "
              f"{1e3 * c1.change[r]:.3f} | {c0.change[r] / c1.change[r]:.2f} |")
    ref = runner.run("R", p, warmup=True)
    print(f"\nOne request, {p.id} (gate {spec.gate}, costs calibrated per keep as above):\n")
    print("| graphs kept | qualified | R / arm | builds | revivals | verify calls |")
    print("|---|---|---|---|---|---|")
    for n in keeps:
        runner.cfg = dataclasses.replace(base, graph_keep=n)
        runner.costs = {a.arm: costs[n]} if spec.gate else {}
        runner.gate = spec.gate or "gain"
        r = runner.run(a.arm, p, warmup=True)
        same = r.endpoint.tokens.tolist() == ref.endpoint.tokens.tolist()
        print(f"| {n} | {'yes' if same else 'NO'} | {ref.seconds / r.seconds:.3f} | {r.counters.graph_builds} | "
              f"{r.counters.graph_revivals} | {r.counters.verify_calls} |")
    return 0


if __name__ == "__main__":
    script_main(main)
