"""Parse, edit and re-serialise llama.cpp sequence-state blobs as numpy arrays.

The blob is what ``llama_state_seq_get_data(ctx, buf, size, seq_id)`` writes in the
llama.cpp vendored by llama-cpp-python 0.3.36 (``src/llama-context.cpp``
``state_seq_get_data``, ``src/llama-kv-cache.cpp`` ``state_write`` and
``src/llama-kv-cache-iswa.cpp`` ``state_write``). All integers are little-endian.

Sequence header (``llama_context::state_seq_get_data``, *before* the memory parts)::

    u32  magic            0xaf143cd8 (``io_magic``)
    i32  seq_id           the sequence the blob was taken from (-1: all sequences)

Then one KV-cache part per cache of the memory: a plain ``llama_kv_cache`` writes one
part; the iSWA memory (``llama_kv_cache_iswa``: Gemma 2/3, Cohere 2, ...) writes two, the
full (base) cache first, then the sliding-window cache. Each cache holds its own layers
(ascending model layer index, layers of the other kind absent) and its own cells: the
sliding-window cache writes only the cells its window still sees (``is_masked_swa``
against the sequence's last position). One part (``llama_kv_cache::state_write``)::

    u32  n_stream         only 1 is accepted here
    per stream:
      u32  cell_count     0 => the stream is skipped: nothing else follows for it
      meta, per cell (``state_write_meta``):
        i32  pos
        u32  n_seq_id
        [ext record (x, y, tok: 3 x i32) only for M-RoPE / PLE models -> refused]
        i32  seq_id * n_seq_id
      data (``state_write_data``):
        u32  v_trans
        u32  n_layer      layers of this cache
        per layer:  i32 k_type, u64 k_row_size, cell_count rows of k_row_size bytes
        v_trans == 0, per layer:  i32 v_type, u64 v_row_size, cell_count rows
        v_trans == 1, per layer:  i32 v_type, u32 v_el_size, u32 n_embd_v_gqa,
                                  n_embd_v_gqa runs of cell_count elements (feature-major)

KV types: F32 (ggml type 0), F16 (1), BF16 (30) and Q8_0 (8). F32/F16 arrays hold the
values (``<f4`` / ``<f2``); BF16 arrays hold the raw 16-bit patterns (``<u2``, numpy has
no bfloat16; :func:`values_f64` converts); Q8_0 arrays hold the raw bytes of each row
(``uint8``, blocks of a float16 scale and 32 int8 quants), so a quantised row is
addressed whole (layer x cell x K/V). llama.cpp only writes a quantised V without
transposition (a quantised V cache needs flash attention, which stores V token-major).
Recurrent or hybrid memories (r/s states after the KV part) and anything else the codec
does not understand (other stream counts, other types, cell extension records,
truncation, trailing bytes) raise :class:`KVFormatError` naming the offset and the
field; the codec never guesses.

In memory the layers of all parts are *flattened* in blob order: ``KVState.k[i]`` is
``(n_cells_of_its_part, n_embd_k_gqa)`` (token-major, as stored) and ``KVState.v[i]`` is
``(n_embd_v_gqa, n_cells)`` when ``v_trans`` (feature-major, as stored) or ``(n_cells,
n_embd_v_gqa)`` otherwise. ``KVState.parts`` describes each cache part: its kind
(``"kv"``, ``"full"`` or ``"swa"``), its cells (positions, sequence ids), its layer count
and, when the model's layer kinds are known (:class:`MemoryLayout`, from the model's
metadata), the model layer index of each stored layer and the window. ``positions`` /
``seq_ids`` / ``v_trans`` of the state are those of its first part. The arrays are
separate writable little-endian arrays whose C order is the blob order, so editing one
element and calling :meth:`KVState.to_bytes` changes exactly that element's bytes.

An empty sequence (``cell_count == 0``) is legal: the part then ends after the cell
count, so it has no layers; it round-trips byte for byte.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from statelab.errors import StatelabError
from statelab.mapping import is_mapped, release

__all__ = [
    "GGML_BF16",
    "GGML_F16",
    "GGML_F32",
    "GGML_Q8_0",
    "KV_TYPE_NAMES",
    "SEQ_STATE_MAGIC",
    "CachePart",
    "ComponentDiff",
    "KVFormatError",
    "KVState",
    "MemoryLayout",
    "PartLayout",
    "StateDiff",
    "build_blob",
    "check_same_geometry",
    "compare",
    "is_quantised",
    "make_iswa_state",
    "make_state",
    "type_name",
    "v_layout",
    "values_f64",
]

GGML_F32 = 0
GGML_F16 = 1
GGML_Q8_0 = 8
GGML_BF16 = 30

#: ``io_magic`` written by ``llama_context::state_seq_get_data`` before the memory part.
SEQ_STATE_MAGIC = 0xAF143CD8

#: size of ``llama_kv_cell_ext`` (x, y, tok), present per cell for M-RoPE / PLE models.
_CELL_EXT_SIZE = 12

#: ggml type -> (elements per block, bytes per block, storage dtype of the parsed array)
_KV_TYPES = {
    GGML_F32: (1, 4, np.dtype("<f4")),
    GGML_F16: (1, 2, np.dtype("<f2")),
    GGML_BF16: (1, 2, np.dtype("<u2")),
    GGML_Q8_0: (32, 34, np.dtype("u1")),
}
#: the names the KV types go by on the command line (``--cache-type-k``) and in llama.cpp
KV_TYPE_NAMES = {"f32": GGML_F32, "f16": GGML_F16, "bf16": GGML_BF16, "q8_0": GGML_Q8_0}
_UINT_VIEW = {GGML_F32: np.dtype("<u4"), GGML_F16: np.dtype("<u2"), GGML_BF16: np.dtype("<u2"),
              GGML_Q8_0: np.dtype("u1")}

_GGML_TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K",
    16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S",
    22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
    29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4", 40: "NVFP4",
    41: "Q1_0", 42: "Q2_0",
}

#: part kinds: a plain cache, and the two caches of the iSWA memory in blob order
PART_KINDS = ("kv", "full", "swa")
#: llama_swa_type
SWA_NONE, SWA_STANDARD, SWA_CHUNKED, SWA_SYMMETRIC = 0, 1, 2, 3


class KVFormatError(StatelabError, ValueError):
    """A blob (or a state) the codec does not understand or two states that do not match."""


def type_name(t: int) -> str:
    return _GGML_TYPE_NAMES.get(int(t), "unknown")


def _supported() -> str:
    return ", ".join(f"{type_name(t)} ({t})" for t in _KV_TYPES)


def _check_type(t: int, what: str, offset: int | None = None) -> np.dtype:
    if t not in _KV_TYPES:
        where = f" at offset {offset}" if offset is not None else ""
        raise KVFormatError(
            f"{what}: ggml type {t} ({type_name(t)}){where} is not supported; "
            f"KV caches of these types can be parsed: {_supported()}"
        )
    return _KV_TYPES[t][2]


def v_layout(v_trans: bool) -> str:
    """How a state stores V, in words (refusals name it): llama.cpp transposes V exactly when
    flash attention is off."""
    return "transposed V (no flash attention)" if v_trans else "untransposed V (flash attention)"


def is_quantised(t: int) -> bool:
    """True for block-quantised KV types (a row is addressed whole)."""
    return _KV_TYPES[int(t)][0] > 1


def _elements(row_bytes: int, t: int) -> int:
    blk, size, _ = _KV_TYPES[int(t)]
    return row_bytes // size * blk


def values_f64(a: np.ndarray, t: int) -> np.ndarray:
    """The values a stored array holds, as float64 (BF16 widened, Q8_0 dequantised: d * q).

    Token-major arrays keep their shape for F32/F16/BF16; a Q8_0 array of shape
    ``(n, row_bytes)`` gives ``(n, n_elements)``."""
    t = int(t)
    if t in (GGML_F32, GGML_F16):
        return np.asarray(a, dtype=np.float64)
    if t == GGML_BF16:
        bits = np.ascontiguousarray(a, dtype="<u2").astype("<u4") << 16
        return bits.view("<f4").astype(np.float64)
    if t == GGML_Q8_0:
        blocks = np.ascontiguousarray(a, dtype=np.uint8).reshape(a.shape[0], -1, 34)
        d = blocks[:, :, :2].copy().view("<f2")[:, :, :1].astype(np.float64)
        q = blocks[:, :, 2:].view(np.int8).astype(np.float64)
        return (d * q).reshape(a.shape[0], -1)
    raise KVFormatError(f"no value conversion for ggml type {t} ({type_name(t)})")


# --------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class PartLayout:
    """What the model says about one cache part: its kind, the model layers it stores, its window."""

    kind: str
    layers: tuple[int, ...]
    n_swa: int = 0
    swa_type: int = SWA_NONE


@dataclass(frozen=True)
class MemoryLayout:
    """The memory a model's context writes (from the model's metadata, not from the blob).

    ``kind``: ``"kv"`` (one cache), ``"iswa"`` (full + sliding-window caches),
    ``"recurrent"`` or ``"hybrid"`` (refused by the codec). ``model`` names the model in
    refusals."""

    kind: str
    parts: tuple[PartLayout, ...]
    n_layer: int
    model: str = ""
    n_head_kv: int = 0  # KV heads per layer (0: unknown; selectors then cannot name heads)

    def as_dict(self) -> dict:
        return {"kind": self.kind, "n_layer": self.n_layer, "model": self.model, "n_head_kv": self.n_head_kv,
                "parts": [{"kind": p.kind, "layers": list(p.layers), "n_swa": p.n_swa, "swa_type": p.swa_type}
                          for p in self.parts]}

    @classmethod
    def from_dict(cls, d: dict) -> "MemoryLayout":
        try:
            parts = tuple(PartLayout(str(p["kind"]), tuple(int(x) for x in p["layers"]), int(p.get("n_swa", 0)),
                                     int(p.get("swa_type", SWA_NONE))) for p in d["parts"])
            return cls(str(d["kind"]), parts, int(d["n_layer"]), str(d.get("model", "")), int(d.get("n_head_kv", 0)))
        except (KeyError, TypeError, ValueError) as e:
            raise KVFormatError(f"malformed memory layout record ({e!r})") from None


@dataclass(eq=False)
class CachePart:
    """One KV-cache part of a state: its kind, cells and layer count (layers live in KVState.k/v).

    ``layers`` is the model layer index of each stored layer when the layout is known
    (None otherwise); ``n_swa`` / ``swa_type`` the window of a sliding-window part."""

    kind: str
    positions: np.ndarray
    seq_ids: tuple[np.ndarray, ...]
    v_trans: bool
    n_layer: int
    layers: tuple[int, ...] | None = None
    n_swa: int = 0
    swa_type: int = SWA_NONE
    n_head_kv: int = 0

    @property
    def n_cells(self) -> int:
        return int(len(self.positions))

    def copy(self) -> "CachePart":
        return CachePart(self.kind, np.array(self.positions, dtype=np.int32, copy=True),
                         tuple(np.array(s, dtype=np.int32, copy=True) for s in self.seq_ids), bool(self.v_trans),
                         int(self.n_layer), self.layers, int(self.n_swa), int(self.swa_type), int(self.n_head_kv))


# --------------------------------------------------------------------------- reader


class _Reader:
    """Cursor over a blob that names the field and offset of every failure."""

    def __init__(self, buf: memoryview, copy: bool = True):
        self.buf = buf
        self.copy = copy
        self.meta_views: list[np.ndarray] = []  # copy=False: each part's (n, 3) cell table, a view of buf
        self.n = len(buf)
        self.off = 0
        # a mapped blob: each field read maps a whole folio (2 MiB) of the file, given back at once
        self.mapped = is_mapped(buf)

    def need(self, nbytes: int, what: str) -> int:
        if nbytes > self.n - self.off:
            raise KVFormatError(
                f"truncated blob: {what} needs {nbytes} bytes at offset {self.off}, "
                f"only {self.n - self.off} remain (blob is {self.n} bytes)"
            )
        start = self.off
        self.off += nbytes
        return start

    def scalar(self, fmt: str, what: str) -> int:
        size = struct.calcsize(fmt)
        start = self.need(size, what)
        value = struct.unpack_from(fmt, self.buf, start)[0]
        if self.mapped:
            release(self.buf[start:start + size])
        return value

    def array(self, dtype: np.dtype, shape: tuple[int, ...], what: str) -> np.ndarray:
        count = int(np.prod(shape, dtype=np.int64))
        start = self.need(count * dtype.itemsize, what)
        a = np.frombuffer(self.buf, dtype=dtype, count=count, offset=start).reshape(shape)
        return a.copy() if self.copy else a


def _parse_meta(r: _Reader, n_cells: int, ext_size: int, header_seq: int):
    """Cell meta (positions, seq ids). Returns (positions, seq_ids, ext or None)."""
    if ext_size == 0:
        # fast path: every cell lists exactly one sequence id -> an (n, 3) int32 table
        need = n_cells * 12
        if need <= r.n - r.off:
            table = np.frombuffer(r.buf, dtype="<i4", count=n_cells * 3, offset=r.off).reshape(n_cells, 3)
            if np.all(table[:, 1] == 1):
                if not r.copy:
                    r.meta_views.append(table)
                r.off += need
                pos = table[:, 0].astype(np.int32)
                ids = table[:, 2].astype(np.int32)
                return pos, tuple(ids.reshape(n_cells, 1)), None
    # general path (cells with several sequence ids, only in seq_id == -1 blobs, or a
    # layout check with extension records): the offsets are sequential, so walk them.
    pos = np.empty(n_cells, dtype=np.int32)
    ext = np.empty((n_cells, 3), dtype=np.int32) if ext_size else None
    seq_ids = []
    for i in range(n_cells):
        pos[i] = r.scalar("<i", f"position of cell {i}")
        n_seq = r.scalar("<I", f"n_seq_id of cell {i}")
        if n_seq == 0:
            raise KVFormatError(
                f"cell {i} lists 0 sequence ids (n_seq_id at offset {r.off - 4}); llama.cpp never writes empty "
                "KV cells (a recurrent memory does: not supported)"
            )
        if header_seq >= 0 and n_seq != 1:
            raise KVFormatError(
                f"cell {i}: n_seq_id {n_seq} at offset {r.off - 4}, but a blob for sequence {header_seq} "
                "lists exactly one id per cell"
            )
        if ext is not None:
            ext[i] = r.array(np.dtype("<i4"), (3,), f"extension record of cell {i}")
        seq_ids.append(r.array(np.dtype("<i4"), (n_seq,), f"seq ids of cell {i}").astype(np.int32))
    return pos, tuple(seq_ids), ext


def _read_rows(r: _Reader, what: str, t: int, n_cells: int) -> np.ndarray:
    """A u64 row size followed by ``n_cells`` token-major rows (K, or V when not transposed)."""
    blk, bsize, dt = _KV_TYPES[t]
    off = r.off
    row = r.scalar("<Q", f"{what} row size")
    if row == 0 or row % bsize:
        unit = f"{bsize}-byte block of {blk} values" if blk > 1 else f"element size {bsize}"
        raise KVFormatError(
            f"{what} row size {row} at offset {off} is not a positive multiple of the {type_name(t)} {unit}"
        )
    return r.array(dt, (n_cells, row // dt.itemsize), f"{what} rows ({n_cells} x {row} bytes)")


def _parse_part(r: _Reader, ext_size: int, header_seq: int, tag: str):
    """One ``llama_kv_cache::state_write`` part at the reader's offset.

    Returns (positions, seq_ids, v_trans, k, v, k_types, v_types)."""
    off_ns = r.off
    n_stream = r.scalar("<I", f"{tag}n_stream")
    if n_stream != 1:
        raise KVFormatError(
            f"{tag}n_stream = {n_stream} at offset {off_ns}: only single-stream KV caches (unified KV) are supported"
        )
    off_nc = r.off
    n_cells = r.scalar("<I", f"{tag}cell_count")
    if n_cells == 0:
        return np.zeros(0, np.int32), (), False, [], [], [], []
    # the smallest possible cell record is 12 bytes: refuse impossible counts before allocating
    if n_cells * 12 > r.n - r.off:
        raise KVFormatError(
            f"truncated blob: {tag}cell_count {n_cells} at offset {off_nc} needs at least {n_cells * 12} bytes of "
            f"cell meta, only {r.n - r.off} remain"
        )
    positions, seq_ids, _ext = _parse_meta(r, n_cells, ext_size, header_seq)
    ids = np.concatenate(seq_ids)
    cell_of_id = np.repeat(np.arange(n_cells), [len(s) for s in seq_ids])
    bad = np.flatnonzero(ids != header_seq) if header_seq >= 0 else np.flatnonzero(ids < 0)
    if bad.size:
        expect = f"the blob header is for sequence {header_seq}" if header_seq >= 0 else "ids must be >= 0"
        raise KVFormatError(
            f"{tag}cell {int(cell_of_id[bad[0]])} lists sequence id {int(ids[bad[0]])}, but {expect} "
            "(unexpected cell layout)"
        )
    off_vt = r.off
    v_trans = r.scalar("<I", f"{tag}v_trans")
    if v_trans not in (0, 1):
        raise KVFormatError(f"{tag}v_trans = {v_trans} at offset {off_vt} (expected 0 or 1): unexpected layout")
    off_nl = r.off
    n_layer = r.scalar("<I", f"{tag}n_layer")
    if n_layer == 0:
        raise KVFormatError(f"{tag}n_layer = 0 at offset {off_nl} with {n_cells} cells: unexpected layout")
    if n_layer * 12 > r.n - r.off:
        raise KVFormatError(
            f"truncated blob: {tag}n_layer {n_layer} at offset {off_nl} needs at least {n_layer * 12} more bytes, "
            f"only {r.n - r.off} remain"
        )
    k, k_types, v, v_types = [], [], [], []
    for il in range(n_layer):
        off = r.off
        t = r.scalar("<i", f"{tag}L{il}.K type")
        _check_type(t, f"{tag}L{il}.K", off)
        k.append(_read_rows(r, f"{tag}L{il}.K", t, n_cells))
        k_types.append(t)
    for il in range(n_layer):
        off = r.off
        t = r.scalar("<i", f"{tag}L{il}.V type")
        dt = _check_type(t, f"{tag}L{il}.V", off)
        if v_trans:
            if is_quantised(t):
                raise KVFormatError(
                    f"{tag}L{il}.V: a transposed V of quantised type {type_name(t)} at offset {off}: llama.cpp "
                    "never writes one (quantised V needs flash attention, which stores V untransposed)"
                )
            off = r.off
            el = r.scalar("<I", f"{tag}L{il}.V element size")
            if el != dt.itemsize:
                raise KVFormatError(
                    f"{tag}L{il}.V element size {el} at offset {off} does not match type {type_name(t)} "
                    f"({dt.itemsize} bytes)"
                )
            off = r.off
            width = r.scalar("<I", f"{tag}L{il}.V n_embd_v_gqa")
            if width == 0:
                raise KVFormatError(f"{tag}L{il}.V n_embd_v_gqa = 0 at offset {off}: unexpected layout")
            v.append(r.array(dt, (width, n_cells), f"{tag}L{il}.V values ({width} features x {n_cells} cells)"))
        else:
            v.append(_read_rows(r, f"{tag}L{il}.V", t, n_cells))
        v_types.append(t)
    return positions, seq_ids, bool(v_trans), k, v, k_types, v_types


def _refuse_memory(layout: "MemoryLayout | None") -> None:
    if layout is not None and layout.kind not in ("kv", "iswa"):
        what = {"recurrent": "a recurrent memory (r/s states)",
                "hybrid": "a hybrid memory (attention KV + recurrent r/s states)"}.get(layout.kind, layout.kind)
        raise KVFormatError(
            f"model {layout.model or '?'} keeps {what}; its sequence states are not supported "
            "(only KV caches and iSWA memories)"
        )


def _parse(buf: memoryview, ext_size: int, layout: "MemoryLayout | None", copy: bool = True) -> "KVState":
    _refuse_memory(layout)
    r = _Reader(buf, copy)
    magic = r.scalar("<I", "sequence-state magic")
    if magic != SEQ_STATE_MAGIC:
        raise KVFormatError(
            f"not a llama.cpp sequence-state blob: magic 0x{magic:08x} at offset 0, expected "
            f"0x{SEQ_STATE_MAGIC:08x} (the blob of llama_state_seq_get_data starts with it)"
        )
    header_seq = r.scalar("<i", "header seq_id")
    if header_seq < -1:
        raise KVFormatError(f"header seq_id {header_seq} at offset 4 is invalid (must be >= -1)")
    want = len(layout.parts) if layout is not None else None
    raw = []
    while True:
        pi = len(raw)
        tag = "" if pi == 0 else "swa part: "
        start = r.off
        if pi >= 1 and want is None:
            # without a layout a second part is read as the sliding-window cache of an
            # iSWA memory; anything else after the first part is refused as trailing bytes
            try:
                raw.append(_parse_part(r, ext_size, header_seq, tag))
            except KVFormatError as e:
                raise KVFormatError(
                    f"trailing bytes: {r.n - start} bytes after the end of the KV stream at offset {start} are not a "
                    f"second (sliding-window) KV cache ({e}); recurrent / hybrid memories are not supported"
                ) from None
        else:
            raw.append(_parse_part(r, ext_size, header_seq, tag))
        if r.off == r.n:
            if want is not None and len(raw) != want:
                raise KVFormatError(
                    f"the blob holds {len(raw)} KV cache part(s), but model {layout.model or '?'} "
                    f"({layout.kind} memory) writes {want}"
                )
            break
        if (want is not None and len(raw) >= want) or len(raw) >= 2:
            raise KVFormatError(
                f"trailing bytes: {r.n - r.off} bytes after the end of the KV stream at offset {r.off} "
                "(more memory parts than a KV or iSWA memory writes; recurrent / hybrid memories are not supported)"
            )
    kinds = ("kv",) if len(raw) == 1 else ("full", "swa")
    parts, k, v, kt, vt = [], [], [], [], []
    for pi, (pos, ids, vtr, pk, pv, pkt, pvt) in enumerate(raw):
        pl = layout.parts[pi] if layout is not None else None
        if pl is not None and pk and len(pk) != len(pl.layers):
            raise KVFormatError(
                f"the {pl.kind} cache part stores {len(pk)} layers, but model {layout.model or '?'} has "
                f"{len(pl.layers)} {pl.kind} layers: the blob belongs to another model"
            )
        parts.append(CachePart(
            kind=kinds[pi] if pl is None else pl.kind, positions=pos, seq_ids=ids, v_trans=vtr, n_layer=len(pk),
            layers=(pl.layers if pk else ()) if pl is not None else None,
            n_swa=pl.n_swa if pl is not None else 0, swa_type=pl.swa_type if pl is not None else SWA_NONE,
            n_head_kv=layout.n_head_kv if layout is not None else 0))
        k += pk
        v += pv
        kt += pkt
        vt += pvt
    filled = [p for p in parts if p.n_layer]
    if len({p.v_trans for p in filled}) > 1:
        raise KVFormatError("the cache parts of the blob disagree on v_trans: unexpected layout")
    first = parts[0]
    out = KVState(
        positions=first.positions, seq_ids=first.seq_ids, v_trans=filled[0].v_trans if filled else False,
        k=k, v=v, k_types=kt, v_types=vt, seq_id=header_seq, parts=parts,
    )
    if not copy:
        out.__dict__["meta_views"] = r.meta_views  # for in-place rewrites of the cells' sequence ids
    return out


# --------------------------------------------------------------------------- state


@dataclass(eq=False)
class KVState:
    """One parsed sequence state. See the module docstring for the array layouts.

    Everything needed to re-serialise is either stored here (``seq_id`` of the header,
    the ggml types, the parts' cells) or derived from the arrays (row sizes, V element
    size, ``n_embd_v_gqa``), which :meth:`to_bytes` checks for consistency. ``parts`` is
    empty for a state built by hand from one cache (``positions`` etc. describe it);
    a parsed state always lists its parts, the first sharing ``positions``,
    ``seq_ids`` and ``v_trans`` with the state.
    """

    positions: np.ndarray
    seq_ids: tuple[np.ndarray, ...]
    v_trans: bool
    k: list[np.ndarray]
    v: list[np.ndarray]
    k_types: list[int]
    v_types: list[int]
    seq_id: int = 0
    n_stream: int = field(default=1)
    parts: list[CachePart] = field(default_factory=list)

    # ---------------------------------------------------------------- construction
    @classmethod
    def parse(cls, blob: bytes | bytearray | memoryview, layout: MemoryLayout | None = None,
              copy: bool = True) -> "KVState":
        """Parse a ``llama_state_seq_get_data`` blob; raise :class:`KVFormatError` on anything unexpected.

        ``layout`` (the model's :class:`MemoryLayout`) names the model layer of every stored
        layer and the window of a sliding-window part, checks the part and layer counts,
        and refuses recurrent / hybrid memories by name; without it, a second part is read
        as an iSWA sliding-window cache whose layers are known only by their index.
        ``copy=False``: the value arrays are views of ``blob`` (no copy; writable when it is)."""
        buf = memoryview(blob).cast("B")
        try:
            return _parse(buf, 0, layout, copy)
        except KVFormatError as err:
            # A blob written by a model whose cells carry extension records (M-RoPE / PLE)
            # has 12 more bytes per cell: recognise it only to refuse it with a clear message.
            try:
                _parse(buf, _CELL_EXT_SIZE, layout, copy=False)
            except KVFormatError:
                raise err from None
            raise KVFormatError(
                "the cells of this blob carry extension records (x, y, tok: an M-RoPE or PLE model); "
                "such states are not supported"
            ) from None

    @classmethod
    def view(cls, blob: bytes | bytearray | memoryview, layout: MemoryLayout | None = None) -> "KVState":
        """:meth:`parse` without a copy: the value arrays are read-only views of ``blob``, so a
        state of any size costs no memory beyond its blob (an edit goes through a copy,
        :func:`statelab.selection.apply_subset` copies only the layers it changes)."""
        st = cls.parse(blob, layout, copy=False).freeze()
        release(blob)  # a mapped blob: the pages the fields' reads mapped (the kernel maps whole folios)
        return st

    def freeze(self) -> "KVState":
        """Make every value array read-only (in place); returns the state."""
        for a in self.k + self.v:
            a.flags.writeable = False
        return self

    def with_layout(self, layout: MemoryLayout) -> "KVState":
        """The same state with the model's layer map and windows attached (checked)."""
        return KVState.parse(self.to_bytes(), layout)

    # ---------------------------------------------------------------- parts and layers
    @property
    def part_list(self) -> list[CachePart]:
        """The cache parts (one implicit ``"kv"`` part for a state built without ``parts``)."""
        if self.parts:
            return self.parts
        return [CachePart("kv", self.positions, self.seq_ids, bool(self.v_trans), len(self.k))]

    @property
    def layer_part(self) -> np.ndarray:
        """Index of the part each (flattened) layer belongs to."""
        ps = self.part_list
        return np.repeat(np.arange(len(ps)), [p.n_layer for p in ps]).astype(np.int64)

    @property
    def layer_ids(self) -> tuple[int, ...] | None:
        """The model layer index of each stored layer (None: a multi-part state parsed without layout)."""
        ps = self.part_list
        if len(ps) == 1 and ps[0].layers is None:
            return tuple(range(len(self.k)))
        if any(p.layers is None for p in ps if p.n_layer):
            return None
        return tuple(int(i) for p in ps for i in (p.layers or ()))

    @property
    def layer_kinds(self) -> list[str]:
        ps = self.part_list
        return [ps[i].kind for i in self.layer_part]

    def layer_positions(self, i: int) -> np.ndarray:
        """Stored positions of the cells of layer ``i`` (its part's cells)."""
        return self.part_list[int(self.layer_part[i])].positions

    def component_name(self, i: int, comp: str) -> str:
        """``"L5.K"`` (model layer 5); for a multi-part state without layout ``"swa.L0.K"``."""
        ids = self.layer_ids
        if ids is not None:
            return f"L{ids[i]}.{comp}"
        pi = int(self.layer_part[i])
        j = i - int(sum(p.n_layer for p in self.part_list[:pi]))
        return f"{self.part_list[pi].kind}.L{j}.{comp}"

    # ---------------------------------------------------------------- geometry
    @property
    def n_cells(self) -> int:
        return int(len(self.positions))

    @property
    def n_layer(self) -> int:
        return len(self.k)

    @staticmethod
    def _row_bytes(a: np.ndarray) -> int:
        return int(a.shape[1] * a.dtype.itemsize)

    @property
    def n_embd_k_gqa(self) -> list[int]:
        return [_elements(self._row_bytes(a), t) for a, t in zip(self.k, self.k_types)]

    @property
    def n_embd_v_gqa(self) -> list[int]:
        return [int(a.shape[0]) if self.v_trans else _elements(self._row_bytes(a), t)
                for a, t in zip(self.v, self.v_types)]

    @property
    def k_row_sizes(self) -> list[int]:
        return [self._row_bytes(a) for a in self.k]

    @property
    def v_row_sizes(self) -> list[int]:
        """Bytes of one cell's V values per layer (the stored row size when not transposed)."""
        return [int(a.shape[0]) * a.dtype.itemsize if self.v_trans else self._row_bytes(a) for a in self.v]

    @property
    def v_element_sizes(self) -> list[int]:
        return [_KV_TYPES[int(t)][1] for t in self.v_types]

    @property
    def value_nbytes(self) -> int:
        """Total bytes of K and V values (the payload a selector can choose from)."""
        return int(sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v))

    def geometry(self) -> dict:
        """Everything two states must share to be compared or crossed."""
        return {
            "n_cells": self.n_cells,
            "n_layer": self.n_layer,
            "v_trans": bool(self.v_trans),
            "k_types": [int(t) for t in self.k_types],
            "v_types": [int(t) for t in self.v_types],
            "n_embd_k_gqa": self.n_embd_k_gqa,
            "n_embd_v_gqa": self.n_embd_v_gqa,
            "parts": [f"{p.kind}: {p.n_cells} cells x {p.n_layer} layers" for p in self.part_list],
        }

    def validate(self) -> None:
        """Check that arrays, types and cell meta are consistent; raise :class:`KVFormatError` if not."""
        if self.n_stream != 1:
            raise KVFormatError(f"n_stream = {self.n_stream}: only single-stream states are supported")
        ps = self.part_list
        if self.parts and not (np.array_equal(ps[0].positions, self.positions) and len(ps[0].seq_ids) ==
                               len(self.seq_ids)):
            raise KVFormatError("the state's positions / seq ids differ from those of its first part")
        if len(ps) > 2 or (len(ps) == 2 and [p.kind for p in ps] != ["full", "swa"]) or \
                (len(ps) == 1 and ps[0].kind != "kv"):
            raise KVFormatError(f"parts {[p.kind for p in ps]}: a state has one 'kv' part or 'full' + 'swa'")
        for name, arrs, types in (("K", self.k, self.k_types), ("V", self.v, self.v_types)):
            if len(arrs) != len(types):
                raise KVFormatError(f"{len(arrs)} {name} arrays but {len(types)} {name} types")
        if len(self.v) != len(self.k):
            raise KVFormatError(f"{len(self.k)} K layers but {len(self.v)} V layers")
        if sum(p.n_layer for p in ps) != len(self.k):
            raise KVFormatError(f"the parts hold {sum(p.n_layer for p in ps)} layers, the state {len(self.k)}")
        for p in ps:
            if p.positions.ndim != 1:
                raise KVFormatError(f"positions must be 1-D, got shape {p.positions.shape}")
            if len(p.seq_ids) != p.n_cells:
                raise KVFormatError(f"{len(p.seq_ids)} seq-id entries for {p.n_cells} cells")
            if p.n_cells and not p.n_layer:
                raise KVFormatError(f"a {p.kind} part with {p.n_cells} cells needs at least one layer")
            if not p.n_cells and p.n_layer:
                raise KVFormatError(f"an empty {p.kind} part carries no layers, this one has {p.n_layer}")
            if p.layers is not None and len(p.layers) != p.n_layer:
                raise KVFormatError(f"the {p.kind} part names {len(p.layers)} model layers for {p.n_layer} layers")
        lp = self.layer_part
        for il, (a, t) in enumerate(zip(self.k, self.k_types)):
            n = ps[int(lp[il])].n_cells
            dt = _check_type(int(t), f"L{il}.K")
            if a.dtype.newbyteorder("<") != dt or a.ndim != 2 or a.shape[0] != n or a.shape[1] == 0 or \
                    self._row_bytes(a) % _KV_TYPES[int(t)][1]:
                raise KVFormatError(
                    f"L{il}.K: array {a.dtype} {a.shape} does not match type {type_name(t)} and "
                    f"({n}, n_embd_k_gqa > 0)"
                )
        for il, (a, t) in enumerate(zip(self.v, self.v_types)):
            n = ps[int(lp[il])].n_cells
            dt = _check_type(int(t), f"L{il}.V")
            cells_axis = 1 if self.v_trans else 0
            if a.dtype.newbyteorder("<") != dt or a.ndim != 2 or a.shape[cells_axis] != n or \
                    a.shape[1 - cells_axis] == 0 or (self.v_trans and is_quantised(t)) or \
                    (not self.v_trans and self._row_bytes(a) % _KV_TYPES[int(t)][1]):
                expect = "(n_embd_v_gqa, n_cells)" if self.v_trans else "(n_cells, n_embd_v_gqa)"
                raise KVFormatError(
                    f"L{il}.V: array {a.dtype} {a.shape} does not match type {type_name(t)} and {expect} with {n} cells"
                )

    def check_positions(self) -> None:
        """The cells' positions as llama.cpp writes one sequence's state; raise
        :class:`KVFormatError` in one line naming the part, the cell and the position.

        A plain or full cache holds the sequence's cells in order: positions ``0..n-1``. The
        sliding-window cache holds the positions its window still sees (``n - 1 - p < n_swa``
        for a standard window; without a known window: the last ``n_cells`` positions), each
        once, in order: what the pinned build writes for Gemma 3 270M (window 512) after a
        680-token prompt, formed with ubatch 64 or 512, with or without flash attention, is
        positions 168..679 ascending (its sliding-window cache mirrors the full cache's cell
        layout, so the cells are never rotated)."""
        ps = self.part_list
        n = None
        for p in ps:
            pos = np.asarray(p.positions, dtype=np.int64)
            name = "KV cache" if p.kind == "kv" else f"{p.kind} cache"
            if p.kind != "swa":
                bad = np.flatnonzero(pos != np.arange(len(pos)))
                if bad.size:
                    i = int(bad[0])
                    raise KVFormatError(f"{name}: cell {i} holds position {int(pos[i])}, expected {i} (the cells of "
                                        f"a sequence hold positions 0..{len(pos) - 1} in order)")
                n = len(pos) if n is None else n
                continue
            if not len(pos):
                continue
            end = int(pos.max()) + 1 if n is None else n
            lo = max(0, end - p.n_swa) if p.n_swa and p.swa_type == SWA_STANDARD else end - len(pos)
            want = np.arange(lo, end)
            _, first_at = np.unique(pos, return_index=True)
            dup = np.setdiff1d(np.arange(len(pos)), first_at)
            outside = np.flatnonzero((pos < lo) | (pos >= end))
            if dup.size or outside.size:
                i = int(min(dup.min() if dup.size else len(pos), outside.min() if outside.size else len(pos)))
                if outside.size and i == int(outside.min()):
                    why = f" outside the window's positions {lo}..{end - 1}"
                else:
                    why = f" a second time (first at cell {int(np.flatnonzero(pos == pos[i])[0])})"
            elif len(pos) != len(want):
                i = len(pos) - 1
                why = f", but the part holds {len(pos)} cells where the window sees {len(want)} ({lo}..{end - 1})"
            else:
                bad = np.flatnonzero(pos != want)
                if not bad.size:
                    continue
                i = int(bad[0])
                why = f", expected {int(want[i])} (the window's positions {lo}..{end - 1}, each once, in order)"
            raise KVFormatError(f"{name}: cell {i} holds position {int(pos[i])}{why}")

    # ---------------------------------------------------------------- serialisation
    @staticmethod
    def _meta_bytes(positions, seq_ids) -> bytes:
        n = len(positions)
        counts = np.fromiter((len(s) for s in seq_ids), dtype=np.int64, count=n)
        pos = np.asarray(positions, dtype="<i4")
        if n and np.all(counts == 1):
            table = np.empty((n, 3), dtype="<i4")
            table[:, 0] = pos
            table[:, 1] = 1
            table[:, 2] = np.concatenate(seq_ids)
            return table.tobytes()
        # general: per cell [pos, n_seq_id, ids...] laid out with vectorised scatter
        rec = 2 + counts
        starts = np.concatenate(([0], np.cumsum(rec)[:-1])) if n else np.zeros(0, np.int64)
        out = np.empty(int(rec.sum()), dtype="<i4")
        out[starts] = pos
        out[starts + 1] = counts
        if counts.sum():
            ids = np.concatenate(seq_ids).astype("<i4")
            cell_of_id = np.repeat(np.arange(n), counts)
            rank = np.arange(len(ids)) - np.repeat(np.cumsum(counts) - counts, counts)
            out[starts[cell_of_id] + 2 + rank] = ids
        return out.tobytes()

    def _parts(self) -> list[tuple[str, bytes | np.ndarray]]:
        """The blob as a sequence of named parts: 'meta' byte strings and 'Lx.K'/'Lx.V' value arrays."""
        self.validate()
        out: list[tuple[str, bytes | np.ndarray]] = [("meta", struct.pack("<Ii", SEQ_STATE_MAGIC, int(self.seq_id)))]
        ps = self.part_list
        first = 0
        k_rows, v_rows, v_els, v_widths = self.k_row_sizes, self.v_row_sizes, self.v_element_sizes, self.n_embd_v_gqa
        for pi, p in enumerate(ps):
            positions, seq_ids = (self.positions, self.seq_ids) if pi == 0 else (p.positions, p.seq_ids)
            head = struct.pack("<II", 1, len(positions))
            if not len(positions):
                out.append(("meta", head))
                continue
            out.append(("meta", head + self._meta_bytes(positions, seq_ids)
                        + struct.pack("<II", int(bool(self.v_trans)), p.n_layer)))
            layers = range(first, first + p.n_layer)
            for il in layers:
                out.append(("meta", struct.pack("<iQ", int(self.k_types[il]), k_rows[il])))
                out.append((self.component_name(il, "K"), self.k[il]))
            for il in layers:
                if self.v_trans:
                    out.append(("meta", struct.pack("<iII", int(self.v_types[il]), v_els[il], v_widths[il])))
                else:
                    out.append(("meta", struct.pack("<iQ", int(self.v_types[il]), v_rows[il])))
                out.append((self.component_name(il, "V"), self.v[il]))
            first += p.n_layer
        return out

    @staticmethod
    def _array_bytes(a: np.ndarray) -> memoryview:
        """The stored bytes of ``a`` in blob order: a view of the array itself when it is
        C-contiguous little-endian (the parsed and synthetic arrays always are), no copy."""
        le = a.dtype.newbyteorder("<")
        if a.dtype != le or not a.flags.c_contiguous:
            a = np.ascontiguousarray(a, dtype=le)  # only an array built by hand in another order
        return memoryview(a.reshape(-1).view(np.uint8))

    def pieces(self) -> Iterator[tuple[str, bytes | memoryview]]:
        """The blob as consecutive byte pieces ``(name, bytes)``: ``"meta"`` fields and the value
        block of each component (``"L0.K"``, ...) as a view of its array (no copy). Every
        serialiser (:meth:`to_bytes`, :meth:`write_to`, the hashes) streams these."""
        for name, p in self._parts():
            yield name, p if isinstance(p, bytes) else self._array_bytes(p)

    def to_bytes(self) -> bytes:
        """Serialise exactly as llama.cpp would: ``to_bytes(parse(blob)) == blob``. The only
        allocation of the state's size is the result."""
        return b"".join([p for _, p in self.pieces()])

    def to_buffer(self) -> bytearray:
        """:meth:`to_bytes` as a bytearray filled piece by piece: the pieces of a state mapped
        from a file (:mod:`statelab.mapping`) are given back as they are copied, so the result
        is the only copy of the state held (``runtime.Context.state_set`` takes it as it is)."""
        out = bytearray(self.nbytes)
        mv, off = memoryview(out), 0
        for _, p in self.pieces():
            mv[off:off + len(p)] = p
            off += len(p)
            release(p)
        return out

    def write_to(self, f) -> int:
        """Write the blob to the binary file ``f`` piece by piece (no copy of the state in
        memory; mapped pieces are given back once written); returns the bytes written."""
        n = 0
        for _, p in self.pieces():
            f.write(p)
            n += len(p)
            release(p)
        return n

    @property
    def nbytes(self) -> int:
        """Length of :meth:`to_bytes`."""
        return sum(len(p) for _, p in self.pieces())

    def component_offsets(self) -> dict[str, tuple[int, int]]:
        """``{"L0.K": (offset, nbytes), ...}``: where each value block lies in :meth:`to_bytes`."""
        out, off = {}, 0
        for name, p in self._parts():
            size = len(p) if isinstance(p, bytes) else p.nbytes
            if name != "meta":
                out[name] = (off, size)
            off += size
        return out

    def sha256(self) -> str:
        """sha256 of :meth:`to_bytes`, streamed over the pieces (no copy of the state)."""
        h = hashlib.sha256()
        for _, p in self.pieces():
            h.update(p)
            release(p)
        return h.hexdigest()

    def component_hashes(self) -> dict[str, str]:
        """SHA-256 of each value block in blob order (``"L0.K"``, ..., ``"L0.V"``, ...) and of
        ``"meta"``: all the other bytes of the blob (header, cell meta, per-layer type/size fields)
        concatenated in blob order."""
        meta = hashlib.sha256()
        out: dict[str, str] = {}
        for name, p in self.pieces():
            if name == "meta":
                meta.update(p)
            else:
                out[name] = hashlib.sha256(p).hexdigest()
                release(p)
        out["meta"] = meta.hexdigest()
        return out

    def copy(self, values: bool = True) -> "KVState":
        """A deep, writable copy; ``values=False``: the cells are copied, the value arrays are
        read-only views of this state's (nothing of the state's size is allocated)."""
        parts = [p.copy() for p in self.parts]
        if parts:
            positions, seq_ids = parts[0].positions, parts[0].seq_ids
        else:
            positions = np.array(self.positions, dtype=np.int32, copy=True)
            seq_ids = tuple(np.array(s, dtype=np.int32, copy=True) for s in self.seq_ids)
        return KVState(
            positions=positions,
            seq_ids=seq_ids,
            v_trans=bool(self.v_trans),
            k=[np.array(a, copy=True) if values else _readonly(a) for a in self.k],
            v=[np.array(a, copy=True) if values else _readonly(a) for a in self.v],
            k_types=[int(t) for t in self.k_types],
            v_types=[int(t) for t in self.v_types],
            seq_id=int(self.seq_id),
            n_stream=int(self.n_stream),
            parts=parts,
        )


