"""The audits: ``statelab audit ...`` (layout oracles, backend admission, weight products,
E1), ``replay`` and ``locate``.

The audit modules are imported inside each command (they load llama_cpp and xarray)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from statelab.cli.common import (BackendLongOpt, BackendOpt, HumanEvalOpt, ModelOpt, PromptFileOpt, PromptOpt,
                                 ThreadsOpt, app, console, err, print_text, prompt_of, setup)
from statelab.limits import int_list
from statelab.runtime.layouts import ATTENTION_LAYOUTS

audit_app = typer.Typer(add_completion=False, no_args_is_help=True,
                        help="Layout oracles, E1 attention correspondence on the model, backend admission.")
app.add_typer(audit_app, name="audit")

AuditOutOpt = typer.Option(None, "--out", "-o", help="also write report.md and results.nc into this folder")
DEFAULT_TASK = "HumanEval/2"  # the audits' prompt when none is given


def _wrote(paths: list[Path]) -> None:
    console.print(f"[dim]wrote {' and '.join(str(p) for p in paths)}[/dim]")


def _report(out: Optional[Path], md: str, ds) -> None:
    """Print an audit's Markdown; with --out also write it and its Dataset."""
    from statelab.audit.outputs import write_report

    print_text(md)
    if out is not None:
        _wrote(write_report(out, md, ds))


@audit_app.command("layouts")
def audit_layouts(quick: bool = typer.Option(False, "--quick", help="a small fixture subset"),
                  out: Optional[Path] = AuditOutOpt):
    """Integer address oracle, fault injection and FP64/F32 oracles of every attention layout (no model)."""
    from statelab.audit.oracles import audit_markdown, run_layout_audit

    ds, passed = run_layout_audit(quick=quick)
    _report(out, audit_markdown(ds), ds)
    if not passed:
        raise typer.Exit(1)


@audit_app.command("backends")
def audit_backends(model: Optional[Path] = ModelOpt, backend: str = BackendOpt,
                   qs: str = typer.Option("1,2,3,4", "--q", help="occupied query counts"),
                   n_kv: int = typer.Option(256, "--n-kv", help="KV extent of the operator shapes"),
                   out: Optional[Path] = AuditOutOpt):
    """Ask every backend device whether it supports the attention operators of every layout
    (ggml_backend_dev_supports_op), next to what the runtime built."""
    from statelab.audit.admission import AttnShape, admission_markdown, run_admission
    from statelab.errors import ConfigError

    m, base = setup(model, backend)
    if n_kv < 1:
        raise ConfigError(f"--n-kv must be >= 1, got {n_kv}")
    ds = run_admission(AttnShape.of_model(m, n_kv), int_list(qs, "--q"), model=m, backend_config=base)
    _report(out, admission_markdown(ds), ds)


@audit_app.command("matmul")
def audit_matmul(model: Optional[Path] = ModelOpt, backend: str = BackendOpt,
                 max_q: int = typer.Option(8, "--max-q", help="largest row count q (1..16)"),
                 max_rows: int = typer.Option(1024, "--max-rows", help="output rows of each weight used"),
                 threads: int = ThreadsOpt, out: Optional[Path] = AuditOutOpt):
    """For each weight type of the model, each device and buffer type: is a q-row product bitwise
    equal to q 1-row products (q = 1..max-q), natively and with the row-by-row repair (+W)."""
    from statelab.audit.matmul import audit_devices, matmul_markdown, repaired_everywhere, run_matmul_audit

    m, _ = setup(model, backend, threads)
    ds = run_matmul_audit(m.path, audit_devices(backend), max_q=max_q, max_rows=max_rows, threads=threads or None)
    _report(out, matmul_markdown(ds), ds)
    if not repaired_everywhere(ds):
        raise typer.Exit(1)


