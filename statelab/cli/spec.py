"""``statelab spec ...``: the QB speculative path (arms on one prompt, campaigns, phase masks).

The campaign and transaction modules are imported inside each command (they load
llama_cpp and xarray)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from statelab.cli.common import (BackendOpt, CapOpt, HumanEvalOpt, ModelOpt, PromptFileOpt, PromptOpt, ThreadsOpt,
                                 app, console, err, prompt_of)
from statelab.errors import one_of
from statelab.paths import atomic_write_text
from statelab.runtime.layouts import Layout

# the arm names of speculative.transaction.ARM_NAMES, from the layouts (that module would load xarray at start)
ARMS_HELP = (f"comma list of R, M0, C0 and M_x (target only) or C_x (draft + target) for x in "
             f"{one_of(x for x in Layout if x.in_arms and x is not Layout.MQ)} (+W: row-by-row weight products)")
spec_app = typer.Typer(no_args_is_help=True, help="The QB speculative path: arms, qualification, timing.")
app.add_typer(spec_app, name="spec")
DraftOpt = typer.Option("self", "--draft", help="the drafter: 'self' (the target), 'derive:N' (its first N layers), a "
                        "GGUF path, 'ngram[:NMIN-NMAX][+session]' (model-free prompt lookup, default 2-4; +session "
                        "also over a session's earlier outputs), or 'none'")
GateOpt = typer.Option(False, "--gate/--no-gate", help="measure the verify cost by rows first, then gate the proposals "
                       "by it (--gate-kind; default gain)")
GateKindOpt = typer.Option(None, "--gate-kind", help="the gate (implies --gate): gain: submit a proposal only when its "
                           "expected gain is positive; shadow: draft in runs, judged by what drafting commits (measured "
                           "in the shadow while not drafting)")
KMaxOpt = typer.Option(None, "--k-max", help="adaptive k: grown after full acceptance, shrunk after a rejection, "
                       "within [1, K_MAX] (default: k fixed)")
FixedRowsOpt = typer.Option(False, "--fixed-rows/--exact-rows", help="every verify submits k_max+1 rows (unused ones "
                            "masked and removed): one graph shape, reused")


@spec_app.command("run")
def spec_run(prompt: Optional[str] = PromptOpt, humaneval: Optional[str] = HumanEvalOpt,
             prompt_file: Optional[Path] = PromptFileOpt,
             arms: str = typer.Option("R,M0,M_QB,C_QB", help=ARMS_HELP),
             k: int = typer.Option(3, help="draft proposals per cycle"),
             k_max: Optional[int] = KMaxOpt, fixed_rows: bool = FixedRowsOpt,
             ubatch: int = typer.Option(0, help="target ubatch (0: k_max+1, one micrograph per verify)"),
             graph_keep: int = typer.Option(4, help="graphs of earlier shapes each target context keeps "
                                                    "(native patch 0008; 0: llama.cpp rebuilds on every change of shape)"),
             mask: int = typer.Option(3, help="phase mask 0..15 (1 target prefill, 2 target continuation, 4 draft "
                                              "prefill, 8 draft continuation)"),
             cap: int = CapOpt, model: Optional[Path] = ModelOpt, draft: str = DraftOpt, backend: str = BackendOpt,
             threads: int = ThreadsOpt, gate: bool = GateOpt, gate_kind: Optional[str] = GateKindOpt,
             warmup: bool = typer.Option(True, help="a short warm-up request of each arm before the timed one "
                                                    "(--no-warmup: one pass; times then include first-use costs)"),
             json_out: Optional[Path] = typer.Option(None, "--json")):
    """Run arms on one prompt in this process; qualify each against R; time qualified arms."""
    from statelab.experiments.spec_run import run_arms
    from statelab.speculative.drafters import check_gate
    from statelab.speculative.transaction import SpecConfig

    gate_name = check_gate(gate_kind or gate)  # an unknown kind is refused before any model loads
    names = [a.strip() for a in arms.split(",") if a.strip()]
    cfg = SpecConfig(k=k, ubatch=ubatch, mask=mask, cap=cap, backend=backend, threads=threads, k_max=k_max,
                     fixed_rows=fixed_rows, graph_keep=graph_keep)
    p = prompt_of(prompt, humaneval, prompt_file)
    results, need_draft = run_arms(model, draft, p, names, cfg, refused=lambda a, why: err.print(f"{a}: {why}; not run"),
                                   gate=gate_name or False, warmup=warmup)
    t = Table(title=f"{p.id} (sha256 {p.sha256[:12]}): k={k}{f'..{k_max}' if k_max else ''}, ubatch "
                    f"{cfg.target_ubatch}, mask {mask}, cap {cap}, {backend}, draft {draft if need_draft else '-'}"
                    f"{f', gate {gate_name}' if gate_name and need_draft else ''}")
    for col in ("arm", "qualified", "first diff", "seconds", "accepted/proposals", "declined", "tokens/call",
                "target callers", "micrographs"):
        t.add_column(col)
    for r in results:
        c = r.counters
        t.add_row(r.arm, "ref" if r.arm == "R" else ("yes" if r.qualified else "NO"),
                  "=" if r.first_diff is None else str(r.first_diff),
                  f"{r.seconds:.3f}" if r.qualified else f"({r.seconds:.3f} not comparable)",
                  f"{c.accepted}/{c.proposals}", str(c.declined), f"{c.committed / max(c.verify_calls, 1):.2f}",
                  str(c.target_callers),
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
                  cap: Optional[int] = typer.Option(None, "--cap", help="override the spec's cap (tokens per request)"),
                  budget: Optional[float] = typer.Option(None, "--budget", help="start no new block after this "
                                                         "many seconds (run again with the same --out to resume)")):
    """Fresh worker processes, counterbalanced blocks, sessions, bootstrap intervals; resumable."""
    from statelab.experiments.campaign import CampaignSpec, run_campaign
    from statelab.experiments.progress import RichReporter
    from statelab.report import campaign_page

    spec = CampaignSpec.load(spec_path, draft=draft, k=k, k_max=k_max, cap=cap)
    res = run_campaign(spec, out, progress=RichReporter(console, "blocks", transient=True), budget_s=budget)
    if not res.complete:
        console.print(f"incomplete: {res.skipped + res.ran} of {res.planned} blocks in {out}; run the same command "
                      "again to continue")
        raise typer.Exit(3)
    console.print(res.outputs["report"], markup=False, highlight=False)
    console.print(f"results: {out}/results.nc, {out}/report.md, "
                  f"{campaign_page(out, res.outputs['contrasts'], spec.threshold)}")


@spec_app.command("masks")
def spec_masks(tasks: str = typer.Option("HumanEval/0,HumanEval/2,HumanEval/4,HumanEval/5", help="prompts"),
               repeats: int = typer.Option(2), k: int = typer.Option(3), ubatch: int = typer.Option(4),
               cap: int = CapOpt, arm: str = typer.Option("C_QB"), masks: str = typer.Option("0-15"),
               model: Optional[Path] = ModelOpt, draft: str = DraftOpt, backend: str = BackendOpt,
               threads: int = ThreadsOpt, out: Optional[Path] = typer.Option(
                   None, "--out", help="run folder (resumable; default runs/masks/<spec hash>)")):
    """Phase-mask experiment: which masks reproduce R; the inclusion-minimal ones."""
    from statelab.experiments.masks import MaskSpec, run_masks
    from statelab.experiments.progress import RichReporter
    from statelab.experiments.spec_run import resolve_draft
    from statelab.speculative.transaction import parse_masks

    ms = parse_masks(masks)
    ps = [x.strip() for x in tasks.split(",") if x.strip()]
    spec = MaskSpec(ps, None, ms, repeats, k, ubatch, cap, arm, backend, threads,
                    None if model is None else str(model)).validate()
    spec.draft = resolve_draft(model, draft)
    res = run_masks(spec, out, progress=RichReporter(console, "requests", transient=True))
    console.print(res.outputs["markdown"], markup=False, highlight=False)
