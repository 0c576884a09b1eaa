"""statelab command line (typer + rich). Thin: parse, call the library, print."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from statelab.errors import StatelabError
from statelab.limits import MAX_THREADS, int_list
from statelab.paths import atomic_write_netcdf, atomic_write_text
from statelab.runtime.layouts import ATTENTION_LAYOUTS

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="KV-state formation, intervention and transplantation on llama.cpp.")
console = Console(width=None if sys.stdout.isatty() else 160)  # logs keep whole table rows
err = Console(stderr=True)

ModelOpt = typer.Option(None, "--model", "-m", help="GGUF model file (default: the embedded SmolLM2-135M-Instruct)")
BackendOpt = typer.Option("cpu", "--backend", "-b", help="cpu, cuda or vulkan")
BackendLongOpt = typer.Option("cpu", "--backend", help="cpu, cuda or vulkan")  # where -b means something else
CapOpt = typer.Option(128, "--cap", help="output cap (generated tokens)")
ThreadsOpt = typer.Option(0, "--threads", min=0, max=MAX_THREADS, help="CPU threads (0: all cores)")
CtxOpt = typer.Option(1024, "--n-ctx", help="context size")


def _setup(model_path, backend: str, threads: int = 0, n_ctx: int = 1024):
    from statelab.runtime import ContextConfig, Model

    config = ContextConfig(backend=backend, n_threads=threads, n_ctx=n_ctx)  # bounds checked before any load
    return Model(model_path, backend=backend), config


def _prompt(prompt: Optional[str], humaneval: Optional[str], prompt_file: Optional[Path]):
    from statelab import prompts
    from statelab.errors import ConfigError

    given = [x is not None for x in (prompt, humaneval, prompt_file)]
    if sum(given) != 1:
        raise ConfigError("give exactly one of --prompt, --humaneval, --prompt-file")
    if prompt is not None:
        return prompts.resolve("text:" + prompt)
    if humaneval is not None:
        return prompts.humaneval(humaneval)
    return prompts.from_file(prompt_file)


PromptOpt = typer.Option(None, "--prompt", "-p", help="prompt text")
HumanEvalOpt = typer.Option(None, "--humaneval", "-H", help="HumanEval id, e.g. HumanEval/12 or 12")
PromptFileOpt = typer.Option(None, "--prompt-file", help="a UTF-8 text file used verbatim")


@app.command()
def doctor(model: Optional[Path] = ModelOpt, backend: str = typer.Option(None, "--backend", "-b",
           help="also load the model on this backend")):
    """Build identity, backends and devices, and the model's metadata."""
    from statelab.models import read_model_info
    from statelab.runtime import build_identity, list_devices, prepare_backend

    if backend:
        prepare_backend(backend)
    ident = build_identity()
    t = Table(title="native build", show_header=False)
    for k in ("backend", "build_key", "sdist", "sdist_sha256", "patches", "patch_series_sha256", "compiler",
              "llama_cpp_python", "lib_override"):
        if k in ident:
            t.add_row(k, str(ident[k]))
    console.print(t)
    d = Table(title="devices")
    for c in ("index", "registry", "name", "type", "description", "memory_total"):
        d.add_column(c)
    for dev in list_devices():
        d.add_row(str(dev.index), dev.registry, dev.name, dev.type, dev.description, f"{dev.memory_total / 2**30:.1f} GiB")
    console.print(d)
    info = read_model_info(model)
    m = Table(title="model", show_header=False)
    for k, v in info.as_dict().items():
        m.add_row(k, str(v))
    console.print(m)
    if model is not None:  # capabilities of a named model (loads it: the QB row asks the runtime)
        from statelab.audit.admission import qb_admission
        from statelab.models import capabilities

        c = Table(title=f"capabilities of {info.name}")
        for col in ("capability", "status", "detail"):
            c.add_column(col)
        for row in capabilities(info) + [qb_admission(model, backend or "cpu")]:
            c.add_row(*row)
        console.print(c)
    if backend:
        from statelab.runtime import Model

        Model(model, backend=backend).close()
        console.print(f"[green]model loads on {backend}[/green]")


@app.command()
def generate(prompt: Optional[str] = PromptOpt, humaneval: Optional[str] = HumanEvalOpt,
             prompt_file: Optional[Path] = PromptFileOpt, model: Optional[Path] = ModelOpt,
             backend: str = BackendOpt, schedule: str = typer.Option("A", help="prefill schedule"),
             cap: int = CapOpt, threads: int = ThreadsOpt, n_ctx: int = CtxOpt,
             json_out: bool = typer.Option(False, "--json", help="print the endpoint as JSON")):
    """Greedy continuation of a prompt."""
    from statelab.lab.formation import parse_schedule
    from statelab.lab.intervene import natural
    from statelab.lab.receiver import check_cap

    check_cap(cap)
    p = _prompt(prompt, humaneval, prompt_file)
    m, base = _setup(model, backend, threads, n_ctx)
    t0 = time.perf_counter()
    capture, ep = natural(m, p, parse_schedule(schedule), base, cap)
    dt = time.perf_counter() - t0
    if json_out:
        console.print_json(json.dumps({"prompt": p.id, "n_prompt": capture.n_prompt, **ep.as_dict()}))
        return
    console.print(f"[bold]{p.id}[/bold] ({capture.n_prompt} prompt tokens, schedule {schedule}, {backend})")
    console.print(m.detokenize(ep.tokens), markup=False, highlight=False)
    console.print(f"[dim]{ep.length} tokens, stop: {ep.stop_reason}, {ep.length / dt:.1f} tokens/s "
                  f"(prefill included)[/dim]")


def _capture_dir(path: Path):
    from statelab.lab.archive import load_capture

    return load_capture(path)


