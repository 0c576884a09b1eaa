"""llama.cpp state files in and out: ``import-state``, ``export-state``.

The interop and archive modules are imported inside each command (they load llama_cpp)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from statelab.cli.common import (BackendOpt, CtxOpt, HumanEvalOpt, ModelOpt, PromptFileOpt, PromptOpt, ThreadsOpt,
                                 SourceBackendOpt, app, console, load_capture_dir, optional_prompt, setup)
from statelab.lab.formation import SCHEDULES_TEXT


@app.command("import-state")
def import_state(file: Path = typer.Argument(..., help="llama.cpp state file (llama_state_seq_save_file, llama-server "
                                             "slot save, or llama_state_save_file)"),
                 out: Path = typer.Argument(..., help="output capture folder (must not exist)"),
                 model: Optional[Path] = ModelOpt, prompt: Optional[str] = PromptOpt,
                 humaneval: Optional[str] = HumanEvalOpt, prompt_file: Optional[Path] = PromptFileOpt,
                 logits: str = typer.Option("none", "--logits", help="none (the file holds none) or recompute "
                                            "(re-evaluate the last token in a recipient context on --backend)"),
                 backend: str = BackendOpt, source_backend: Optional[str] = SourceBackendOpt,
                 threads: int = ThreadsOpt, n_ctx: int = CtxOpt,
                 flash_attn: Optional[bool] = typer.Option(
                     None, "--flash-attn/--no-flash-attn", help="the recipient's attention (default: from the state: "
                     "an untransposed V, as llama.cpp writes with flash attention, turns it on)"),
                 schedule: Optional[str] = typer.Option(
                     None, "--schedule", "-s", help=f"the formation the state comes from, when known ({SCHEDULES_TEXT}): "
                     "recorded, and checked by sham")):
    """Import a llama.cpp state file as a verified capture (tokens, vocabulary, geometry checked)."""
    from statelab.lab.archive import save_capture
    from statelab.lab.formation import parse_schedule
    from statelab.lab.interop import import_state_file

    p = optional_prompt(prompt, humaneval, prompt_file)
    sched = parse_schedule(schedule) if schedule is not None else None
    m, base = setup(model, backend, threads, n_ctx)
    c = import_state_file(file, m, base, prompt=p, logits=logits, source_backend=source_backend,
                         flash_attn=flash_attn, schedule=sched)
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

    c = load_capture_dir(capture_dir, mapped=True)
    path = export_state_file(c, file, kind, model, overwrite, streams)
    console.print(f"{path}: {kind} state file, {c.n_prompt} tokens, {path.stat().st_size} bytes", markup=False)
