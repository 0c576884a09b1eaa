"""Activation scale over the depth of a model (made for the synthetic models of
`statelab model synth`): the RMS of the residual stream after every layer (`l_out-N`) at the
last prompt position, and the last position's logits.

    .venv/bin/python benchmarks/synth_activations.py --model M.gguf [--task HumanEval/2] [--backend cpu]

Prints one line per layer and a summary; exits 1 when any value is not finite. Nothing is
written to docs: the printout is the record (docs/models.md quotes it with this command).
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from statelab import prompts
from statelab.lab.formation import PRESETS, prefill
from statelab.runtime import Context, ContextConfig, Model, TensorCapture, prepare_backend


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--task", default="HumanEval/2")
    ap.add_argument("--backend", default="cpu")
    a = ap.parse_args()
    prepare_backend(a.backend)
    model = Model(a.model, backend=a.backend)
    tokens = model.tokenize(prompts.resolve(a.task).text)
    cap = TensorCapture(lambda name: name.startswith("l_out-"))
    with Context(model, ContextConfig(backend=a.backend, n_ctx=max(512, len(tokens) + 1)), capture=cap) as ctx:
        logits = prefill(ctx, tokens, PRESETS["A"])
    finite = bool(np.isfinite(logits).all())
    by_layer = {}
    for t in cap.tensors:
        last = np.asarray(t.data, dtype=np.float64).reshape(-1, t.ne[0])[-1]  # the last position's row
        by_layer[t.layer] = last
        finite &= bool(np.isfinite(last).all())
    print(f"{model.info.name}: {model.n_layer} layers, width {model.info.n_embd}, {a.task} ({len(tokens)} tokens), "
          f"{a.backend}")
    for il in sorted(by_layer):
        x = by_layer[il]
        print(f"layer {il:3d}  residual RMS {np.sqrt(np.mean(x * x)):8.4f}  max |x| {np.abs(x).max():9.4f}")
    top = np.sort(logits.astype(np.float64))[::-1]
    print(f"logits: std {logits.std():.4f}, max {top[0]:.4f}, top-1 margin {top[0] - top[1]:.4f}, "
          f"all finite: {finite}")
    return 0 if finite else 1


if __name__ == "__main__":
    sys.exit(main())
