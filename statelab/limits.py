"""Bounds on geometry and threads, checked before any value reaches the native library.

llama.cpp takes context sizes as u32 and allocates batches with an i32 count: a larger
value wraps or overflows there (a crash, not an error).  statelab refuses such values
first.  The bounds are far above any context it creates (the KV cache of 2^24 positions
of even a small model does not fit in memory)."""
from __future__ import annotations

import operator

from statelab.errors import ConfigError

MAX_TOKENS = 1 << 24  # context size, batch, microbatch, submission: tokens
MAX_THREADS = 512  # GGML_MAX_N_THREADS of the pinned ggml


def _bounded(value, lo: int, hi: int) -> int | None:
    if isinstance(value, bool):
        return None
    try:
        v = operator.index(value)  # ints and numpy integers, not floats or strings
    except TypeError:
        return None
    return v if lo <= v <= hi else None


def check_tokens(what: str, value, lo: int = 1) -> int:
    """``value`` as an int in ``lo..MAX_TOKENS``, else a ConfigError naming ``what``."""
    v = _bounded(value, lo, MAX_TOKENS)
    if v is None:
        raise ConfigError(f"{what} must be an integer in {lo}..{MAX_TOKENS}, got {value!r}")
    return v


def check_threads(what: str, value) -> int:
    """A thread count: 0 (automatic) to MAX_THREADS."""
    v = _bounded(value, 0, MAX_THREADS)
    if v is None:
        raise ConfigError(f"{what} must be an integer in 0..{MAX_THREADS} (0: automatic), got {value!r}")
    return v


def int_list(text: str, what: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4]; a ConfigError names ``what`` otherwise."""
    try:
        vals = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{what} must be a comma list of integers, got {text!r}") from None
    if not vals:
        raise ConfigError(f"{what}: empty list")
    return vals
