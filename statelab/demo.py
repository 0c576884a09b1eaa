"""`statelab demo`: the main job on the embedded default.

Partition study: on CPU the arms A (whole prompt, ubatch 512) and R (token by token);
on CUDA and Vulkan A, B and C.  Natural endpoints, own-path shams, whole-KV crosses both
ways, summarised as a table and written to a Markdown report.
"""
from __future__ import annotations

import time
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from .formation import PRESETS
from .partition import study_prompt
from .paths import atomic_write_text


def default_tasks(backend: str) -> str:
    """Prompts whose natural endpoints differ between the backend's arms (measured: docs/findings.md)."""
    return "HumanEval/0,HumanEval/2,HumanEval/10" if backend == "cpu" else "HumanEval/10,HumanEval/20,HumanEval/86"


def arms_for(backend: str) -> dict:
    names = ("A", "R") if backend == "cpu" else ("A", "B", "C")
    return {n: PRESETS[n] for n in names}


def markdown_table(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)\n"
    cols = list(dict.fromkeys(k for r in rows for k in r))
    fmt = lambda v: "=" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def frontier_section(model, base, prompts, cap: int = 48, console=None, directions=None) -> str:
    """The L0 and POSITION frontier panels of ``prompts`` (Prompt objects or prompt specs) as a
    Markdown section: for the inputs where the selector matrix found donor effects.  Runs in
    this process (one repeat per direction, cap ~48) with the arms that differ on the backend."""
    from . import prompts as prompts_mod
    from .frontier_run import frontier_section as section

    ps = [prompts_mod.resolve(p) if isinstance(p, str) else p for p in prompts]
    say = (lambda msg: console.print(msg, markup=False, highlight=False)) if console is not None else (lambda msg: None)
    return section(model, base, ps, cap, arms=arms_for(base.backend), directions=directions, say=say)


def run(console, model_path, backend: str, cap: int, tasks: list[str], threads: int, out: Path,
        frontier_tasks: list[str] | None = None, frontier_cap: int = 48):
    from . import prompts
    from .receiver import check_cap
    from .runtime import ContextConfig, Model, prepare_backend

    check_cap(cap)
    prepare_backend(backend)
    ps = [prompts.resolve(t.strip()) for t in tasks if t.strip()]
    arms = arms_for(backend)
    model = Model(model_path, backend=backend)
    base = ContextConfig(backend=backend, n_threads=threads)
    n_steps = len(ps) * (2 * len(arms) + 2 * (len(arms) - 1))
    rows, t0 = [], time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=console, transient=True) as prog:
        task = prog.add_task(f"partition study ({', '.join(arms)})", total=n_steps)
        for p in ps:
            res = study_prompt(model, p, arms, base, cap, progress=lambda: prog.advance(task))
            rows += res.rows()
    t = Table(title=f"partition study on {backend}: arms {', '.join(arms)}, cap {cap} "
                    f"({time.perf_counter() - t0:.0f} s)")
    for col in rows[0] if rows else []:
        t.add_column(col)
    for r in rows:
        t.add_row(*["=" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v)) for v in r.values()])
    console.print(t)
    console.print("first_diff: first differing output index of the natural endpoints ('=' equal); "
                  "cross classes: B reproduces the donor, C third trajectory, D keeps the recipient.")
    report = (f"# statelab demo ({backend})\n\nmodel: {model.info.name} ({model.sha256[:16]})\n\n"
              f"## Partition study (arms {', '.join(arms)}, cap {cap})\n\n" + markdown_table(rows))
    if frontier_tasks:
        report += "\n" + frontier_section(model, base, frontier_tasks, frontier_cap, console)
    atomic_write_text(Path(out) / "report.md", report)
    console.print(f"report: {Path(out) / 'report.md'}")
    return rows
