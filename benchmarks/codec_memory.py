"""KV codec memory at a model's geometry: time and peak memory of each codec operation on a
synthetic state of a published shape, one fresh process per operation.

    .venv/bin/python benchmarks/codec_memory.py [--shape llama-3.1-8b] [--cells 4096] [--no-write]

The state is what a model of the shape (``statelab/data/shapes.toml``) writes for ``--cells``
tokens with an F16 KV cache and no flash attention (transposed V): ``n_layer`` K and V blocks of
``cells x n_head_kv * head_dim`` values, built with the codec's own synthetic-state helper
(``kvstate.make_state``, seeded random values) and saved as two captures A and B (B: A with a
quarter of its layers changed) through the archive's own writer. No model is needed. For
``llama-3.1-8b`` and 4,096 cells: 2 x 32 x 8 x 128 x 4,096 x 2 bytes = 512 MiB of values.

Each operation runs in its own fresh interpreter with statelab and llama-cpp-python already
imported; its peak is the growth of the resident set over what the process held just before
(``VmHWM`` after resetting it through ``/proc/self/clear_refs``; ``ru_maxrss`` where that is
not allowed), with the Python heap's peak beside it (``tracemalloc``; numpy's arrays count
there, pages of mapped files do not). Operations, each through the library function the
command line calls:

- parse: ``load_capture`` (seal, every file hash, the KV payload's and per-layer hashes, parse)
- round trip: a parsed capture's state serialised to a file and compared with ``kv.bin`` byte
  for byte
- subset cross: recipient A and donor B loaded as read-only maps, a selector over 8 of 32 layers
  and 2 of 8 KV heads (K and V) compiled, the payload the recipient context would import made,
  the byte account (what ``lab.intervene.subset_cross`` does before and after the import; the
  study runners still load their captures as bytes, which adds each capture's size once)
- diff: two captures loaded as read-only maps and compared (``statelab diff``)
- export: a capture loaded as a read-only map and written as a ``llama_state_seq_save_file``
  file (``statelab export-state``)
- import: that file read back and turned into a capture folder (``statelab import-state`` without
  the model checks and the restore into a context); the result must equal A byte for byte

Goal: every peak <= 1.5x the state's size. ``--code DIR`` runs the operations on another
checkout of statelab (the figures before a change).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _report import REPO, machine, update_section

from statelab.errors import script_main
from statelab.kvstate import GGML_F16, MemoryLayout, PartLayout, make_state
from statelab.lab.archive import save_capture
from statelab.lab.formation import Capture, Schedule
from statelab.synth import get_shape

GOAL = 1.5
OPS = ("parse", "round trip", "subset cross", "diff", "export", "import")

#: 8 of 32 layers (the paper's EARLY quarter), KV heads 0 and 1, K and V
SELECTOR = 'description = "benchmark: early layers, two KV heads"\n\n[[term]]\nlayer_fraction = [0, "1/4"]\n' \
           'heads = [0, 1]\ncomponent = "KV"\n'

PRE = """
import json, os, resource, sys, time, tracemalloc
from pathlib import Path
import numpy as np
import statelab.runtime  # llama-cpp-python: held before the baseline, as in every command
from statelab.api import comparable_states, difference_summary
from statelab.kvstate import KVState, compare
from statelab.lab.archive import load_capture, read_manifest, save_capture
from statelab.lab.formation import Capture, Schedule
from statelab.lab.interop import export_state_file, read_state_file, sequence_zero_state, _blob_of
from statelab.lab.intervene import account
from statelab.selection import apply_subset, load_selector, select
D = Path(sys.argv[1])
A, B = D / "A", D / "B"

def load(path):  # as the commands that only read a capture load it (diff, cross, export-state)
    try:
        return load_capture(path, mapped=True)
    except TypeError:  # a tree without mapped loading
        return load_capture(path)

def write_state(st, path):
    with open(path, "wb") as f:
        w = getattr(st, "write_to", None)
        if w is not None:
            w(f)
        else:
            f.write(st.to_bytes())

