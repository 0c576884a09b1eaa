"""Layout oracles for the query-to-batch (QB) attention view: no model, numpy only.

The seed paper (sections 3.1-3.3, supplement S6.2) changes the non-flash attention of
llama.cpp (``llm_graph_context::build_attn_mha`` in ``src/llama-graph.cpp``) from the
native multi-query layout MQ to a view in which each query is a separate batch instance
of the same operators. This module checks that change without running a model.

Vocabulary (ggml axis order: ``ne[0]`` is the fastest axis, ``nb`` are byte strides):

* after the native permutes the query is ``q: (d, n_q, h_Q, 1)``, the keys
  ``k: (d, n_kv, h_KV, 1)`` (F16 cache view), the values ``v: (n_kv, d_v, h_KV, 1)``
  (transposed F16 cache view, ``v_trans``), the mask ``(n_kv, q_pad, 1, 1)`` (F32);
* ``kq = mul_mat(k, q)``, ``soft_max_ext(kq, mask, scale)``, ``kqv = mul_mat(v, kq)``,
  then ``permute(0, 2, 1, 3)`` and ``cont`` give the output ``(d_v * h_Q, n_q)`` in
  ``(v, a, j)`` order (channel fastest, then head, then query);
* ggml's ``mul_mat`` broadcasts ``src0`` over ``src1``: ``i02 = i12 / (ne12/ne02)`` and
  ``i03 = i13 / (ne13/ne03)`` (``ggml-cpu.c``, factors ``r2``/``r3``), so query head ``a``
  reads KV head ``a // (h_Q/h_KV)`` (contiguous groups);
* ``soft_max`` broadcasts the mask with ``i11 = i01``, ``i12 = i02 % ne12``,
  ``i13 = i03 % ne13`` (``ops.cpp``).

Layouts: MQ (native), PQ (one attention sub-graph per query, outputs concatenated in
query order) and QB (query view ``(d, 1, h_Q, q)`` with ``nb[3]`` = the query-column
stride, mask view ``(n_kv, 1, 1, q)`` with ``nb[3]`` = the mask row stride ``m1``, K/V
shared through the ``r3`` broadcast). A layout is a small parameterised object that
builds *attention calls* (tensor descriptors plus the logical label of every batch
coordinate); a fault is a variant of :class:`QBLayout`.

Three oracles:

1. :func:`check_qb_addressing`: an integer address oracle. For every logical coordinate
   it compares the byte address a layout reads (through ggml's indexing and broadcast
   rules applied to the layout's descriptors) with the address the native layout reads,
   and checks bounds, alignment, injectivity, the GQA head map and output recombination.
2. :func:`evaluate_layout`: reads operands through a layout's addresses from byte
   buffers and computes QK, softmax and AV in float64 (the scalar oracle) and in a
   float32 emulation; :func:`reference_attention` computes the same stages from the
   logical arrays. Structured cases (``onehot``, ``single_key``) carry exact expectations.
3. :func:`run_layout_audit` runs both over the fixture product and returns an
   ``xarray.Dataset`` plus a pass flag; :func:`audit_markdown` summarises it.

:func:`ulp_distance` measures float32/float16 differences in units in the last place.
"""
from __future__ import annotations

import functools
import itertools
import math
import zlib
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

import numpy as np

from statelab.runtime.layouts import ATTENTION_LAYOUTS, Layout

if TYPE_CHECKING:  # pragma: no cover
    import xarray as xr

__all__ = [
    "EXACT_PATTERNS",
    "F16",
    "F32",
    "F32_KERNELS",
    "FAULTS",
    "HEAD_DIMS",
    "HEAD_PAIRS",
    "KV_EXTENTS",
    "MASK_KINDS",
    "OBLIGATIONS",
    "PATTERNS",
    "PRECISIONS",
    "Q_EXTENTS",
    "Q_STORAGES",
    "STAGES",
    "ULP_NAN",
    "AttnCall",
    "Fault",
    "Fixture",
    "FixtureData",
    "ADDRESS_MODELS",
    "AddressModel",
    "MQLayout",
    "NativeTensors",
    "OracleReport",
    "PQLayout",
    "QBLayout",
    "TensorDesc",
    "Violation",
    "address_model",
    "audit_markdown",
    "check_qb_addressing",
    "evaluate_layout",
    "fixtures",
    "make_data",
    "reference_attention",
    "run_layout_audit",
    "ulp_distance",
]

F32 = 4  # bytes per element
F16 = 2

Q_EXTENTS = (1, 2, 3, 4)
KV_EXTENTS = (127, 128, 129, 255, 256, 257)
HEAD_PAIRS = ((8, 8), (8, 1), (32, 8), (9, 3))
HEAD_DIMS = (64, 128)
Q_STORAGES = ("compact", "offset")
MASK_KINDS = ("causal", "causal_padded", "sparse")
PATTERNS = ("random", "dyadic", "onehot", "single_key")
EXACT_PATTERNS = ("onehot", "single_key")
STAGES = ("qk", "softmax", "av", "output")
PRECISIONS = ("fp64", "f32")

# Geometry constants of the synthetic fixtures.
KV_SPARE_CELLS = 3  # cache cells allocated beyond the key extent (filled with NaN)
MASK_ROW_PAD = 8  # padded mask rows of the causal_padded kind (like GGML_KQ_MASK_PAD)
UNUSED_TAIL_CELLS = 5  # trailing key cells that causal_padded masks out
ARENA_OFFSET = 256  # byte offset of the fused QKV tensor inside its arena ("offset" Q)
ONEHOT_KEY_VALUE = 1024.0  # exact in F16; exp(-1024) underflows to 0 in f64 and f32

OBLIGATIONS = (
    "op_preconditions",  # ggml asserts: mul_mat broadcastability, soft_max mask shape, contiguity
    "alignment",  # view offsets and strides are multiples of the element size
    "view_bounds",  # every view lies inside its allocated source span
    "label_bijection",  # the calls' batch coordinates label each (query j, head a) exactly once
    "q_address",  # QB/PQ reads Q[c, j, a] at the native MQ address
    "q_injective",  # distinct logical (c, j, a) read distinct Q addresses
    "mask_address",  # query j reads mask key t at b_M + t*m0 + j*m1
    "mask_injective",  # distinct (t, j) read distinct mask addresses, one per (t, j)
    "gqa_head_map",  # ggml's broadcast picks KV head a // (h_Q/h_KV) for query head a
    "kv_address",  # K[c, t] and V[t, v] of that head are read at the native cache address
    "output_order",  # recombination writes logical (v, j, a) at v + d_v*a + d_v*h_Q*j
    "output_bijection",  # the recombined output covers (d_v*h_Q, q) exactly once
)


# --------------------------------------------------------------------------- descriptors


@dataclass(frozen=True)
class TensorDesc:
    """A ggml tensor as (ne, nb, offset) over a named flat byte buffer."""

    buffer: str
    ne: tuple[int, int, int, int]
    nb: tuple[int, int, int, int]
    offset: int
    itemsize: int

    def addr(self, i0=0, i1=0, i2=0, i3=0) -> np.ndarray:
        """Byte address of element (i0, i1, i2, i3); arguments broadcast as numpy arrays."""
        nb = self.nb
        return (
            np.int64(self.offset)
            + np.asarray(i0, dtype=np.int64) * nb[0]
            + np.asarray(i1, dtype=np.int64) * nb[1]
            + np.asarray(i2, dtype=np.int64) * nb[2]
            + np.asarray(i3, dtype=np.int64) * nb[3]
        )

    def extent(self) -> tuple[int, int]:
        """[lowest byte, one past the highest byte] the view can touch."""
        lo = self.offset + sum(min(0, (n - 1) * s) for n, s in zip(self.ne, self.nb))
        hi = self.offset + sum(max(0, (n - 1) * s) for n, s in zip(self.ne, self.nb)) + self.itemsize
        return lo, hi

    def permute(self, a0: int, a1: int, a2: int, a3: int) -> "TensorDesc":
        """``ggml_permute``: source axis i moves to position ``axes[i]``."""
        ne = [0] * 4
        nb = [0] * 4
        for src, dst in enumerate((a0, a1, a2, a3)):
            ne[dst] = self.ne[src]
            nb[dst] = self.nb[src]
        return replace(self, ne=tuple(ne), nb=tuple(nb))

    def view(self, ne, nb, offset_delta: int = 0) -> "TensorDesc":
        """``ggml_view_4d`` relative to this descriptor's offset."""
        return replace(self, ne=tuple(int(x) for x in ne), nb=tuple(int(x) for x in nb),
                       offset=self.offset + int(offset_delta))

    def is_contiguous(self) -> bool:
        """``ggml_is_contiguous`` (axes of extent 1 are skipped)."""
        if self.ne[0] != 1 and self.nb[0] != self.itemsize:
            return False
        nxt = self.itemsize * self.ne[0]
        for n, s in zip(self.ne[1:], self.nb[1:]):
            if n != 1 and s != nxt:
                return False
            nxt *= n
        return True


