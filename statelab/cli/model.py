"""``statelab model derive``: layer-truncated draft models (gguf only, no llama.cpp).

The derive module is imported inside the command (it reads GGUF files through gguf)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from statelab.cli.common import ModelOpt, app, console

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