def same_file(p, q):
    with open(p, "rb") as f, open(q, "rb") as g:
        while True:
            a, b = f.read(1 << 20), g.read(1 << 20)
            if a != b:
                return False
            if not a:
                return True
"""

OP_CODE = {
    "parse": """
c = load_capture(A)
out = c.state.n_layer
""",
    "round trip": """
c = load_capture(A)
write_state(c.state, D / "rt.bin")
out = same_file(D / "rt.bin", A / "kv.bin")
assert out, "the round trip changed bytes"
""",
    "subset cross": """
sel_def = load_selector(D / "SEL.toml")
r, d = load(A), load(B)
sel = select(sel_def, r.state)
try:  # as lab.intervene.subset_cross makes the payload
    from statelab.selection import subset_payload
    blob, mixed = subset_payload(r.state, d.state, sel)
except ImportError:
    mixed = apply_subset(r.state, d.state, sel)
    blob = mixed.to_bytes()
acc = account(r.state, mixed, int(sel.selected_bytes), True)
out = [int(sel.selected_bytes), acc.changed_bytes, len(blob)]
""",
    "diff": """
a, b = load(A), load(B)
sa, sb = comparable_states(a, b)
out = [compare(sa, sb).first_differing_layer, difference_summary(a, b, (sa, sb))["first_layer"]]
""",
    "export": """
c = load(A)
export_state_file(c, D / "s.bin")
out = (D / "s.bin").stat().st_size
""",
    "import": """
sf = read_state_file(D / "s.bin")
st = sequence_zero_state(sf.memory, sf.source)
st.check_positions()
blob = _blob_of(st)
ref = read_manifest(A, "statelab.capture/2")
c = Capture("imported", "0" * 64, sf.tokens, np.zeros(8, np.float32), blob, Schedule("Imported"),
            {"origin": "imported", "memory": ref["identity"]["memory"]})
save_capture(c, D / "imported", overwrite=(D / "imported").exists())
out = len(blob)
""",
}

MEASURE = """
op = sys.argv[2]
import gc
gc.collect()
peak_rss = Peak()
peak_rss.reset()
how = peak_rss.how
before = status("VmRSS:")
tracemalloc.start()
t0 = time.perf_counter()
exec(compile(CODE, op, "exec"))
dt = time.perf_counter() - t0
py_peak = tracemalloc.get_traced_memory()[1]
tracemalloc.stop()
peak = peak_rss.read()
print("RESULT " + json.dumps({"op": op, "s": dt, "rss": peak - before, "py": py_peak, "how": how,
                              "out": out}, default=str))
