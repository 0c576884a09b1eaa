"""The lab commands: generate, capture, continue, sham, cross, diff.

Each command imports its library modules inside itself (they load llama_cpp, xarray or
matplotlib), so ``statelab --help`` stays fast."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from statelab.cli.common import (BackendOpt, CapOpt, CaptureModelOpt, CtxOpt, HumanEvalOpt, JsonOpt, ModelOpt,
                                 PromptFileOpt, PromptOpt, ThreadsOpt, app, backend_name, console, load_capture_dir,
                                 model_for, print_endpoint, prompt_of, setup)
from statelab.errors import one_of
from statelab.kvstate import KV_TYPE_NAMES
from statelab.lab.formation import SCHEDULES_TEXT


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
    p = prompt_of(prompt, humaneval, prompt_file)
    m, base = setup(model, backend, threads, n_ctx)
    t0 = time.perf_counter()
    capture, ep = natural(m, p, parse_schedule(schedule), base, cap)
    dt = time.perf_counter() - t0
    if json_out:
        console.print_json(json.dumps({"prompt": p.id, "n_prompt": capture.n_prompt, **ep.as_dict()}))
        return
    console.print(f"[bold]{escape(p.id)}[/bold] ({capture.n_prompt} prompt tokens, schedule {escape(schedule)}, {backend})")
    console.print(m.detokenize(ep.tokens), markup=False, highlight=False)
    console.print(f"[dim]{ep.length} tokens, stop: {ep.stop_reason}, {ep.length / dt:.1f} tokens/s "
                  f"(prefill included)[/dim]")


@app.command()
def capture(out: Path = typer.Argument(..., help="output folder (must not exist)"),
            prompt: Optional[str] = PromptOpt, humaneval: Optional[str] = HumanEvalOpt,
            prompt_file: Optional[Path] = PromptFileOpt, schedule: str = typer.Option("A", "--schedule", "-s",
            help=SCHEDULES_TEXT),
            model: Optional[Path] = ModelOpt, backend: str = BackendOpt, threads: int = ThreadsOpt,
            n_ctx: int = CtxOpt, overwrite: bool = typer.Option(False, help="replace an existing capture (only a "
                                                                  "capture that verifies is replaced)"),
            cache_type_k: str = typer.Option("f16", "--cache-type-k", help=f"K cache type: {one_of(KV_TYPE_NAMES)}"),
            cache_type_v: str = typer.Option("f16", "--cache-type-v", help=f"V cache type: {one_of(KV_TYPE_NAMES)} "
                                             "(q8_0 needs --flash-attn)"),
            flash_attn: bool = typer.Option(False, "--flash-attn", help="flash attention (V stored untransposed)")):
    """Form a state with a prefill schedule and archive it (KV, initial FP32 logits, identities)."""
    from statelab.lab.archive import check_capture_dest, save_capture
    from statelab.lab.formation import form, parse_schedule
    from statelab.runtime import ContextConfig

    check_capture_dest(out, overwrite)
    sched = parse_schedule(schedule)
    p = prompt_of(prompt, humaneval, prompt_file)
    ContextConfig(type_k=cache_type_k, type_v=cache_type_v, flash_attn=flash_attn)  # checked before loading
    m, base = setup(model, backend, threads, n_ctx)
    base = base.with_(type_k=cache_type_k, type_v=cache_type_v, flash_attn=flash_attn)
    cap_ = form(m, p, sched, base)
    save_capture(cap_, out, overwrite=overwrite)
    h = cap_.hashes()
    console.print(f"captured {p.id} ({cap_.n_prompt} tokens, {sched.describe()}) -> {out}\n"
                  f"kv {h['kv'][:16]}  logits {h['logits'][:16]}", markup=False)  # "[rest]" is no markup


@app.command("continue")
def continue_(capture_dir: Path = typer.Argument(..., help="a capture folder"), cap: int = CapOpt,
              model: Optional[Path] = CaptureModelOpt, backend: Optional[str] = typer.Option(
                  None, "--backend", "-b", callback=backend_name, help="recipient backend (default: the capture's)"),
              allow_backend: bool = typer.Option(False, "--allow-backend", help="allow another backend"),
              json_out: bool = JsonOpt):
    """Continue greedily from a capture through the common receiver."""
    from statelab.lab.archive import check_importable
    from statelab.lab.intervene import config_of, import_and_continue
    from statelab.lab.receiver import check_cap

    check_cap(cap)
    c = load_capture_dir(capture_dir)
    cfg = config_of(c)
    if backend:
        cfg = cfg.with_(backend=backend)
    m, _ = setup(model_for(c, model), cfg.backend)
    check_importable(c, m, cfg, allow_backend)
    ep = import_and_continue(m, cfg, c.blob, c.logits, c.n_prompt, cap)
    print_endpoint(m, ep, f"{c.prompt_id} [{c.schedule.name}] via receiver on {cfg.backend}", json_out)


@app.command("sham")
def sham_(capture_dir: Path = typer.Argument(...), cap: int = CapOpt, model: Optional[Path] = CaptureModelOpt,
          json_out: bool = JsonOpt):
    """Restore a capture into its own path and compare with its natural endpoint."""
    from statelab.experiments.partition import sham_control
    from statelab.lab.intervene import config_of
    from statelab.lab.receiver import check_cap

    check_cap(cap)
    c = load_capture_dir(capture_dir)
    m, _ = setup(model_for(c, model), config_of(c).backend)
    s, fd = sham_control(m, c, cap)
    print_endpoint(m, s, f"sham {c.prompt_id} [{c.schedule.name}]", json_out)
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
           model: Optional[Path] = CaptureModelOpt, json_out: bool = JsonOpt):
    """Whole-KV cross: the donor's KV imported into the recipient's path."""
    from statelab.lab.intervene import config_of, cross

    d, r = load_capture_dir(donor, mapped=True), load_capture_dir(recipient, mapped=True)
    m, _ = setup(model_for(r, model), config_of(r).backend)
    ep, acc = cross(m, d, r, logits_from, cap, allow_other_backend=allow_backend)
    print_endpoint(m, ep, f"cross {d.schedule.name}->{r.schedule.name} ({d.prompt_id})", json_out)
    if not json_out:
        console.print(f"selected {acc.selected_bytes} B, changed {acc.changed_bytes} B, max|d| {acc.max_abs:.6g}, "
                      f"L2 rel {acc.l2_rel:.3g}, first differing layer {acc.first_differing_layer}")


@app.command()
def diff(a: Path = typer.Argument(..., help="capture A"), b: Path = typer.Argument(..., help="capture B"),
         plot: Optional[Path] = typer.Option(None, "--plot", help="also draw the per-layer K/V profile into this PNG")):
    """Per-layer table of differences between two captures' KV states."""
    from statelab.api import comparable_states, difference_summary
    from statelab.kvstate import compare

    ca, cb = load_capture_dir(a, mapped=True), load_capture_dir(b, mapped=True)
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
