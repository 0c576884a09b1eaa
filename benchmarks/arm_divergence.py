"""Where the natural greedy outputs of the paper's arms part from arm A's, on this build.

    .venv/bin/python benchmarks/arm_divergence.py [--backend cpu] [--model PATH] [--tasks 0-19]
        [--arms B,C,R] [--cap 40]

One fresh context per (HumanEval task, arm): the prompt is prefilled with the arm's schedule
and decoded greedily for --cap outputs (statelab.lab.intervene.natural). Each row gives the
prompt length, whether the arm's KV state equals A's, and the first output at which the
arm's tokens differ from A's ("-" when they agree up to the cap; "n/a" where the arm's
schedule does not apply, e.g. B's split at 128 on a shorter prompt). The tests that need an
A/R divergence on the CPU build pick their prompts from this printout.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from statelab import prompts
from statelab.errors import ConfigError, script_main
from statelab.lab.formation import PRESETS
from statelab.lab.intervene import natural
from statelab.runtime import ContextConfig, Model, prepare_backend
from statelab.runtime.native import build_identity


def _tasks(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def first_difference(a: np.ndarray, b: np.ndarray) -> int | None:
    n = min(len(a), len(b))
    d = np.flatnonzero(a[:n] != b[:n])
    if d.size:
        return int(d[0])
    return None if len(a) == len(b) else n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2-135M)")
    ap.add_argument("--tasks", default="0-19", help="HumanEval task numbers: 0,2,10 or 0-19")
    ap.add_argument("--arms", default="B,C,R", help="arms compared with A")
    ap.add_argument("--cap", type=int, default=40)
    args = ap.parse_args(argv)
    try:
        tasks = _tasks(args.tasks)
    except ValueError:
        ap.error("--tasks takes whole numbers and ranges, e.g. 0,2,10 or 0-19")
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in PRESETS]
    if unknown:
        ap.error(f"--arms: unknown arm {unknown[0]!r}; choose from {', '.join(sorted(PRESETS))}")
    prepare_backend(args.backend)
    ident = build_identity()
    print(f"build {ident.get('build_key')} ({ident.get('backend')}); {ident.get('system_info')}")
    model = Model(args.model, backend=args.backend)
    cfg = ContextConfig(backend=args.backend, n_ctx=1024)
    print("| task | tokens | " + " | ".join(f"{a}: state = A's | {a}: first output != A's" for a in arms) + " |")
    print("|---|---|" + "---|---|" * len(arms))
    for task in tasks:
        p = prompts.humaneval(task)
        ca, ea = natural(model, p, PRESETS["A"], cfg, args.cap)
        cells = []
        for arm in arms:
            try:
                PRESETS[arm].submissions(ca.n_prompt)
            except ConfigError:  # B splits at 128: no remainder on a shorter prompt
                cells += ["n/a", "n/a"]
                continue
            c, e = natural(model, p, PRESETS[arm], cfg, args.cap)
            d = first_difference(ea.tokens, e.tokens)
            cells += ["yes" if c.blob == ca.blob else "no", "-" if d is None else str(d)]
        print(f"| HumanEval/{task} | {ca.n_prompt} | " + " | ".join(cells) + " |", flush=True)
    model.close()
    return 0


if __name__ == "__main__":
    sys.exit(script_main(main))
