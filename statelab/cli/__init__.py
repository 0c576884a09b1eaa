"""The command line: ``statelab ...`` and ``python -m statelab.cli ...`` (typer commands in
one module per group, registered by :mod:`.main`; each parses, calls the library and prints).

Ctrl-C handling is installed first, before typer, numpy and the commands are imported: an
interrupt during those imports ends the command as any other (exit 130, ``interrupted``)."""
import os as _os
import sys as _sys

from statelab.cli import interrupts as _interrupts

# this process is the command (``python -m statelab.cli`` while its package is imported, or
# the ``statelab`` script), not a program that imports the CLI (tests, notebooks)
_COMMAND = _sys.argv[:1] == ["-m"] or _os.path.basename(_sys.argv[0] if _sys.argv else "") == "statelab"
if _COMMAND:
    _interrupts.install()

try:
    from statelab.cli.main import app, main
except KeyboardInterrupt:  # pragma: no cover - Ctrl-C during the imports
    if not _COMMAND:
        raise
    _interrupts.hold()
    print("interrupted", file=_sys.stderr)
    _sys.stderr.flush()
    _os._exit(130)

if _COMMAND:
    _interrupts.hold()  # until main() starts the command: nothing may unwind the caller's next lines

__all__ = ["app", "main"]
