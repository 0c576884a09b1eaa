"""Attention layouts of the patched llama.cpp (native/patches/0002-attention-layouts.patch).

MQ is the native multi-query attention of the non-flash path, PQ builds one attention
subgraph per occupied query and concatenates the results, QB views the query axis as a
batch axis (q (d,q,h,1) -> (d,1,h,q), mask (n,q,1,1) -> (n,1,1,q), K/V shared).

The library admits PQ/QB only when its guards hold (one KV stream, non-flash attention,
no KQ bias / sinks / MLA value projection / soft-capping / ALiBi, F32 q and mask, F16 K/V,
integral GQA ratio, 1 < q <= max queries) and otherwise builds MQ and records why; with
q == 1 every layout is the same native graph ("trivial" admission). The requested layout
and max queries take part in llama.cpp's graph-reuse check.

Layout families with "+W" (MQ+W, PQ+W, QB+W) add the row-count-invariant weight products of
native/patches/0003-row-invariant-weight-products.patch: every weight product whose input has
1 < n <= max queries rows is built as n native 1-row products (a view of each input row, the
product, concatenation in row order), so each row is computed by exactly the kernel and
summation order of a 1-row product, for every weight type and backend. The repair flag takes
part in the graph-reuse check, like the attention layout. `weight_repair_available()` tells
whether the loaded library carries that patch; a "+W" family raises LayoutError without it.

PQ and QB promise that each query row is computed as its 1-row decode, so they also turn on the
row-invariance hint of native/patches/0005-row-invariant-kernels.patch where the library carries
it: every weight product is marked, and ggml-cuda's quantized matrix-vector kernel then keeps for
5-8 rows the reduction split it uses for 1-4 rows (natively it halves its warps for 5-8 rows, so
verifies of more than 4 rows differed from 1-row decodes on CUDA). MQ, GS and the "+W" families
leave it off (native kernels; "+W" computes 1-row products anyway). Backends without such a kernel
ignore the hint.

On Vulkan, QB needs native/patches/0007-vulkan-qb-attention.patch: natively ggml-vulkan refuses
a matrix product whose operands differ in their fourth extent (QB's K x q and V^T x softmax), and
the patch admits exactly those products, computed by the matrix-vector shader of a 1-row decode
with the query index as one more workgroup index. `vulkan_qb_available()` tells whether the
loaded library carries it.

The C functions are bound on first use, so this module imports on an unpatched build;
`available()` then returns False and every other call raises LayoutError.

`ctx` is a llama_context pointer (ctypes) or any object holding one as `.ptr`
(statelab.runtime.Context).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from statelab.errors import ConfigError, StatelabError, one_of
from statelab.runtime.native import lib

ABI_VERSION = 1
WEIGHT_REPAIR_VERSION = 1  # LLAMA_STATELAB_WEIGHT_REPAIR_VERSION
ROW_INVARIANT_KERNELS_VERSION = 1  # LLAMA_STATELAB_ROW_INVARIANT_KERNELS_VERSION (the hint, patch 0005)
QB_COLUMNS_VERSION = 2  # the same version function: the QB attention products as one launch (patch 0006)
VULKAN_QB_VERSION = 1  # LLAMA_STATELAB_VULKAN_QB_VERSION
VULKAN_QB_PATCH = "0007-vulkan-qb-attention.patch"
GRAPH_KEEP_VERSION = 1  # LLAMA_STATELAB_GRAPH_KEEP_VERSION (graphs kept per ubatch shape, patch 0008)
GRAPH_KEEP_MAX = 8  # LLAMA_STATELAB_GRAPH_KEEP_MAX
GRAPH_KEEP_PATCH = "0008-graph-keep.patch"
REPAIR_SUFFIX = "+W"
MAX_QUERIES_LIMIT = 16  # LLAMA_STATELAB_MAX_QUERIES_LIMIT


class Layout(StrEnum):
    """Every layout name statelab knows, with its properties (the one place they are declared;
    every list of layouts below is derived from them).

    MQ/PQ/QB are the attention layouts of the patched library (each one :class:`Attention`
    object in :data:`ATTENTION`); "+W" adds the row-by-row weight products (patch 0003); GS
    (global serialisation, one target row per physical micrograph) is a scheduling of native
    MQ graphs done by the speculative runner, not a library layout.
    """
    MQ = "MQ"
    PQ = "PQ"
    QB = "QB"
    GS = "GS"
    MQ_W = "MQ+W"
    PQ_W = "PQ+W"
    QB_W = "QB+W"

    @property
    def attention(self) -> str:
        """The attention layout the library builds: MQ, PQ or QB (GS runs native MQ graphs)."""
        return "MQ" if self is Layout.GS else self.value.removesuffix(REPAIR_SUFFIX)

    @property
    def repair(self) -> bool:
        """Row-by-row weight products (patch 0003)."""
        return self.value.endswith(REPAIR_SUFFIX)

    @property
    def row_invariant_kernels(self) -> bool:
        """The row-invariance hint on weight products (patch 0005): PQ and QB, whose rows must
        equal 1-row decodes; the "+W" families compute 1-row products already."""
        return self in (Layout.PQ, Layout.QB)

    @property
    def serialised(self) -> bool:
        """One target row per physical micrograph, scheduled by the speculative runner (GS): not a
        layout family of the library."""
        return self is Layout.GS

    @property
    def in_arms(self) -> bool:
        """An arm of ``spec run`` may name it (``M_x``/``C_x``; MQ is the native arms M0/C0).
        MQ+W is a library family for the audits, not an arm."""
        return self is not Layout.MQ_W

    @property
    def needs_patch(self) -> bool:
        """Set on the context through the patched library (PQ, QB, every +W); MQ and GS run
        on an unpatched llama.cpp."""
        return self.attention != "MQ" or self.repair

    def device_must_admit(self, backend: str) -> bool:
        """Whether a run on ``backend`` must first ask the device (ggml supports_op) to run
        this layout's products where the scheduler put them: the CPU runs every layout, a
        GPU backend may reject the views (unpatched ggml-vulkan rejects QB's matrix products, paper
        S6.3; patch 0007 admits them)."""
        return backend != "cpu" and self.needs_patch

    @classmethod
    def parse(cls, name, allowed=None, what: str = "layout") -> "Layout":
        """The one parser of layout names (any case, spaces around ignored), optionally restricted to
        ``allowed``; a LayoutError of one line names the valid ones (``what``: "attention layout")."""
        valid = tuple(cls.parse(x) if not isinstance(x, Layout) else x for x in allowed) if allowed else tuple(cls)
        try:
            lay = cls(str(name).strip().upper())
        except ValueError:
            lay = None
        if lay not in valid:
            raise LayoutError(f"unknown {what} {name!r}; choose one of {one_of(valid)}")
        return lay


# library families (every layout but the runner's GS), in declaration order
FAMILY_LAYOUTS = tuple(x for x in Layout if not x.serialised)
# the attention layouts (MQ, PQ, QB): families without "+W"
ATTENTION_LAYOUTS = tuple(x.value for x in FAMILY_LAYOUTS if x.value == x.attention)
# every layout family: attention layout, weight products row by row
FAMILIES = {x.value: (x.attention, x.repair) for x in FAMILY_LAYOUTS}


# -- attention layouts: one object each -------------------------------------------------------

STAGES = ("qk", "softmax", "av")


class Attention:
    """One attention layout of the patch as one object (this class is MQ, the native graph).

    From Q (``Qcur`` permuted, (d, q, h_Q)), K and V (the permuted cache views) and the mask
    ((n_kv, q, 1, 1)) it builds QK -> softmax -> AV in a ggml graph (:meth:`build`) with the
    views and node names the patched library gives them, and puts its outputs back into native
    order (:meth:`native_order`).  What a layout does differently is :meth:`views` (the
    (query, mask) pairs it hands to the operators), :meth:`names` and :meth:`native_order`.
    The device admission (:mod:`statelab.runtime.admission`), the operator replay and E1
    iterate :data:`ATTENTION`; the address oracle (``audit.oracles.address_model``) holds each
    one's integer model of the same views.  With one occupied query every layout is MQ
    (:func:`attention`)."""

    layout = Layout.MQ
    code = 0  # the patch's llama_statelab attention layout code

    def views(self, g, qt, mask, q: int) -> list:
        return [(qt, mask)]

    def names(self, q: int) -> dict[str, list[str]]:
        return {"qk": ["kq"], "softmax": ["kq_soft_max"], "av": ["kqv"]}

    def native_order(self, arrays: list) -> np.ndarray:
        """The stage's output arrays (ggml order, ne reversed) of one layer as (h_Q, q, X)."""
        return np.ascontiguousarray(np.asarray(arrays[0])[0])

    def recognises(self, kq_ne, q: int) -> bool:
        """Whether a graph whose QK node(s) named :meth:`names` have extents ``kq_ne`` was built as this layout."""
        return True

    def build(self, g, qt, k, v, mask, scale: float, max_bias: float = 0.0) -> dict[str, list]:
        """Every operator of the layout for ``qt.ne[1]`` queries: {stage: [tensors]}, plus
        ``concat`` (the per-query results joined, PQ)."""
        q = int(qt.ne[1])
        names = self.names(q)
        out: dict[str, list] = {s: [] for s in (*STAGES, "concat")}
        prev = None
        for j, (qj, mj) in enumerate(self.views(g, qt, mask, q)):
            kq = g.mul_mat(k, qj, names["qk"][j])
            sm = g.soft_max_ext(kq, mj, scale, max_bias, names["softmax"][j])
            av = g.mul_mat(v, sm, names["av"][j], prec_f32=False)
            for s, t in zip(STAGES, (kq, sm, av)):
                out[s].append(t)
            if prev is not None:
                prev = g.concat(prev, av, 1, f"kqv_concat{j}")
                out["concat"].append(prev)
            else:
                prev = av
        return out