"""


def make_captures(d: Path, shape_name: str, n_cells: int, seed: int) -> int:
    """Captures A and B of the shape's KV geometry; returns the size of A's KV payload."""
    shape = get_shape(shape_name)
    width = shape.n_head_kv * shape.head_dim
    layout = MemoryLayout("kv", (PartLayout("kv", tuple(range(shape.n_layer))),), shape.n_layer, shape.name,
                          shape.n_head_kv)
    st = make_state(n_cells, shape.n_layer, width, k_type=GGML_F16, v_trans=True, seed=seed)
    tokens = np.random.default_rng(seed).integers(0, 32000, n_cells).astype(np.int32)
    ident = {"model_sha256": "0" * 64, "backend": "cpu", "memory": layout.as_dict(), "origin": "synthetic",
             "shape": shape.name}
    prompt_sha = hashlib.sha256(tokens.tobytes()).hexdigest()

    def capture(blob, name):
        return Capture("synthetic", prompt_sha, tokens, np.zeros(8, np.float32), blob, Schedule(name), ident)

    blob = st.to_bytes()
    save_capture(capture(blob, "A"), d / "A")
    size = len(blob)
    del blob
    rng = np.random.default_rng(seed + 1)
    for il in range(shape.n_layer // 2, shape.n_layer, 4):  # a quarter of the layers, from the middle on
        st.k[il][...] = rng.standard_normal(st.k[il].shape).astype(np.float16)
        st.v[il][...] = rng.standard_normal(st.v[il].shape).astype(np.float16)
    save_capture(capture(st.to_bytes(), "B"), d / "B")
    (d / "SEL.toml").write_text(SELECTOR)
    return size


def run_op(d: Path, op: str, pythonpath: str) -> dict:
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\nfrom _rss import Peak, status\n"
            + PRE + f"CODE = {OP_CODE[op]!r}\n" + MEASURE)
    env = {**os.environ, "PYTHONPATH": pythonpath}
    r = subprocess.run([sys.executable, "-c", code, str(d), op], capture_output=True, text=True, env=env,
                       cwd=pythonpath)  # `python -c` puts the working folder first on sys.path
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode != 0 or not line:
        tail = (r.stderr.strip().splitlines() or ["?"])[-1]
        return {"op": op, "error": tail}
    return json.loads(line[-1][len("RESULT "):])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--cells", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma list of {', '.join(OPS)}")
    ap.add_argument("--code", default=str(REPO), help="the statelab tree the operations run (default: this one)")
    ap.add_argument("--dir", help="keep the captures and outputs in this folder (default: a temporary one)")
    ap.add_argument("--no-write", action="store_true", help="print the section, leave docs/benchmarks.md alone")
    a = ap.parse_args(argv)
    ops = [o.strip() for o in a.ops.split(",") if o.strip()]
    bad = [o for o in ops if o not in OPS]
    if bad or a.cells < 1:
        print(f"error: unknown operation(s) {bad} (choose from {', '.join(OPS)}) or --cells < 1", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="statelab-codec-mem-", dir=a.dir) as tmp:
        d = Path(tmp)
        t0 = time.perf_counter()
        size = make_captures(d, a.shape, a.cells, a.seed)
        print(f"captures made in {time.perf_counter() - t0:.1f} s: KV payload {size:,} bytes "
              f"({size / 2**20:.1f} MiB)", flush=True)
        rows = []
        for op in ops:
            r = run_op(d, op, a.code)
            rows.append(r)
            if "error" in r:
                print(f"{op}: FAILED: {r['error']}", flush=True)
            else:
                print(f"{op}: {r['s']:.2f} s, peak RSS +{r['rss'] / 2**20:.0f} MiB ({r['rss'] / size:.2f}x), "
                      f"Python heap peak {r['py'] / 2**20:.0f} MiB ({r['py'] / size:.2f}x)", flush=True)
    shape = get_shape(a.shape)
    table = ("| operation | seconds | peak RSS growth (MiB) | / state | Python heap peak (MiB) | / state | "
             f"<= {GOAL}x |\n|---|---|---|---|---|---|---|\n")
    for r in rows:
        if "error" in r:
            table += f"| {r['op']} | failed: {r['error']} | | | | | |\n"
            continue
        ratio = max(r["rss"], r["py"]) / size
        table += (f"| {r['op']} | {r['s']:.2f} | {r['rss'] / 2**20:.0f} | {r['rss'] / size:.2f} | "
                  f"{r['py'] / 2**20:.0f} | {r['py'] / size:.2f} | {'yes' if ratio <= GOAL else 'NO'} |\n")
    hows = sorted({r["how"] for r in rows if "how" in r})
    body = (f"Command: `.venv/bin/python benchmarks/codec_memory.py --shape {a.shape} --cells {a.cells}`  \n"
            f"{machine()}. A synthetic state of the {a.shape} KV geometry ({shape.n_layer} layers, "
            f"{shape.n_head_kv} KV heads of {shape.head_dim}, F16 K and V, transposed V) for {a.cells:,} tokens: "
            f"{size:,} bytes ({size / 2**20:.1f} MiB). Each operation in a fresh process; peak RSS growth over "
            f"the process's resident set just before it ({', '.join(hows)}), Python heap peak from tracemalloc "
            "(numpy arrays included, mapped file pages not). The subset cross selects layers 0..7 and KV heads "
            "0 and 1 (K and V: 1/16 of the values).\n\n" + table)
    print(body)
    if not a.no_write:
        update_section("codec-memory", f"KV codec memory at {a.shape} geometry ({a.cells:,} tokens, F16 K/V)", body)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(script_main(main))
