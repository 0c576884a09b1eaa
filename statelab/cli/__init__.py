"""The command line: ``statelab ...`` and ``python -m statelab.cli ...`` (typer commands in
:mod:`.main`; each parses, calls one library function and prints)."""
from statelab.cli.main import app, main

__all__ = ["app", "main"]