class _PQ(Attention):
    """One subgraph per query j: Q column j, mask row j; the results concatenated."""

    layout = Layout.PQ
    code = 1

    def views(self, g, qt, mask, q):
        return [(g.view_4d(qt, (qt.ne[0], 1, qt.ne[2], 1), qt.nb[1:], j * qt.nb[1], f"q_{j}"),
                 g.view_4d(mask, (mask.ne[0], 1, 1, 1), mask.nb[1:], j * mask.nb[1], f"mask_{j}")) for j in range(q)]

    def names(self, q):
        return {"qk": [f"kq_pq{j}" for j in range(q)], "softmax": [f"kq_soft_max_pq{j}" for j in range(q)],
                "av": [f"kqv_pq{j}" for j in range(q)]}

    def native_order(self, arrays):
        return np.ascontiguousarray(np.stack([np.asarray(a)[0, :, 0, :] for a in arrays], axis=1))


class _QB(Attention):
    """The query axis as a batch axis: Q (d, q, h_Q, 1) viewed (d, 1, h_Q, q), the mask (n_kv, q, 1, 1)
    viewed (n_kv, 1, 1, q); K and V broadcast over dim 3."""

    layout = Layout.QB
    code = 2

    def views(self, g, qt, mask, q):
        return [(g.view_4d(qt, (qt.ne[0], 1, qt.ne[2], q), (qt.nb[1], qt.nb[2], qt.nb[1]), 0, "Qcur (qb view)"),
                 g.view_4d(mask, (mask.ne[0], 1, 1, q), (mask.nb[1],) * 3, 0, "kq_mask (qb view)"))]

    def native_order(self, arrays):
        return np.ascontiguousarray(np.asarray(arrays[0])[:, :, 0, :].transpose(1, 0, 2))

    def recognises(self, kq_ne, q):
        return q > 1 and kq_ne[1] == 1 and kq_ne[3] == q


