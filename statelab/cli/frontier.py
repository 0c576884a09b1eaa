"""``statelab frontier ...``: frontier panels with full FP32 logit traces.

The frontier and report modules are imported inside each command (they load xarray and
matplotlib)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from statelab.cli.common import app, print_text, say

frontier_app = typer.Typer(add_completion=False, no_args_is_help=True,
                           help="Frontier panels (2x2: EMPTY, component 1, component 2, both) with full FP32 "
                                "logit traces: t*, fixed-pair scores, additive prediction and interaction.")
app.add_typer(frontier_app, name="frontier")


@frontier_app.command("run")
def frontier_run_(spec: Path = typer.Argument(..., help="frontier spec (studies/frontier-*.toml)"),
                  out: Optional[Path] = typer.Option(None, "--out", "-o",
                                                     help="run folder (default runs/frontier/NAME); resumes"),
                  workers: int = typer.Option(1, "--workers", "-w", help="worker processes at once"),
                  executor: str = typer.Option("local", "--executor", "-e", help="local (fork server), local-spawn, "
                                               "dask-local or dask://HOST:PORT")):
    """Run (or resume) a frontier spec: traces in fresh processes, then results.nc, report.md, plots."""
    from statelab.experiments.frontier_panels import run_frontier
    from statelab.report import frontier_page

    s = run_frontier(spec, out, workers, say=say, executor=executor)
    print_text(f"{s.out}: {s.ran} worker(s) run, {s.skipped} already done, {s.seconds:.0f} s; "
               f"{s.outputs['n_frontiers']} panel repeat(s) with a frontier; repeats agree on "
               f"{s.outputs['agreement'][0]} of {s.outputs['agreement'][1]} compared contrasts")
    print_text(f"report: {s.report}, {frontier_page(s.out)}\nresults: {s.results}")


@frontier_app.command("analyse")
def frontier_analyse_(results_dir: Path = typer.Argument(..., help="a frontier run folder")):
    """Recompute the dataset, tables and plots from the stored traces (no model is loaded)."""
    from statelab.experiments.frontier_panels import reanalyse
    from statelab.report import frontier_page

    r, paths, page = reanalyse(results_dir, frontier_page)
    a = r.agreement.attrs
    print_text(f"{results_dir}: {r.n_frontiers} panel repeat(s) with a frontier; repeats agree on "
               f"{a['n_agree']} of {a['n_compared']} compared contrasts")
    print_text(f"report: {paths['report']}, {page}\nresults: {paths['results']}")
