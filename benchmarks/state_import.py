"""State export and import with and without patch 0004 (one strided copy per run of state rows),
side by side in one run.

    python benchmarks/state_import.py [--backend cpu|vulkan|cuda] [--build cpu|vulkan|cuda]
                                      [--rounds 5] [--imports 20] [--no-write]

Two builds of the same sdist and backend: the patch series up to 0003 (each transposed V row
its own backend copy) and the whole series (one ``ggml_backend_tensor_set_2d`` / ``_get_2d``
per layer).  ``native/build.py`` builds or finds both (cached by source hash); each is
unpacked into its own folder and every round runs one child process per build, alternating
A B A B, on the same prompt (HumanEval/2, the embedded model, the backend's default context).
A child decodes the prompt once, then times ``--imports`` exports (``llama_state_seq_get_data``)
and imports (``llama_state_seq_set_data``) of the sequence and checks that every import reads
back as the exported bytes.  The ratio is per round (without / with 0004); the section goes to
docs/benchmarks.md.  On backends without a 2-D copy (CPU, Vulkan) 0004 loops over the rows as
before, so the ratio there says what the patch costs, not what it saves; on CUDA it is one
cudaMemcpy2D per layer.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import machine, update_section  # noqa: E402
from statelab.errors import script_main  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time, hashlib
from statelab import prompts
from statelab.models import default_model_path
from statelab.runtime import Context, ContextConfig, Model, layouts
backend, n = sys.argv[1], int(sys.argv[2])
model = Model(default_model_path(), backend=backend)
toks = model.tokenize(prompts.humaneval(2).text)
out = {"llama_cpp": __import__("llama_cpp").__file__}
with Context(model, ContextConfig(backend=backend, n_ctx=1024)) as ctx:
    ctx.decode(toks, 0, logits="none")
    blob = ctx.state_get()
    exp, imp = [], []
    try:
        c0 = layouts.state_copies()
    except layouts.LayoutError:  # a build without 0004 has no counter
        c0 = None
    for _ in range(n):
        t = time.perf_counter(); b = ctx.state_get(); exp.append(time.perf_counter() - t)
        assert b == blob
        t = time.perf_counter(); ctx.state_set(blob); imp.append(time.perf_counter() - t)
    c1 = layouts.state_copies() if c0 is not None else None
    assert ctx.state_get() == blob
out.update(export_s=exp, import_s=imp, bytes=len(blob), sha=hashlib.sha256(blob).hexdigest()[:12])
out["copies_per_import"] = out["pieces_per_import"] = None
if c0 is not None:  # n exports and n imports, each the same pieces
    out["copies_per_import"] = (c1["copies"] - c0["copies"]) / (2 * n)
    out["pieces_per_import"] = (c1["pieces"] - c0["pieces"]) / (2 * n)
model.close()
print("RESULT " + json.dumps(out))
"""


class BenchError(Exception):
    pass


def build(backend: str, upto: str | None, tree: str | None = None) -> Path:
    cmd = [sys.executable, str(REPO / "native" / "build.py"), "--backend", backend, "--no-install"]
    if tree:
        cmd += ["--tree", tree]
    if upto:
        cmd += ["--upto", upto]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise BenchError(f"native build failed ({' '.join(cmd[2:])}): {r.stderr.strip().splitlines()[-1:]}")
    wheel = Path(r.stdout.strip().splitlines()[-1])
    if wheel.suffix != ".whl" or not wheel.is_file():
        raise BenchError(f"native/build.py printed no wheel: {r.stdout[-300:]}")
    return wheel


def unpack(wheel: Path, into: Path) -> Path:
    into.mkdir(parents=True)
    with zipfile.ZipFile(wheel) as z:
        z.extractall(into)
    return into


