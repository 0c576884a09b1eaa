"""KV codec speed: parse + edit + re-serialise real 1024-cell sequence states of two model families.

    .venv/bin/python benchmarks/codec.py [--rounds 30] [--models smollm2,gemma3]

Each state comes from a real 1024-token prefill (HumanEval prompts concatenated), F16 K/V:
the embedded default SmolLM2-135M (one KV cache, 30 layers) and Gemma 3 270M (an iSWA
memory: a full cache of 3 layers holding all 1024 cells and a sliding-window cache of 15
layers holding the 512 cells its window sees), parsed with the model's layer map.  Edit:
one K value in every layer and the whole first stored layer's V block replaced from a
second array (what a subset cross does).  The models' rounds are interleaved.  Goal:
<= 20 ms per state.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
from _report import machine, update_section

from statelab import prompts
from statelab.errors import script_main
from statelab.kvstate import KVState
from statelab.runtime import Context, ContextConfig, Model

STEPS = ("parse", "edit", "write", "total")


def real_state(model, n_cells: int) -> bytes:
    toks = np.concatenate([model.tokenize(prompts.humaneval(i).text) for i in range(40)])[:n_cells]
    with Context(model, ContextConfig(n_ctx=2 * n_cells, n_batch=n_cells, n_ubatch=512)) as ctx:
        ctx.decode(toks, 0, logits=None)
        return ctx.state_get()


def one_round(blob: bytes, layout, donor_v0: np.ndarray) -> tuple[list[float], KVState]:
    t0 = time.perf_counter()
    st = KVState.parse(blob, layout)
    t1 = time.perf_counter()
    for k in st.k:
        k[7, 3] = np.float16(1.5)
    st.v[0][...] = donor_v0
    t2 = time.perf_counter()
    out = st.to_bytes()
    t3 = time.perf_counter()
    assert len(out) == len(blob)
    return [(t1 - t0) * 1000, (t2 - t1) * 1000, (t3 - t2) * 1000, (t3 - t0) * 1000], st


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--cells", type=int, default=1024)
    ap.add_argument("--models", default="smollm2,gemma3", help="comma list of model paths or short names")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    cases = []
    for name in a.models.split(","):
        with Model(name) as model:
            blob = real_state(model, a.cells)
            layout = model.memory_layout
        st = KVState.parse(blob, layout)
        assert st.to_bytes() == blob
        cases.append({"name": name, "blob": blob, "layout": layout, "donor": st.v[0][::-1].copy(), "state": st,
                      "times": {k: [] for k in STEPS}})
    for i in range(a.rounds + 2):  # interleaved; the first two rounds are warm-up
        for c in cases:
            t, _ = one_round(c["blob"], c["layout"], c["donor"])
            if i >= 2:
                for k, v in zip(STEPS, t):
                    c["times"][k].append(v)
    med = statistics.median
    load = os.getloadavg()[0]
    lines = []
    for c in cases:
        st = c["state"]
        parts = " + ".join(f"{p.kind} {p.n_cells} cells x {p.n_layer} layers" for p in st.part_list)
        lines.append(f"- {c['name']}: {len(c['blob']) / 2**20:.1f} MiB, {parts}, F16 K/V")
    body = (f"Command: `.venv/bin/python benchmarks/codec.py --rounds {a.rounds} --models {a.models}`  \n{machine()}; "
            f"real states of a {a.cells}-token prefill, rounds interleaved; 1-minute load average "
            f"{load:.1f} when the rounds ended (other processes share the cores):\n\n" + "\n".join(lines) + "\n\n"
            "| model | step | median ms | min ms | max ms |\n|---|---|---|---|---|\n"
            + "".join(f"| {c['name']} | {k} | {med(v):.2f} | {min(v):.2f} | {max(v):.2f} |\n"
                      for c in cases for k, v in c["times"].items())
            + "\nGoal parse + edit + write <= 20 ms per state: "
            + "; ".join(f"{c['name']} median {med(c['times']['total']):.2f} ms "
                        f"({'met' if med(c['times']['total']) <= 20 else 'NOT met'})" for c in cases) + ".\n")
    print(body)
    if not a.no_write:
        update_section("codec", f"KV codec (parse + edit + write, {a.cells} cells, two model families)", body)


if __name__ == "__main__":
    sys.exit(script_main(main))