ATTENTION = {a.layout: a for a in (Attention(), _PQ(), _QB())}
LAYOUTS = {a.layout.value: a.code for a in ATTENTION.values()}  # name -> the patch's code
NAMES = {v: k for k, v in LAYOUTS.items()}


def attention(layout, q: int = 2) -> Attention:
    """The :class:`Attention` object of an attention layout (a name or :class:`Layout`), for q occupied
    queries: with one query every layout builds the native graph (MQ)."""
    lay = Layout.parse(layout, ATTENTION_LAYOUTS, "attention layout")
    return ATTENTION[Layout.MQ if q < 2 else lay]

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
    "llama_statelab_weight_repair_version": ([], _i32),
    "llama_statelab_set_weight_repair": ([_vp, _i32], _i32),
    "llama_statelab_get_weight_repair": ([_vp], _i32),
    "llama_statelab_last_weight_repair": ([_vp, ctypes.POINTER(_i32), ctypes.POINTER(_i32), ctypes.c_char_p,
                                           ctypes.c_size_t], _i32),
    "llama_statelab_get_weight_counters": ([_vp, ctypes.POINTER(_u64), ctypes.POINTER(_u64)], None),
    "llama_statelab_get_state_copies": ([ctypes.POINTER(_u64), ctypes.POINTER(_u64)], None),
    "llama_statelab_row_invariant_kernels_version": ([], _i32),
    "llama_statelab_set_row_invariant_kernels": ([_vp, _i32], _i32),
    "llama_statelab_get_row_invariant_kernels": ([_vp], _i32),
    "llama_statelab_vulkan_qb_version": ([], _i32),
    "llama_statelab_graph_keep_version": ([], _i32),
    "llama_statelab_set_graph_keep": ([_vp, _i32], _i32),
    "llama_statelab_get_graph_keep": ([_vp], _i32),
    "llama_statelab_get_graph_revivals": ([_vp], _u64),
}
_PATCH_OF = {name: "0003-row-invariant-weight-products.patch" for name in _SIGNATURES if "weight" in name}
_PATCH_OF["llama_statelab_get_state_copies"] = "0004-state-copies-2d.patch"
_PATCH_OF.update({name: "0005-row-invariant-kernels.patch" for name in _SIGNATURES if "row_invariant" in name})
_PATCH_OF["llama_statelab_vulkan_qb_version"] = VULKAN_QB_PATCH
_PATCH_OF.update({name: GRAPH_KEEP_PATCH for name in _SIGNATURES if "graph_" in name})
_fns: dict[str, object] = {}


