"""``statelab model derive``: layer-truncated draft models (gguf only, no llama.cpp);
``statelab model synth`` / ``shapes``: synthetic models of published shapes (gguf, then
llama.cpp's quantiser).

The library modules are imported inside the commands (they read GGUF files through gguf)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from statelab.cli.common import ModelOpt, app, console

model_app = typer.Typer(add_completion=False, no_args_is_help=True,
                        help="Model files: derive layer-truncated draft models; synthesise models of published shapes.")
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


@model_app.command("synth")
def model_synth(out: Path = typer.Argument(..., help="output GGUF file"),
                shape: str = typer.Option(..., "--shape", help="a shape of `statelab model shapes` (qwen3-0.6b, "
                                                                 "smollm2-1.7b, llama-3.2-1b, llama-3.1-8b, qwen3-8b, ci)"),
                type_: str = typer.Option("q8_0", "--type", help="q8_0, q6_k, q4_k_m or f16"),
                seed: int = typer.Option(0, "--seed", help="weight seed (0 .. 2^63-1)"),
                tokenizer: Optional[Path] = typer.Option(None, "--tokenizer",
                                                         help="GGUF whose tokenizer to copy (default: the embedded "
                                                              "SmolLM2)"),
                threads: int = typer.Option(0, "--threads", min=0, max=1024, help="threads (0: all cores, at most 16)"),
                overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing output file")):
    """A GGUF of a published shape with seeded random weights (the same shape, type and seed
    give the same bytes), cached; its identity (sha256, recipe) is written beside it as
    OUT.synth.json."""
    from statelab.synth import synth_to

    r = synth_to(out, shape, type_, seed, overwrite=overwrite, tokenizer=tokenizer, threads=threads,
                 progress=lambda msg: console.print(msg, markup=False, highlight=False))
    console.print(f"{r['path']}\n{r['shape']} {r['type']} seed {r['seed']}: {r['parameters']:,} parameters, "
                  f"{r['size']} bytes ({r['size'] / 2**20:.1f} MiB), vocab {r['n_vocab']}"
                  f"{' (from the cache)' if r['cached'] else ''}, {r['seconds']:.1f} s\nsha256 {r['sha256']}",
                  markup=False, highlight=False)


@model_app.command("shapes")
def model_shapes():
    """The shapes `model synth` knows: published hyperparameters and where each comes from."""
    from rich.table import Table

    from statelab.synth import shapes

    t = Table("shape", "arch", "layers", "width", "FFN", "heads q/kv", "head dim", "RoPE base", "norm eps",
              "QK norm", "tied", "vocab (published)", "source")
    for s in shapes().values():
        rope = f"{s.rope_theta:g}" + (f" llama3 x{s.rope_scaling['factor']:g}" if s.rope_scaling else "")
        t.add_row(s.name, s.arch, str(s.n_layer), str(s.n_embd), str(s.n_ff), f"{s.n_head}/{s.n_head_kv}",
                  str(s.head_dim), rope, f"{s.norm_eps:g}", "yes" if s.qk_norm else "no",
                  "yes" if s.tied_embeddings else "no", str(s.vocab_published), s.source)
    console.print(t)
