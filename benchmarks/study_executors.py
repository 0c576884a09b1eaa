"""Cells per minute of a study (default: the CI study) under the three local executors with
the same number of workers, measured in one run: the fork server (``local``, the default),
one new interpreter per cell (``local-spawn``, what every cell cost before the fork server)
and a Dask LocalCluster (``dask-local``, whose tasks start new interpreters too).

Each executor runs every cell of the study in a fresh process.  The per-prompt controls
(captures, naturals, shams, EMPTY/ALL) run once, in a first run; the other runs start from
copies of that folder (same captures, same controls), so only the cell phase is compared:
from the first cell submitted to the last result appended, the fork server's and Dask's
start and shutdown included.  Rounds alternate the executors so a drift of the shared
machine hits all of them.  Before timings are compared, every run must give the same
deterministic records (qualification); a run that does not is reported and fails the
benchmark.  Then one cell is taken apart in this process (model load, reading and
verifying the captures, context creation, state import, decode) for the breakdown.

    python benchmarks/study_executors.py [--spec studies/ci.toml] [--workers 2] [--rounds 1]
        [--executors local-spawn,local,batch,batch:2]   (batch:L = the batch executor with L lanes)

Writes (or replaces) the section "## Study executors" of docs/benchmarks.md.
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
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from statelab.errors import script_main  # noqa: E402
from statelab.experiments.matrix import CellLog, load_spec, run_study  # noqa: E402
from statelab.experiments.matrix.cells import plan  # noqa: E402
from statelab.experiments.matrix.store import StudyDir  # noqa: E402

HEADING = "## Study executors"
EXECUTORS = ("local-spawn", "local", "dask-local")
VOLATILE = {"timing", "pid", "host", "same_cross_as"}  # same_cross_as: which cell of a batch ran the cross


def _records(out: Path) -> dict:
    return {r["key"]: {k: v for k, v in r.items() if k not in VOLATILE} for r in CellLog(out / "cells.jsonl").records()}


def _fresh_copy(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("cells.jsonl", "results.nc", "report.md", "runs.jsonl"))


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def update_section(doc: Path, body: str) -> None:
    text = doc.read_text() if doc.is_file() else "# Benchmarks\n\nMeasured results; each section is written by the script it names.\n"
    section = f"{HEADING}\n\n{body.strip()}\n"
    # the section ends at the next heading or at the start marker of a _report.py section
    pattern = re.compile(rf"^{re.escape(HEADING)}\b.*?(?=^## |^<!-- bench:|\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _m: section + "\n", text, count=1).rstrip() + "\n"
    else:
        text = text.rstrip() + "\n\n" + section
    from statelab.paths import atomic_write_text

    atomic_write_text(doc, text)


def breakdown(seed: Path, repeats: int = 3) -> dict:
    """One cell taken apart in this process, the pieces timed (median of ``repeats``)."""
    import time

    import numpy as np

    from statelab.lab.archive import check_importable, load_capture
    from statelab.lab.intervene import account, config_of
    from statelab.lab.receiver import continue_greedy
    from statelab.runtime import Context, Model
    from statelab.selection import apply_subset, load_selector, select

    sdir = StudyDir(seed)
    rec = sdir.read_spec()
    ctls = {p["id"]: sdir.read_controls(p["id"]) for p in rec["normalized"]["prompts"]}
    tasks, _ = plan(rec, sdir, ctls)
    task = next(t for t in tasks if t["selector"] == "ALL")
    times: dict[str, list[float]] = {}

    def lap(name, t0):
        t1 = time.perf_counter()
        times.setdefault(name, []).append(t1 - t0)
        return t1

    for _ in range(repeats):
        t = time.perf_counter()
        model = Model(task["model"], backend=task["backend"])
        t = lap("model load", t)
        donor, recipient = load_capture(task["donor_capture"]), load_capture(task["recipient_capture"])
        t = lap("read + verify 2 captures", t)
        sel = select(load_selector(task["selector_source"], search_dirs=task["selector_dirs"]), recipient.state)
        config = config_of(recipient)
        check_importable(donor, model, config)
        blob = apply_subset(recipient.state, donor.state, sel).to_bytes()
        t = lap("selection + mixed state", t)
        ctx = Context(model, config)
        t = lap("context creation", t)
        ctx.state_set(blob)
        assert ctx.state_get() == blob
        t = lap("state import + read-back", t)
        ep = continue_greedy(ctx, recipient.logits, recipient.n_prompt, int(task["cap"]))
        t = lap(f"decode ({ep.length} outputs)", t)
        ctx.close()
        account(recipient.state, apply_subset(recipient.state, donor.state, sel), sel.selected_bytes, True)
        t = lap("byte accounting", t)
        model.close()
    return {k: float(np.median(v)) for k, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", type=Path, default=REPO / "studies" / "ci.toml")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="rounds, each running every executor once")
    ap.add_argument("--doc", type=Path, default=REPO / "docs" / "benchmarks.md")
    ap.add_argument("--keep", type=Path, default=None, help="keep the study folders here")
    ap.add_argument("--executors", default=",".join(EXECUTORS),
                    help="comma-separated, local and local-spawn included (e.g. local-spawn,local,batch,batch:2; "
                         "batch:L runs the batch executor with L lanes)")
    args = ap.parse_args(argv)
    exs = tuple(x for x in args.executors.split(",") if x)
    if not {"local", "local-spawn"} <= set(exs):
        ap.error("--executors must include local and local-spawn")

    spec = load_spec(args.spec)
    root = Path(tempfile.mkdtemp(prefix="statelab-bench-")) if args.keep is None else args.keep
    root.mkdir(parents=True, exist_ok=True)
    seed = root / "seed"
    print(f"controls and captures (fork server, once; not timed) -> {seed}", flush=True)
    cpu: dict[str, list[float]] = {ex: [] for ex in exs}
    runs: dict[str, list] = {ex: [] for ex in exs}

    def timed(ex, out):
        name, _, lanes = ex.partition(":")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        s = run_study(args.spec, out, name, args.workers, spec=spec, lanes=int(lanes or 1))
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        used = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        cpu[ex].append(used / max(s.ran, 1))
        return s

    first = run_study(args.spec, seed, "local", args.workers, spec=spec)
    reference = _records(seed)
    failures = ["the first run had failed cells"] if first.failed else []
    for r in range(args.rounds):
        order = exs[r % len(exs):] + exs[:r % len(exs)]  # rotate who goes first
        for ex in order:
            out = root / f"{ex}-{r}"
            _fresh_copy(seed, out)
            s = timed(ex, out)
            runs[ex].append(s)
            if _records(out) != reference or s.failed:
                failures.append(f"{ex} round {r}: records differ from the first run")
            print(f"{ex:11s} round {r}: {s.ran} cells in {s.cells_seconds:.1f} s = {s.cells_per_minute:.1f} cells/min",
                  flush=True)

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
    fork_spawn = [a.cells_per_minute / b.cells_per_minute for a, b in zip(runs["local"], runs["local-spawn"])]
    others = [ex for ex in exs if ex not in ("local", "local-spawn")]
    versus = {ex: [a.cells_per_minute / b.cells_per_minute for a, b in zip(runs["local"], runs[ex])] for ex in others}

    def per_cell(ex, key):
        recs = [r for s in runs[ex] for r in CellLog(s.out / "cells.jsonl").records()]
        vals = [r["timing"][key] for r in recs if r.get("timing", {}).get(key) is not None]
        return statistics.median(vals) if vals else float("nan")

    print("one cell taken apart in this process ...", flush=True)
    parts = breakdown(seed)
    parts_rows = "\n".join(f"| {k} | {v:.3f} |" for k, v in parts.items())
    load = os.getloadavg()
    ratio = med["local"] / med["local-spawn"]
    goal = "met" if ratio >= 2.0 else "NOT met"
    qual = ("every run gave the same deterministic records as the first run" if not failures
            else "FAILED: " + "; ".join(failures))
    body = f"""\