class LayoutError(ConfigError, RuntimeError):
    """An unknown layout or limit, or a library without the layout patch."""


@dataclass(frozen=True)
class Admission:
    """How the graph computed last was built.

    requested/built: "MQ", "PQ", "QB"; "none" before any graph with attention was computed;
    built "mixed" if attention layers were built with different layouts. built "MQ" means the
    native path (flash attention when the context enables it; the reason then says so).
    With the weight repair requested both carry "+W" (built only when no weight product was
    left native).
    admitted: the requested layout was built, or q == 1 (trivial: all layouts are the native graph).
    reason: "admitted", "trivial: ...", "not admitted: <first failed guard> (<k> of <n> attention layers)";
    a weight product left native adds "; weights not repaired: <first reason> (<k> products)".
    """
    requested: str
    built: str
    admitted: bool
    reason: str

    @property
    def trivial(self) -> bool:
        return self.reason.startswith("trivial")


def _lib():
    return lib()


def _fn(name: str):
    fn = _fns.get(name)
    if fn is None:
        try:
            fn = getattr(_lib(), name)
        except AttributeError:
            patch = _PATCH_OF.get(name, "0002-attention-layouts.patch")
            raise LayoutError(f"the loaded libllama has no {name}: it was built without "
                              f"native/patches/{patch}; rebuild with native/build.py") from None
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


def _patch_at(version_fn: str, want: int) -> bool:
    """The layout patch is loaded and a later patch's version function answers ``want`` or more
    (a later version of a patch keeps the functions of the earlier ones)."""
    if not available():
        return False
    try:
        return int(_fn(version_fn)()) >= want
    except StatelabError:
        return False


def weight_repair_available() -> bool:
    """True when the loaded libllama carries the row-invariant weight-product patch (0003)."""
    return _patch_at("llama_statelab_weight_repair_version", WEIGHT_REPAIR_VERSION)


