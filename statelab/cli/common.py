"""What every command module shares: the typer app, the two consoles, the common options and
the small parsing helpers (prompt options, model and context options, capture folders).

The library modules behind these helpers load llama_cpp (``statelab.runtime.Model``) or read
captures, so they are imported inside the helper that needs them: ``statelab --help`` and a
small command do not pay for them."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from statelab.errors import one_of
from statelab.limits import MAX_THREADS
from statelab.runtime.native import BACKENDS, check_backend

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="KV-state formation, intervention and transplantation on llama.cpp.")
console = Console(width=None if sys.stdout.isatty() else 160)  # logs keep whole table rows
err = Console(stderr=True)



def backend_name(value: Optional[str]) -> Optional[str]:
    """The one parser of every backend option: a name of BACKENDS (or None where the option
    may be left out); anything else is one line naming them (ConfigError)."""
    return None if value is None else check_backend(value)


ModelOpt = typer.Option(None, "--model", "-m", help="GGUF model file (default: the embedded SmolLM2-135M-Instruct)")
CaptureModelOpt = typer.Option(None, "--model", "-m", help="GGUF model file or short name (default: the capture's "
                               "recorded model, found by path or short name and checked by sha256)")
BackendOpt = typer.Option("cpu", "--backend", "-b", help=one_of(BACKENDS), callback=backend_name)
BackendLongOpt = typer.Option("cpu", "--backend", help=one_of(BACKENDS), callback=backend_name)  # where -b means something else
SourceBackendOpt = typer.Option(None, "--source-backend", callback=backend_name,
                                help=f"the backend that formed the state, when known ({one_of(BACKENDS)})")
CapOpt = typer.Option(128, "--cap", help="output cap (generated tokens)")
ThreadsOpt = typer.Option(0, "--threads", min=0, max=MAX_THREADS, help="CPU threads (0: all cores)")
CtxOpt = typer.Option(1024, "--n-ctx", help="context size")
PromptOpt = typer.Option(None, "--prompt", "-p", help="prompt text")
HumanEvalOpt = typer.Option(None, "--humaneval", "-H", help="HumanEval id, e.g. HumanEval/12 or 12")
PromptFileOpt = typer.Option(None, "--prompt-file", help="a UTF-8 text file used verbatim")
JsonOpt = typer.Option(False, "--json", help="print the endpoint as JSON")


def setup(model_path, backend: str, threads: int = 0, n_ctx: int = 1024):
    """The model and the base context configuration (bounds checked before any load)."""
    from statelab.runtime import ContextConfig, Model

    config = ContextConfig(backend=backend, n_threads=threads, n_ctx=n_ctx)
    return Model(model_path, backend=backend), config


def model_for(capture, model_path):
    """``--model`` when given, else the capture's recorded model (found by path or short name and
    checked by sha256)."""
    if model_path is not None:
        return model_path
    from statelab.lab.archive import capture_model_path

    return capture_model_path(capture)


def prompt_of(prompt: Optional[str], humaneval: Optional[str], prompt_file: Optional[Path],
              default_task: Optional[str] = None):
    """The one prompt that --prompt, --humaneval or --prompt-file names (``default_task``
    when none is given and a default exists)."""
    from statelab import prompts
    from statelab.errors import ConfigError

    given = sum(x is not None for x in (prompt, humaneval, prompt_file))
    if given == 0 and default_task is not None:
        return prompts.humaneval(default_task)
    if given != 1:
        raise ConfigError("give exactly one of --prompt, --humaneval, --prompt-file")
    if prompt is not None:
        return prompts.resolve("text:" + prompt)
    if humaneval is not None:
        return prompts.humaneval(humaneval)
    return prompts.from_file(prompt_file)


def prompt_spec_of(prompt: Optional[str], humaneval: Optional[str], prompt_file: Optional[Path]) -> str:
    """The prompt spec (``statelab.prompts.resolve``) of the one prompt --prompt, --humaneval or
    --prompt-file names, checked: what a unit in another process resolves again."""
    p = prompt_of(prompt, humaneval, prompt_file)
    if prompt is not None:
        return "text:" + prompt
    return p.id if humaneval is not None else f"file:{Path(prompt_file).resolve()}"


def load_capture_dir(path: Path, mapped: bool = False):
    """``mapped``: the payload as a read-only map of its file (commands that only read it)."""
    from statelab.lab.archive import load_capture

    return load_capture(path, mapped)


def print_endpoint(m, ep, label: str, json_out: bool) -> None:
    if json_out:
        console.print_json(json.dumps({"label": label, **ep.as_dict()}))
        return
    console.print(f"[bold]{label}[/bold]: {ep.length} tokens, stop {ep.stop_reason}")
    console.print(m.detokenize(ep.tokens), markup=False, highlight=False)


def print_text(text: str) -> None:
    """Markdown or plain text as it is (no rich markup, highlighting or wrapping)."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def say(msg: str) -> None:
    """A progress line on stderr, as it is."""
    err.print(msg, markup=False, highlight=False, soft_wrap=True)


def optional_prompt(prompt: Optional[str], humaneval: Optional[str], prompt_file: Optional[Path]):
    """The prompt named by the options, or None when none is given."""
    if prompt is None and humaneval is None and prompt_file is None:
        return None
    return prompt_of(prompt, humaneval, prompt_file)