Command: `python benchmarks/study_executors.py --spec {os.path.relpath(args.spec, REPO)} --workers {args.workers} --rounds {args.rounds} --executors {','.join(exs)}`
({dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}, commit {_commit()}; {platform.machine()}, {os.cpu_count()} CPUs shared
with other work, load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}; spec hash {spec.hash[:12]}).

Study `{spec.name}`: {len(spec.prompts)} prompts x {len(spec.selectors)} selectors x {len(spec.directions)} directions x {spec.repeats} repeats = {n_cells} cells, output cap {spec.cap}, {spec.threads} thread(s) per cell.
Under `local`, `local-spawn` and `dask-local` every cell runs in its own fresh process whose llama.cpp
context has decoded nothing else: `local` forks it from the pre-imported fork server (the default),
`local-spawn` starts a new interpreter per cell (what every cell cost before the fork server),
`dask-local` runs each cell's new interpreter from a Dask LocalCluster task. `batch` (study cells only)
runs one new interpreter per (prompt, direction, repeat), each cell in a context of its configuration
cleared before it, and runs a cross with byte-identical inputs once per process (its cells share a
process, not a state); `batch:L` runs one process per repeat with L cells at once (lanes). Timed: the cell phase only, from the first submission to the
last durable append, the fork server's and Dask's start and shutdown included (start also shown apart);
the per-prompt controls ran once, untimed, and every run starts from the same captures and controls.
Rounds rotate the executors. Qualification: {qual}.