def row_invariant_kernels_available() -> bool:
    """True when the loaded libllama carries the row-invariance hint (patch 0005)."""
    return _patch_at("llama_statelab_row_invariant_kernels_version", ROW_INVARIANT_KERNELS_VERSION)


def qb_columns_available() -> bool:
    """True when the hint also marks QB's attention products, which ggml-cuda then serves as the columns
    of one matrix-vector launch, each query reduced as its own 1-row product (patch 0006)."""
    return _patch_at("llama_statelab_row_invariant_kernels_version", QB_COLUMNS_VERSION)


def vulkan_qb_available() -> bool:
    """True when the loaded libllama carries the QB attention products on Vulkan (patch 0007):
    ggml-vulkan then admits QB's two products and computes each query with its 1-row decode's
    shader and workgroup; without it ggml-vulkan refuses them (the scheduler would run them on the CPU)."""
    return _patch_at("llama_statelab_vulkan_qb_version", VULKAN_QB_VERSION)


def graph_keep_available() -> bool:
    """True when the loaded libllama keeps graphs per ubatch shape on request (patch 0008)."""
    return _patch_at("llama_statelab_graph_keep_version", GRAPH_KEEP_VERSION)


def check_graph_keep(n) -> int:
    """The number of graphs to keep besides the previous one: an integer in 0..GRAPH_KEEP_MAX."""
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= GRAPH_KEEP_MAX:
        raise ConfigError(f"graphs kept must be an integer from 0 to {GRAPH_KEEP_MAX}, got {n!r}")
    return n


def set_graph_keep(ctx, n: int) -> bool:
    """Keep up to ``n`` graphs of earlier ubatch shapes in ctx besides the previous one (0: llama.cpp's
    own reuse of the previous graph only), so that a loop alternating shapes (a 1-row decode, a k+1-row
    verify) revives a graph instead of rebuilding it; on CUDA each kept graph keeps its own CUDA graph.
    The graphs computed are the ones a rebuild would build. Returns False (nothing set) on a library
    without patch 0008, where every change of shape rebuilds."""
    check_graph_keep(n)
    _require()
    if not graph_keep_available():
        return False
    if _fn("llama_statelab_set_graph_keep")(_ptr(ctx), n) != 0:
        raise LayoutError(f"llama.cpp rejected {n} kept graphs")
    return True


def get_graph_keep(ctx) -> int:
    """Graphs ctx keeps besides the previous one (0 without patch 0008)."""
    _require()
    return int(_fn("llama_statelab_get_graph_keep")(_ptr(ctx))) if graph_keep_available() else 0


def patch_refusal(layout: str, backend: str) -> str | None:
    """Why this build cannot run ``layout``'s attention on ``backend``'s device, or None: QB (and
    QB+W) on Vulkan without patch 0007. One line, for the callers' refusals."""
    if backend == "vulkan" and Layout.parse(layout).attention == "QB" and not vulkan_qb_available():
        return (f"attention layout QB on Vulkan needs native/patches/{VULKAN_QB_PATCH}, which this libllama "
                "lacks (unpatched ggml-vulkan refuses QB's two matrix products, so they would run on the CPU); "
                "rebuild with native/build.py --backend vulkan")
    return None


def get_row_invariant_kernels(ctx) -> bool:
    """Whether ctx's weight products carry the row-invariance hint (False without patch 0005)."""
    _require()
    return row_invariant_kernels_available() and _fn("llama_statelab_get_row_invariant_kernels")(_ptr(ctx)) == 1


def parse_family(name: str) -> tuple[str, bool]:
    """("QB", True) for "QB+W": the attention layout and whether weight products are repaired."""
    return FAMILIES[Layout.parse(name, FAMILY_LAYOUTS).value]


