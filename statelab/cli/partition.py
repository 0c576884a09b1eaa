"""Partition studies on a few prompts: ``sweep`` and ``demo``.

The experiment modules are imported inside each command (they load llama_cpp and xarray)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from statelab.cli.common import (BackendOpt, CapOpt, CtxOpt, HumanEvalOpt, ModelOpt, PromptFileOpt, PromptOpt,
                                 ThreadsOpt, app, console, err, prompt_spec_of)
from statelab.paths import atomic_write_text


@app.command()
def sweep(prompt: Optional[str] = PromptOpt, humaneval: Optional[str] = HumanEvalOpt,
          prompt_file: Optional[Path] = PromptFileOpt, schedules: Optional[str] = typer.Option(
              None, "--schedules", help="comma list, or 'paper' (the 19 schedules of the paper's kinds; "
              "prompts > 130 tokens); default: A then the partition sweep"),
          tasks: Optional[str] = typer.Option(None, "--tasks", help="comma list of prompts (HumanEval/N, chat:FILE, "
                                              "file:FILE) instead of one: one table over all of them"),
          cap: int = CapOpt, model: Optional[Path] = ModelOpt, backend: str = BackendOpt,
          threads: int = ThreadsOpt, n_ctx: int = CtxOpt,
          out: Optional[Path] = typer.Option(None, "--out", help="run folder (resumable; default runs/sweep/<spec "
                                             "hash>): spec.json, units.jsonl, sweep.json, report.md"),
          json_out: Optional[Path] = typer.Option(None, "--json", help="also write the result as JSON"),
          md_out: Optional[Path] = typer.Option(None, "--md", help="also write the table as Markdown")):
    """Partition sweep of one prompt (or of --tasks): endpoints, first difference from the first
    schedule, endpoint and state classes; one prompt per fresh process (the engine's kind
    ``partition``), resumable in its run folder."""
    from rich.markup import escape

    from statelab.experiments.progress import RichReporter
    from statelab.experiments.partition import PartitionSpec, run_partition, sweep_table

    if tasks is not None:
        from statelab.errors import ConfigError

        if any(x is not None for x in (prompt, humaneval, prompt_file)):
            raise ConfigError("--tasks replaces --prompt, --humaneval and --prompt-file: give one of them")
        specs = [t.strip() for t in tasks.split(",") if t.strip()]
    else:
        specs = [prompt_spec_of(prompt, humaneval, prompt_file)]
    spec = PartitionSpec(specs, "sweep", schedules=schedules, cap=cap, backend=backend, threads=threads, n_ctx=n_ctx,
                         model=model)
    res = run_partition(spec, out, RichReporter(console, "prompts", transient=True))
    results = res.outputs["records"]
    if json_out:  # the runs first: a table that cannot be drawn loses nothing
        atomic_write_text(json_out, json.dumps(results if tasks is not None else results[0], indent=2))
    if tasks is not None:
        table = (f"Partition sweep, {len(specs)} prompts x {len(results[0]['rows'])} schedules, cap {cap}, "
                 f"{backend}\n\n" + res.outputs["markdown"])
        console.print(table, markup=False)
        if md_out:
            atomic_write_text(md_out, table)
        return
    r0 = results[0]
    t = Table(title=f"partition sweep {r0['prompt']} ({r0['rows'][0]['n_prompt']} tokens, cap {cap}, {backend})")
    for col in ("schedule", "kv", "logits", "len", "stop", "first diff"):
        t.add_column(col)
    for r in r0["rows"]:
        t.add_row(escape(r["describe"]), r["kv_sha256"], r["logits_sha256"], str(r["length"]), r["stop"],
                  "=" if r["first_diff"] is None else str(r["first_diff"]))
    console.print(t)
    console.print("endpoint classes: " + " | ".join(", ".join(c) for c in r0["endpoint_classes"]))
    console.print("state classes:    " + " | ".join(", ".join(c) for c in r0["state_classes"]))
    if md_out:
        atomic_write_text(md_out, sweep_table([r0]))


@app.command()
def demo(model: Optional[Path] = ModelOpt, backend: str = BackendOpt, cap: int = CapOpt,
         tasks: Optional[str] = typer.Option(None, help="comma list of prompts (default: HumanEval/0,2,10 on cpu; "
                                             "10,20,86 elsewhere, all longer than B's 128-token split)"),
         threads: int = ThreadsOpt, out: Path = typer.Option(Path("runs/demo"), help="report folder"),
         matrix: bool = typer.Option(True, "--matrix/--no-matrix", help="run the 12-selector matrix (both "
                                     "directions, 2 repeats) and the frontier panels where it finds donor effects"),
         matrix_cap: int = typer.Option(48, help="output cap of the selector matrix and frontier panels")):
    """The main job: a partition study on a few HumanEval prompts (natural arms, shams,
    whole-KV crosses both ways) with arms that differ on this backend."""
    from statelab.experiments import demo as demo_mod
    from statelab.experiments.partition import cell_text
    from statelab.experiments.progress import RichReporter
    from statelab.report import demo_page

    class View(demo_mod.DemoView):  # the terminal's view of the demo while it runs
        def progress(self, label, transient=False):
            return RichReporter(console, label, transient=transient)

        def partition(self, rows, title):
            t = Table(title=title)
            for col in rows[0] if rows else []:
                t.add_column(col)
            for r in rows:
                t.add_row(*[cell_text(v) for v in r.values()])
            console.print(t)
            console.print("first_diff: first differing output index of the natural endpoints ('=' equal); "
                          "cross classes: B reproduces the donor, C third trajectory, D keeps the recipient.")

        def say(self, text):
            console.print(text, markup=False, highlight=False)

    res = demo_mod.run(View(), model, backend, cap, (tasks or demo_mod.default_tasks(backend)).split(","), threads,
                       out, frontier_cap=matrix_cap, matrix=matrix, matrix_cap=matrix_cap,
                       page=lambda folder, r: demo_page(folder, r.partition, r.matrix, r.frontier))
    console.print(f"report: {res.report}, {res.page}")
    bad = demo_mod.failed_controls(res.rows, out)
    if bad:
        err.print(f"FAILED CONTROL: {'; '.join(bad)}", markup=False, highlight=False)
        raise typer.Exit(1)
