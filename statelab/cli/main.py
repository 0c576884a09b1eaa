"""statelab command line (typer + rich): ``statelab ...`` and ``python -m statelab.cli ...``.

The commands live in one module per group (:mod:`.doctor`, :mod:`.lab`, :mod:`.interop`, :mod:`.slot`,
:mod:`.partition`, :mod:`.study`, :mod:`.model`, :mod:`.spec`, :mod:`.frontier`,
:mod:`.audit`); each parses its options, calls the library and prints.  Importing them here
registers them on :data:`statelab.cli.common.app` in the order ``statelab --help`` lists them.
:func:`main` turns every error a user can cause into one line and exit status 2."""
from __future__ import annotations

import _thread
import signal
import sys
import threading

import typer
from typer._click.exceptions import ClickException  # typer's vendored click raises these

from statelab.cli import doctor, lab, interop, slot, partition, study, model, spec, frontier, audit  # noqa: F401 (order)
from statelab.cli.common import app
from statelab.errors import StatelabError


def _one_line(msg: str) -> None:
    print(f"error: {' '.join(str(msg).split())}", file=sys.stderr)


def _keep_interrupts() -> None:
    """A Ctrl-C that lands while Python runs inside a ctypes callback (llama.cpp's log or
    eval callback) is swallowed there ("Exception ignored ..."): deliver it again shortly,
    until it lands outside a callback and unwinds the command."""
    prev = sys.unraisablehook

    def again() -> None:
        t = threading.Timer(0.05, _thread.interrupt_main)  # calls on_sigint in the main thread
        t.daemon = True
        t.start()

    def hook(u):
        if u.exc_type is not None and issubclass(u.exc_type, KeyboardInterrupt):
            again()
            return
        prev(u)

    def on_sigint(signum, frame):
        if frame is not None and frame.f_code in (hook.__code__, again.__code__):
            again()  # raising here would be swallowed too
            return
        raise KeyboardInterrupt

    sys.unraisablehook = hook
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, on_sigint)


def main():
    """Run the CLI.  A usage error prints the usage line and exits 2; a StatelabError, an
    unreadable file or undecodable text prints one line and exits 2; Ctrl-C exits 130."""
    _keep_interrupts()
    try:
        rc = app(standalone_mode=False)  # an Exit (typer.Exit, Ctrl-C as Exit(130)) comes back as its code
    except StatelabError as e:
        _one_line(e)
        sys.exit(2)
    except ClickException as e:  # usage errors: the usage line, then the error
        e.show()
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        rc = 130
    except OSError as e:  # a file that cannot be read or written
        _one_line(e)
        sys.exit(2)
    except UnicodeDecodeError as e:  # a user's file that is not UTF-8 text
        _one_line(f"a file is not UTF-8 text ({e.reason} at byte {e.start})")
        sys.exit(2)
    if rc == 130:
        print("interrupted", file=sys.stderr)
    sys.exit(rc if isinstance(rc, int) else 0)