@app.command()
def capture(out: Path = typer.Argument(..., help="output folder (must not exist)"),
            prompt: Optional[str] = PromptOpt, humaneval: Optional[str] = HumanEvalOpt,
            prompt_file: Optional[Path] = PromptFileOpt, schedule: str = typer.Option("A", "--schedule", "-s",
            help="A, B, C, R or explicit like 132+1, 128+rest@ub64, ub16"),
            model: Optional[Path] = ModelOpt, backend: str = BackendOpt, threads: int = ThreadsOpt,
            n_ctx: int = CtxOpt, overwrite: bool = typer.Option(False, help="replace an existing capture (only a "
                                                                  "capture that verifies is replaced)"),
            cache_type_k: str = typer.Option("f16", "--cache-type-k", help="K cache type: f32, f16, bf16, q8_0"),
            cache_type_v: str = typer.Option("f16", "--cache-type-v", help="V cache type: f32, f16, bf16, q8_0 "
                                             "(q8_0 needs --flash-attn)"),
            flash_attn: bool = typer.Option(False, "--flash-attn", help="flash attention (V stored untransposed)")):
    """Form a state with a prefill schedule and archive it (KV, initial FP32 logits, identities)."""
    from statelab.lab.archive import ArchiveError, check_replaceable_capture, save_capture
    from statelab.lab.formation import form, parse_schedule
    from statelab.runtime import ContextConfig

    if overwrite:
        check_replaceable_capture(out)
    elif out.exists() or out.is_symlink():
        raise ArchiveError(f"output already exists: {out} (choose another path, or --overwrite to replace a capture)")
    sched = parse_schedule(schedule)
    p = _prompt(prompt, humaneval, prompt_file)
    ContextConfig(type_k=cache_type_k, type_v=cache_type_v, flash_attn=flash_attn)  # checked before loading
    m, base = _setup(model, backend, threads, n_ctx)
    base = base.with_(type_k=cache_type_k, type_v=cache_type_v, flash_attn=flash_attn)
    cap_ = form(m, p, sched, base)
    save_capture(cap_, out, overwrite=overwrite)
    h = cap_.hashes()
    console.print(f"captured {p.id} ({cap_.n_prompt} tokens, {sched.describe()}) -> {out}\n"
                  f"kv {h['kv'][:16]}  logits {h['logits'][:16]}", markup=False)  # "[rest]" is no markup


def _print_endpoint(m, ep, label: str, json_out: bool):
    if json_out:
        console.print_json(json.dumps({"label": label, **ep.as_dict()}))
        return
    console.print(f"[bold]{label}[/bold]: {ep.length} tokens, stop {ep.stop_reason}")
    console.print(m.detokenize(ep.tokens), markup=False, highlight=False)


JsonOpt = typer.Option(False, "--json", help="print the endpoint as JSON")


@app.command("continue")
def continue_(capture_dir: Path = typer.Argument(..., help="a capture folder"), cap: int = CapOpt,
              model: Optional[Path] = ModelOpt, backend: Optional[str] = typer.Option(
                  None, "--backend", "-b", help="recipient backend (default: the capture's)"),
              allow_backend: bool = typer.Option(False, "--allow-backend", help="allow another backend"),
              json_out: bool = JsonOpt):
    """Continue greedily from a capture through the common receiver."""
    from statelab.lab.archive import check_importable
    from statelab.lab.intervene import config_of, import_and_continue
    from statelab.lab.receiver import check_cap

    check_cap(cap)
    c = _capture_dir(capture_dir)
    cfg = config_of(c)
    if backend:
        cfg = cfg.with_(backend=backend)
    m, _ = _setup(model, cfg.backend)
    check_importable(c, m, cfg, allow_backend)
    ep = import_and_continue(m, cfg, c.blob, c.logits, c.n_prompt, cap)
    _print_endpoint(m, ep, f"{c.prompt_id} [{c.schedule.name}] via receiver on {cfg.backend}", json_out)


@app.command("sham")
def sham_(capture_dir: Path = typer.Argument(...), cap: int = CapOpt, model: Optional[Path] = ModelOpt,
          json_out: bool = JsonOpt):
    """Restore a capture into its own path and compare with its natural endpoint."""
    from statelab.analysis.classes import first_difference
    from statelab.lab.formation import prefill
    from statelab.lab.intervene import config_of, sham
    from statelab.lab.receiver import check_cap, continue_greedy
    from statelab.runtime import Context

    check_cap(cap)
    c = _capture_dir(capture_dir)
    cfg = config_of(c)
    m, _ = _setup(model, cfg.backend)
    s = sham(m, c, cap)
    with Context(m, cfg) as ctx:  # natural: re-form with the same schedule and continue in place
        logits = prefill(ctx, c.tokens, c.schedule)
        nat = continue_greedy(ctx, logits, c.n_prompt, cap)
    fd = first_difference(nat.tokens, s.tokens)
    _print_endpoint(m, s, f"sham {c.prompt_id} [{c.schedule.name}]", json_out)
    if not json_out:
        console.print("[green]sham equals the natural endpoint[/green]" if fd is None else
                      f"[red]FAILED CONTROL: sham differs from natural at output {fd}[/red]")
    if fd is not None:
        raise typer.Exit(1)


@app.command("cross")
def cross_(donor: Path = typer.Argument(..., help="donor capture"),
           recipient: Path = typer.Argument(..., help="recipient capture"), cap: int = CapOpt,
           logits_from: str = typer.Option("recipient", help="whose initial logits are consumed"),
           allow_backend: bool = typer.Option(False, "--allow-backend", help="allow a cross-backend transplant"),
           model: Optional[Path] = ModelOpt, json_out: bool = JsonOpt):
    """Whole-KV cross: the donor's KV imported into the recipient's path."""
    from statelab.lab.intervene import config_of, cross

    d, r = _capture_dir(donor), _capture_dir(recipient)
    m, _ = _setup(model, config_of(r).backend)
    ep, acc = cross(m, d, r, logits_from, cap, allow_other_backend=allow_backend)
    _print_endpoint(m, ep, f"cross {d.schedule.name}->{r.schedule.name} ({d.prompt_id})", json_out)
    if not json_out:
        console.print(f"selected {acc.selected_bytes} B, changed {acc.changed_bytes} B, max|d| {acc.max_abs:.6g}, "
                      f"L2 rel {acc.l2_rel:.3g}, first differing layer {acc.first_differing_layer}")


