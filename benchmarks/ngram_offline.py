"""Committed tokens per target verify call of the n-gram drafter, counted offline on
reference outputs (no timing: what the drafter would commit, cycle by cycle, when the
target's greedy choices are R's tokens).

    .venv/bin/python benchmarks/ngram_offline.py [SPEC] [--cap 256] [--ranges 1-4,2-4,1-8] [--ks 3,7,15]

The reference outputs come from the M_QB arm on CPU, which reproduces R there (see
docs/findings.md); the prompts are the spec's.  For each n range and k: tokens per call,
rows per call and acceptance over all prompts together.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from statelab import prompts
from statelab.errors import script_main
from statelab.experiments.campaign import CampaignSpec
from statelab.runtime import Model
from statelab.speculative.drafters import NgramDrafter, parse_ngram
from statelab.speculative.transaction import AdaptiveK, Runner, SpecConfig


def replay(prompt: np.ndarray, out: np.ndarray, drafter: NgramDrafter, kp: AdaptiveK) -> tuple[int, int, int, int]:
    """(verify calls, rows, accepted, proposed) when the target's choices are `out`."""
    hist = np.concatenate([prompt, out]).astype(np.int32)
    n0, n = len(prompt), 1
    calls = rows = acc = prop = 0
    while n < len(out):
        props = drafter.propose(hist[:n0 + n], min(kp.k, len(out) - n))
        agree = props == out[n:n + len(props)]
        m = len(props) if agree.all() else int(np.argmin(agree))
        kp.update(len(props), m)
        calls, rows, acc, prop = calls + 1, rows + len(props) + 1, acc + m, prop + len(props)
        n += min(m + 1, len(out) - n)
    return calls, rows, acc, prop


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("spec", nargs="?", default="studies/spec-cuda-ngram.toml")
    ap.add_argument("--cap", type=int, default=256)
    ap.add_argument("--ranges", default="1-4,2-4,3-6,1-8")
    ap.add_argument("--ks", default="3,7,15")
    a = ap.parse_args()
    spec = CampaignSpec.load(a.spec)
    model = Model(spec.model)
    runner = Runner(model, None, SpecConfig(k=3, cap=a.cap, threads=spec.threads))
    refs = []
    for p in spec.prompts:
        pr = prompts.resolve(p)
        refs.append((model.tokenize(pr.text), runner.run("M_QB", pr).endpoint.tokens))
    print(f"{len(refs)} prompts of {a.spec}, cap {a.cap}, {sum(len(o) - 1 for _, o in refs)} tokens after the first\n")
    print("| n | k | tokens/call | rows/call | acceptance |\n|---|---|---|---|---|")
    for rng in a.ranges.split(","):
        lo, hi = parse_ngram(f"ngram:{rng}")
        for k in (int(x) for x in a.ks.split(",")):
            tot = np.zeros(4, dtype=np.int64)
            for prompt, out in refs:
                tot += replay(prompt, out, NgramDrafter(lo, hi), AdaptiveK(k))
            calls, rows, acc, prop = tot
            committed = sum(len(o) - 1 for _, o in refs)
            print(f"| {lo}-{hi} | {k} | {committed / calls:.3f} | {rows / calls:.2f} | "
                  f"{acc / max(prop, 1):.3f} |")


if __name__ == "__main__":
    sys.exit(script_main(main))
