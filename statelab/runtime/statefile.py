"""llama.cpp's own state files and llama-cpp-python's LlamaState, through the real library.

``llama_state_seq_save_file`` / ``llama_state_seq_load_file`` (the format llama-server's
slot save and restore use) and ``llama_state_save_file`` / ``llama_state_load_file``
(whole context) on a :class:`~statelab.runtime.context.Context`, and the construction of
a ``llama_cpp.LlamaState``.  The file formats themselves are read and written in pure
Python by :mod:`statelab.lab.interop`; this module is how statelab asks the pinned library
whether it accepts them.
"""
from __future__ import annotations

import ctypes
import os

import numpy as np

from statelab.errors import DecodeError
from statelab.runtime.native import llama


def _tokens_arg(tokens):
    L = llama()
    toks = np.ascontiguousarray(tokens, dtype=np.int32)
    return toks, toks.ctypes.data_as(ctypes.POINTER(L.llama_token))


def seq_save_file(ctx, path: str | os.PathLike, tokens, seq_id: int = 0) -> int:
    """``llama_state_seq_save_file``: the sequence's state and ``tokens`` to ``path``; bytes written."""
    toks, ptr = _tokens_arg(tokens)
    n = llama().llama_state_seq_save_file(ctx.ptr, os.fsencode(path), seq_id, ptr, len(toks))
    if n == 0:
        raise DecodeError(f"llama_state_seq_save_file could not write {path}")
    return int(n)


def seq_load_file(ctx, path: str | os.PathLike, seq_id: int = 0, capacity: int | None = None) -> np.ndarray:
    """``llama_state_seq_load_file`` into sequence ``seq_id``; returns the file's tokens."""
    L = llama()
    cap = ctx.n_ctx if capacity is None else int(capacity)
    buf = (L.llama_token * max(cap, 1))()
    n_out = ctypes.c_size_t(0)
    r = L.llama_state_seq_load_file(ctx.ptr, os.fsencode(path), seq_id, buf, cap, ctypes.byref(n_out))
    if r == 0:
        raise DecodeError(f"llama_state_seq_load_file rejected {path} (wrong magic/version, too many tokens "
                          "for the context, or a state that does not fit this model and context)")
    return np.frombuffer(buf, dtype=np.int32, count=n_out.value).copy()


def save_file(ctx, path: str | os.PathLike, tokens) -> None:
    """``llama_state_save_file``: the whole context's state and ``tokens`` to ``path``."""
    toks, ptr = _tokens_arg(tokens)
    if not llama().llama_state_save_file(ctx.ptr, os.fsencode(path), ptr, len(toks)):
        raise DecodeError(f"llama_state_save_file could not write {path}")


def load_file(ctx, path: str | os.PathLike, capacity: int | None = None) -> np.ndarray:
    """``llama_state_load_file`` (whole context); returns the file's tokens."""
    L = llama()
    cap = ctx.n_ctx if capacity is None else int(capacity)
    buf = (L.llama_token * max(cap, 1))()
    n_out = ctypes.c_size_t(0)
    if not L.llama_state_load_file(ctx.ptr, os.fsencode(path), buf, cap, ctypes.byref(n_out)):
        raise DecodeError(f"llama_state_load_file rejected {path}")
    return np.frombuffer(buf, dtype=np.int32, count=n_out.value).copy()


def state_get_whole(ctx) -> bytes:
    """``llama_state_get_data``: the whole context's state stream (what ``Llama.save_state`` keeps)."""
    L = llama()
    n = L.llama_state_get_size(ctx.ptr)
    buf = (ctypes.c_uint8 * n)()
    w = L.llama_state_get_data(ctx.ptr, buf, n)
    if w != n:
        raise DecodeError(f"llama_state_get_data wrote {w} of {n} bytes")
    return bytes(buf)


def make_llama_state(input_ids: np.ndarray, scores: np.ndarray, n_tokens: int, data: bytes, seed: int):
    """A ``llama_cpp.LlamaState`` (the object ``Llama.save_state`` returns and ``load_state`` takes)."""
    return llama().LlamaState(input_ids=input_ids, scores=scores, n_tokens=int(n_tokens),
                                    llama_state=bytes(data), llama_state_size=len(data), seed=int(seed))


__all__ = ["load_file", "make_llama_state", "save_file", "seq_load_file", "seq_save_file", "state_get_whole"]