@dataclass(frozen=True)
class Fixture:
    """One synthetic attention geometry (S6.2 style)."""

    q: int
    n_kv: int
    h_q: int
    h_kv: int
    d: int
    q_storage: str = "compact"
    mask_kind: str = "causal"

    def __post_init__(self):
        if self.q < 1 or self.n_kv < 1 or self.d < 1 or self.h_kv < 1:
            raise ValueError(f"bad fixture extents: {self}")
        if self.h_q % self.h_kv:
            raise ValueError(f"GQA ratio must be integral: h_q={self.h_q}, h_kv={self.h_kv}")
        if self.q_storage not in Q_STORAGES:
            raise ValueError(f"q_storage must be one of {Q_STORAGES}, got {self.q_storage!r}")
        if self.mask_kind not in MASK_KINDS:
            raise ValueError(f"mask_kind must be one of {MASK_KINDS}, got {self.mask_kind!r}")
        if self.mask_kind == "causal_padded" and self.n_kv - UNUSED_TAIL_CELLS < self.q:
            raise ValueError("causal_padded needs n_kv >= q + UNUSED_TAIL_CELLS")

    @property
    def d_v(self) -> int:
        return self.d

    @property
    def group(self) -> int:
        return self.h_q // self.h_kv

    @property
    def kv_size(self) -> int:
        return self.n_kv + KV_SPARE_CELLS

    @property
    def q_pad(self) -> int:
        if self.mask_kind == "causal_padded":
            return -(-self.q // MASK_ROW_PAD) * MASK_ROW_PAD
        return self.q

    @property
    def name(self) -> str:
        return (f"q{self.q}_n{self.n_kv}_h{self.h_q}x{self.h_kv}_d{self.d}"
                f"_{self.q_storage}_{self.mask_kind}")

    def native(self) -> "NativeTensors":
        return _native(self)


@dataclass(frozen=True)
class NativeTensors:
    """The native (MQ) descriptors of a fixture, after build_attn_mha's permutes."""

    q: TensorDesc  # (d, q, h_Q, 1)
    k: TensorDesc  # (d, n_kv, h_KV, 1)
    v: TensorDesc  # (n_kv, d_v, h_KV, 1)
    mask: TensorDesc  # (n_kv, q_pad, 1, 1)
    spans: dict  # buffer name -> allocated bytes
    scale: float  # kq_scale as stored in the op params (a float32 value)


@functools.lru_cache(maxsize=64)
def _native(fx: Fixture) -> NativeTensors:
    d, q, hq, hkv, n, dv, kvs = fx.d, fx.q, fx.h_q, fx.h_kv, fx.n_kv, fx.d_v, fx.kv_size
    if fx.q_storage == "compact":
        # Qcur reshaped from a contiguous (d*h_Q, q) projection output.
        row = F32 * d * hq
        qoff = 0
        qspan = row * q
    else:
        # Qcur as a view of the fused QKV projection output (row = Q | K | V), with the
        # fused tensor at an aligned offset inside a larger arena.
        row = F32 * d * (hq + 2 * hkv)
        qoff = ARENA_OFFSET
        qspan = ARENA_OFFSET + row * q + 64
    qcur = TensorDesc("q", (d, hq, q, 1), (F32, F32 * d, row, row * q), qoff, F32)
    qn = qcur.permute(0, 2, 1, 3)
    # llama_kv_cache::get_k: (d, h_KV, n_kv, 1), then permute(0, 2, 1, 3)
    krow = F16 * d * hkv
    kc = TensorDesc("k", (d, hkv, n, 1), (F16, F16 * d, krow, krow * kvs), 0, F16)
    # llama_kv_cache::get_v with v_trans: (n_kv, h_KV, d_v, 1), then permute(0, 2, 1, 3)
    vc = TensorDesc("v", (n, hkv, dv, 1), (F16, F16 * kvs * dv, F16 * kvs, F16 * kvs * dv * hkv), 0, F16)
    mask = TensorDesc("mask", (n, fx.q_pad, 1, 1), (F32, F32 * n, F32 * n * fx.q_pad, F32 * n * fx.q_pad), 0, F32)
    spans = {
        "q": qspan,
        "k": krow * kvs,
        "v": F16 * kvs * dv * hkv,
        "mask": F32 * n * fx.q_pad,
        "out": F32 * dv * hq * q,
    }
    return NativeTensors(qn, kc.permute(0, 2, 1, 3), vc.permute(0, 2, 1, 3), mask, spans,
                         float(np.float32(1.0 / math.sqrt(d))))


# --------------------------------------------------------------------------- layouts


@dataclass(frozen=True, eq=False)
class AttnCall:
    """One QK -> softmax -> AV instance of a layout, with the logical labels of its
    batch coordinates: ``label_j[i1, i2, i3]`` / ``label_a[i1, i2, i3]`` name the query
    and query head that the kq column (i1, i2, i3) stands for."""

    q: TensorDesc
    k: TensorDesc
    v: TensorDesc
    mask: TensorDesc
    label_j: np.ndarray
    label_a: np.ndarray
    kv_head_map: str  # "broadcast" (ggml mul_mat r2/r3) | "repeat" (tiled, i % ne)
    out_perm: tuple[int, int, int, int]
    out_offset: int  # element offset of this call's block in the (d_v*h_Q, q) output


@dataclass(frozen=True)
class AddressModel:
    """The address model of one attention layout (``layout``, a :class:`statelab.runtime.layouts.Layout`
    whose :class:`~statelab.runtime.layouts.Attention` object builds the same views in ggml):
    builds a fixture's attention calls.

    kv_head_map  "broadcast": ggml mul_mat's src0 broadcast (query head a reads KV head
                 a // (h_Q/h_KV)); "repeat": K/V tiled to h_Q heads as ggml_repeat would
                 (a -> a % h_KV), traced back to the cache (a GQA fault)
    out_perm     the permute applied to kqv before cont (native: (0, 2, 1, 3))
    """
    kv_head_map: Literal["broadcast", "repeat"] = "broadcast"
    out_perm: tuple[int, int, int, int] = (0, 2, 1, 3)

    layout = Layout.MQ

    @property
    def name(self) -> str:
        defaults = type(self)()
        diffs = [f"{f}={getattr(self, f)}" for f in self.__dataclass_fields__
                 if getattr(self, f) != getattr(defaults, f)]
        return self.layout.value + (f"[{','.join(diffs)}]" if diffs else "")

    def calls(self, nat: NativeTensors, fx: Fixture) -> list[AttnCall]:  # pragma: no cover
        raise NotImplementedError


@dataclass(frozen=True)
class MQLayout(AddressModel):
    """The native multi-query graph: one call over all queries."""

    layout = Layout.MQ

    def calls(self, nat, fx):
        N, H = fx.q, fx.h_q
        lj = np.broadcast_to(np.arange(N)[:, None, None], (N, H, 1))
        la = np.broadcast_to(np.arange(H)[None, :, None], (N, H, 1))
        return [AttnCall(nat.q, nat.k, nat.v, nat.mask, lj, la, self.kv_head_map, self.out_perm, 0)]


@dataclass(frozen=True)
class PQLayout(AddressModel):
    """One attention sub-graph per query: q column j, mask column j, outputs concatenated."""

    layout = Layout.PQ

    def calls(self, nat, fx):
        H, out = fx.h_q, []
        la = np.broadcast_to(np.arange(H)[None, :, None], (1, H, 1))
        for j in range(fx.q):
            qd = nat.q.view((fx.d, 1, H, 1), nat.q.nb, j * nat.q.nb[1])
            md = nat.mask.view((fx.n_kv, 1, 1, 1), nat.mask.nb, j * nat.mask.nb[1])
            lj = np.full((1, H, 1), j)
            out.append(AttnCall(qd, nat.k, nat.v, md, lj, la, self.kv_head_map, self.out_perm,
                                j * fx.d_v * H))
        return out


@dataclass(frozen=True)
class QBLayout(AddressModel):
    """The query-to-batch view. Defaults are the correct layout; other values are faults.

    q_nb3          which original query stride becomes the view's fourth-axis stride
    q_offset_delta bytes added to the query view's offset
    mask_columns   "per_query": mask view (n_kv, 1, 1, q), nb[3] = m1;
                   "shared": mask view (n_kv, 1, 1, 1) that softmax broadcasts to all queries
    kv_batch       "shared": K view (d, n_kv, h_KV, 1) broadcast over q (r3 = q);
                   "strided": K view (d, n_kv, h_KV, q) with nb[3] = the K cell stride
    kv_head_map    "broadcast": ggml mul_mat src0 broadcast; "repeat": K/V tiled to h_Q
                   heads (ggml_repeat), i.e. query head a reads KV head a % h_KV
    out_perm       the permute applied to kqv (d_v, 1, h_Q, q) before cont
    """

    q_nb3: Literal["nb1", "nb2"] = "nb1"
    q_offset_delta: int = 0
    mask_columns: Literal["per_query", "shared"] = "per_query"
    kv_batch: Literal["shared", "strided"] = "shared"

    layout = Layout.QB

    def calls(self, nat, fx):
        qn, m = nat.q, nat.mask
        nb3 = {"nb1": qn.nb[1], "nb2": qn.nb[2]}[self.q_nb3]
        qd = qn.view((fx.d, 1, fx.h_q, fx.q), (qn.nb[0], qn.nb[1], qn.nb[2], nb3), self.q_offset_delta)
        if self.mask_columns == "per_query":
            md = m.view((fx.n_kv, 1, 1, fx.q), (m.nb[0], m.nb[1], m.nb[2], m.nb[1]))
        else:
            md = m.view((fx.n_kv, 1, 1, 1), m.nb)
        k = nat.k
        if self.kv_batch == "strided":
            k = k.view((k.ne[0], k.ne[1], k.ne[2], fx.q), (k.nb[0], k.nb[1], k.nb[2], k.nb[1]))
        H, B = fx.h_q, fx.q
        lj = np.broadcast_to(np.arange(B)[None, None, :], (1, H, B))
        la = np.broadcast_to(np.arange(H)[None, :, None], (1, H, B))
        return [AttnCall(qd, k, nat.v, md, lj, la, self.kv_head_map, self.out_perm, 0)]


ADDRESS_MODELS = {m.layout: m for m in (MQLayout, PQLayout, QBLayout)}


def address_model(layout) -> AddressModel:
    """The correct address model of an attention layout (every one of ``ATTENTION_LAYOUTS`` has one)."""
    return ADDRESS_MODELS[Layout.parse(layout, ATTENTION_LAYOUTS, "attention layout")]()


@dataclass(frozen=True)
class Fault:
    """An injected QB fault and the obligation that must detect it."""

    name: str
    layout: AddressModel
    obligation: str
    description: str


FAULTS = (
    Fault("fourth_axis_stride_nb2", QBLayout(q_nb3="nb2"), "q_address",
          "query view uses the head stride nb[2] instead of the query-column stride nb[1] as nb[3]"),
    Fault("gqa_modulo", QBLayout(kv_head_map="repeat"), "gqa_head_map",
          "K/V tiled over query heads (a -> a % h_KV) instead of contiguous groups"),
    Fault("shared_mask_column", QBLayout(mask_columns="shared"), "mask_address",
          "one mask column (n_kv, 1, 1, 1) broadcast to every query"),
    Fault("permuted_output", QBLayout(out_perm=(0, 1, 3, 2)), "output_order",
          "output recombined in (v, j, a) instead of (v, a, j) order"),
    Fault("q_offset_plus_one_element", QBLayout(q_offset_delta=F32), "q_address",
          "query view offset off by one element"),
    Fault("misaligned_q_offset", QBLayout(q_offset_delta=F16), "alignment",
          "query view offset not a multiple of the F32 element size"),
    Fault("kv_not_shared", QBLayout(kv_batch="strided"), "kv_address",
          "K view given a fourth axis of extent q stepping one cache cell per query"),
)


# --------------------------------------------------------------------------- address oracle


@dataclass(frozen=True)
class Violation:
    obligation: str
    coordinate: dict
    detail: str

    def __str__(self) -> str:
        coord = ", ".join(f"{k}={v}" for k, v in self.coordinate.items())
        return f"{self.obligation} at ({coord}): {self.detail}"


@dataclass(frozen=True)
class OracleReport:
    fixture: str
    layout: str
    checked: tuple[str, ...]
    violations: tuple[Violation, ...]

    @property
    def passed(self) -> bool:
        return not self.violations

    @property
    def violated(self) -> frozenset[str]:
        return frozenset(v.obligation for v in self.violations)

    def __str__(self) -> str:
        head = f"{self.layout} on {self.fixture}: "
        if self.passed:
            return head + f"all {len(self.checked)} obligations hold"
        return head + "; ".join(str(v) for v in self.violations)


class _Collector:
    def __init__(self):
        self.first: dict[str, Violation] = {}

    def fail(self, obligation: str, coordinate: dict, detail: str):
        if obligation not in self.first:
            self.first[obligation] = Violation(obligation, {k: int(v) for k, v in coordinate.items()}, detail)

    def compare(self, obligation, got, expected, names, grids, ci, what="address"):
        """Record the first coordinate (C order) where got != expected."""
        got, expected = np.broadcast_arrays(got, expected)
        bad = got != expected
        if bad.any():
            idx = tuple(int(x) for x in np.argwhere(bad)[0])
            coord = {"call": ci}
            for nm, g in zip(names, grids):
                coord[nm] = np.broadcast_to(g, bad.shape)[idx]
            self.fail(obligation, coord, f"{what} {int(got[idx])} != expected {int(expected[idx])}")
            return False
        return True


def _kv_head_index(call: AttnCall, src0: TensorDesc, H: int, B: int):
    """(i02, i03) that ggml's mul_mat reads for dst batch coordinates (i2, i3)."""
    i2 = np.arange(H)[:, None]
    i3 = np.arange(B)[None, :]
    if call.kv_head_map == "broadcast":
        return i2 // (H // src0.ne[2]), i3 // (B // src0.ne[3])
    return i2 % src0.ne[2], i3 % src0.ne[3]


def _recombined_position(call: AttnCall, dv: int) -> np.ndarray:
    """Element index in the final output of kqv element (v, i1, i2, i3) after
    permute(out_perm) + cont (+ the call's concat offset); shape (dv, N, H, B)."""
    ne = (dv,) + tuple(call.q.ne[1:])
    new_ne = [0] * 4
    for src, dst in enumerate(call.out_perm):
        new_ne[dst] = ne[src]
    stride = np.cumprod([1] + new_ne[:3])
    grids = np.meshgrid(*[np.arange(n) for n in ne], indexing="ij", sparse=True)
    pos = np.int64(call.out_offset)
    for src, dst in enumerate(call.out_perm):
        pos = pos + grids[src].astype(np.int64) * int(stride[dst])
    return pos


def _preconditions(call: AttnCall, fx: Fixture, col: _Collector, ci: int) -> bool:
    q, k, v, m = call.q, call.k, call.v, call.mask
    kq_ne = (k.ne[1], q.ne[1], q.ne[2], q.ne[3])
    checks = [
        (k.ne[0] == q.ne[0], "mul_mat(k, q): k.ne0 != q.ne0"),
        (q.ne[2] % k.ne[2] == 0, "mul_mat(k, q): q.ne2 % k.ne2 != 0"),
        (q.ne[3] % k.ne[3] == 0, "mul_mat(k, q): q.ne3 % k.ne3 != 0"),
        (k.nb[0] <= k.nb[1], "mul_mat(k, q): k is transposed"),
        (m.ne[0] == kq_ne[0], "soft_max: mask.ne0 != kq.ne0"),
        (m.ne[1] >= kq_ne[1], "soft_max: mask.ne1 < kq.ne1"),
        (kq_ne[2] % m.ne[2] == 0, "soft_max: kq.ne2 % mask.ne2 != 0"),
        (kq_ne[3] % m.ne[3] == 0, "soft_max: kq.ne3 % mask.ne3 != 0"),
        (m.is_contiguous(), "soft_max: mask not contiguous"),
        (v.ne[0] == kq_ne[0], "mul_mat(v, kq): v.ne0 != kq.ne0"),
        (kq_ne[2] % v.ne[2] == 0, "mul_mat(v, kq): kq.ne2 % v.ne2 != 0"),
        (kq_ne[3] % v.ne[3] == 0, "mul_mat(v, kq): kq.ne3 % v.ne3 != 0"),
        (v.nb[0] <= v.nb[1], "mul_mat(v, kq): v is transposed"),
        (k.ne[1] == fx.n_kv and v.ne[1] == fx.d_v, "K/V extents differ from the fixture"),
        (call.label_j.shape == tuple(q.ne[1:]) and call.label_a.shape == tuple(q.ne[1:]),
         "labels do not cover the kq batch coordinates"),
        (sorted(call.out_perm) == [0, 1, 2, 3], "out_perm is not a permutation"),
    ]
    ok = True
    for good, msg in checks:
        if not good:
            col.fail("op_preconditions", {"call": ci}, msg)
            ok = False
    return ok


def check_qb_addressing(fixture: Fixture, layout: AddressModel | None = None) -> OracleReport:
    """Integer address oracle: check ``layout`` (default :class:`QBLayout`) against the
    native MQ addressing of ``fixture`` for every logical coordinate.

    The obligations are :data:`OBLIGATIONS`; the report lists each violated obligation
    once, with its first offending coordinate (C order over the call's index grid).
    K/V addresses are affine in (channel, key) with a per-(j, a) base, so they are
    checked exactly as "base equal for every (j, a)" plus "row strides equal".
    """
    layout = QBLayout() if layout is None else layout
    fx = fixture
    nat = fx.native()
    col = _Collector()
    d, dv, n, Q, HQ = fx.d, fx.d_v, fx.n_kv, fx.q, fx.h_q
    calls = layout.calls(nat, fx)

    q_addrs, labels, mask_rows, out_pos = [], [], [], []
    for ci, call in enumerate(calls):
        # alignment and bounds of every view this call reads
        for role, desc in (("q", call.q), ("k", call.k), ("v", call.v), ("mask", call.mask)):
            strides_ok = all(s % desc.itemsize == 0 for s, e in zip(desc.nb, desc.ne) if e > 1)
            if desc.offset % desc.itemsize or not strides_ok:
                col.fail("alignment", {"call": ci, "offset": desc.offset},
                         f"{role} view offset/stride not a multiple of {desc.itemsize}")
            lo, hi = desc.extent()
            if lo < 0 or hi > nat.spans[desc.buffer]:
                col.fail("view_bounds", {"call": ci, "lo": lo, "hi": hi},
                         f"{role} view spans [{lo}, {hi}) outside [0, {nat.spans[desc.buffer]})")
        if not _preconditions(call, fx, col, ci):
            continue
        N, H, B = call.q.ne[1:]
        i1 = np.arange(N)[:, None, None]
        i2 = np.arange(H)[None, :, None]
        i3 = np.arange(B)[None, None, :]
        lj, la = np.asarray(call.label_j), np.asarray(call.label_a)
        labels.append(np.stack([lj.ravel(), la.ravel()]))
        if lj.min() < 0 or lj.max() >= Q or la.min() < 0 or la.max() >= HQ:
            col.fail("label_bijection", {"call": ci}, "label outside [0, q) x [0, h_Q)")
            continue
        kappa = la // fx.group

        # Q: (c, i1, i2, i3) -> native (c, j, a)
        c = np.arange(d)[:, None, None, None]
        got = call.q.addr(c, i1, i2, i3)
        col.compare("q_address", got, nat.q.addr(c, lj, la, 0), ("c", "j", "a"), (c, lj, la), ci)
        q_addrs.append(got.ravel())

        # mask: softmax reads (t, i01, i02 % ne12, i03 % ne13); native: b_M + t*m0 + j*m1.
        # The column address does not depend on t, so the check runs over the distinct
        # (j, i1, i2 % ne12, i3 % ne13) batch columns (one representative head each).
        m = call.mask
        cols = np.stack(np.broadcast_arrays(lj, i1, i2 % m.ne[2], i3 % m.ne[3], la), -1).reshape(-1, 5)
        _, rep = np.unique(cols[:, :4], axis=0, return_index=True)
        cj, c1, c2, c3, ca = cols[rep].T
        t = np.arange(n)[:, None]
        got_m = m.addr(t, c1, c2, c3)
        exp_m = nat.mask.offset + t * nat.mask.nb[0] + cj * nat.mask.nb[1]
        col.compare("mask_address", got_m, exp_m, ("t", "j", "a"), (t, cj, ca), ci)
        mask_rows.append(np.stack([np.broadcast_to(t * Q + cj, got_m.shape).ravel(), got_m.ravel()]))

        # K and V: ggml broadcast rule -> head index; then full address = base + row part
        for role, src, nsrc, rows in (
            ("k", call.k, nat.k, (d, n)),
            ("v", call.v, nat.v, (n, dv)),
        ):
            i02, i03 = _kv_head_index(call, src, H, B)
            i02 = np.broadcast_to(i02[None], (N, H, B))
            i03 = np.broadcast_to(i03[None], (N, H, B))
            bad = i02 != kappa
            if bad.any():
                idx = tuple(np.argwhere(bad)[0])
                col.fail("gqa_head_map", {"call": ci, "j": lj[idx], "a": la[idx]},
                         f"{role}: query head {int(la[idx])} reads KV head {int(i02[idx])}, "
                         f"expected {int(kappa[idx])}")
            base = src.offset + i02 * src.nb[2] + i03 * src.nb[3]
            exp_base = nsrc.offset + kappa * nsrc.nb[2]
            names = ("c", "t") if role == "k" else ("t", "v")
            col.compare("kv_address", base, exp_base, ("j", "a"), (lj, la), ci)
            for ax in (0, 1):
                if rows[ax] > 1 and (src.nb[ax] != nsrc.nb[ax] or src.ne[ax] != nsrc.ne[ax]):
                    coord = {"call": ci, names[ax]: 1, "j": 0, "a": 0}
                    col.fail("kv_address", coord,
                             f"{role} axis {ax} stride/extent ({src.nb[ax]}, {src.ne[ax]}) != native "
                             f"({nsrc.nb[ax]}, {nsrc.ne[ax]})")

        # output recombination
        vv = np.arange(dv)[:, None, None, None]
        pos = _recombined_position(call, dv)
        exp_pos = vv + dv * la + dv * HQ * lj
        col.compare("output_order", pos, exp_pos, ("v", "j", "a"), (vv, lj, la), ci, "output element")
        out_pos.append(np.broadcast_to(pos, (dv, N, H, B)).ravel())

    # aggregate obligations over all calls
    if labels:
        lab = np.concatenate(labels, axis=1)
        flat = lab[0] * HQ + lab[1]
        if flat.size != Q * HQ or not np.array_equal(np.sort(flat), np.arange(Q * HQ)):
            counts = np.bincount(flat.clip(0, Q * HQ - 1), minlength=Q * HQ)
            bad = int(np.flatnonzero(counts != 1)[0])
            col.fail("label_bijection", {"j": bad // HQ, "a": bad % HQ},
                     f"(j, a) labelled {int(counts[bad])} times")
    if q_addrs:
        qa = np.concatenate(q_addrs)
        cnt = np.bincount(qa - qa.min())
        if cnt.max() > 1:
            col.fail("q_injective", {"address": int(np.argmax(cnt > 1) + qa.min())},
                     f"{int((cnt[cnt > 1] - 1).sum())} logical Q coordinates share an address")
    if mask_rows:
        mr = np.concatenate(mask_rows, axis=1)
        lo = int(mr[1].min())
        width = int(mr[1].max()) - lo + 1
        pairs = np.unique(mr[0] * width + (mr[1] - lo))  # unique (key, address) pairs
        keys, addrs = pairs // width, pairs % width + lo
        if np.unique(keys).size != pairs.size:
            kk = keys[np.flatnonzero(np.diff(keys) == 0)[0]]
            col.fail("mask_injective", {"t": kk // Q, "j": kk % Q}, "one (t, j) read at several mask addresses")
        ua, inv, cnt = np.unique(addrs, return_inverse=True, return_counts=True)
        if ua.size != pairs.size:
            tj = keys[cnt[inv] > 1]
            col.fail("mask_injective", {"t": tj[0] // Q, "j": tj[0] % Q, "t2": tj[1] // Q, "j2": tj[1] % Q},
                     f"distinct (t, j) share mask address {int(addrs[cnt[inv] > 1][0])}")
    if out_pos:
        op = np.concatenate(out_pos)
        total = dv * HQ * Q
        if op.min() < 0 or op.max() >= total:
            col.fail("output_bijection", {"position": int(op.max() if op.max() >= total else op.min())},
                     f"output position outside [0, {total})")
        elif (counts := np.bincount(op, minlength=total)).max() > 1 or counts.min() < 1:
            bad = int(np.flatnonzero(counts != 1)[0])
            col.fail("output_bijection", {"v": bad % dv, "a": (bad // dv) % HQ, "j": bad // (dv * HQ)},
                     f"output element written {int(counts[bad])} times")

    ordered = tuple(col.first[o] for o in OBLIGATIONS if o in col.first)
    return OracleReport(fx.name, layout.name, OBLIGATIONS, ordered)


# --------------------------------------------------------------------------- fixtures


def fixtures(*, quick: bool = False) -> tuple[Fixture, ...]:
    """The fixture product: q x key extent x head pair x d x Q storage x mask kind
    (4 * 6 * 4 * 2 * 2 * 3 = 1152). ``quick`` keeps q in {1, 3}, key extents
    {127, 256}, d = 64 (all head pairs, storages and masks: 96 fixtures)."""
    qs, kvs, ds = (Q_EXTENTS, KV_EXTENTS, HEAD_DIMS) if not quick else ((1, 3), (127, 256), (64,))
    return tuple(
        Fixture(q, n, hq, hkv, d, st, mk)
        for q, n, (hq, hkv), d, st, mk in itertools.product(qs, kvs, HEAD_PAIRS, ds, Q_STORAGES, MASK_KINDS)
    )


def _mask_values(fx: Fixture) -> np.ndarray:
    """Logical mask (n_kv, q_pad): 0 where allowed, -inf elsewhere (padded rows -inf)."""
    n, Q = fx.n_kv, fx.q
    used = n - UNUSED_TAIL_CELLS if fx.mask_kind == "causal_padded" else n
    t = np.arange(n)[:, None]
    j = np.arange(Q)[None, :]
    pos = used - Q + j  # position of query j; the queries are the last q used cells
    allowed = t <= pos
    if fx.mask_kind == "sparse":
        hole = (t >= 1) & (t < pos) & ((3 * t + 7 * j) % 5 == 0)
        allowed &= ~hole
    m = np.full((n, fx.q_pad), -np.inf, dtype=np.float32)
    m[:, :Q] = np.where(allowed, 0.0, -np.inf)
    return m


def _single_keys(fx: Fixture) -> np.ndarray:
    return (5 + 29 * np.arange(fx.q)) % fx.n_kv


@dataclass(frozen=True, eq=False)
class FixtureData:
    """Logical operands of one fixture and pattern, their byte buffers written through
    the native descriptors, and the exact expectations of structured patterns."""

    fixture: Fixture
    pattern: str
    q: np.ndarray  # (d, q, h_Q) float32
    k: np.ndarray  # (d, n_kv, h_KV) float16
    v: np.ndarray  # (n_kv, d_v, h_KV) float16
    mask: np.ndarray  # (n_kv, q_pad) float32
    scale: float
    buffers: dict = field(repr=False)
    expected: dict = field(repr=False)  # stage -> exact expected array (structured patterns)


@functools.lru_cache(maxsize=8)
def _native_element_index(fx: Fixture) -> dict[str, np.ndarray]:
    """Element indices at which the native descriptors store the logical arrays
    q (d, q, h_Q), k (d, n_kv, h_KV), v (n_kv, d_v, h_KV) and mask (n_kv, q_pad)."""
    nat = fx.native()
    ar = np.arange
    return {
        "q": nat.q.addr(ar(fx.d)[:, None, None], ar(fx.q)[None, :, None], ar(fx.h_q)[None, None, :]) // F32,
        "k": nat.k.addr(ar(fx.d)[:, None, None], ar(fx.n_kv)[None, :, None], ar(fx.h_kv)[None, None, :]) // F16,
        "v": nat.v.addr(ar(fx.n_kv)[:, None, None], ar(fx.d_v)[None, :, None], ar(fx.h_kv)[None, None, :]) // F16,
        "mask": nat.mask.addr(ar(fx.n_kv)[:, None], ar(fx.q_pad)[None, :]) // F32,
    }


def _fill_buffer(span: int, dtype) -> np.ndarray:
    buf = np.zeros(span, dtype=np.uint8)
    buf.view(dtype)[:] = np.nan
    return buf


def make_data(fixture: Fixture, pattern: str = "random", seed: int = 0) -> FixtureData:
    """Seeded operands for ``fixture``.

    random      Q ~ N(0, 1) in F32, K/V ~ N(0, 1) rounded to F16, scale 1/sqrt(d)
    dyadic      Q in k/8, K in k/16, V in k/32 (small integers k): exact in F16/F32
                and in every QK sum; scale 2**-3
    onehot      Q[:, j, a] = e_c(j,a); K[c, t, h] = 1024 at one key allowed for every
                query, else 0; scale 1: QK, softmax (one-hot) and AV are exact
    single_key  random data, mask row j allows only key s_j (distinct per query):
                softmax one-hot at s_j and AV = V[s_j] exactly
    """
    if pattern not in PATTERNS:
        raise ValueError(f"pattern must be one of {PATTERNS}, got {pattern!r}")
    fx = fixture
    nat = fx.native()
    d, Q, HQ, HKV, n, dv = fx.d, fx.q, fx.h_q, fx.h_kv, fx.n_kv, fx.d_v
    rng = np.random.default_rng([seed, zlib.crc32(fx.name.encode()), PATTERNS.index(pattern)])
    mask = _mask_values(fx)
    scale = nat.scale
    expected: dict[str, np.ndarray] = {}
    kappa = np.arange(HQ) // fx.group
    if pattern in ("random", "single_key"):
        qv = rng.standard_normal((d, Q, HQ), dtype=np.float32)
        kv = rng.standard_normal((d, n, HKV), dtype=np.float32).astype(np.float16)
        vv = rng.standard_normal((n, dv, HKV), dtype=np.float32).astype(np.float16)
    elif pattern == "dyadic":
        qv = (rng.integers(-8, 9, (d, Q, HQ)) / 8).astype(np.float32)
        kv = (rng.integers(-8, 9, (d, n, HKV)) / 16).astype(np.float16)
        vv = (rng.integers(-16, 17, (n, dv, HKV)) / 32).astype(np.float16)
        scale = 0.125
    else:  # onehot
        cj = (np.arange(Q)[:, None] * HQ + np.arange(HQ)[None, :]) % d  # (q, h_Q)
        qv = np.zeros((d, Q, HQ), dtype=np.float32)
        qv[cj, np.arange(Q)[:, None], np.arange(HQ)[None, :]] = 1.0
        common = np.flatnonzero(np.isfinite(mask[:, :Q]).all(axis=1))
        tgt = common[(31 * np.arange(d)[:, None] + 17 * np.arange(HKV)[None, :]) % common.size]  # (d, h_KV)
        kv = np.zeros((d, n, HKV), dtype=np.float16)
        kv[np.arange(d)[:, None], tgt, np.arange(HKV)[None, :]] = ONEHOT_KEY_VALUE
        tt, cc, hh = np.meshgrid(np.arange(n), np.arange(dv), np.arange(HKV), indexing="ij")
        vv = (((37 * tt + 11 * cc + 101 * hh) % 2001 - 1000) / 8).astype(np.float16)
        scale = 1.0
        key = tgt[cj, kappa[None, :]]  # (q, h_Q): the one key each (j, a) attends to
        expected["qk"] = kv[cj[None], np.arange(n)[:, None, None], kappa[None, None, :]].astype(np.float64)
        sm = np.zeros((n, Q, HQ))
        sm[key, np.arange(Q)[:, None], np.arange(HQ)[None, :]] = 1.0
        expected["softmax"] = sm
        expected["av"] = np.moveaxis(vv[key, :, kappa[None, :]], -1, 0).astype(np.float64)  # (dv, q, h_Q)
    if pattern == "single_key":
        s = _single_keys(fx)
        mask = np.full((n, fx.q_pad), -np.inf, dtype=np.float32)
        mask[s, np.arange(Q)] = 0.0
        sm = np.zeros((n, Q, HQ))
        sm[s[:, None], np.arange(Q)[:, None], np.arange(HQ)[None, :]] = 1.0
        expected["softmax"] = sm
        expected["av"] = np.moveaxis(vv[s[:, None], :, kappa[None, :]], -1, 0).astype(np.float64)
    if "av" in expected:
        expected["output"] = _native_output_order(expected["av"])

    idx = _native_element_index(fx)
    bufs = {}
    for name, values, dt in (("q", qv, np.float32), ("k", kv, np.float16), ("v", vv, np.float16),
                             ("mask", mask, np.float32)):
        bufs[name] = _fill_buffer(nat.spans[name], dt)
        bufs[name].view(dt)[idx[name]] = values
    return FixtureData(fx, pattern, qv, kv, vv, mask, float(scale), bufs, expected)


def _native_output_order(av: np.ndarray) -> np.ndarray:
    """(d_v, q, h_Q) -> flat (d_v * h_Q * q) in the native (v, a, j) order."""
    return np.ascontiguousarray(np.transpose(av, (1, 2, 0))).ravel()


# --------------------------------------------------------------------------- numerics


class _Gather:
    """A precomputed gather of ``dtype`` elements at byte addresses of one buffer:
    aligned in-span addresses become element indices; anything else is read byte by
    byte (misaligned) or as NaN (outside the span)."""

    def __init__(self, addr: np.ndarray, dtype: np.dtype, size: int):
        self.dtype = dtype
        isz = dtype.itemsize
        if addr.size == 0 or (addr.min() >= 0 and addr.max() + isz <= size and not (addr & (isz - 1)).any()):
            self.index = addr >> (isz.bit_length() - 1)
            self.inb = None
        else:
            self.inb = (addr >= 0) & (addr + isz <= size)
            self.index = np.where(self.inb, addr, 0)[..., None] + np.arange(isz)

    def __call__(self, buf: np.ndarray) -> np.ndarray:
        if self.inb is None:
            return buf.view(self.dtype)[self.index]
        vals = np.ascontiguousarray(buf[self.index]).view(self.dtype)[..., 0]
        return np.where(self.inb, vals, np.array(np.nan, dtype=self.dtype))


def _softmax(w: np.ndarray, precision: str, axis: int) -> np.ndarray:
    """Masked-softmax over the key axis. "f32" follows ggml-cpu: exp in float32, the
    sum in double, then a scale by the float32 reciprocal."""
    mx = np.max(w, axis=axis, keepdims=True)
    if precision == "fp64":
        e = np.exp(w - mx)
        return e / np.sum(e, axis=axis, keepdims=True)
    e = np.exp(w - mx).astype(np.float32)
    s = np.sum(e, axis=axis, keepdims=True, dtype=np.float64)
    return e * (1.0 / s).astype(np.float32)


def _canonical_fp64(q, kpanels, kidx, mask, vpanels, vidx, scale) -> dict[str, np.ndarray]:
    """The FP64 scalar oracle on logical operands, in one fixed arithmetic arrangement.

    q (d, q, h_Q); kpanels (U, n_kv, d) with kidx (q, h_Q) naming the panel each (j, a)
    reads (-1: none); mask (n_kv, q, h_Q); vpanels (W, d_v, n_kv) with vidx (q, h_Q).
    Every (j, a) column is computed by the same float64 contraction (``np.einsum``, no
    BLAS) over the same panel and the same column set whichever layout supplied the
    operands, so two layouts that read identical values give bitwise identical results:
    an FP64 difference between layouts is an addressing difference, not a
    summation-order artefact.
    """
    d, Q, HQ = q.shape
    n = mask.shape[0]
    dv = vpanels.shape[1]
    qf = np.ascontiguousarray(q, dtype=np.float64).reshape(d, Q * HQ)
    s = np.full((n, Q * HQ), np.nan)
    for u in range(kpanels.shape[0]):
        cols = np.flatnonzero(kidx.ravel() == u)
        if cols.size:
            s[:, cols] = np.einsum("tc,cn->tn", np.ascontiguousarray(kpanels[u], dtype=np.float64), qf[:, cols])
    w = s * np.float64(np.float32(scale)) + mask.reshape(n, Q * HQ).astype(np.float64)
    with np.errstate(invalid="ignore"):
        p = _softmax(w, "fp64", axis=0)
    o = np.full((dv, Q * HQ), np.nan)
    for u in range(vpanels.shape[0]):
        cols = np.flatnonzero(vidx.ravel() == u)
        if cols.size:
            o[:, cols] = np.einsum("vt,tn->vn", np.ascontiguousarray(vpanels[u], dtype=np.float64), p[:, cols])
    av = o.reshape(dv, Q, HQ)
    return {"qk": s.reshape(n, Q, HQ), "softmax": p.reshape(n, Q, HQ), "av": av,
            "output": _native_output_order(av)}


F32_KERNELS = ("einsum", "matmul")


def evaluate_layout(data: FixtureData, layout: AddressModel | None = None, *,
                    src1_f16: bool = False, f32_kernel: str = "einsum") -> dict[str, dict[str, np.ndarray]]:
    """Compute attention by reading every operand through ``layout``'s addressing.

    Returns ``{precision: {stage: array}}`` with precision in :data:`PRECISIONS` and
    logical stage arrays ``qk``/``softmax`` (n_kv, q, h_Q), ``av`` (d_v, q, h_Q) and
    ``output`` (d_v*h_Q*q in native (v, a, j) order, as written by the layout's
    recombination).

    * "fp64", the scalar oracle: the values the layout's calls read (Q columns, mask
      columns, the K/V panels picked by ggml's broadcast rule) are gathered at their
      logical labels and fed to one canonical float64 computation
      (:func:`_canonical_fp64`); the AV values are then written through the layout's
      output recombination.
    * "f32", an emulation in the layout's own batch structure: per call, float32
      contractions of each K/V panel with the call's (d, N) query blocks / (n_kv, N)
      probability blocks (MQ: N = q, PQ/QB: N = 1), ggml-cpu style softmax.
      ``f32_kernel="einsum"`` (default) uses ``np.einsum`` (float32 accumulation, no
      BLAS, single-threaded); ``"matmul"`` uses ``np.matmul`` (OpenBLAS sgemm/sgemv,
      whose thread wake-ups make it far slower on a small shared machine).
      ``src1_f16`` additionally rounds mul_mat's src1 to F16 as ggml-cpu does for an
      F16 src0.

    Coordinates a faulty layout never labels or writes stay NaN; reads outside a
    buffer give NaN.
    """
    layout = QBLayout() if layout is None else layout
    if f32_kernel not in F32_KERNELS:
        raise ValueError(f"f32_kernel must be one of {F32_KERNELS}, got {f32_kernel!r}")
    plan = _layout_plan(data.fixture, layout)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):  # faulty layouts read garbage
        return _evaluate(data, plan, src1_f16, f32_kernel)


def _contract_einsum(panel: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """(M, K) x (E, K, N) -> (E, M, N) in the operands' dtype."""
    return np.einsum("mk,ekn->emn", panel, blocks)


@dataclass(frozen=True, eq=False)
class _CallPlan:
    N: int
    E: int  # batch entries, e = i3 * H + i2
    q: _Gather  # -> (E, d, N) after reshape
    mask: _Gather  # -> (E, n_kv, N)
    lj: np.ndarray  # (E, N) logical query of each kq column
    la: np.ndarray  # (E, N) logical head
    labelled: tuple  # (e, n) index arrays of in-range labels
    pos: np.ndarray  # (E, d_v, N) final output element of each kqv element
    k_idx: np.ndarray  # (E,) index into the K panels
    v_idx: np.ndarray  # (E,) index into the V panels


@dataclass(frozen=True, eq=False)
class _Plan:
    calls: tuple
    k_panels: tuple  # of (panel ids, _Gather of those panels)
    v_panels: tuple
    n_k: int
    n_v: int


@functools.lru_cache(maxsize=16)
def _layout_plan(fx: Fixture, layout: AddressModel) -> _Plan:
    """Every address a layout reads, for one fixture (data-independent, so cached)."""
    nat = fx.native()
    d, dv, n, Q, HQ = fx.d, fx.d_v, fx.n_kv, fx.q, fx.h_q
    f32, f16 = np.dtype(np.float32), np.dtype(np.float16)
    cc, tt, vc = np.arange(d), np.arange(n), np.arange(dv)
    calls = layout.calls(nat, fx)
    pre = []
    for call in calls:
        N, H, B = call.q.ne[1:]
        E = H * B
        i1 = np.arange(N)[:, None, None]
        i2 = np.arange(H)[None, :, None]
        i3 = np.arange(B)[None, None, :]
        qa = call.q.addr(cc[:, None, None, None], i1, i2, i3).transpose(3, 2, 0, 1).reshape(E, d, N)
        m = call.mask
        ma = m.addr(tt[:, None, None, None], i1, i2 % m.ne[2], i3 % m.ne[3]).transpose(3, 2, 0, 1).reshape(E, n, N)
        lj = np.asarray(call.label_j).transpose(2, 1, 0).reshape(E, N)
        la = np.asarray(call.label_a).transpose(2, 1, 0).reshape(E, N)
        pos = np.broadcast_to(_recombined_position(call, dv), (dv, N, H, B)).transpose(3, 2, 0, 1).reshape(E, dv, N)
        row = {}
        for role, src in (("k", call.k), ("v", call.v)):
            i02, i03 = _kv_head_index(call, src, H, B)
            row[role] = (src, (src.offset + i02 * src.nb[2] + i03 * src.nb[3]).T.reshape(E))
        pre.append((N, E, qa, ma, lj, la, pos, row))
    # One panel per distinct (row strides, base address): K panels (n_kv, d), V (d_v, n_kv).
    ids = {"k": {}, "v": {}}
    gathers = {"k": [], "v": []}
    pidx = []
    for *_, row in pre:
        call_idx = {}
        for role in ("k", "v"):
            src, base = row[role]
            known = ids[role]
            new_ids, new_bases, idx = [], [], []
            for b in base.tolist():
                key = (src.nb[0], src.nb[1], b)
                if key not in known:
                    known[key] = len(known)
                    new_ids.append(known[key])
                    new_bases.append(b)
                idx.append(known[key])
            call_idx[role] = np.array(idx)
            if new_bases:
                if role == "k":
                    rows = tt[:, None] * src.nb[1] + cc[None, :] * src.nb[0]
                else:
                    rows = vc[:, None] * src.nb[1] + tt[None, :] * src.nb[0]
                addr = np.array(new_bases, dtype=np.int64)[:, None, None] + rows[None]
                gathers[role].append((np.array(new_ids), _Gather(addr, f16, nat.spans[role])))
        pidx.append(call_idx)
    out = []
    for (N, E, qa, ma, lj, la, pos, _), ci in zip(pre, pidx):
        labelled = np.nonzero((lj >= 0) & (lj < Q) & (la >= 0) & (la < HQ))
        out.append(_CallPlan(N, E, _Gather(qa, f32, nat.spans["q"]), _Gather(ma, f32, nat.spans["mask"]),
                             lj, la, labelled, pos, ci["k"], ci["v"]))
    return _Plan(tuple(out), tuple(gathers["k"]), tuple(gathers["v"]), len(ids["k"]), len(ids["v"]))


def _read_panels(gathers, count, shape, buf) -> np.ndarray:
    pan = np.full((count,) + shape, np.nan, dtype=np.float16)
    for ids, g in gathers:
        pan[ids] = g(buf)
    return pan


def _evaluate(data: FixtureData, plan: _Plan, src1_f16: bool, f32_kernel: str) -> dict[str, dict[str, np.ndarray]]:
    contract = _contract_einsum if f32_kernel == "einsum" else np.matmul
    fx = data.fixture
    d, dv, n, Q, HQ = fx.d, fx.d_v, fx.n_kv, fx.q, fx.h_q
    bufs = data.buffers
    kpan = _read_panels(plan.k_panels, plan.n_k, (n, d), bufs["k"])
    vpan = _read_panels(plan.v_panels, plan.n_v, (dv, n), bufs["v"])
    reads = [(cp, cp.q(bufs["q"]), cp.mask(bufs["mask"])) for cp in plan.calls]

    # FP64: gather the read operands at their logical labels, canonical arithmetic
    q_log = np.full((d, Q, HQ), np.nan, dtype=np.float32)
    m_log = np.full((n, Q, HQ), np.nan, dtype=np.float32)
    kidx = np.full((Q, HQ), -1)
    vidx = np.full((Q, HQ), -1)
    for cp, qv, mv in reads:
        e_i, n_i = cp.labelled
        J, A = cp.lj[e_i, n_i], cp.la[e_i, n_i]
        q_log[:, J, A] = qv[e_i, :, n_i].T
        m_log[:, J, A] = mv[e_i, :, n_i].T
        kidx[J, A] = cp.k_idx[e_i]
        vidx[J, A] = cp.v_idx[e_i]
    fp64 = _canonical_fp64(q_log, kpan, kidx, m_log, vpan, vidx, data.scale)
    out = np.full(dv * HQ * Q, np.nan)
    for cp, _, _ in reads:
        e_i, n_i = cp.labelled
        pos = cp.pos[e_i, :, n_i]  # (L, d_v)
        vals = fp64["av"][:, cp.lj[e_i, n_i], cp.la[e_i, n_i]].T
        ok = (pos >= 0) & (pos < out.size)
        out[pos[ok]] = vals[ok]
    fp64["output"] = out

    # F32 emulation in the layout's batch structure
    r = {"qk": np.full((n, Q, HQ), np.nan), "softmax": np.full((n, Q, HQ), np.nan),
         "av": np.full((dv, Q, HQ), np.nan), "output": np.full(dv * HQ * Q, np.nan)}
    scale32 = np.float32(data.scale)
    k32 = kpan.astype(np.float32)
    v32 = vpan.astype(np.float32)
    for cp, qv, mv in reads:
        E, N = cp.E, cp.N
        src1 = qv.astype(np.float16).astype(np.float32) if src1_f16 else qv
        s = np.empty((E, n, N), dtype=np.float32)
        for u in np.unique(cp.k_idx):
            sel = cp.k_idx == u
            s[sel] = contract(k32[u], src1[sel])
        pr = _softmax(s * scale32 + mv, "f32", axis=1)
        src1 = pr.astype(np.float16).astype(np.float32) if src1_f16 else pr
        o = np.empty((E, dv, N), dtype=np.float32)
        for u in np.unique(cp.v_idx):
            sel = cp.v_idx == u
            o[sel] = contract(v32[u], src1[sel])
        e_i, n_i = cp.labelled
        J, A = cp.lj[e_i, n_i], cp.la[e_i, n_i]
        r["qk"][:, J, A] = s[e_i, :, n_i].T
        r["softmax"][:, J, A] = pr[e_i, :, n_i].T
        r["av"][:, J, A] = o[e_i, :, n_i].T
        inside = (cp.pos >= 0) & (cp.pos < r["output"].size)
        r["output"][cp.pos[inside]] = o[inside]
    return {"fp64": fp64, "f32": r}


def reference_attention(data: FixtureData) -> dict[str, np.ndarray]:
    """FP64 attention from the logical arrays (no descriptors, no buffers), with the
    contiguous-group head map a -> a // (h_Q/h_KV) stated directly; computed by the
    same canonical arithmetic as :func:`evaluate_layout`'s "fp64"."""
    fx = data.fixture
    Q = fx.q
    kappa = np.broadcast_to(np.arange(fx.h_q)[None, :] // fx.group, (Q, fx.h_q))
    mask = np.broadcast_to(data.mask[:, :Q, None], (fx.n_kv, Q, fx.h_q))
    return _canonical_fp64(data.q, data.k.transpose(2, 1, 0), kappa, mask,
                           data.v.transpose(2, 1, 0), kappa, data.scale)


def _maxabs(a: np.ndarray, b: np.ndarray) -> float:
    with np.errstate(invalid="ignore"):
        diff = np.abs(a - b)
    both_inf = np.isinf(a) & np.isinf(b) & (a == b)
    diff = np.where(both_inf, 0.0, diff)
    return float(np.max(diff)) if diff.size else 0.0


# --------------------------------------------------------------------------- audit


def run_layout_audit(*, quick: bool = False, fixture_list=None, patterns=PATTERNS, seed: int = 0,
                     src1_f16: bool = False, f32_kernel: str = "einsum",
                     layouts=None) -> tuple["xr.Dataset", bool]:
    """Run the address oracle (layouts and injected faults) and the FP64/F32 oracles.

    Returns ``(dataset, passed)``. ``passed`` requires every obligation to hold for every
    layout and fixture, every fault to be detected by its expected obligation on at
    least one fixture, the structured patterns to meet their exact expectations for
    every layout and precision, and every numeric result to be finite. General
    numerical differences are reported, never thresholded.
    """
    import xarray as xr

    fxs = tuple(fixture_list) if fixture_list is not None else fixtures(quick=quick)
    lays = tuple(layouts) if layouts is not None else tuple(address_model(x) for x in ATTENTION_LAYOUTS)
    pats = tuple(patterns)
    exact = tuple(p for p in pats if p in EXACT_PATTERNS)
    nF, nL, nO, nX, nP, nS, nR = len(fxs), len(lays), len(OBLIGATIONS), len(FAULTS), len(pats), len(STAGES), len(PRECISIONS)

    ob_ok = np.ones((nF, nL, nO), dtype=bool)
    first_violation = np.full((nF, nL), "", dtype=object)
    fault_detected = np.zeros((nF, nX), dtype=bool)
    fault_expected = np.zeros((nF, nX), dtype=bool)
    fault_fired = np.full((nF, nX), "", dtype=object)
    vs_ref = np.full((nF, nP, nL, nR, nS), np.nan)
    vs_mq = np.full((nF, nP, nL, nR, nS), np.nan)
    finite = np.ones((nF, nP, nL, nR), dtype=bool)
    exact_ok = np.ones((nF, len(exact), nL, nR), dtype=bool)
    mq_index = next((i for i, lay in enumerate(lays) if isinstance(lay, MQLayout)), 0)

    for fi, fx in enumerate(fxs):
        for li, lay in enumerate(lays):
            rep = check_qb_addressing(fx, lay)
            ob_ok[fi, li] = [o not in rep.violated for o in OBLIGATIONS]
            first_violation[fi, li] = str(rep.violations[0]) if rep.violations else ""
        for xi, fault in enumerate(FAULTS):
            rep = check_qb_addressing(fx, fault.layout)
            fault_detected[fi, xi] = not rep.passed
            fault_expected[fi, xi] = fault.obligation in rep.violated
            fault_fired[fi, xi] = ",".join(sorted(rep.violated))
        for pi, pat in enumerate(pats):
            data = make_data(fx, pat, seed)
            ref = reference_attention(data)
            outs = [evaluate_layout(data, lay, src1_f16=src1_f16, f32_kernel=f32_kernel) for lay in lays]
            for li in range(nL):
                for ri, prec in enumerate(PRECISIONS):
                    st = outs[li][prec]
                    finite[fi, pi, li, ri] = all(np.isfinite(st[s]).all() for s in STAGES)
                    for si, stage in enumerate(STAGES):
                        vs_ref[fi, pi, li, ri, si] = _maxabs(st[stage], ref[stage])
                        vs_mq[fi, pi, li, ri, si] = _maxabs(st[stage], outs[mq_index][prec][stage])
                    if pat in exact:
                        ok = all(np.array_equal(st[s], e) for s, e in data.expected.items())
                        exact_ok[fi, exact.index(pat), li, ri] = ok

    fcoords = {
        "fixture": [fx.name for fx in fxs],
        "q": ("fixture", [fx.q for fx in fxs]),
        "n_kv": ("fixture", [fx.n_kv for fx in fxs]),
        "h_q": ("fixture", [fx.h_q for fx in fxs]),
        "h_kv": ("fixture", [fx.h_kv for fx in fxs]),
        "d": ("fixture", [fx.d for fx in fxs]),
        "q_storage": ("fixture", [fx.q_storage for fx in fxs]),
        "mask_kind": ("fixture", [fx.mask_kind for fx in fxs]),
    }
    coords = {
        **fcoords,
        "layout": [lay.name for lay in lays],
        "obligation": list(OBLIGATIONS),
        "fault": [f.name for f in FAULTS],
        "fault_obligation": ("fault", [f.obligation for f in FAULTS]),
        "pattern": list(pats),
        "exact_pattern": list(exact),
        "precision": list(PRECISIONS),
        "stage": list(STAGES),
    }
    ds = xr.Dataset(
        {
            "obligation_ok": (("fixture", "layout", "obligation"), ob_ok),
            "first_violation": (("fixture", "layout"), first_violation.astype(str)),
            "fault_detected": (("fixture", "fault"), fault_detected),
            "fault_expected_fired": (("fixture", "fault"), fault_expected),
            "fault_obligations_fired": (("fixture", "fault"), fault_fired.astype(str)),
            "maxdiff_vs_reference": (("fixture", "pattern", "layout", "precision", "stage"), vs_ref),
            "maxdiff_vs_mq": (("fixture", "pattern", "layout", "precision", "stage"), vs_mq),
            "finite": (("fixture", "pattern", "layout", "precision"), finite),
            "exact_ok": (("fixture", "exact_pattern", "layout", "precision"), exact_ok),
        },
        coords=coords,
    )
    faults_ok = bool(fault_expected.any(axis=0).all()) if nF else False
    passed = bool(ob_ok.all() and faults_ok and exact_ok.all() and finite.all())
    ds.attrs.update({
        "title": "statelab layout audit: integer address oracle, fault injection, FP64/F32 oracles",
        "quick": int(quick),
        "seed": int(seed),
        "src1_f16": int(src1_f16),
        "f32_kernel": f32_kernel,
        "n_fixtures": nF,
        "passed": int(passed),
        "maxdiff_note": "max |x - y| over all logical coordinates; reported, never thresholded",
    })
    return ds, passed


def _fmt(x: float) -> str:
    if np.isnan(x):
        return "nan"
    return "0" if x == 0 else f"{x:.7e}"


def audit_markdown(ds: "xr.Dataset") -> str:
    """A markdown summary of :func:`run_layout_audit`'s dataset."""
    nF = ds.sizes["fixture"]
    lines = [
        "# Layout audit",
        "",
        f"Fixtures checked: **{nF}** (quick={bool(ds.attrs.get('quick'))}, seed={ds.attrs.get('seed')}); "
        f"overall: **{'PASS' if ds.attrs.get('passed') else 'FAIL'}**",
        "",
        "## Address obligations",
        "",
        "| layout | obligations passed | fixtures with all obligations |",
        "| --- | --- | --- |",
    ]
    ok = ds["obligation_ok"]
    for lay in ds["layout"].values:
        o = ok.sel(layout=lay)
        lines.append(f"| {lay} | {int(o.sum())}/{o.size} | {int(o.all('obligation').sum())}/{nF} |")
    lines += ["", "## Injected faults", "",
              "| fault | expected obligation | detected | expected obligation fired |",
              "| --- | --- | --- | --- |"]
    for f in ds["fault"].values:
        det = ds["fault_detected"].sel(fault=f)
        exp = ds["fault_expected_fired"].sel(fault=f)
        lines.append(f"| {f} | {ds['fault_obligation'].sel(fault=f).item()} | "
                     f"{int(det.sum())}/{nF} | {int(exp.sum())}/{nF} |")
    if ds.sizes.get("exact_pattern", 0):
        lines += ["", "## Exact expectations (structured cases)", "",
                  "| case | layout | precision | exact |", "| --- | --- | --- | --- |"]
        for c in ds["exact_pattern"].values:
            for lay in ds["layout"].values:
                for p in ds["precision"].values:
                    e = ds["exact_ok"].sel(exact_pattern=c, layout=lay, precision=p)
                    lines.append(f"| {c} | {lay} | {p} | {int(e.sum())}/{nF} |")
    lines += ["", f"Non-finite numeric results: {int((~ds['finite']).sum())}", ""]
    for var, title in (("maxdiff_vs_reference", "vs the FP64 logical reference"),
                       ("maxdiff_vs_mq", "vs MQ (same precision)")):
        lines += [f"## Max absolute difference {title}", "",
                  "| pattern | precision | layout | " + " | ".join(ds["stage"].values) + " |",
                  "| --- | --- | --- | " + " | ".join("---" for _ in ds["stage"].values) + " |"]
        mx = ds[var].max("fixture", skipna=False)
        for pat in ds["pattern"].values:
            for p in ds["precision"].values:
                for lay in ds["layout"].values:
                    vals = [_fmt(float(mx.sel(pattern=pat, precision=p, layout=lay, stage=s)))
                            for s in ds["stage"].values]
                    lines.append(f"| {pat} | {p} | {lay} | " + " | ".join(vals) + " |")
        lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------- ULP distance

ULP_NAN = -1  # sentinel distance where either operand is NaN (nan="sentinel")


def ulp_distance(a, b, *, nan: Literal["raise", "sentinel"] = "raise") -> np.ndarray:
    """Integer distance in units in the last place between float32 or float16 arrays.

    Each value's bits are read as a sign-magnitude integer and mapped to an ordered
    integer (negatives to minus their magnitude), so +0 and -0 are both 0, adjacent
    floats are 1 apart, a sign change counts the steps through zero, and +-inf are one
    step beyond the largest finite value. Both operands must share one dtype. NaN
    raises ``ValueError`` (``nan="raise"``) or yields :data:`ULP_NAN` (``"sentinel"``).
    Returns int64 with the broadcast shape.
    """
    a = np.asarray(a)
    b = np.asarray(b)
    if a.dtype != b.dtype or a.dtype not in (np.dtype(np.float32), np.dtype(np.float16)):
        raise TypeError(f"ulp_distance needs two float32 or two float16 arrays, got {a.dtype} and {b.dtype}")
    if nan not in ("raise", "sentinel"):
        raise ValueError(f"nan must be 'raise' or 'sentinel', got {nan!r}")
    ity, mag = (np.int32, 0x7FFFFFFF) if a.dtype == np.float32 else (np.int16, 0x7FFF)

    def ordered(x):
        bits = x.view(ity).astype(np.int64)
        return np.where(bits < 0, -(bits & mag), bits)

    isnan = np.isnan(a) | np.isnan(b)
    if isnan.any() and nan == "raise":
        raise ValueError("ulp_distance: NaN operand")
    dist = np.abs(ordered(a) - ordered(b))
    return np.where(isnan, np.int64(ULP_NAN), dist)