def child(site: Path, backend: str, n: int) -> dict:
    path = os.pathsep.join(p for p in (str(site), str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "STATELAB_THREADS": os.environ.get("STATELAB_THREADS", "1")}
    r = subprocess.run([sys.executable, "-c", CHILD, backend, str(n)], capture_output=True, text=True, env=env)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode != 0 or not line:
        raise BenchError(f"the timing child failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    res = json.loads(line[-1][len("RESULT "):])
    if not res["llama_cpp"].startswith(str(site)):
        raise BenchError(f"the child loaded {res['llama_cpp']}, not the build under {site}")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cpu", choices=("cpu", "vulkan", "cuda"))
    ap.add_argument("--build", choices=("cpu", "vulkan", "cuda"),
                    help="the native build family (default: the backend's; every build holds the CPU backend)")
    ap.add_argument("--tree", help="build from this unpacked copy of the pinned sdist (native/build.py --tree)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--imports", type=int, default=20)
    ap.add_argument("--no-write", action="store_true", help="print the section, leave docs/benchmarks.md alone")
    a = ap.parse_args(argv)
    if a.rounds < 1 or a.imports < 1:
        print("error: --rounds and --imports must be at least 1", file=sys.stderr)
        return 2
    try:
        with tempfile.TemporaryDirectory(prefix="statelab-bench-") as tmp:
            fam = a.build or a.backend
            sites = {"without 0004": unpack(build(fam, "0003", a.tree), Path(tmp) / "a"),
                     "with 0004": unpack(build(fam, None, a.tree), Path(tmp) / "b")}
            runs: dict[str, list[dict]] = {k: [] for k in sites}
            for i in range(a.rounds):
                for k in (sites if i % 2 == 0 else reversed(list(sites))):
                    runs[k].append(child(sites[k], a.backend, a.imports))
                    print(f"round {i + 1}: {k}: import median {1e3 * statistics.median(runs[k][-1]['import_s']):.3f} ms",
                          flush=True)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    shas = {r["sha"] for rs in runs.values() for r in rs}
    med = {k: [statistics.median(r["import_s"]) for r in rs] for k, rs in runs.items()}
    mexp = {k: [statistics.median(r["export_s"]) for r in rs] for k, rs in runs.items()}
    ratios = [a_ / b_ for a_, b_ in zip(med["without 0004"], med["with 0004"])]
    eratios = [a_ / b_ for a_, b_ in zip(mexp["without 0004"], mexp["with 0004"])]
    one = runs["with 0004"][0]
    rows = "\n".join(
        f"| {k} | {1e3 * statistics.median(med[k]):.3f} | {1e3 * statistics.median(mexp[k]):.3f} | "
        f"{runs[k][0]['copies_per_import'] if runs[k][0]['copies_per_import'] is not None else 'n/a (no counter)'} |"
        for k in runs)
    build_arg = f" --build {a.build}" if a.build else ""
    body = (f"Command: `python benchmarks/state_import.py --backend {a.backend}{build_arg} --rounds {a.rounds} "
            f"--imports {a.imports}` "
            f"({machine()}).\n\nHumanEval/2 on the embedded model, {a.backend}, one sequence of {one['bytes']:,} state "
            f"bytes ({one['pieces_per_import']:.0f} K/V pieces per import or export); each figure the median over "
            f"rounds of each child's median over {a.imports} calls. Same state bytes in every run: "
            f"{'yes' if len(shas) == 1 else 'NO'}.\n\n"
            "| build | import (ms) | export (ms) | backend copies per import |\n|---|---|---|---|\n" + rows +
            f"\n\nImport without / with 0004: {statistics.median(ratios):.2f}x (per round "
            f"{', '.join(f'{r:.2f}' for r in ratios)}); export {statistics.median(eratios):.2f}x (per round "
            f"{', '.join(f'{r:.2f}' for r in eratios)}).\n")
    print(body)
    if not a.no_write:
        update_section(f"state-import-{a.backend}", f"State import and export, patch 0004 ({a.backend})", body)
    return 0


if __name__ == "__main__":
    sys.exit(script_main(main))
