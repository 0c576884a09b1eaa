"""The command line: ``statelab ...`` and ``python -m statelab.cli ...`` (typer commands in
one module per group, registered by :mod:`.main`; each parses, calls the library and prints)."""
from statelab.cli.main import app, main

__all__ = ["app", "main"]