@audit_app.command("e1")
def audit_e1(prompt: Optional[str] = PromptOpt, humaneval: Optional[str] = HumanEvalOpt,
             prompt_file: Optional[Path] = PromptFileOpt, model: Optional[Path] = ModelOpt,
             layers: str = typer.Option("first,middle,last", "--layers", help="target layers"),
             phases: str = typer.Option("prefill,continuation", "--phases"),
             qs: str = typer.Option("1,2,3,4", "--q", help="occupied query counts (1..4)"),
             layouts_: str = typer.Option(",".join(ATTENTION_LAYOUTS), "--layouts"),
             replay: bool = typer.Option(True, "--replay/--no-replay", help="also replay the frozen MQ operands "
                                         "as every attention layout's standalone graphs"),
             backend: str = BackendLongOpt, threads: int = ThreadsOpt, out: Optional[Path] = AuditOutOpt):
    """E1: capture Q/K/V/mask and QK/softmax/AV at target layers under every attention layout
    (controls first), compare bitwise with max |d| and ULP (default prompt HumanEval/2)."""
    from statelab.audit.capture import parse_layers
    from statelab.audit.e1 import e1_markdown, run_e1, write_e1
    from statelab.audit.replay import replay_e1, replay_markdown

    m, base = setup(model, backend, threads)
    p = prompt_of(prompt, humaneval, prompt_file, DEFAULT_TASK)
    toks = m.tokenize(p.text)
    lay = parse_layers(layers, m.n_layer) or list(range(m.n_layer))
    ds, detail = run_e1(m, toks, layers=lay, phases=tuple(x.strip() for x in phases.split(",") if x.strip()),
                        qs=int_list(qs, "--q"), layouts=tuple(x for x in layouts_.split(",") if x.strip()),
                        base_config=base, progress=lambda s: err.print(f"[dim]{s}[/dim]"))
    ds.attrs["prompt"] = p.id
    md = f"Prompt: {p.id} ({len(toks)} tokens)\n\n" + e1_markdown(ds)
    rds = None
    if replay:
        # the replay runs where the capture ran (the CPU's kernels do not reproduce a GPU capture)
        rds = replay_e1(detail, device=None if m.backend == "cpu" else m.backend, threads=threads or None)
        md += "\n" + replay_markdown(rds)
    print_text(md)
    if out is not None:
        _wrote(write_e1(out, md, ds, rds, detail, p.id))


@app.command("replay")
def replay_cmd(prompt: Optional[str] = PromptOpt, humaneval: Optional[str] = HumanEvalOpt,
               prompt_file: Optional[Path] = PromptFileOpt, model: Optional[Path] = ModelOpt,
               layer: int = typer.Option(0, "--layer", "-l", help="layer whose operator calls are replayed"),
               q: int = typer.Option(4, "--q", help="occupied queries of the captured micro-batch (1..4)"),
               layout: str = typer.Option("MQ", "--layout", help="attention layout of the native capture "
                                          "(all but MQ need the layout patch)"),
               capture_dir: Optional[Path] = typer.Option(None, "--capture", help="replay a saved attention "
                                                          "capture (from 'audit e1 --out') instead"),
               device: Optional[str] = typer.Option(None, "--device", help="backend device for the replay "
                                                    "(default: CPU)"),
               backend: str = BackendLongOpt, threads: int = ThreadsOpt, out: Optional[Path] = AuditOutOpt):
    """Operator replay: re-run captured operator calls of a layer (own-path correspondence,
    in-place aliasing excluded) and its attention operands as every attention layout's standalone graphs."""
    from statelab.audit.e1 import load_capture
    from statelab.audit.outputs import write_report
    from statelab.audit.replay import replay_layer, replay_report

    m, base = setup(model, backend, threads)
    if capture_dir is not None:
        cap, man = load_capture(capture_dir, m)
        rows, title = [], f"saved capture {capture_dir} (layer {cap.layer}, {man.get('phase', '?')}, q={cap.q}, " \
                           f"captured as {cap.layout})"
    else:
        p = prompt_of(prompt, humaneval, prompt_file, DEFAULT_TASK)
        rows, cap, lay = replay_layer(m, m.tokenize(p.text), layer, q, layout, base, device, threads or None)
        title = f"{p.id}: first {q} prompt tokens in one micro-batch, layer {layer}, native layout {lay}"
    md = replay_report(title, rows, cap, device, threads or None)
    print_text(md)
    if out is not None:
        write_report(out, md)
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
    from statelab.audit.outputs import write_report
    from statelab.errors import ConfigError

    m, base = setup(model, backend, threads)
    p = prompt_of(prompt, humaneval, prompt_file, DEFAULT_TASK)
    toks = m.tokenize(p.text)
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
    md = f"Prompt: {p.id} ({len(toks)} tokens)\n\n" + locate_markdown(res.dataset)
    if not json_out:
        print_text(md)
    if out is not None:
        _wrote(write_report(out, md, res.dataset))
