"""statelab command line (typer + rich): ``statelab ...`` and ``python -m statelab.cli ...``.

The commands live in one module per group (:mod:`.doctor`, :mod:`.lab`, :mod:`.interop`, :mod:`.slot`,
:mod:`.partition`, :mod:`.study`, :mod:`.model`, :mod:`.spec`, :mod:`.frontier`,
:mod:`.audit`); each parses its options, calls the library and prints.  Importing them here
registers them on :data:`statelab.cli.common.app` in the order ``statelab --help`` lists them.
:func:`main` turns every error a user can cause into one line and exit status 2."""
from __future__ import annotations

import sys

import typer
from typer._click.exceptions import ClickException  # typer's vendored click raises these

from statelab.cli import doctor, lab, interop, slot, partition, study, model, spec, frontier, audit  # noqa: F401 (order)
from statelab.cli import interrupts
from statelab.cli.common import app
from statelab.errors import StatelabError


def _one_line(msg: str) -> None:
    print(f"error: {' '.join(str(msg).split())}", file=sys.stderr)


def main():
    """Run the CLI.  A usage error prints the usage line and exits 2; a StatelabError, an
    unreadable file or undecodable text prints one line and exits 2; Ctrl-C at any moment
    exits 130 with one line ``interrupted`` (also when the command then ended otherwise)."""
    interrupts.install()
    try:
        try:
            rc = 130 if interrupts.release() else _run()
        finally:
            interrupts.hold()  # from here a Ctrl-C is only recorded
    except KeyboardInterrupt:
        rc = 130
    if interrupts.take():
        rc = 130
    interrupts.ignore()  # the exit status is decided: a Ctrl-C during the exit cannot kill the process
    if rc == 130:
        print("interrupted", file=sys.stderr)
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    interrupts.forget_native_record()
    sys.exit(rc)


def _run() -> int:
    try:
        rc = app(standalone_mode=False)  # an Exit (typer.Exit, Ctrl-C as Exit(130)) comes back as its code
    except StatelabError as e:
        _one_line(e)
        return 2
    except ClickException as e:  # usage errors: the usage line, then the error
        e.show()
        return e.exit_code
    except (typer.Abort, KeyboardInterrupt):
        return 130
    except OSError as e:  # a file that cannot be read or written
        _one_line(e)
        return 2
    except UnicodeDecodeError as e:  # a user's file that is not UTF-8 text
        _one_line(f"a file is not UTF-8 text ({e.reason} at byte {e.start})")
        return 2
    except SystemExit as e:  # a command that exits itself
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return rc if isinstance(rc, int) else 0
