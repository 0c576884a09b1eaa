"""``statelab doctor``: the native build, its devices and the model's metadata.

The runtime, model and audit modules are imported inside the command (they load llama_cpp)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from statelab.cli.common import ModelOpt, app, backend_name, console


@app.command()
def doctor(model: Optional[Path] = ModelOpt, backend: str = typer.Option(None, "--backend", "-b", callback=backend_name,
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