def set_layout(ctx, name: str) -> None:
    """Request a layout family (attention layout, optionally "+W" weight repair) for the following graphs of ctx."""
    attn, repair = parse_family(name)
    _require()
    have_repair = weight_repair_available()
    if repair and not have_repair:
        raise LayoutError(f"layout {name} needs native/patches/0003-row-invariant-weight-products.patch, "
                          "which the loaded libllama lacks; rebuild with native/build.py")
    if _fn("llama_statelab_set_attn_layout")(_ptr(ctx), LAYOUTS[attn]) != 0:
        raise LayoutError(f"llama.cpp rejected attention layout {attn}")
    if have_repair and _fn("llama_statelab_set_weight_repair")(_ptr(ctx), int(repair)) != 0:
        raise LayoutError(f"llama.cpp rejected weight repair {int(repair)}")
    hint = Layout.parse(name).row_invariant_kernels
    if row_invariant_kernels_available() and _fn("llama_statelab_set_row_invariant_kernels")(_ptr(ctx), int(hint)) != 0:
        raise LayoutError(f"llama.cpp rejected row-invariant kernels {int(hint)}")


def get_layout(ctx) -> str:
    _require()
    attn = _name(_fn("llama_statelab_get_attn_layout")(_ptr(ctx)))
    if weight_repair_available() and _fn("llama_statelab_get_weight_repair")(_ptr(ctx)) == 1:
        return attn + REPAIR_SUFFIX
    return attn


@dataclass(frozen=True)
class WeightRepair:
    """Weight products of the graph computed last: requested, repaired (row by row), rejected (left native)."""
    requested: bool
    repaired: int
    rejected: int
    reason: str


def last_weight_repair(ctx) -> WeightRepair:
    _require()
    if not weight_repair_available():
        return WeightRepair(False, 0, 0, "")
    rep, rej = _i32(0), _i32(0)
    buf = ctypes.create_string_buffer(256)
    code = _fn("llama_statelab_last_weight_repair")(_ptr(ctx), ctypes.byref(rep), ctypes.byref(rej), buf, len(buf))
    return WeightRepair(code == 1, int(rep.value), int(rej.value), buf.value.decode(errors="replace"))


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
    req, got = _name(requested), _name(built)
    w = last_weight_repair(ctx)
    if w.requested:
        req += REPAIR_SUFFIX
        if w.rejected:
            admitted = False
            reason += f"; weights not repaired: {w.reason} ({w.rejected} products)"
        else:
            got += REPAIR_SUFFIX
    return Admission(req, got, admitted, reason)


def counters(ctx) -> dict[str, int]:
    """graph_builds / graph_reuses in llama_decode's graph-reuse path; ubatches = micrographs computed;
    with patch 0008 graph_revivals (reuses that revived a kept graph of another shape); with the weight-repair patch also weight_products (computed row by row) and weight_row_products
    (the 1-row products they consisted of)."""
    _require()
    b, r, u = _u64(0), _u64(0), _u64(0)
    _fn("llama_statelab_get_counters")(_ptr(ctx), ctypes.byref(b), ctypes.byref(r), ctypes.byref(u))
    out = {"graph_builds": int(b.value), "graph_reuses": int(r.value), "ubatches": int(u.value)}
    if graph_keep_available():  # revivals of kept graphs, also counted in graph_reuses
        out["graph_revivals"] = int(_fn("llama_statelab_get_graph_revivals")(_ptr(ctx)))
    if weight_repair_available():
        wp, wr = _u64(0), _u64(0)
        _fn("llama_statelab_get_weight_counters")(_ptr(ctx), ctypes.byref(wp), ctypes.byref(wr))
        out.update(weight_products=int(wp.value), weight_row_products=int(wr.value))
    return out


def state_copies() -> dict[str, int]:
    """Process-wide, cumulative (patch 0004): the K/V pieces the host state readers and writers
    recorded (llama_state_*_get_data / _set_data) and the backend copies that moved them; one
    strided copy per run of equal pieces, so a transposed V layer is one copy, not one per row."""
    pieces, copies = _u64(0), _u64(0)
    _fn("llama_statelab_get_state_copies")(ctypes.byref(pieces), ctypes.byref(copies))
    return {"pieces": int(pieces.value), "copies": int(copies.value)}


def reset_counters(ctx) -> None:
    _require()
    _fn("llama_statelab_reset_counters")(_ptr(ctx))
