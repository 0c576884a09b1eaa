"""Attention layouts of the patched llama.cpp (native/patches/0002-attention-layouts.patch).

MQ is the native multi-query attention of the non-flash path, PQ builds one attention
subgraph per occupied query and concatenates the results, QB views the query axis as a
batch axis (q (d,q,h,1) -> (d,1,h,q), mask (n,q,1,1) -> (n,1,1,q), K/V shared).

The library admits PQ/QB only when its guards hold (one KV stream, non-flash attention,
no KQ bias / sinks / MLA value projection / soft-capping / ALiBi, F32 q and mask, F16 K/V,
integral GQA ratio, 1 < q <= max queries) and otherwise builds MQ and records why; with
q == 1 every layout is the same native graph ("trivial" admission). The requested layout
and max queries take part in llama.cpp's graph-reuse check.

The C functions are bound on first use, so this module imports on an unpatched build;
`available()` then returns False and every other call raises LayoutError.

`ctx` is a llama_context pointer (ctypes) or any object holding one as `.ptr`
(statelab.runtime.Context).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from ..errors import StatelabError

ABI_VERSION = 1
LAYOUTS = {"MQ": 0, "PQ": 1, "QB": 2}
NAMES = {v: k for k, v in LAYOUTS.items()}
MAX_QUERIES_LIMIT = 16  # LLAMA_STATELAB_MAX_QUERIES_LIMIT

_vp, _i32, _u64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint64
_SIGNATURES = {
    "llama_statelab_abi_version": ([], _i32),
    "llama_statelab_set_attn_layout": ([_vp, _i32], _i32),
    "llama_statelab_get_attn_layout": ([_vp], _i32),
    "llama_statelab_set_attn_max_queries": ([_vp, _i32], _i32),
    "llama_statelab_get_attn_max_queries": ([_vp], _i32),
    "llama_statelab_last_admission": ([_vp, ctypes.c_char_p, ctypes.c_size_t], _i32),
    "llama_statelab_last_requested": ([_vp], _i32),
    "llama_statelab_get_counters": ([_vp, ctypes.POINTER(_u64), ctypes.POINTER(_u64), ctypes.POINTER(_u64)], None),
    "llama_statelab_reset_counters": ([_vp], None),
}
_fns: dict[str, object] = {}


class LayoutError(StatelabError, RuntimeError):
    """An unknown layout or limit, or a library without the layout patch."""


@dataclass(frozen=True)
class Admission:
    """How the graph computed last was built.

    requested/built: "MQ", "PQ", "QB"; "none" before any graph with attention was computed;
    built "mixed" if attention layers were built with different layouts. built "MQ" means the
    native path (flash attention when the context enables it; the reason then says so).
    admitted: the requested layout was built, or q == 1 (trivial: all layouts are the native graph).
    reason: "admitted", "trivial: ...", "not admitted: <first failed guard> (<k> of <n> attention layers)".
    """
    requested: str
    built: str
    admitted: bool
    reason: str

    @property
    def trivial(self) -> bool:
        return self.reason.startswith("trivial")


def _lib():
    from .native import lib
    return lib()


def _fn(name: str):
    fn = _fns.get(name)
    if fn is None:
        try:
            fn = getattr(_lib(), name)
        except AttributeError:
            raise LayoutError(f"the loaded libllama has no {name}: it was built without "
                              "native/patches/0002-attention-layouts.patch; rebuild with native/build.py") from None
        fn.argtypes, fn.restype = _SIGNATURES[name]
        _fns[name] = fn
    return fn


def _ptr(ctx):
    p = getattr(ctx, "ptr", ctx)
    if not p:
        raise LayoutError("no llama context (null pointer)")
    return p


def abi_version() -> int | None:
    """The patch's ABI version, or None on an unpatched (or unloadable) library."""
    try:
        return int(_fn("llama_statelab_abi_version")())
    except StatelabError:
        return None


def available() -> bool:
    """True when the loaded libllama carries the layout patch with the ABI this module speaks."""
    return abi_version() == ABI_VERSION


def _require() -> None:
    v = abi_version()
    if v != ABI_VERSION:
        have = "no layout patch" if v is None else f"layout ABI {v}"
        raise LayoutError(f"the loaded libllama has {have}, statelab needs layout ABI {ABI_VERSION}; "
                          "rebuild with native/build.py")


def _name(code: int) -> str:
    return NAMES.get(code, {-1: "none", -2: "mixed"}.get(code, f"?{code}"))


def set_layout(ctx, name: str) -> None:
    """Request an attention layout for the following graphs of ctx."""
    key = str(name).strip().upper()
    if key not in LAYOUTS:
        raise LayoutError(f"unknown attention layout {name!r}; valid layouts: {', '.join(LAYOUTS)}")
    _require()
    if _fn("llama_statelab_set_attn_layout")(_ptr(ctx), LAYOUTS[key]) != 0:
        raise LayoutError(f"llama.cpp rejected attention layout {key}")


def get_layout(ctx) -> str:
    _require()
    return _name(_fn("llama_statelab_get_attn_layout")(_ptr(ctx)))


def set_max_queries(ctx, n: int) -> None:
    """Largest number of occupied queries for which PQ/QB are admitted (1..16; default 4)."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_QUERIES_LIMIT:
        raise LayoutError(f"max queries must be an integer in [1, {MAX_QUERIES_LIMIT}], got {n!r}")
    _require()
    if _fn("llama_statelab_set_attn_max_queries")(_ptr(ctx), n) != 0:
        raise LayoutError(f"llama.cpp rejected max queries {n}")


def get_max_queries(ctx) -> int:
    _require()
    return int(_fn("llama_statelab_get_attn_max_queries")(_ptr(ctx)))


def last_admission(ctx) -> Admission:
    """Admission of the graph computed last by ctx (built or reused)."""
    _require()
    p = _ptr(ctx)
    buf = ctypes.create_string_buffer(512)
    built = _fn("llama_statelab_last_admission")(p, buf, len(buf))
    requested = _fn("llama_statelab_last_requested")(p)
    reason = buf.value.decode(errors="replace")
    admitted = built >= 0 and (built == requested or reason.startswith("trivial"))
    return Admission(_name(requested), _name(built), admitted, reason)


def counters(ctx) -> dict[str, int]:
    """graph_builds / graph_reuses in llama_decode's graph-reuse path; ubatches = micrographs computed."""
    _require()
    b, r, u = _u64(0), _u64(0), _u64(0)
    _fn("llama_statelab_get_counters")(_ptr(ctx), ctypes.byref(b), ctypes.byref(r), ctypes.byref(u))
    return {"graph_builds": int(b.value), "graph_reuses": int(r.value), "ubatches": int(u.value)}


def reset_counters(ctx) -> None:
    _require()
    _fn("llama_statelab_reset_counters")(_ptr(ctx))
