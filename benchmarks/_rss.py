"""The process's resident set, for the memory benchmarks (codec_memory.py, state_scale.py):
fields of /proc/self/status, and the peak over a block (VmHWM reset through
/proc/self/clear_refs before it; ru_maxrss, a whole-run peak, where that is not allowed)."""
from __future__ import annotations

import resource


def status(key: str) -> int:
    """A size field of /proc/self/status in bytes (``"VmRSS:"``, ``"RssAnon:"`` ...); 0 if absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


class Peak:
    """The resident set's peak over a block: ``reset()`` before it, ``read()`` after it."""

    def __init__(self):
        self.resettable = True

    @property
    def how(self) -> str:
        return "VmHWM" if self.resettable else "ru_maxrss"

    def reset(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident size
        except OSError:
            self.resettable = False

    def read(self) -> int:
        return status("VmHWM:") if self.resettable else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
