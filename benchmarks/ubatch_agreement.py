"""Which prefill micro-batch sizes give the same initial logits as ubatch 512 on this build.

    .venv/bin/python benchmarks/ubatch_agreement.py [--backend cpu] [--tasks 0,2,10] [--ubatches 1,2,3,4,8,16,512]

One fresh context per (HumanEval task, ubatch): the whole prompt is prefilled with that
ubatch, and the last row's logits are compared bitwise with ubatch 512's. Each row prints
the prompt length, the size of the last micro-batch and max |d|. The CPU facts of
docs/backends.md come from this printout. They depend on the build's instruction set
(pinned to x86-64-v3 on x86-64 by native/build.py; docs/backends.md, "CPU").
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from statelab import prompts
from statelab.errors import script_main
from statelab.lab.formation import parse_schedule, prefill
from statelab.runtime import Context, ContextConfig, Model, prepare_backend
from statelab.runtime.native import build_identity


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--tasks", default="0,2,10", help="HumanEval task numbers")
    ap.add_argument("--ubatches", default="1,2,3,4,8,16,512")
    args = ap.parse_args(argv)
    try:
        tasks = [int(x) for x in args.tasks.split(",")]
        ubs = sorted({int(x) for x in args.ubatches.split(",")} | {512})
    except ValueError:
        ap.error("--tasks and --ubatches take comma-separated whole numbers")
    if min(ubs) < 1:
        ap.error("--ubatches: each at least 1")
    prepare_backend(args.backend)
    ident = build_identity()
    print(f"build {ident.get('build_key')} ({ident.get('backend')}); {ident.get('system_info')}")
    model = Model(None, backend=args.backend)
    cfg = ContextConfig(backend=args.backend, n_ctx=1024)
    print("| task | tokens | ubatch | last micro-batch | max abs d against ubatch 512 |")
    print("|---|---|---|---|---|")
    for task in tasks:
        toks = model.tokenize(prompts.humaneval(task).text)
        logits = {}
        for ub in ubs:
            with Context(model, cfg.with_(n_ubatch=ub)) as ctx:
                logits[ub] = prefill(ctx, toks, parse_schedule(f"ub{ub}")).copy()
        for ub in (u for u in ubs if u != 512):
            last = len(toks) % ub or min(ub, len(toks))
            d = float(np.abs(logits[ub] - logits[512]).max())
            print(f"| HumanEval/{task} | {len(toks)} | {ub} | {last} | {'equal' if d == 0 else f'{d:.4g}'} |")
    model.close()
    return 0


if __name__ == "__main__":
    sys.exit(script_main(main))