@app.command()
def diff(a: Path = typer.Argument(..., help="capture A"), b: Path = typer.Argument(..., help="capture B"),
         plot: Optional[Path] = typer.Option(None, "--plot", help="also draw the per-layer K/V profile into this PNG")):
    """Per-layer table of differences between two captures' KV states."""
    from statelab.api import comparable_states, difference_summary
    from statelab.kvstate import compare

    ca, cb = _capture_dir(a), _capture_dir(b)
    sa, sb = comparable_states(ca, cb)
    d = compare(sa, sb)
    t = Table(title=f"{ca.schedule.name} vs {cb.schedule.name} ({ca.prompt_id})")
    for col in ("layer", "cache", "comp", "changed bytes", "max |d|", "L2", "L2 rel"):
        t.add_column(col, justify="right")
    for r in d.records():
        t.add_row(str(r["layer"]), r["cache"], r["component"], str(r["changed_bytes"]), f"{r['max_abs']:.6g}",
                  f"{r['l2']:.6g}", f"{r['l2_rel']:.3g}")
    console.print(t)
    s = difference_summary(ca, cb, (sa, sb))
    where = ("none" if s["first_layer"] < 0 else
             f"layer {s['first_layer']} ({s['first_component']}) at position {s['first_position']}; earliest "
             f"position {s['earliest_position']} (layer {s['earliest_layer']})")
    logits = ("unknown (a capture without logits)" if not s["logits_known"] else str(s["logits_equal"])
              + ("" if s["logits_equal"] else f" (max |d| {s['logits_max_abs']:.6g})"))
    console.print(f"identical KV: {d.identical}; first differing layer: {d.first_differing_layer}; "
                  f"first difference: {where}; initial logits identical: {logits}", markup=False, highlight=False)
    if not s["tokens_equal"]:
        console.print(f"compared the first {s['compared_cells']} cells: one capture's tokens extend the other's "
                      f"({ca.n_prompt} and {cb.n_prompt} tokens)", markup=False, highlight=False)

    if plot is not None:
        from statelab.report import diff_plot

        console.print(f"plot: {diff_plot(ca, cb, d.records(), plot)}")

# ---------------------------------------------------------------------------- interop (llama.cpp state files)
def _optional_prompt(prompt, humaneval, prompt_file):
    return None if prompt is None and humaneval is None and prompt_file is None else \
        _prompt(prompt, humaneval, prompt_file)


@app.command("import-state")
def import_state(file: Path = typer.Argument(..., help="llama.cpp state file (llama_state_seq_save_file, llama-server "
                                             "slot save, or llama_state_save_file)"),
                 out: Path = typer.Argument(..., help="output capture folder (must not exist)"),
                 model: Optional[Path] = ModelOpt, prompt: Optional[str] = PromptOpt,
                 humaneval: Optional[str] = HumanEvalOpt, prompt_file: Optional[Path] = PromptFileOpt,
                 logits: str = typer.Option("none", "--logits", help="none (the file holds none) or recompute "
                                            "(re-evaluate the last token in a recipient context on --backend)"),
                 backend: str = BackendOpt, source_backend: Optional[str] = typer.Option(
                     None, "--source-backend", help="the backend that formed the state, when known"),
                 threads: int = ThreadsOpt, n_ctx: int = CtxOpt):
    """Import a llama.cpp state file as a verified capture (tokens, vocabulary, geometry checked)."""
    from statelab.lab.archive import save_capture
    from statelab.lab.interop import import_state_file

    p = _optional_prompt(prompt, humaneval, prompt_file)
    m, base = _setup(model, backend, threads, n_ctx)
    c = import_state_file(file, m, base, prompt=p, logits=logits, source_backend=source_backend)
    save_capture(c, out)
    console.print(f"imported {c.identity['imported']['format']}: {c.n_prompt} tokens as {c.prompt_id} -> {out}\n"
                  f"logits: {c.identity['logits']['source']}; kv {c.hashes()['kv'][:16]}", markup=False)


