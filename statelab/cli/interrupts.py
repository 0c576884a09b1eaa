"""Ctrl-C for the command line: installed by ``statelab.cli`` before anything heavy is
imported, so that an interrupt at any moment (the first imports included) ends the command
with exit status 130 and one line ``interrupted``.

:func:`install` replaces Python's SIGINT handler by one that records the interrupt and
raises KeyboardInterrupt (as the default one does), except in two cases:

* inside a ctypes callback (llama.cpp's log or eval callback) a KeyboardInterrupt would be
  swallowed ("Exception ignored ..."): it is delivered again shortly, until it lands outside
  a callback and unwinds the command;
* while :func:`hold` is in force (from the end of the imports until the command starts, and
  once the command has ended) a Ctrl-C only records itself: nothing may unwind the lines
  between the imports and the command, or the printing of the last line (a KeyboardInterrupt
  there is a traceback or a death by SIGINT); the command then exits 130.

Once the exit status is decided, :func:`ignore` ignores SIGINT for the interpreter's shutdown.

Only built-in modules are imported here (``threading`` when first needed): the handler is
in place a millisecond after the package starts loading.  The interpreter's own start
(before any statelab code runs: tens of milliseconds) is beyond its reach."""
from __future__ import annotations

import _thread
import signal
import sys

_state = {"interrupted": False, "finishing": False}


def hold() -> None:
    """From now on a Ctrl-C is only recorded (between the imports and the command, and once
    the command is ending)."""
    _state["finishing"] = True


def release() -> bool:
    """Let a Ctrl-C raise again; True when one was recorded while held (then the command
    must not start).  The record is cleared."""
    _state["finishing"] = False
    was, _state["interrupted"] = _state["interrupted"], False
    return was


def take() -> bool:
    """Whether a Ctrl-C arrived, and clear the record."""
    was, _state["interrupted"] = _state["interrupted"], False
    return was


def _again() -> None:
    import threading

    t = threading.Timer(0.05, _thread.interrupt_main)  # calls _on_sigint in the main thread
    t.daemon = True
    t.start()


def _hook_factory(prev):
    def hook(u):
        if u.exc_type is not None and issubclass(u.exc_type, KeyboardInterrupt):
            _again()
            return
        prev(u)
    return hook


_hook = None


def _on_sigint(signum, frame):
    _state["interrupted"] = True
    if _state["finishing"]:
        return
    if frame is not None and _hook is not None and frame.f_code in (_hook.__code__, _again.__code__):
        _again()  # raising here would be swallowed too
        return
    raise KeyboardInterrupt


def install() -> None:
    """Install the handler (main thread only; a second call changes nothing)."""
    global _hook
    try:
        signal.signal(signal.SIGINT, _on_sigint)
    except (ValueError, OSError):  # not the main thread of the main interpreter
        return
    if _hook is None:
        _hook = _hook_factory(sys.unraisablehook)
        sys.unraisablehook = _hook


def ignore() -> None:
    """Ignore Ctrl-C from now on (the command's exit status is decided).  The interpreter
    puts the default action back for a Python handler when it shuts down, so a Ctrl-C during
    the exit would kill the process by SIGINT; an ignored signal stays ignored."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except (ValueError, OSError):
        pass


def forget_native_record() -> None:
    """Clear CPython's own record of an unhandled KeyboardInterrupt.  Code that Python runs
    from a string (``exec(str)``: dataclasses and named tuples build their methods so) sets
    a flag when a KeyboardInterrupt leaves it, and the interpreter then ends itself with
    SIGINT at exit even though the command caught the interrupt and chose its exit status.
    Each such run clears the flag first: one that raises nothing leaves it clear."""
    exec("pass")  # noqa: S102 - a constant string, on purpose (see above)
