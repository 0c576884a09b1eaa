"""Cells per minute of a study (default: the CI study) on the local process pool versus a
Dask LocalCluster with the same number of workers (or any executors named by --executors,
e.g. local,batch), measured in one run.

The local and Dask executors run every cell of the study in a fresh process; the batch
executor one process per (prompt, direction, repeat).  The per-prompt controls
(captures, naturals, shams, EMPTY/ALL) run once, in a first local run; the other runs start
from copies of that folder (same captures, same controls), so only the cell phase is
compared: from the first cell submitted to the last result appended, Dask's LocalCluster
start and shutdown included.  Rounds alternate the executors (local, dask, local, dask...)
so a drift of the shared machine hits both.  Before timings are compared, every run must
give the same deterministic records (qualification); a run that does not is reported and
fails the benchmark.

    python benchmarks/study_executors.py [--spec studies/ci.toml] [--workers 2] [--rounds 1]
        [--executors local,dask-local]

Writes (or replaces) the section "## Study executors" of docs/benchmarks.md (with other
executors: "## Study executors: A, B (STUDY)").
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import re
import resource
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from statelab.study import CellLog, load_spec, run_study  # noqa: E402

HEADING = "## Study executors"
VOLATILE = {"timing", "pid", "host", "same_mask_as"}  # same_mask_as: which cell the batch executor crossed


def _records(out: Path) -> dict:
    return {r["key"]: {k: v for k, v in r.items() if k not in VOLATILE} for r in CellLog(out / "cells.jsonl").records()}


def _fresh_copy(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("cells.jsonl", "results.nc", "report.md", "runs.jsonl"))


def update_section(doc: Path, body: str, heading: str = HEADING) -> None:
    text = doc.read_text() if doc.is_file() else "# Benchmarks\n\nMeasured results; each section is written by the script it names.\n"
    section = f"{heading}\n\n{body.strip()}\n"
    # the section ends at the next heading or at the start marker of a _report.py section
    pattern = re.compile(rf"^{re.escape(heading)}$.*?(?=^## |^<!-- bench:|\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _m: section + "\n", text, count=1).rstrip() + "\n"
    else:
        text = text.rstrip() + "\n\n" + section
    from statelab.paths import atomic_write_text

    atomic_write_text(doc, text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", type=Path, default=REPO / "studies" / "ci.toml")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds of the executors")
    ap.add_argument("--executors", default="local,dask-local", help="comma-separated, the first one forms the controls")
    ap.add_argument("--doc", type=Path, default=REPO / "docs" / "benchmarks.md")
    ap.add_argument("--keep", type=Path, default=None, help="keep the study folders here")
    args = ap.parse_args(argv)

    spec = load_spec(args.spec)
    root = Path(tempfile.mkdtemp(prefix="statelab-bench-")) if args.keep is None else args.keep
    root.mkdir(parents=True, exist_ok=True)
    seed = root / "seed"
    print(f"controls and captures (local, once) -> {seed}", flush=True)
    exs = [e.strip() for e in args.executors.split(",") if e.strip()]
    cpu = {e: [] for e in exs}

    def timed(ex, out):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        s = run_study(args.spec, out, ex, args.workers, spec=spec)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        used = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        cpu[ex].append(used / max(s.ran, 1))
        return s

    first = timed(exs[0], seed)
    reference = _records(seed)
    runs = {e: [] for e in exs}
    runs[exs[0]].append(first)
    failures = []
    for r in range(args.rounds):
        for ex in (exs[1:] if r == 0 else exs):
            out = root / f"{ex}-{r}"
            _fresh_copy(seed, out)
            s = timed(ex, out)
            runs[ex].append(s)
            if _records(out) != reference or s.failed:
                failures.append(f"{ex} round {r}: records differ from the first {exs[0]} run")
            print(f"{ex:10s} round {r}: {s.ran} cells in {s.cells_seconds:.1f} s = {s.cells_per_minute:.1f} cells/min",
                  flush=True)
    if first.failed:
        failures.append(f"the first {exs[0]} run had failed cells")

    n_cells = first.ran
    rows, med = [], {}
    for ex in exs:
        rs = runs[ex]
        cpm = [s.cells_per_minute for s in rs]
        secs = [s.cells_seconds for s in rs]
        start = [s.executor_startup_s for s in rs]
        net = [60.0 * s.ran / (s.cells_seconds - s.executor_startup_s) for s in rs]
        med[ex] = statistics.median(cpm)
        rows.append(f"| {ex} | {args.workers} | {len(rs)} | {n_cells} | {statistics.median(secs):.1f} | "
                    f"{statistics.median(start):.1f} | {med[ex]:.1f} | {statistics.median(net):.1f} | "
                    f"{statistics.median(cpu[ex]):.2f} | {', '.join(f'{x:.1f}' for x in cpm)} |")
    a, b = exs[0], exs[1] if len(exs) > 1 else exs[0]
    pair = [x.cells_per_minute / y.cells_per_minute for x, y in zip(runs[a], runs[b])]
    recs = CellLog(seed / "cells.jsonl").records()
    proc_s = statistics.median(r["timing"].get("subprocess_s", r["timing"]["process_s"]) for r in recs)
    load_s = statistics.median(r["timing"]["load_s"] for r in recs)
    cross_s = statistics.median(r["timing"]["cross_s"] for r in recs)
    load = os.getloadavg()
    qual = ("every run gave the same deterministic records as the first local run" if not failures
            else "FAILED: " + "; ".join(failures))
    body = f"""\
Command: `python benchmarks/study_executors.py --spec {os.path.relpath(args.spec, REPO)} --workers {args.workers} --rounds {args.rounds} --executors {','.join(exs)}`
({dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; {platform.machine()}, {os.cpu_count()} CPUs shared
with other work, load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}; spec hash {spec.hash[:12]}).

Study `{spec.name}`: {len(spec.prompts)} prompts x {len(spec.selectors)} selectors x {len(spec.directions)} directions x {spec.repeats} repeats = {n_cells} cells, output cap {spec.cap}, {spec.threads} thread(s) per cell.
local and dask-local run every cell in its own fresh process; batch runs one process per (prompt, direction,
repeat) and crosses a byte-identical selection once per process. Timed: the cell phase only, from the first
submission to the last durable append, Dask's LocalCluster start and shutdown included (start also shown
apart); the per-prompt controls ran once and every run starts from the same captures and controls.
Rounds alternate the executors. Qualification: {qual}.

| executor | workers | runs | cells | median cell phase (s) | median executor start (s) | median cells/min | cells/min without start | CPU s per cell | each run (cells/min) |
|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

{a} / {b} throughput ratio: {med[a] / med[b]:.3f} (medians); per round
({a} run, then the {b} run right after it): {', '.join(f'{x:.3f}' for x in pair)}. CPU s per cell: user + system
time of all descendant processes (the cell processes and, under Dask, its worker processes), divided by the cells run.
Per cell (median, first {a} run): {proc_s:.2f} s in its process, of which model load {load_s:.2f} s and the
subset cross {cross_s:.2f} s; the rest is interpreter start, imports and reading the verified captures.
The machine is shared: quote medians and the ratio, not single absolute times.
"""
    default = exs == ["local", "dask-local"]
    update_section(args.doc, body, HEADING if default else f"{HEADING}: {', '.join(exs)} ({spec.name})")
    print(body)
    if args.keep is None:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