@app.command("export-state")
def export_state(capture_dir: Path = typer.Argument(..., help="a capture folder"),
                 file: Path = typer.Argument(..., help="output state file"),
                 kind: str = typer.Option("seq", "--kind", help="seq (llama_state_seq_load_file, llama-server slot "
                                          "restore) or whole (llama_state_load_file)"),
                 model: Optional[Path] = typer.Option(None, "--model", "-m", help="the capture's model (whole files "
                                                      "record its architecture; default: the path in the capture)"),
                 streams: int = typer.Option(1, "--streams", help="KV streams of the receiving context (llama-server "
                                             "-np N without --kv-unified has N)"),
                 overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing file")):
    """Write a capture as a llama.cpp state file."""
    from statelab.lab.interop import export_state_file

    c = _capture_dir(capture_dir)
    path = export_state_file(c, file, kind, model, overwrite, streams)
    console.print(f"{path}: {kind} state file, {c.n_prompt} tokens, {path.stat().st_size} bytes", markup=False)


@app.command()
def sweep(prompt: Optional[str] = PromptOpt, humaneval: Optional[str] = HumanEvalOpt,
          prompt_file: Optional[Path] = PromptFileOpt, schedules: Optional[str] = typer.Option(
              None, "--schedules", help="comma list (default: A then the partition sweep)"),
          cap: int = CapOpt, model: Optional[Path] = ModelOpt, backend: str = BackendOpt,
          threads: int = ThreadsOpt, n_ctx: int = CtxOpt,
          json_out: Optional[Path] = typer.Option(None, "--json", help="also write the result as JSON")):
    """Partition sweep of one prompt: endpoints, first difference from the first schedule, classes."""
    from rich.markup import escape
    from rich.progress import Progress

    from statelab.lab.formation import PRESETS, parse_schedule, partition_sweep
    from statelab.experiments.partition import sweep as run_sweep
    from statelab.lab.receiver import check_cap

    check_cap(cap)
    p = _prompt(prompt, humaneval, prompt_file)
    m, base = _setup(model, backend, threads, n_ctx)
    if schedules:
        scheds = [parse_schedule(s) for s in schedules.split(",")]
    else:
        scheds = [PRESETS["A"]] + partition_sweep(len(m.tokenize(p.text)))
    with Progress(console=console, transient=True) as prog:
        task = prog.add_task("schedules", total=len(scheds))
        res = run_sweep(m, p, scheds, base, cap, progress=lambda: prog.advance(task))
    t = Table(title=f"partition sweep {p.id} ({res['rows'][0]['n_prompt']} tokens, cap {cap}, {backend})")
    for col in ("schedule", "kv", "logits", "len", "stop", "first diff"):
        t.add_column(col)
    for r in res["rows"]:
        t.add_row(escape(r["describe"]), r["kv_sha256"], r["logits_sha256"], str(r["length"]), r["stop"],
                  "=" if r["first_diff"] is None else str(r["first_diff"]))
    console.print(t)
    console.print("endpoint classes: " + " | ".join(", ".join(c) for c in res["endpoint_classes"]))
    console.print("state classes:    " + " | ".join(", ".join(c) for c in res["state_classes"]))
    if json_out:
        atomic_write_text(json_out, json.dumps(res, indent=2))


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

    rows = demo_mod.run(console, model, backend, cap, (tasks or demo_mod.default_tasks(backend)).split(","), threads,
                        out, frontier_cap=matrix_cap, matrix=matrix, matrix_cap=matrix_cap)
    bad = demo_mod.failed_controls(rows, out)
    if bad:
        err.print(f"FAILED CONTROL: {'; '.join(bad)}", markup=False, highlight=False)
        raise typer.Exit(1)


# ---------------------------------------------------------------------------- study
study_app = typer.Typer(add_completion=False, no_args_is_help=True,
                        help="Selector-matrix studies: spec -> cells in fresh processes -> results.nc + report.md.")
app.add_typer(study_app, name="study")


@study_app.command("run")
def study_run(spec: Path = typer.Argument(..., help="study spec (studies/*.toml)"),
              out: Optional[Path] = typer.Option(None, "--out", "-o", help="output folder (default runs/studies/NAME)"),
              executor: str = typer.Option("local", "--executor", "-e", help="local (fork server), batch (one process per prompt, direction and repeat), local-spawn, dask-local or dask://HOST:PORT"),
              workers: int = typer.Option(2, "--workers", "-w", help="cells running at once")):
    """Run (or resume) a study: controls per prompt, then every cell in a fresh process."""
    from statelab.experiments.matrix import run_study
    from statelab.experiments.matrix.progress import RichReporter

    from statelab.report import study_page

    s = run_study(spec, out, executor, workers, RichReporter(err), on_compiled=study_page)
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
    from statelab.report import study_page
    from statelab.experiments.matrix import compile_study

    ds, md = compile_study(out, on_compiled=study_page)  # the page too is written under the folder's lock
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
    from statelab.analysis.findings import write

    path, f = write(runs, out)
    console.print(f"{len(f.runs)} studies, {len(f.natural)} natural pairs, {len(f.nonmono_pairs)} non-monotone "
                  f"pairs, {f.minimal['searched']} minimal searches, {f.panels['panels']} panels -> {path}")


@study_app.command("findings-run")
def study_findings_run(out: Path = typer.Argument(..., help="a finished study folder"),
                       kind: str = typer.Option(..., "--kind", "-k", help="minimal or panels"),
                       budget: float = typer.Option(..., "--budget", "-b", help="wall seconds; no target starts after"),
                       workers: int = typer.Option(2, "--workers", "-w", help="worker processes"),
                       limit: Optional[int] = typer.Option(None, "--limit", help="at most this many new targets")):
    """Minimal sufficient selections or frontier panels for the study's class-B cells (resumable)."""
    from statelab.experiments.findings_run import run_findings

    c = run_findings(out, kind, budget, workers, limit)
    console.print(f"{kind}: {c['ran']} run ({c['ok']} ok, {c['skipped']} skipped, {c['failed']} failed), "
                  f"{c['done_before']} done before, {c['not_started']} not started, of {c['targets']} class-B cells; "
                  f"{c['seconds']:.0f} s")


# ---------------------------------------------------------------------------- model
model_app = typer.Typer(add_completion=False, no_args_is_help=True,
                        help="Model files: derive layer-truncated draft models (gguf only, no llama.cpp).")
app.add_typer(model_app, name="model")


@model_app.command("derive")
def model_derive(out: Path = typer.Argument(..., help="output GGUF file"),
                 layers: int = typer.Option(..., "--layers", "-l", help="transformer blocks to keep (the first N)"),
                 model: Optional[Path] = ModelOpt,
                 overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing output file")):
    """Write a copy of a GGUF model keeping its first N blocks (tensors copied byte for byte)."""
    from statelab.speculative.derive import derive_truncated

    r = derive_truncated(model, out, layers, overwrite=overwrite)
    console.print(f"{r['path']}\n{r['n_layers']} of {r['source_layers']} layers, {r['tensors']} tensors "
                  f"({r['tensors_dropped']} dropped), {r['size']} bytes ({r['size'] / 2**20:.1f} MiB)\n"
                  f"sha256 {r['sha256']}", markup=False, highlight=False)


spec_app = typer.Typer(no_args_is_help=True, help="The QB speculative path: arms, qualification, timing.")
app.add_typer(spec_app, name="spec")
DraftOpt = typer.Option("self", "--draft", help="'self' (the target), 'derive:N' (its first N layers), a GGUF path, "
                        "'ngram[:NMIN-NMAX]' (model-free prompt lookup, default 2-4), or 'none'")
KMaxOpt = typer.Option(None, "--k-max", help="adaptive k: grown after full acceptance, shrunk after a rejection, "
                       "within [1, K_MAX] (default: k fixed)")
FixedRowsOpt = typer.Option(False, "--fixed-rows/--exact-rows", help="every verify submits k_max+1 rows (unused ones "
                            "masked and removed): one graph shape, reused")


@spec_app.command("run")
def spec_run(prompt: Optional[str] = PromptOpt, humaneval: Optional[str] = HumanEvalOpt,
             prompt_file: Optional[Path] = PromptFileOpt,
             arms: str = typer.Option("R,M0,M_QB,C_QB", help="comma list of R, M0, C0, M_QB, M_PQ, M_GS, C_QB, C_PQ, "
                                      "C_GS, M_QB+W, M_PQ+W, C_QB+W, C_PQ+W (+W: row-by-row weight products)"),
             k: int = typer.Option(3, help="draft proposals per cycle"),
             k_max: Optional[int] = KMaxOpt, fixed_rows: bool = FixedRowsOpt,
             ubatch: int = typer.Option(0, help="target ubatch (0: k_max+1, one micrograph per verify)"),
             mask: int = typer.Option(3, help="phase mask 0..15 (1 target prefill, 2 target continuation, 4 draft "
                                              "prefill, 8 draft continuation)"),
             cap: int = CapOpt, model: Optional[Path] = ModelOpt, draft: str = DraftOpt, backend: str = BackendOpt,
             threads: int = ThreadsOpt, json_out: Optional[Path] = typer.Option(None, "--json")):
    """Run arms on one prompt in this process; qualify each against R; time qualified arms."""
    from statelab.experiments.campaign import run_arms
    from statelab.speculative.transaction import SpecConfig

    names = [a.strip() for a in arms.split(",") if a.strip()]
    cfg = SpecConfig(k=k, ubatch=ubatch, mask=mask, cap=cap, backend=backend, threads=threads, k_max=k_max,
                     fixed_rows=fixed_rows)
    p = _prompt(prompt, humaneval, prompt_file)
    results, need_draft = run_arms(model, draft, p, names, cfg, refused=lambda a, why: err.print(f"{a}: {why}; not run"))
    t = Table(title=f"{p.id} (sha256 {p.sha256[:12]}): k={k}{f'..{k_max}' if k_max else ''}, ubatch "
                    f"{cfg.target_ubatch}, mask {mask}, cap {cap}, {backend}, draft {draft if need_draft else '-'}")
    for col in ("arm", "qualified", "first diff", "seconds", "accepted/proposals", "tokens/call", "target callers",
                "micrographs"):
        t.add_column(col)
    for r in results:
        c = r.counters
        t.add_row(r.arm, "ref" if r.arm == "R" else ("yes" if r.qualified else "NO"),
                  "=" if r.first_diff is None else str(r.first_diff),
                  f"{r.seconds:.3f}" if r.qualified else f"({r.seconds:.3f} not comparable)",
                  f"{c.accepted}/{c.proposals}", f"{c.committed / max(c.verify_calls, 1):.2f}", str(c.target_callers),
                  str(c.target_micrographs))
    console.print(t)
    if json_out:
        atomic_write_text(json_out, json.dumps([r.record() for r in results], indent=1))


@spec_app.command("campaign")
def spec_campaign(spec_path: Path = typer.Argument(..., help="campaign TOML (see studies/spec-cpu.toml)"),
                  out: Path = typer.Option(Path("runs/campaign"), "--out"),
                  draft: Optional[str] = typer.Option(None, "--draft", help="override the spec's drafter"),
                  k: Optional[int] = typer.Option(None, "--k", help="override the spec's k"),
                  k_max: Optional[int] = typer.Option(None, "--k-max", help="override the spec's k_max"),
                  budget: Optional[float] = typer.Option(None, "--budget", help="start no new block after this "
                                                         "many seconds (run again with the same --out to resume)")):
    """Fresh worker processes, counterbalanced blocks, sessions, bootstrap intervals; resumable."""
    from rich.progress import Progress

    from statelab.experiments.campaign import CampaignSpec, plan, run_campaign

    spec = CampaignSpec.load(spec_path, draft=draft, k=k, k_max=k_max)
    with Progress(console=console, transient=True) as prog:
        task = prog.add_task("blocks", total=len(plan(spec, spec.draft)))
        res = run_campaign(spec, out, progress=lambda: prog.advance(task), budget_s=budget)
    if not res["complete"]:
        console.print(f"incomplete: {res['blocks_done']} of {res['blocks']} blocks in {out}; run the same command "
                      "again to continue")
        raise typer.Exit(3)
    from statelab.report import campaign_page

    console.print(res["report"], markup=False, highlight=False)
    console.print(f"results: {out}/results.nc, {out}/report.md, {campaign_page(out, res['contrasts'], spec.threshold)}")


@spec_app.command("masks")
def spec_masks(tasks: str = typer.Option("HumanEval/0,HumanEval/2,HumanEval/4,HumanEval/5", help="prompts"),
               repeats: int = typer.Option(2), k: int = typer.Option(3), ubatch: int = typer.Option(4),
               cap: int = CapOpt, arm: str = typer.Option("C_QB"), masks: str = typer.Option("0-15"),
               model: Optional[Path] = ModelOpt, draft: str = DraftOpt, backend: str = BackendOpt,
               threads: int = ThreadsOpt, out: Path = typer.Option(Path("runs/masks"), "--out")):
    """Phase-mask experiment: which masks reproduce R; the inclusion-minimal ones."""
    from rich.progress import Progress

    from statelab.experiments.campaign import mask_markdown, phase_mask_experiment, resolve_draft
    from statelab.speculative.transaction import parse_masks

    ms = parse_masks(masks)
    ps = [x.strip() for x in tasks.split(",") if x.strip()]
    n = len(ps) * (1 + len(ms) * repeats)
    with Progress(console=console, transient=True) as prog:
        task = prog.add_task("requests", total=n)
        res = phase_mask_experiment(model, resolve_draft(model, draft), ps, ms, repeats, k, ubatch, cap, arm, backend,
                                    threads, progress=lambda: prog.advance(task))
    md = mask_markdown(res, ps)
    console.print(md, markup=False, highlight=False)
    atomic_write_text(Path(out) / "masks.md", md)
    atomic_write_text(Path(out) / "masks.json", json.dumps({k_: v for k_, v in res.items() if k_ != "records"}
                                                           | {"records": res["records"]}, indent=1, default=str))


# ---------------------------------------------------------------------------- frontier
frontier_app = typer.Typer(add_completion=False, no_args_is_help=True,
                           help="Frontier panels (2x2: EMPTY, component 1, component 2, both) with full FP32 "
                                "logit traces: t*, fixed-pair scores, additive prediction and interaction.")
app.add_typer(frontier_app, name="frontier")


def _frontier_say(msg: str) -> None:
    err.print(msg, markup=False, highlight=False, soft_wrap=True)


@frontier_app.command("run")
def frontier_run_(spec: Path = typer.Argument(..., help="frontier spec (studies/frontier-*.toml)"),
                  out: Optional[Path] = typer.Option(None, "--out", "-o",
                                                     help="run folder (default runs/frontier/NAME); resumes"),
                  workers: int = typer.Option(1, "--workers", "-w", help="worker processes at once"),
                  executor: str = typer.Option("local", "--executor", "-e", help="local (fork server), local-spawn, "
                                               "dask-local or dask://HOST:PORT")):
    """Run (or resume) a frontier spec: traces in fresh processes, then results.nc, report.md, plots."""
    from statelab.experiments.frontier_panels import run_frontier

    s = run_frontier(spec, out, workers, say=_frontier_say, executor=executor)
    console.print(f"{s.out}: {s.ran} worker(s) run, {s.skipped} already done, {s.seconds:.0f} s; "
                  f"{s.n_frontiers} panel repeat(s) with a frontier; repeats agree on {s.agreement[0]} of "
                  f"{s.agreement[1]} compared contrasts", markup=False, highlight=False, soft_wrap=True)
    from statelab.report import frontier_page

    console.print(f"report: {s.report}, {frontier_page(s.out)}\nresults: {s.results}", markup=False, highlight=False,
                  soft_wrap=True)


@frontier_app.command("analyse")
def frontier_analyse_(results_dir: Path = typer.Argument(..., help="a frontier run folder")):
    """Recompute the dataset, tables and plots from the stored traces (no model is loaded)."""
    from statelab.experiments.frontier_panels import analyse_run, write_outputs

    r = analyse_run(results_dir)
    paths = write_outputs(results_dir, r)
    a = r.agreement.attrs
    console.print(f"{results_dir}: {r.n_frontiers} panel repeat(s) with a frontier; repeats agree on "
                  f"{a['n_agree']} of {a['n_compared']} compared contrasts", markup=False, highlight=False,
                  soft_wrap=True)
    from statelab.report import frontier_page

    console.print(f"report: {paths['report']}, {frontier_page(results_dir, r.ds)}\nresults: {paths['results']}",
                  markup=False, highlight=False, soft_wrap=True)


# ---------------------------------------------------------------------------- audit / replay / locate
audit_app = typer.Typer(add_completion=False, no_args_is_help=True,
                        help="Layout oracles, E1 attention correspondence on the model, backend admission.")
app.add_typer(audit_app, name="audit")

AuditOutOpt = typer.Option(None, "--out", "-o", help="also write report.md and results.nc into this folder")


def _audit_write(out: Optional[Path], md: str, ds, name: str = "results.nc") -> None:

    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "report.md", md)
    atomic_write_netcdf(out / name, ds)
    console.print(f"[dim]wrote {out / 'report.md'} and {out / name}[/dim]")


def _audit_prompt_tokens(m, prompt, humaneval, prompt_file, default_task: str = "HumanEval/2"):
    from statelab import prompts

    if prompt is None and humaneval is None and prompt_file is None:
        p = prompts.humaneval(default_task)
    else:
        p = _prompt(prompt, humaneval, prompt_file)
    return p, m.tokenize(p.text)


@audit_app.command("layouts")
def audit_layouts(quick: bool = typer.Option(False, "--quick", help="a small fixture subset"),
                  out: Optional[Path] = AuditOutOpt):
    """Integer address oracle, fault injection and FP64/F32 oracles of MQ/PQ/QB (no model)."""
    from statelab.audit.oracles import audit_markdown, run_layout_audit

    ds, passed = run_layout_audit(quick=quick)
    md = audit_markdown(ds)
    console.print(md, markup=False, highlight=False, soft_wrap=True)
    _audit_write(out, md, ds)
    if not passed:
        raise typer.Exit(1)


@audit_app.command("backends")
def audit_backends(model: Optional[Path] = ModelOpt, backend: str = BackendOpt,
                   qs: str = typer.Option("1,2,3,4", "--q", help="occupied query counts"),
                   n_kv: int = typer.Option(256, "--n-kv", help="KV extent of the operator shapes"),
                   out: Optional[Path] = AuditOutOpt):
    """Ask every backend device whether it supports the MQ/PQ/QB attention operators
    (ggml_backend_dev_supports_op), next to what the runtime built."""
    from statelab.audit.admission import AttnShape, admission_markdown, run_admission
    from statelab.errors import ConfigError

    m, base = _setup(model, backend)
    if n_kv < 1:
        raise ConfigError(f"--n-kv must be >= 1, got {n_kv}")
    ds = run_admission(AttnShape.of_model(m, n_kv), int_list(qs, "--q"), model=m, backend_config=base)
    md = admission_markdown(ds)
    console.print(md, markup=False, highlight=False, soft_wrap=True)
    _audit_write(out, md, ds)


@audit_app.command("matmul")
def audit_matmul(model: Optional[Path] = ModelOpt, backend: str = BackendOpt,
                 max_q: int = typer.Option(8, "--max-q", help="largest row count q (1..16)"),
                 max_rows: int = typer.Option(1024, "--max-rows", help="output rows of each weight used"),
                 threads: int = ThreadsOpt, out: Optional[Path] = AuditOutOpt):
    """For each weight type of the model, each device and buffer type: is a q-row product bitwise
    equal to q 1-row products (q = 1..max-q), natively and with the row-by-row repair (+W)."""
    from statelab.audit.matmul import matmul_markdown, repaired_everywhere, run_matmul_audit
    from statelab.runtime.ggml_ops import backend_devices
    from statelab.runtime.native import devices_for_backend

    m, _ = _setup(model, backend, threads)
    devs = [d for d in backend_devices() if d.type == "CPU"] + devices_for_backend(backend)
    ds = run_matmul_audit(m.path, devs, max_q=max_q, max_rows=max_rows, threads=threads or None)
    md = matmul_markdown(ds)
    console.print(md, markup=False, highlight=False, soft_wrap=True)
    _audit_write(out, md, ds)
    if not repaired_everywhere(ds):
        raise typer.Exit(1)


@audit_app.command("e1")
def audit_e1(prompt: Optional[str] = PromptOpt, humaneval: Optional[str] = HumanEvalOpt,
             prompt_file: Optional[Path] = PromptFileOpt, model: Optional[Path] = ModelOpt,
             layers: str = typer.Option("first,middle,last", "--layers", help="target layers"),
             phases: str = typer.Option("prefill,continuation", "--phases"),
             qs: str = typer.Option("1,2,3,4", "--q", help="occupied query counts (1..4)"),
             layouts_: str = typer.Option("MQ,PQ,QB", "--layouts"),
             replay: bool = typer.Option(True, "--replay/--no-replay", help="also replay the frozen MQ operands "
                                         "as MQ/PQ/QB standalone graphs"),
             backend: str = BackendLongOpt, threads: int = ThreadsOpt, out: Optional[Path] = AuditOutOpt):
    """E1: capture Q/K/V/mask and QK/softmax/AV at target layers under MQ, PQ and QB
    (controls first), compare bitwise with max |d| and ULP (default prompt HumanEval/2)."""
    from statelab.audit.capture import parse_layers
    from statelab.audit.e1 import e1_markdown, run_e1, save_capture
    from statelab.audit.replay import replay_e1, replay_markdown

    m, base = _setup(model, backend, threads)
    p, toks = _audit_prompt_tokens(m, prompt, humaneval, prompt_file)
    lay = parse_layers(layers, m.n_layer) or list(range(m.n_layer))
    ds, detail = run_e1(m, toks, layers=lay, phases=tuple(x.strip() for x in phases.split(",") if x.strip()),
                        qs=int_list(qs, "--q"), layouts=tuple(x.strip().upper() for x in layouts_.split(",")),
                        base_config=base, progress=lambda s: err.print(f"[dim]{s}[/dim]"))
    ds.attrs["prompt"] = p.id
    md = f"Prompt: {p.id} ({len(toks)} tokens)\n\n" + e1_markdown(ds)
    rds = None
    if replay:
        rds = replay_e1(detail, threads=threads or None)
        md += "\n" + replay_markdown(rds)
    console.print(md, markup=False, highlight=False, soft_wrap=True)
    _audit_write(out, md, ds)
    if out is not None:
        if rds is not None:
            atomic_write_netcdf(out / "replay.nc", rds)
        for (ph, q, lo), r in detail["runs"].items():
            for L, cap in r.captures.items():
                save_capture(cap, r.identity, out / "captures" / f"L{L}_{ph}_q{q}_{lo}",
                             {"prompt": p.id, "phase": ph})


@app.command("replay")
def replay_cmd(prompt: Optional[str] = PromptOpt, humaneval: Optional[str] = HumanEvalOpt,
               prompt_file: Optional[Path] = PromptFileOpt, model: Optional[Path] = ModelOpt,
               layer: int = typer.Option(0, "--layer", "-l", help="layer whose operator calls are replayed"),
               q: int = typer.Option(4, "--q", help="occupied queries of the captured micro-batch (1..4)"),
               layout: str = typer.Option("MQ", "--layout", help="attention layout of the native capture "
                                          "(PQ/QB need the layout patch)"),
               capture_dir: Optional[Path] = typer.Option(None, "--capture", help="replay a saved attention "
                                                          "capture (from 'audit e1 --out') instead"),
               device: Optional[str] = typer.Option(None, "--device", help="backend device for the replay "
                                                    "(default: CPU)"),
               backend: str = BackendLongOpt, threads: int = ThreadsOpt, out: Optional[Path] = AuditOutOpt):
    """Operator replay: re-run captured operator calls of a layer (own-path correspondence,
    in-place aliasing excluded) and its attention operands as MQ/PQ/QB standalone graphs."""
    import numpy as np

    from statelab.audit.capture import Geometry, check_layer, run_graph
    from statelab.audit.e1 import MAX_Q, extract_attention, load_capture
    from statelab.audit.replay import ops_markdown, replay_attention, replay_ops
    from statelab.errors import ConfigError
    from statelab.lab.formation import Schedule

    m, base = _setup(model, backend, threads)
    if capture_dir is not None:
        cap, man = load_capture(capture_dir, m)
        rows, title = [], f"saved capture {capture_dir} (layer {cap.layer}, {man.get('phase', '?')}, q={cap.q}, " \
                           f"captured as {cap.layout})"
    else:
        check_layer(m, layer)
        if isinstance(q, bool) or not 1 <= q <= MAX_Q:
            raise ConfigError(f"--q must be in 1..{MAX_Q} (occupied queries), got {q}")
        p, toks = _audit_prompt_tokens(m, prompt, humaneval, prompt_file)
        if len(toks) < q:
            raise ConfigError(f"the prompt has {len(toks)} tokens, fewer than q={q}")

        def mine(name):
            from statelab.audit.capture import name_layer

            return name_layer(name) == layer

        lay = layout.strip().upper()
        if lay not in ATTENTION_LAYOUTS:
            raise ConfigError(f"unknown attention layout {layout!r}; use MQ, PQ or QB")
        run = run_graph(m, toks[:q], Geometry(Schedule(f"q{q}", (q,), q, 512), lay), base, want=mine,
                        want_srcs=mine, logits="all")
        rows = replay_ops(run, layer, device, threads or None)
        cap = extract_attention(run, layer)
        title = f"{p.id}: first {q} prompt tokens in one micro-batch, layer {layer}, native layout {lay}"
    lines = [f"# Replay: {title}", ""]
    if rows:
        lines.append(ops_markdown(rows))
    lines += ["## Attention operands replayed as MQ / PQ / QB", "",
              "| layout | qk | softmax | av |", "| --- | --- | --- | --- |"]
    results = {}
    for lo in ATTENTION_LAYOUTS:
        results[lo] = replay_attention(cap, lo, device, threads or None)
        cells = []
        for s in ("qk", "softmax", "av"):
            a, b = results[lo][s], cap.outputs[s]
            if a.tobytes() == b.tobytes():
                cells.append("= native")
            else:
                fin = np.isfinite(a) & np.isfinite(b)
                cells.append(f"≠ native (max abs diff {float(np.abs(a[fin].astype(np.float64) - b[fin]).max()):.3g})")
        lines.append(f"| {lo} | " + " | ".join(cells) + " |")
    lines.append(f"\nNative capture was built as {cap.layout}; PQ vs QB replay bitwise equal at every stage: "
                 f"{all(results['PQ'][s].tobytes() == results['QB'][s].tobytes() for s in ('qk', 'softmax', 'av'))}.")
    md = "\n".join(lines) + "\n"
    console.print(md, markup=False, highlight=False, soft_wrap=True)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "report.md", md)
    if any(r.status == "failed" for r in rows):
        raise typer.Exit(1)


