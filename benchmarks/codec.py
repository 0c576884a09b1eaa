"""KV codec speed: parse + edit + re-serialise a real 1024-cell sequence state.

    .venv/bin/python benchmarks/codec.py [--rounds 30]

The state comes from a real 1024-token prefill of the embedded default (HumanEval prompts
concatenated), F16 K/V, 30 layers.  Edit: one K value in every layer and the whole layer-0 V
block replaced from a second array (what a subset cross does).  Goal: <= 20 ms.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from _report import machine, update_section

from statelab import prompts
from statelab.kvstate import KVState
from statelab.runtime import Context, ContextConfig, Model


def real_state(model, n_cells: int) -> bytes:
    toks = np.concatenate([model.tokenize(prompts.humaneval(i).text) for i in range(40)])[:n_cells]
    with Context(model, ContextConfig(n_ctx=2 * n_cells, n_batch=n_cells, n_ubatch=512)) as ctx:
        ctx.decode(toks, 0, logits=None)
        return ctx.state_get()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--cells", type=int, default=1024)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    model = Model()
    blob = real_state(model, a.cells)
    donor_v0 = KVState.parse(blob).v[0][::-1].copy()
    times = {"parse": [], "edit": [], "write": [], "total": []}
    for _ in range(a.rounds + 2):
        t0 = time.perf_counter()
        st = KVState.parse(blob)
        t1 = time.perf_counter()
        for k in st.k:
            k[7, 3] = np.float16(1.5)
        st.v[0][...] = donor_v0
        t2 = time.perf_counter()
        out = st.to_bytes()
        t3 = time.perf_counter()
        assert len(out) == len(blob)
        for key, v in zip(times, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
            times[key].append(v * 1000)
    times = {k: v[2:] for k, v in times.items()}
    med = statistics.median
    body = (f"Command: `.venv/bin/python benchmarks/codec.py --rounds {a.rounds}`  \n{machine()}; a real "
            f"{st.n_cells}-cell state ({len(blob) / 2**20:.1f} MiB, {st.n_layer} layers, F16 K/V).\n\n"
            "| step | median ms | min ms | max ms |\n|---|---|---|---|\n"
            + "".join(f"| {k} | {med(v):.2f} | {min(v):.2f} | {max(v):.2f} |\n" for k, v in times.items())
            + f"\nGoal parse + edit + write <= 20 ms: median {med(times['total']):.2f} ms.\n")
    print(body)
    if not a.no_write:
        update_section("codec", "KV codec (parse + edit + write, 1024 cells)", body)


if __name__ == "__main__":
    main()
