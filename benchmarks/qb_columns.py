"""What QB's exactness costs a verify call, by rows: QB with its attention products in one
launch (patch 0006), QB with one product per query (the same build, the launch turned off),
and the unrepaired multi-query layout MQ, side by side in one run.

    .venv/bin/python benchmarks/qb_columns.py [SPEC] [--model PATH] [--k-max K] [--rounds N] [--repeats N] [--no-write]

SPEC (default studies/spec-cuda-panel.toml) gives the backend, the model, the context, the
verify rows (k_max + 1) and the prompt whose prefill the verify calls extend; --model
replaces its model (Gemma 3: the GGUF's path), --k-max its largest k (rows = k + 1). Each variant runs in a fresh process (the
launch is chosen once per process, by STATELAB_CUDA_QB_COLUMNS), the variants interleaved
for --repeats rounds; each process times --rounds calls of every row count with the same
shape every call (the graph reused) and reports medians; the table gives the median over
repeats. Goals (issue 25 items 1 and 2): a 4-row QB verify <= 1.10x MQ, an 8-row one <= 1.15x.
On a backend other than CUDA the two QB variants are the same graph and kernels.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from _report import machine, update_section

from statelab.errors import script_main
from statelab.experiments.campaign import CampaignSpec

VARIANTS = {  # name: (layout, environment)
    "QB": ("QB", {}),
    "QB, one product per query": ("QB", {"STATELAB_CUDA_QB_COLUMNS": "0"}),
    "MQ": ("MQ", {}),
}
GOALS = {4: 1.10, 8: 1.15}


def _child(spec: CampaignSpec, layout: str, rounds: int) -> dict:
    from speculative import _rows_one_layout

    from statelab.runtime import layouts, prepare_backend

    prepare_backend(spec.backend)
    fixed, _changing, _rm = _rows_one_layout(spec, spec.spec_config(), layout, rounds)
    return {"fixed": {str(r): t for r, t in fixed.items()}, "qb_columns": layouts.qb_columns_available()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", nargs="?", default="studies/spec-cuda-panel.toml")
    ap.add_argument("--model", help="the spec's model replaced (a GGUF path or a model name)")
    ap.add_argument("--k-max", type=int, help="the spec's k_max replaced (verify rows 1 .. k_max + 1)")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    over = {"model": a.model, "k_max": a.k_max}
    spec = CampaignSpec.load(a.spec, check_fit=not a.child, **over)
    if a.child:
        print(json.dumps(_child(spec, a.child, a.rounds)))
        return 0
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for _ in range(a.repeats):
        for name, (layout, env) in VARIANTS.items():
            cmd = [sys.executable, __file__, a.spec, "--child", layout, "--rounds", str(a.rounds)]
            cmd += (["--model", a.model] if a.model else []) + (["--k-max", str(a.k_max)] if a.k_max else [])
            r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env})
            if r.returncode != 0:
                raise SystemExit(f"variant {name!r} failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
            runs[name].append(json.loads(r.stdout.strip().splitlines()[-1]))
    rows = sorted(int(k) for k in runs["QB"][0]["fixed"])
    med = {v: {r: statistics.median(x["fixed"][str(r)] for x in runs[v]) for r in rows} for v in VARIANTS}
    off = "QB, one product per query"
    model = a.model or spec.model or "the embedded default"
    body = (f"Command: `.venv/bin/python benchmarks/qb_columns.py {a.spec}"
            f"{' --model ' + Path(a.model).name if a.model else ''}{f' --k-max {a.k_max}' if a.k_max else ''} --rounds {a.rounds} --repeats {a.repeats}`  \n"
            f"{machine()}; backend {spec.backend}, model {Path(str(model)).name}, patch 0006 loaded: "
            f"{runs['QB'][0]['qb_columns']}. Median ms of one verify call (decode + logits of every row + greedy "
            f"choice), same shape every call, {a.rounds} calls per row count and process, median over "
            f"{a.repeats} interleaved processes per variant.\n\n"
            "| rows | QB (ms) | QB one product per query (ms) | MQ (ms) | QB / MQ | per-query QB / MQ | goal |\n"
            "|---|---|---|---|---|---|---|\n")
    for r in rows:
        q, p, m = (1e3 * med[v][r] for v in ("QB", off, "MQ"))
        goal = f"<= {GOALS[r]:.2f}: {'met' if q / m <= GOALS[r] else 'not met'}" if r in GOALS else ""
        body += f"| {r} | {q:.3f} | {p:.3f} | {m:.3f} | {q / m:.3f} | {p / m:.3f} | {goal} |\n"
    print(body)
    if not a.no_write:
        update_section(f"qb-columns-{spec.backend}", f"QB verify cost by rows, one launch against one product "
                       f"per query ({spec.backend})", body)
    return 0


if __name__ == "__main__":
    sys.exit(script_main(main))