@app.command("locate")
def locate_cmd(prompt: Optional[str] = PromptOpt, humaneval: Optional[str] = HumanEvalOpt,
               prompt_file: Optional[Path] = PromptFileOpt, model: Optional[Path] = ModelOpt,
               a: str = typer.Option("ub1", "--a", "-a", help="first geometry: SCHEDULE[:LAYOUT], e.g. ub1, A, "
                                     "16+rest, ub4:QB, ub4:QB+W"),
               b: str = typer.Option("ub4", "--b", "-b", help="second geometry"),
               layers: str = typer.Option("all", "--layers", help="captured layers: all, 0, 0-3, first,last"),
               logits: str = typer.Option("last", "--logits", help="last (prefill) or all (every row an output)"),
               max_tokens: int = typer.Option(0, "--max-tokens", help="use only the first N prompt tokens (0: all)"),
               backend: str = BackendLongOpt, threads: int = ThreadsOpt, out: Optional[Path] = AuditOutOpt,
               json_out: bool = typer.Option(False, "--json", help="print the first divergence as JSON")):
    """Divergence locator: capture every graph node under two geometries and name the first
    node (layer, op) whose outputs differ on the same token positions."""
    from statelab.audit.locate import locate, locate_markdown
    from statelab.errors import ConfigError

    m, base = _setup(model, backend, threads)
    p, toks = _audit_prompt_tokens(m, prompt, humaneval, prompt_file)
    if max_tokens < 0:
        raise ConfigError(f"--max-tokens must be >= 0, got {max_tokens}")
    if max_tokens:
        toks = toks[:max_tokens]
    res = locate(m, toks, a, b, base, layers=layers, logits=logits)
    res.dataset.attrs["prompt"] = p.id
    if json_out:
        console.print_json(json.dumps({"prompt": p.id, "n_tokens": int(len(toks)), "a": a, "b": b,
                                       "diverged": res.diverged, "first": res.first,
                                       "logits_equal": bool(res.dataset.attrs["logits_equal"])}))
    else:
        md = f"Prompt: {p.id} ({len(toks)} tokens)\n\n" + locate_markdown(res.dataset)
        console.print(md, markup=False, highlight=False, soft_wrap=True)
    if out is not None:
        _audit_write(out, f"Prompt: {p.id} ({len(toks)} tokens)\n\n" + locate_markdown(res.dataset), res.dataset)


