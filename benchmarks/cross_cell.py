"""A cross cell against a plain continuation from the same state, side by side.

    .venv/bin/python benchmarks/cross_cell.py [--rounds 5] [--cap 128]

Cross cell: load a verified capture archive (donor) and the recipient's, build the subset
(L0_V + LATE from the donor), serialise, restore into a fresh context with read-back
verification, continue 128 tokens.  Plain: restore the recipient's own state into a fresh
context and continue 128 tokens.  Rounds alternate the two; goal: cross / plain <= 1.10.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _report import machine, update_section

from statelab import prompts
from statelab.errors import script_main
from statelab.lab.archive import load_capture, save_capture
from statelab.lab.formation import PRESETS, form
from statelab.lab.intervene import config_of, subset_cross
from statelab.lab.receiver import continue_greedy
from statelab.runtime import Context, ContextConfig, Model
from statelab.selection import load_selector, select


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cap", type=int, default=128)
    ap.add_argument("--task", default="HumanEval/1")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    model = Model()
    base = ContextConfig()
    p = prompts.resolve(a.task)
    with tempfile.TemporaryDirectory() as tmp:
        dpath, rpath = Path(tmp) / "donor", Path(tmp) / "recipient"
        save_capture(form(model, p, PRESETS["A"], base), dpath)
        save_capture(form(model, p, PRESETS["R"], base), rpath)
        sel_l0v, sel_late = load_selector("L0_V"), load_selector("LATE")
        rec = load_capture(rpath)

        def cross_cell():
            d, r = load_capture(dpath), load_capture(rpath)
            sel = select(sel_l0v, r.state) | select(sel_late, r.state)
            ep, _acc = subset_cross(model, d, r, sel, a.cap)
            return ep

        def plain():
            with Context(model, config_of(rec)) as ctx:
                ctx.state_set(rec.blob)
                return continue_greedy(ctx, rec.logits, rec.n_prompt, a.cap)

        tc, tp, ratio = [], [], []
        for i in range(a.rounds + 1):
            order = (cross_cell, plain) if i % 2 == 0 else (plain, cross_cell)
            t = {}
            for fn in order:
                t0 = time.perf_counter()
                ep = fn()
                t[fn.__name__] = (time.perf_counter() - t0, ep.length)
            if i == 0:
                continue  # warm-up
            # equal work: normalise per generated token in case the endpoints differ in length
            c = t["cross_cell"][0] / t["cross_cell"][1]
            pl = t["plain"][0] / t["plain"][1]
            tc.append(c * 1000)
            tp.append(pl * 1000)
            ratio.append(c / pl)
    med = statistics.median
    body = (f"Command: `.venv/bin/python benchmarks/cross_cell.py --rounds {a.rounds} --cap {a.cap}`  \n"
            f"{machine()}; {a.task}, donor A / recipient R, selection L0_V + LATE, cap {a.cap}; "
            "times per generated token, interleaved rounds after a warm-up.\n\n"
            "| figure | median | min | max |\n|---|---|---|---|\n"
            f"| cross cell ms/token (load archives, select, edit, restore + verify, continue) | {med(tc):.2f} | "
            f"{min(tc):.2f} | {max(tc):.2f} |\n"
            f"| plain continuation ms/token (restore, continue) | {med(tp):.2f} | {min(tp):.2f} | {max(tp):.2f} |\n"
            f"| ratio cross / plain (goal <= 1.10) | {med(ratio):.3f} | {min(ratio):.3f} | {max(ratio):.3f} |\n")
    print(body)
    if not a.no_write:
        update_section("cross-cell", "Cross cell versus plain continuation", body)


if __name__ == "__main__":
    sys.exit(script_main(main))
