"""Greedy decode speed: statelab's receiver loop against llama.cpp's own decode time.

    .venv/bin/python benchmarks/decode.py [--backend cpu] [--rounds 5] [--tokens 128]

Each round prefills a HumanEval prompt, then decodes `tokens` greedy tokens through
statelab (`receiver.continue_greedy`: decode call, FP32 logits copy, native greedy
sampler).  llama.cpp's own decode time for the same tokens comes from its perf counters
(llama_perf_context: t_eval_ms / n_eval) in the same context, so the ratio
statelab tokens/s / llama.cpp tokens/s is measured side by side.  Goal >= 0.90.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from _report import machine, update_section

from statelab import prompts
from statelab.errors import script_main
from statelab.lab.formation import PRESETS, prefill
from statelab.lab.receiver import continue_greedy
from statelab.runtime import Context, ContextConfig, Model, prepare_backend


def greedy_choice_us(model, cfg, tokens) -> dict:
    """Microseconds per greedy choice on the last row: llama.cpp's own sampler call (it fills a
    candidate array of the whole vocabulary, then picks the first maximum) against the in-place
    argmax the receiver uses; both choose the same token (checked here too)."""
    from statelab.runtime.native import llama

    with Context(model, cfg) as ctx:
        prefill(ctx, tokens, PRESETS["A"])
        ctx.decode([int(tokens[-1])], len(tokens))
        calls = {"sampler": lambda: int(llama().llama_sampler_sample(ctx._greedy, ctx.ptr, -1)),
                 "argmax": lambda: ctx.greedy_row(-1)}
        if calls["sampler"]() != calls["argmax"]():
            raise SystemExit("the sampler and the in-place argmax chose different tokens")
        out = {}
        for name, f in calls.items():
            runs = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(200):
                    f()
                runs.append((time.perf_counter() - t0) / 200 * 1e6)
            out[name] = statistics.median(runs)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--task", default="HumanEval/1")
    ap.add_argument("--model", default=None)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    prepare_backend(a.backend)
    model = Model(a.model, backend=a.backend)
    cfg = ContextConfig(backend=a.backend)
    tokens = model.tokenize(prompts.resolve(a.task).text)
    ours, lib, ratios = [], [], []
    for _ in range(a.rounds + 1):  # first round is a warm-up
        with Context(model, cfg) as ctx:
            logits = prefill(ctx, tokens, PRESETS["A"])
            ctx.perf_reset()
            t0 = time.perf_counter()
            ep = continue_greedy(ctx, logits, len(tokens), a.tokens)
            wall = time.perf_counter() - t0
            perf = ctx.perf()
        n = ep.length - 1  # decode calls made (the last token is sampled, not decoded)
        if perf["n_eval"] != n:
            raise SystemExit(f"perf counters saw {perf['n_eval']} decodes, expected {n}")
        ours.append(n / wall)
        lib.append(n / (perf["t_eval_ms"] / 1000))
        ratios.append(ours[-1] / lib[-1])
    ours, lib, ratios = ours[1:], lib[1:], ratios[1:]
    med = statistics.median
    choice = greedy_choice_us(model, cfg, tokens)
    body = (f"Command: `.venv/bin/python benchmarks/decode.py --backend {a.backend} --rounds {a.rounds} "
            f"--tokens {a.tokens}`  \n{machine()}; model {model.info.name}, backend {a.backend}, "
            f"{a.rounds} rounds of {n} decoded tokens after a warm-up.\n\n"
            "| figure | median | min | max |\n|---|---|---|---|\n"
            f"| statelab tokens/s (receiver loop, wall) | {med(ours):.1f} | {min(ours):.1f} | {max(ours):.1f} |\n"
            f"| llama.cpp tokens/s (perf counters, same decodes) | {med(lib):.1f} | {min(lib):.1f} | {max(lib):.1f} |\n"
            f"| ratio statelab / llama.cpp (goal >= 0.90) | {med(ratios):.3f} | {min(ratios):.3f} | "
            f"{max(ratios):.3f} |\n"
            "\nHost time of one greedy choice after a one-token decode (median of 5 x 200 calls, same context): "
            f"llama.cpp's sampler call `llama_sampler_sample` {choice['sampler']:.1f} us, the in-place argmax "
            f"of `Context.greedy_row` (the receiver's, since 2026-12-03) {choice['argmax']:.1f} us.\n")
    print(body)
    if not a.no_write:
        update_section(f"decode-{a.backend}", f"Greedy decode ({a.backend})", body)


if __name__ == "__main__":
    sys.exit(script_main(main))