def _readonly(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v


# --------------------------------------------------------------------------- builders


def _per_layer(value, n_layer: int, what: str) -> list[int]:
    if isinstance(value, (int, np.integer)):
        return [int(value)] * n_layer
    vals = [int(x) for x in value]
    if len(vals) != n_layer:
        raise ValueError(f"{what}: {len(vals)} entries for {n_layer} layers")
    return vals


def make_state(
    n_cells: int,
    n_layer: int,
    n_embd_k: int | list[int] = 8,
    n_embd_v: int | list[int] | None = None,
    *,
    k_type: int | list[int] = GGML_F16,
    v_type: int | list[int] | None = None,
    v_trans: bool = True,
    positions=None,
    seq_id: int = 0,
    seed: int = 0,
    fill: str = "random",
) -> KVState:
    """Build a synthetic :class:`KVState` (for tests, examples and format experiments).

    ``positions`` defaults to ``0..n_cells-1``. ``fill`` is ``"random"`` (standard normal
    values from ``seed``), ``"zeros"`` or ``"index"`` (each value = its element index in
    blob order within its component, modulo 2048, exact in F16). An empty state
    (``n_cells == 0``) has no layers, exactly as parsing its blob gives.
    """
    if n_cells < 0 or n_layer < 1:
        raise ValueError("n_cells must be >= 0 and n_layer >= 1")
    n_embd_v = n_embd_k if n_embd_v is None else n_embd_v
    v_type = k_type if v_type is None else v_type
    kw = _per_layer(n_embd_k, n_layer, "n_embd_k")
    vw = _per_layer(n_embd_v, n_layer, "n_embd_v")
    kt = _per_layer(k_type, n_layer, "k_type")
    vt = _per_layer(v_type, n_layer, "v_type")
    pos = np.arange(n_cells, dtype=np.int32) if positions is None else np.asarray(positions, dtype=np.int32)
    if pos.shape != (n_cells,):
        raise ValueError(f"positions has shape {pos.shape}, expected ({n_cells},)")
    seq = tuple(np.full((n_cells, 1), seq_id if seq_id >= 0 else 0, dtype=np.int32))
    if n_cells == 0:
        return KVState(positions=pos, seq_ids=(), v_trans=False, k=[], v=[], k_types=[], v_types=[], seq_id=seq_id)
    rng = np.random.default_rng(seed)

    def values(shape, t):
        _check_type(t, "make_state")
        if fill not in ("random", "zeros", "index"):
            raise ValueError(f"unknown fill {fill!r}")
        return _synthetic_values(shape, t, fill, rng)

    k = [values((n_cells, w), t) for w, t in zip(kw, kt)]
    v = [values((w, n_cells) if v_trans else (n_cells, w), t) for w, t in zip(vw, vt)]
    return KVState(positions=pos, seq_ids=seq, v_trans=bool(v_trans), k=k, v=v, k_types=kt, v_types=vt, seq_id=seq_id)


def _synthetic_values(shape, t: int, fill: str, rng) -> np.ndarray:
    """Stored arrays of ``shape`` (rows x elements) for type ``t``: F32/F16 values, BF16 bit
    patterns, Q8_0 rows of blocks (a float16 scale, 32 int8 quants)."""
    n, w = shape
    if fill == "random":
        x = rng.standard_normal(shape)
    elif fill == "zeros":
        x = np.zeros(shape)
    else:
        x = (np.arange(n * w) % 2048).reshape(shape).astype(np.float64)
    if t in (GGML_F32, GGML_F16):
        return x.astype(_KV_TYPES[t][2])
    if t == GGML_BF16:
        return (x.astype("<f4").view("<u4") >> 16).astype("<u2")
    if w % 32:
        raise ValueError(f"a Q8_0 row needs a multiple of 32 values, got {w}")
    blocks = x.reshape(n, w // 32, 32)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    d = np.where(amax > 0, amax / 127.0, 1.0)
    out = np.empty((n, w // 32, 34), dtype=np.uint8)
    out[:, :, :2] = d.astype("<f2").view(np.uint8).reshape(n, w // 32, 2)
    out[:, :, 2:] = np.rint(blocks / d).astype(np.int8).view(np.uint8)
    return out.reshape(n, w // 32 * 34)


def make_iswa_state(
    n_cells: int,
    n_layer: int,
    swa_layers,
    n_swa: int,
    n_embd: int = 8,
    *,
    kv_type: int = GGML_F16,
    v_trans: bool = True,
    seed: int = 0,
    model: str = "synthetic",
) -> KVState:
    """A synthetic iSWA state: the full cache holds every cell (positions ``0..n_cells-1``),
    the sliding-window cache the cells its window still sees (``n_cells - 1 - p < n_swa``);
    layer kinds and windows attached as a model's :class:`MemoryLayout` would."""
    swa = tuple(sorted(int(i) for i in swa_layers))
    full = tuple(i for i in range(n_layer) if i not in swa)
    layout = MemoryLayout("iswa", (PartLayout("full", full), PartLayout("swa", swa, n_swa, SWA_STANDARD)),
                          n_layer, model)
    a = make_state(n_cells, max(len(full), 1), n_embd, k_type=kv_type, v_trans=v_trans, seed=seed)
    keep = np.arange(n_cells)[n_cells - 1 - np.arange(n_cells) < n_swa]
    b = make_state(len(keep), max(len(swa), 1), n_embd, k_type=kv_type, v_trans=v_trans, positions=keep,
                   seed=seed + 1)
    head = struct.pack("<Ii", SEQ_STATE_MAGIC, 0)
    blob = head + (a.to_bytes()[8:] if full else struct.pack("<II", 1, 0)) + \
        (b.to_bytes()[8:] if swa else struct.pack("<II", 1, 0))
    return KVState.parse(blob, layout)


def build_blob(*args, **kwargs) -> bytes:
    """``make_state(...).to_bytes()``: a synthetic blob in llama.cpp's sequence-state format."""
    return make_state(*args, **kwargs).to_bytes()


# --------------------------------------------------------------------------- compare


@dataclass(frozen=True)
class ComponentDiff:
    """Difference of one layer's K or V values; all numbers computed in float64 from stored values.

    ``changed_values`` counts values whose stored bit patterns differ (so -0.0 vs 0.0 counts,
    identical NaNs do not); ``max_abs`` and ``l2`` are over those values only.
    """

    layer: int  # model layer
    component: str  # "K" or "V"
    n_values: int
    nbytes: int
    changed_bytes: int
    changed_values: int
    max_abs: float
    l2: float
    ref_l2: float
    l2_rel: float
    cache: str = "kv"  # the cache part holding the layer: "kv", "full" or "swa"

    def record(self) -> dict:
        return {
            "layer": self.layer, "component": self.component, "cache": self.cache, "n_values": self.n_values,
            "nbytes": self.nbytes, "changed_bytes": self.changed_bytes,
            "changed_values": self.changed_values, "max_abs": self.max_abs, "l2": self.l2,
            "ref_l2": self.ref_l2, "l2_rel": self.l2_rel,
        }


def _same_memory(x: np.ndarray, y: np.ndarray) -> bool:
    """True when ``x`` and ``y`` are the same bytes (one array, or views of it alike)."""
    ix, iy = x.__array_interface__, y.__array_interface__
    return x is y or (ix["data"][0] == iy["data"][0] and x.shape == y.shape and x.strides == y.strides
                      and x.dtype == y.dtype)


def _rel(num: float, den: float) -> float:
    if den > 0:
        return num / den
    return 0.0 if num == 0 else float("inf")


@dataclass(frozen=True)
class StateDiff:
    """Result of :func:`compare`. ``components`` is keyed ``"L0.K"``, ``"L0.V"``, ... in blob order
    (all K layers, then all V layers)."""

    components: dict[str, ComponentDiff]
    changed_bytes: int
    changed_values: int
    max_abs: float
    l2: float
    ref_l2: float
    l2_rel: float
    first_differing_layer: int | None
    values_identical: bool
    positions_equal: bool
    seq_ids_equal: bool
    identical: bool  # values, positions, seq ids and header all equal: same blob

    def records(self) -> list[dict]:
        """One dict per layer and component (K then V within a layer), for tables."""
        order = sorted(self.components.values(), key=lambda c: (c.layer, c.component))
        return [c.record() for c in order]

    def __getitem__(self, key: str) -> ComponentDiff:
        return self.components[key]


def check_same_geometry(a: KVState, b: KVState, names: tuple[str, str] = ("a", "b")) -> None:
    """Raise :class:`KVFormatError` naming the first geometry field in which ``a`` and ``b`` differ."""
    ga, gb = a.geometry(), b.geometry()
    for key in ga:
        if ga[key] != gb[key]:
            raise KVFormatError(
                f"states differ in geometry: {key} is {ga[key]} in {names[0]} but {gb[key]} in {names[1]}"
            )


def compare(a: KVState, b: KVState, reference: KVState | None = None) -> StateDiff:
    """Compare two states of the same geometry, component by component.

    ``l2_rel`` divides the L2 norm of the difference by the L2 norm of the reference
    state's same component (``reference`` defaults to ``a``); the totals use the norm of
    the whole reference state.
    """
    ref = a if reference is None else reference
    check_same_geometry(a, b)
    if ref is not a:
        check_same_geometry(a, ref, ("a", "reference"))
    comps: dict[str, ComponentDiff] = {}
    ids = a.layer_ids or tuple(range(a.n_layer))
    kinds = a.layer_kinds
    for comp, xs, ys, rs, types in (("K", a.k, b.k, ref.k, a.k_types), ("V", a.v, b.v, ref.v, a.v_types)):
        for il, (x, y, r, t) in enumerate(zip(xs, ys, rs, types)):
            quant = is_quantised(t)
            n_values = int(x.shape[0]) * _elements(int(x.shape[1]), t) if quant else int(x.size)
            changed_bytes = changed_values = 0
            max_abs = l2 = 0.0
            if not _same_memory(x, y):  # apply_subset's result shares the arrays it leaves with its recipient
                uview = _UINT_VIEW[int(t)]
                xb = np.ascontiguousarray(x, dtype=x.dtype.newbyteorder("<")).view(uview)
                yb = np.ascontiguousarray(y, dtype=y.dtype.newbyteorder("<")).view(uview)
                changed_bytes = int(np.count_nonzero(xb.view(np.uint8) != yb.view(np.uint8)))
            if changed_bytes:  # no bit differs: no value does
                if quant:  # a value changes when its quant or its block scale does
                    xv, yv = values_f64(x, t), values_f64(y, t)
                    diff_bits = (xv != yv) | (np.isnan(xv) != np.isnan(yv))
                else:
                    diff_bits = xb != yb
                changed_values = int(np.count_nonzero(diff_bits))
                if changed_values:
                    if not quant:
                        xv, yv = values_f64(x, t), values_f64(y, t)
                    with np.errstate(invalid="ignore", over="ignore"):
                        # only values whose stored bits differ count (identical NaNs / infs give 0);
                        # in place in xv (the values of np.where(diff, x - y, 0), |d| and d**2 exactly)
                        d = np.subtract(xv, yv, out=xv)
                        del yv
                        d[~diff_bits] = 0.0
                        max_abs = float(np.max(np.abs(d, out=d)))
                        l2 = float(np.sqrt(np.sum(np.square(d, out=d))))
                    del xv, d
                del diff_bits
            with np.errstate(over="ignore", invalid="ignore"):
                rv = values_f64(r, t)
                if not np.may_share_memory(rv, r):
                    np.square(rv, out=rv)
                else:  # an F64 array would be its own values: square a copy
                    rv = np.square(rv)
                ref_l2 = float(np.sqrt(np.sum(rv)))
                del rv
            for arr in (x, y, r):  # states mapped from files: only the layer at hand stays resident
                release(arr)
            comps[a.component_name(il, comp)] = ComponentDiff(
                layer=int(ids[il]), component=comp, n_values=n_values, nbytes=int(x.nbytes),
                changed_bytes=changed_bytes, changed_values=changed_values, max_abs=max_abs,
                l2=l2, ref_l2=ref_l2, l2_rel=_rel(l2, ref_l2), cache=kinds[il],
            )
    cs = list(comps.values())
    l2 = float(np.sqrt(sum(c.l2 ** 2 for c in cs)))
    ref_l2 = float(np.sqrt(sum(c.ref_l2 ** 2 for c in cs)))
    changed_layers = [c.layer for c in cs if c.changed_bytes]
    pa, pb = a.part_list, b.part_list
    positions_equal = all(np.array_equal(p.positions, q.positions) for p, q in zip(pa, pb))
    seq_ids_equal = all(
        len(p.seq_ids) == len(q.seq_ids) and all(np.array_equal(s, t) for s, t in zip(p.seq_ids, q.seq_ids))
        for p, q in zip(pa, pb)
    )
    values_identical = not changed_layers
    return StateDiff(
        components=comps,
        changed_bytes=sum(c.changed_bytes for c in cs),
        changed_values=sum(c.changed_values for c in cs),
        max_abs=max((c.max_abs for c in cs), default=0.0),
        l2=l2,
        ref_l2=ref_l2,
        l2_rel=_rel(l2, ref_l2),
        first_differing_layer=min(changed_layers) if changed_layers else None,
        values_identical=values_identical,
        positions_equal=positions_equal,
        seq_ids_equal=seq_ids_equal,
        identical=values_identical and positions_equal and seq_ids_equal and int(a.seq_id) == int(b.seq_id),
    )