| executor | workers | runs | cells | median cell phase (s) | median executor start (s) | median cells/min | cells/min without start | CPU s per cell | each run (cells/min) |
|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Fork server / new interpreter per cell: {ratio:.2f}x cells per minute (medians; goal >= 2x: {goal}); per round
{', '.join(f'{x:.2f}' for x in fork_spawn)}. {' '.join(f"Fork server / {ex}: {med['local'] / med[ex]:.2f}x (per round {', '.join(f'{x:.2f}' for x in versus[ex])})." for ex in others)} CPU s per cell: user + system time of all descendant
processes (cell processes, the fork server and its children, Dask's worker processes), divided by the cells run.

Per cell, median over every run of the executor (wall seconds as the cell saw them, with the other worker
competing for the two cores): a new interpreter {per_cell('local-spawn', 'subprocess_s'):.2f} s for the whole process,
of which model load {per_cell('local-spawn', 'load_s'):.2f} s, reading and verifying the captures and the selection
{per_cell('local-spawn', 'prepare_s'):.2f} s, the subset cross {per_cell('local-spawn', 'cross_s'):.2f} s; the rest is interpreter
start and imports. A forked child {per_cell('local', 'subprocess_s'):.2f} s: fork {per_cell('local', 'fork_s'):.3f} s, model load
{per_cell('local', 'load_s'):.2f} s (llama.cpp backend initialisation included: the child does it, nothing
in the server initialises a backend), captures and selection {per_cell('local', 'prepare_s'):.2f} s, subset cross
{per_cell('local', 'cross_s'):.2f} s.

One cell (selector ALL) taken apart in the benchmark's own process, median of 3, seconds:

| piece | s |
|---|---|
{parts_rows}

What the fork server keeps and what it cuts: each child still loads the model itself (its own llama.cpp
model and context; the model's sha256 comes from the identity cache keyed by path, size and mtime, as in
every process) and still reads and verifies both captures (seal, file hashes, KV hashes: a few
milliseconds for these sizes, so handing a verified capture down from the server would save little and
would share state between cells). It cuts the interpreter start and the imports (numpy, xarray, pandas,
networkx, llama_cpp), which the server pays once.
The machine is shared: quote medians and ratios, not single absolute times.
"""
    update_section(args.doc, body)
    print(body)
    if args.keep is None:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(script_main(main))
