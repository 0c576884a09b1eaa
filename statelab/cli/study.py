"""``statelab study ...``: selector-matrix studies and their findings.

The engine and report modules are imported inside each command (they load xarray,
matplotlib and, in the workers, llama_cpp)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from statelab.cli.common import app, console, err
from statelab.paths import atomic_write_text

study_app = typer.Typer(add_completion=False, no_args_is_help=True,
                        help="Selector-matrix studies: spec -> cells in fresh processes -> results.nc + report.md.")
app.add_typer(study_app, name="study")


@study_app.command("run")
def study_run(spec: Path = typer.Argument(..., help="study spec (studies/*.toml)"),
              out: Optional[Path] = typer.Option(None, "--out", "-o", help="output folder (default runs/studies/NAME)"),
              executor: str = typer.Option("local", "--executor", "-e", help="local (fork server), batch (one "
                                           "process per prompt, direction and repeat, or per repeat with --lanes), local-spawn, dask-local or "
                                           "dask://HOST:PORT"),
              workers: int = typer.Option(2, "--workers", "-w", help="cells (batch: batch processes) running at once"),
              lanes: int = typer.Option(1, "--lanes", help="batch executor: cells at once in each batch process, "
                                        "which then runs a whole repeat (the shape for a GPU: --workers 1 --lanes 8)")):
    """Run (or resume) a study: controls per prompt, then every cell in a fresh process (batch:
    a process per batch of cells, each cell in a cleared context)."""
    from statelab.experiments.matrix import run_study
    from statelab.experiments.progress import RichReporter
    from statelab.experiments.matrix import StudyDir
    from statelab.report import study_page

    def page(folder, ds, md):
        return study_page(folder, ds, md, StudyDir(folder).natural_pairs())

    s = run_study(spec, out, executor, workers, RichReporter(err), on_compiled=page, lanes=lanes)
    console.print(f"{'resumed' if s.resumed else 'ran'} {s.out}: {s.ran} cells run ({s.failed} failed), "
                  f"{s.skipped} already done, {s.withheld} withheld, {s.seconds:.0f} s"
                  + (f", {s.cells_per_minute:.1f} cells/min" if s.ran else ""))
    console.print(f"report: {s.report}, {s.page}\nresults: {s.results}")
    if s.withheld:  # a failed control is a failed run, even though the report is written
        err.print(f"controls failed: {s.withheld} cells withheld (reasons in {s.report})", markup=False,
                  highlight=False)
    if s.failed or s.withheld:
        raise typer.Exit(1)


@study_app.command("report")
def study_report(out: Path = typer.Argument(..., help="a study output folder")):
    """Recompile results.nc and report.md from cells.jsonl (no model needed)."""
    from statelab.experiments.matrix import StudyDir, compile_study
    from statelab.report import study_page

    ds, md = compile_study(out, on_compiled=lambda folder, ds, md: study_page(folder, ds, md,
                                                                              StudyDir(folder).natural_pairs()))
    # the page too is written under the folder's lock
    n_ok = int((ds.status.values == "ok").sum())
    console.print(f"{n_ok} of {ds.status.size} cells done -> {out / 'report.md'}, {out / 'report.html'}, "
                  f"{out / 'results.nc'}")


@study_app.command("minimal")
def study_minimal(spec: Path = typer.Argument(..., help="study spec"),
                  prompt: str = typer.Option(..., "--prompt", "-p", help="one of the study's prompts"),
                  direction: str = typer.Option(..., "--direction", "-d", help="e.g. A->R"),
                  out: Optional[Path] = typer.Option(None, "--out", "-o", help="reuse this study folder's captures"),
                  json_out: Optional[Path] = typer.Option(None, "--json", help="also write the result as JSON")):
    """Search a small sufficient selection (layers, then positions) reproducing the donor."""
    from statelab.experiments.matrix import minimal_selection

    res = minimal_selection(spec, prompt, direction, out,
                            progress=lambda t: err.print(f"[dim]layers {t['layers']} positions {t['positions']}: "
                                                         f"{t['klass']}[/dim]", highlight=False))
    if res["found"]:
        console.print(f"{res['prompt']} {res['direction']}: layers {res['layers']} positions "
                      f"[{res['positions'][0]}, {res['positions'][1]}) reproduce the donor; "
                      f"{res['selected_bytes']} bytes ({res['share']:.3%}), {res['evaluations']} evaluations")
    else:
        console.print(f"{res['prompt']} {res['direction']}: even ALL does not reproduce the donor endpoint")
    if json_out:
        atomic_write_text(json_out, json.dumps(res, indent=2))


@study_app.command("findings")
def study_findings(runs: list[Path] = typer.Argument(..., help="study output folders (compiled results)"),
                   out: Path = typer.Option(..., "--out", "-o", help="folder for findings.md/.json/.nc and figures")):
    """The paper's claims as tables with denominators, over one or more study folders (no model)."""
    from statelab.experiments.findings_inputs import load_runs
    from statelab.report.findings import write

    path, f = write(load_runs(runs), out)
    console.print(f"{len(f.runs)} studies, {len(f.natural)} natural pairs, {len(f.nonmono_pairs)} non-monotone "
                  f"pairs, {f.minimal['searched']} minimal searches, {f.panels['panels']} panels -> {path}")


@study_app.command("findings-run")
def study_findings_run(out: Path = typer.Argument(..., help="a finished study folder"),
                       kind: str = typer.Option(..., "--kind", "-k", help="minimal or panels"),
                       budget: float = typer.Option(..., "--budget", "-b", help="wall seconds; no target starts after"),
                       workers: int = typer.Option(2, "--workers", "-w", help="worker processes"),
                       limit: Optional[int] = typer.Option(None, "--limit", help="at most this many new targets"),
                       lanes: int = typer.Option(1, "--lanes", help="targets at once in each worker process, "
                                                 "one thread and context each, the model loaded once (the GPU shape)"),
                       repeats: int = typer.Option(1, "--repeats", help="panels: process repeats of every panel "
                                                   "(repeat-level contrasts; each repeat in processes of its own)"),
                       independent: bool = typer.Option(False, "--independent", help="only the class-B cells of "
                                                        "directions not folded into another (byte-identical arms)")):
    """Minimal sufficient selections or frontier panels for the study's class-B cells (resumable)."""
    from statelab.experiments.findings_run import run_findings

    s = run_findings(out, kind, budget, workers, limit, lanes=lanes, repeats=repeats, independent=independent)
    c = {"ok": 0, "skipped": 0, **s.counts, **s.outputs}
    console.print(f"{kind}: {s.ran} run ({c['ok']} ok, {c['skipped']} skipped, {s.failed} failed), "
                  f"{c['done_before']} done before, {c['not_started']} not started, of {c['targets']} class-B cells; "
                  f"{s.seconds:.0f} s")
