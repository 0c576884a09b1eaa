"""Child processes that end with the runner that started them, kill -9 included.

The runner starts every child (fork server, batch process, spawned worker) with
``STATELAB_PARENT_PID`` in its environment (:func:`child_env`); the child calls
:func:`die_with_parent` first thing.  On Linux the kernel then sends SIGKILL to the child
when its parent ends (``prctl(PR_SET_PDEATHSIG)``); everywhere a daemon thread watches the
parent pid once a second as a fallback (the parent's death reparents the child).  A child
whose parent is already gone when it starts exits at once.  The fork server calls it again
in every forked child, with itself as the parent.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

ENV = "STATELAB_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def child_env(env: dict | None = None) -> dict:
    """``env`` (default: this process's environment) naming this process as the parent."""
    return {**(os.environ if env is None else env), ENV: str(os.getpid())}


def _pdeathsig() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent: int, interval: float) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(interval)


def die_with_parent(parent: int | None = None, interval: float = 1.0, watch: bool = True) -> None:
    """End this process when ``parent`` (default: ``$STATELAB_PARENT_PID``; nothing to do
    when unset) ends.  A fork of this process must call it again (neither the kernel's
    setting nor the watching thread survive fork)."""
    if parent is None:
        try:
            parent = int(os.environ.pop(ENV, ""))  # popped: this process's own children are not its parent's
        except ValueError:
            return
    _pdeathsig()
    if os.getppid() != parent:  # the parent died before the kernel could be told
        os._exit(1)
    if watch:
        threading.Thread(target=_watch, args=(parent, interval), name="statelab-lifeline", daemon=True).start()
