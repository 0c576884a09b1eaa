"""A running llama-server's slots: ``slot save`` (a slot as a verified capture) and
``slot restore`` (a capture into a slot).  The library is :mod:`statelab.lab.server`."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from statelab.cli.common import (BackendOpt, CtxOpt, HumanEvalOpt, PromptFileOpt, PromptOpt, ThreadsOpt, app,
                                 backend_name, console, load_capture_dir, optional_prompt, setup)

slot_app = typer.Typer(add_completion=False, no_args_is_help=True,
                       help="A running llama-server's slots: save one as a capture, restore a capture into one.")
app.add_typer(slot_app, name="slot")

UrlOpt = typer.Option(..., "--url", help="the server, e.g. http://127.0.0.1:8080")
SlotOpt = typer.Option(0, "--slot", min=0, help="slot id")
SlotDirOpt = typer.Option(..., "--slot-save-path", help="the folder the server was started with (--slot-save-path); "
                          "the server does not report it")
TimeoutOpt = typer.Option(120.0, "--timeout", min=0.001, help="seconds to wait for each HTTP answer")
KeepOpt = typer.Option(False, "--keep-file", help="leave the transfer file in the slot folder")


@slot_app.command("save")
def save(out: Path = typer.Argument(..., help="output capture folder (must not exist)"),
         url: str = UrlOpt, slot: int = SlotOpt, slot_dir: Path = SlotDirOpt,
         model: Optional[Path] = typer.Option(None, "--model", "-m", help="the server's model (default: the file the "
                                              "server reports in /props when it exists here, else the embedded "
                                              "default)"),
         prompt: Optional[str] = PromptOpt, humaneval: Optional[str] = HumanEvalOpt,
         prompt_file: Optional[Path] = PromptFileOpt,
         logits: str = typer.Option("recompute", "--logits", help="recompute (re-evaluate the last token; the file "
                                    "holds no logits) or none"),
         backend: str = BackendOpt, source_backend: Optional[str] = typer.Option(
             None, "--source-backend", callback=backend_name, help="the backend the server runs on (it does not report it); without it the "
             "capture's backend is unknown and continuing it needs --allow-backend"),
         threads: int = ThreadsOpt, n_ctx: int = CtxOpt, timeout: float = TimeoutOpt, keep_file: bool = KeepOpt):
    """Ask the server to save a slot (POST /slots/N?action=save) and import it as a verified capture."""
    from statelab.lab.archive import check_capture_dest, save_capture
    from statelab.lab.server import Server, save_slot_capture, server_model_path

    check_capture_dest(out)
    srv = Server(url, timeout)
    p = optional_prompt(prompt, humaneval, prompt_file)
    m, base = setup(model or server_model_path(srv), backend, threads, n_ctx)
    c = save_slot_capture(srv, slot, slot_dir, m, base, prompt=p, logits=logits, source_backend=source_backend,
                          keep_file=keep_file)
    save_capture(c, out)
    console.print(f"slot {slot} of {srv.url}: {c.n_prompt} tokens as {c.prompt_id} -> {out}\n"
                  f"logits: {c.identity['logits']['source']}; kv {c.hashes()['kv'][:16]}", markup=False)


@slot_app.command("restore")
def restore(capture_dir: Path = typer.Argument(..., help="a capture folder"),
            url: str = UrlOpt, slot: int = SlotOpt, slot_dir: Path = SlotDirOpt,
            streams: int = typer.Option(1, "--streams", min=1, help="KV streams of the server's context (-np N "
                                        "without a unified KV cache has N)"),
            cap: int = typer.Option(0, "--cap", min=0, help="then continue there: decode the capture's greedy "
                                    "token and generate up to CAP tokens in all (0: restore only)"),
            json_out: bool = typer.Option(False, "--json", help="print the server's answer (and tokens) as JSON"),
            timeout: float = TimeoutOpt, keep_file: bool = KeepOpt):
    """Write a capture into the server's slot folder and restore it (POST /slots/N?action=restore)."""
    from statelab.lab.server import Server, continue_in_server, greedy_first, restore_capture

    c = load_capture_dir(capture_dir)
    srv = Server(url, timeout)
    answer = restore_capture(srv, slot, c, slot_dir, n_stream=streams, keep_file=keep_file)
    tokens = continue_in_server(srv, slot, c.tokens, greedy_first(c), cap - 1) if cap else None
    if json_out:
        console.print_json(json.dumps({"restore": answer, "tokens": tokens}))
        return
    console.print(f"{capture_dir} -> slot {slot} of {srv.url}: {answer.get('n_restored')} tokens, "
                  f"{answer.get('n_read')} bytes", markup=False)
    if tokens is not None:
        console.print(f"continued in the server: {len(tokens)} tokens {tokens}", markup=False)