def _one_line(msg: str) -> None:
    print(f"error: {' '.join(str(msg).split())}", file=sys.stderr)


def _keep_interrupts() -> None:
    """A Ctrl-C that lands while Python runs inside a ctypes callback (llama.cpp's log or
    eval callback) is swallowed there ("Exception ignored ..."): deliver it again shortly,
    until it lands outside a callback and unwinds the command."""
    import _thread
    import signal
    import threading

    prev = sys.unraisablehook

    def again() -> None:
        t = threading.Timer(0.05, _thread.interrupt_main)  # calls on_sigint in the main thread
        t.daemon = True
        t.start()

    def hook(u):
        if u.exc_type is not None and issubclass(u.exc_type, KeyboardInterrupt):
            again()
            return
        prev(u)

    def on_sigint(signum, frame):
        if frame is not None and frame.f_code in (hook.__code__, again.__code__):
            again()  # raising here would be swallowed too
            return
        raise KeyboardInterrupt

    sys.unraisablehook = hook
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, on_sigint)


def main():
    """Run the CLI.  A usage error prints the usage line and exits 2; a StatelabError, an
    unreadable file or undecodable text prints one line and exits 2; Ctrl-C exits 130."""
    from typer._click.exceptions import ClickException  # typer's vendored click raises these

    _keep_interrupts()
    try:
        rc = app(standalone_mode=False)  # an Exit (typer.Exit, Ctrl-C as Exit(130)) comes back as its code
    except StatelabError as e:
        _one_line(e)
        sys.exit(2)
    except ClickException as e:  # usage errors: the usage line, then the error
        e.show()
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        rc = 130
    except OSError as e:  # a file that cannot be read or written
        _one_line(e)
        sys.exit(2)
    except UnicodeDecodeError as e:  # a user's file that is not UTF-8 text
        _one_line(f"a file is not UTF-8 text ({e.reason} at byte {e.start})")
        sys.exit(2)
    if rc == 130:
        print("interrupted", file=sys.stderr)
    sys.exit(rc if isinstance(rc, int) else 0)
