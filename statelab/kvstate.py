"""Parse, edit and re-serialise llama.cpp sequence-state blobs as numpy arrays.

The blob is what ``llama_state_seq_get_data(ctx, buf, size, seq_id)`` writes in the
llama.cpp vendored by llama-cpp-python 0.3.36 (``src/llama-context.cpp``
``state_seq_get_data`` and ``src/llama-kv-cache.cpp`` ``state_write``). All integers
are little-endian.

Sequence header (``llama_context::state_seq_get_data``, *before* the memory part)::

    u32  magic            0xaf143cd8 (``io_magic``)
    i32  seq_id           the sequence the blob was taken from (-1: all sequences)

Memory part (``llama_kv_cache::state_write``)::

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
        u32  n_layer
        per layer:  i32 k_type, u64 k_row_size, cell_count rows of k_row_size bytes
        v_trans == 0, per layer:  i32 v_type, u64 v_row_size, cell_count rows
        v_trans == 1, per layer:  i32 v_type, u32 v_el_size, u32 n_embd_v_gqa,
                                  n_embd_v_gqa runs of cell_count elements (feature-major)

Only F32 (ggml type 0) and F16 (1) K/V are accepted. Anything the codec does not
understand (other stream counts, quantised types, cell extension records, iSWA or hybrid
memories that append a second part, truncation, trailing bytes) raises
:class:`KVFormatError` naming the offset and the field; the codec never guesses.

In memory, ``KVState.k[l]`` has shape ``(n_cells, n_embd_k_gqa)`` (token-major, as
stored) and ``KVState.v[l]`` has shape ``(n_embd_v_gqa, n_cells)`` when ``v_trans``
(feature-major, as stored) or ``(n_cells, n_embd_v_gqa)`` otherwise. The arrays are
separate writable little-endian arrays whose C order is the blob order, so editing one
element and calling :meth:`KVState.to_bytes` changes exactly that element's bytes.

An empty sequence (``cell_count == 0``) is legal: the blob then ends after the cell
count, so the parsed state has no layers and ``v_trans`` is ``False`` (the blob does not
carry them); it round-trips byte for byte.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field

import numpy as np

from .errors import StatelabError

__all__ = [
    "GGML_F16",
    "GGML_F32",
    "SEQ_STATE_MAGIC",
    "ComponentDiff",
    "KVFormatError",
    "KVState",
    "StateDiff",
    "build_blob",
    "check_same_geometry",
    "compare",
    "make_state",
]

GGML_F32 = 0
GGML_F16 = 1

#: ``io_magic`` written by ``llama_context::state_seq_get_data`` before the memory part.
SEQ_STATE_MAGIC = 0xAF143CD8

#: size of ``llama_kv_cell_ext`` (x, y, tok), present per cell for M-RoPE / PLE models.
_CELL_EXT_SIZE = 12

_DTYPES = {GGML_F32: np.dtype("<f4"), GGML_F16: np.dtype("<f2")}
_UINT_VIEW = {GGML_F32: np.dtype("<u4"), GGML_F16: np.dtype("<u2")}

_GGML_TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K",
    16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S",
    22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
    29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4", 40: "NVFP4",
    41: "Q1_0", 42: "Q2_0",
}


class KVFormatError(StatelabError, ValueError):
    """A blob (or a state) the codec does not understand or two states that do not match."""


def _type_name(t: int) -> str:
    return _GGML_TYPE_NAMES.get(int(t), "unknown")


def _check_type(t: int, what: str, offset: int | None = None) -> np.dtype:
    if t not in _DTYPES:
        where = f" at offset {offset}" if offset is not None else ""
        raise KVFormatError(
            f"{what}: ggml type {t} ({_type_name(t)}){where} is not supported; "
            f"only F32 ({GGML_F32}) and F16 ({GGML_F16}) KV caches can be parsed"
        )
    return _DTYPES[t]


# --------------------------------------------------------------------------- reader


class _Reader:
    """Cursor over a blob that names the field and offset of every failure."""

    def __init__(self, buf: memoryview):
        self.buf = buf
        self.n = len(buf)
        self.off = 0

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
        return struct.unpack_from(fmt, self.buf, start)[0]

    def array(self, dtype: np.dtype, shape: tuple[int, ...], what: str) -> np.ndarray:
        count = int(np.prod(shape, dtype=np.int64))
        start = self.need(count * dtype.itemsize, what)
        return np.frombuffer(self.buf, dtype=dtype, count=count, offset=start).reshape(shape).copy()


def _parse_meta(r: _Reader, n_cells: int, ext_size: int, header_seq: int):
    """Cell meta (positions, seq ids). Returns (positions, seq_ids, ext or None)."""
    if ext_size == 0:
        # fast path: every cell lists exactly one sequence id -> an (n, 3) int32 table
        need = n_cells * 12
        if need <= r.n - r.off:
            table = np.frombuffer(r.buf, dtype="<i4", count=n_cells * 3, offset=r.off).reshape(n_cells, 3)
            if np.all(table[:, 1] == 1):
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
                f"cell {i} lists 0 sequence ids (n_seq_id at offset {r.off - 4}); llama.cpp never writes empty cells"
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


def _read_rows(r: _Reader, what: str, t: int, dt: np.dtype, n_cells: int) -> np.ndarray:
    """A u64 row size followed by ``n_cells`` token-major rows (K, or V when not transposed)."""
    off = r.off
    row = r.scalar("<Q", f"{what} row size")
    if row == 0 or row % dt.itemsize:
        raise KVFormatError(
            f"{what} row size {row} at offset {off} is not a positive multiple of the "
            f"{_type_name(t)} element size {dt.itemsize}"
        )
    return r.array(dt, (n_cells, row // dt.itemsize), f"{what} rows ({n_cells} x {row} bytes)")


def _parse(buf: memoryview, ext_size: int) -> "KVState":
    r = _Reader(buf)
    magic = r.scalar("<I", "sequence-state magic")
    if magic != SEQ_STATE_MAGIC:
        raise KVFormatError(
            f"not a llama.cpp sequence-state blob: magic 0x{magic:08x} at offset 0, expected "
            f"0x{SEQ_STATE_MAGIC:08x} (the blob of llama_state_seq_get_data starts with it)"
        )
    header_seq = r.scalar("<i", "header seq_id")
    if header_seq < -1:
        raise KVFormatError(f"header seq_id {header_seq} at offset 4 is invalid (must be >= -1)")
    n_stream = r.scalar("<I", "n_stream")
    if n_stream != 1:
        raise KVFormatError(
            f"n_stream = {n_stream} at offset 8: only single-stream KV caches (unified KV) are supported"
        )
    n_cells = r.scalar("<I", "cell_count")
    if n_cells == 0:
        if r.off != r.n:
            raise KVFormatError(
                f"trailing bytes: {r.n - r.off} bytes after the end of an empty KV stream at offset {r.off} "
                "(iSWA / hybrid memories append further parts; not supported)"
            )
        return KVState(
            positions=np.zeros(0, np.int32), seq_ids=(), v_trans=False, k=[], v=[],
            k_types=[], v_types=[], seq_id=header_seq,
        )
    # the smallest possible cell record is 12 bytes: refuse impossible counts before allocating
    if n_cells * 12 > r.n - r.off:
        raise KVFormatError(
            f"truncated blob: cell_count {n_cells} at offset 12 needs at least {n_cells * 12} bytes of cell meta, "
            f"only {r.n - r.off} remain"
        )
    positions, seq_ids, _ext = _parse_meta(r, n_cells, ext_size, header_seq)
    ids = np.concatenate(seq_ids)
    cell_of_id = np.repeat(np.arange(n_cells), [len(s) for s in seq_ids])
    bad = np.flatnonzero(ids != header_seq) if header_seq >= 0 else np.flatnonzero(ids < 0)
    if bad.size:
        expect = f"the blob header is for sequence {header_seq}" if header_seq >= 0 else "ids must be >= 0"
        raise KVFormatError(
            f"cell {int(cell_of_id[bad[0]])} lists sequence id {int(ids[bad[0]])}, but {expect} "
            "(unexpected cell layout)"
        )
    off_vt = r.off
    v_trans = r.scalar("<I", "v_trans")
    if v_trans not in (0, 1):
        raise KVFormatError(f"v_trans = {v_trans} at offset {off_vt} (expected 0 or 1): unexpected layout")
    off_nl = r.off
    n_layer = r.scalar("<I", "n_layer")
    if n_layer == 0:
        raise KVFormatError(f"n_layer = 0 at offset {off_nl} with {n_cells} cells: unexpected layout")
    if n_layer * 12 > r.n - r.off:
        raise KVFormatError(
            f"truncated blob: n_layer {n_layer} at offset {off_nl} needs at least {n_layer * 12} more bytes, "
            f"only {r.n - r.off} remain"
        )

    k, k_types, v, v_types = [], [], [], []
    for il in range(n_layer):
        off = r.off
        t = r.scalar("<i", f"L{il}.K type")
        dt = _check_type(t, f"L{il}.K", off)
        k.append(_read_rows(r, f"L{il}.K", t, dt, n_cells))
        k_types.append(t)
    for il in range(n_layer):
        off = r.off
        t = r.scalar("<i", f"L{il}.V type")
        dt = _check_type(t, f"L{il}.V", off)
        if v_trans:
            off = r.off
            el = r.scalar("<I", f"L{il}.V element size")
            if el != dt.itemsize:
                raise KVFormatError(
                    f"L{il}.V element size {el} at offset {off} does not match type {_type_name(t)} "
                    f"({dt.itemsize} bytes)"
                )
            off = r.off
            width = r.scalar("<I", f"L{il}.V n_embd_v_gqa")
            if width == 0:
                raise KVFormatError(f"L{il}.V n_embd_v_gqa = 0 at offset {off}: unexpected layout")
            v.append(r.array(dt, (width, n_cells), f"L{il}.V values ({width} features x {n_cells} cells)"))
        else:
            v.append(_read_rows(r, f"L{il}.V", t, dt, n_cells))
        v_types.append(t)
    if r.off != r.n:
        raise KVFormatError(
            f"trailing bytes: {r.n - r.off} bytes after the end of the KV stream at offset {r.off} "
            "(iSWA / hybrid memories append further parts, and layers without V change the layout; not supported)"
        )
    return KVState(
        positions=positions, seq_ids=seq_ids, v_trans=bool(v_trans), k=k, v=v,
        k_types=k_types, v_types=v_types, seq_id=header_seq,
    )


# --------------------------------------------------------------------------- state


@dataclass(eq=False)
class KVState:
    """One parsed sequence state. See the module docstring for the array layouts.

    Everything needed to re-serialise is either stored here (``seq_id`` of the header,
    the ggml types) or derived from the arrays (row sizes = width x element size,
    V element size, ``n_embd_v_gqa``), which :meth:`to_bytes` checks for consistency.
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

    # ---------------------------------------------------------------- construction
    @classmethod
    def parse(cls, blob: bytes | bytearray | memoryview) -> "KVState":
        """Parse a ``llama_state_seq_get_data`` blob; raise :class:`KVFormatError` on anything unexpected."""
        buf = memoryview(blob).cast("B")
        try:
            return _parse(buf, 0)
        except KVFormatError as err:
            # A blob written by a model whose cells carry extension records (M-RoPE / PLE)
            # has 12 more bytes per cell: recognise it only to refuse it with a clear message.
            try:
                _parse(buf, _CELL_EXT_SIZE)
            except KVFormatError:
                raise err from None
            raise KVFormatError(
                "the cells of this blob carry extension records (x, y, tok: an M-RoPE or PLE model); "
                "such states are not supported"
            ) from None

    # ---------------------------------------------------------------- geometry
    @property
    def n_cells(self) -> int:
        return int(len(self.positions))

    @property
    def n_layer(self) -> int:
        return len(self.k)

    @property
    def n_embd_k_gqa(self) -> list[int]:
        return [int(a.shape[1]) for a in self.k]

    @property
    def n_embd_v_gqa(self) -> list[int]:
        return [int(a.shape[0] if self.v_trans else a.shape[1]) for a in self.v]

    @property
    def k_row_sizes(self) -> list[int]:
        return [w * _DTYPES[t].itemsize for w, t in zip(self.n_embd_k_gqa, self.k_types)]

    @property
    def v_row_sizes(self) -> list[int]:
        """Bytes of one cell's V values per layer (the stored row size when not transposed)."""
        return [w * _DTYPES[t].itemsize for w, t in zip(self.n_embd_v_gqa, self.v_types)]

    @property
    def v_element_sizes(self) -> list[int]:
        return [_DTYPES[t].itemsize for t in self.v_types]

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
        }

    def validate(self) -> None:
        """Check that arrays, types and cell meta are consistent; raise :class:`KVFormatError` if not."""
        n = self.n_cells
        if self.n_stream != 1:
            raise KVFormatError(f"n_stream = {self.n_stream}: only single-stream states are supported")
        if self.positions.ndim != 1:
            raise KVFormatError(f"positions must be 1-D, got shape {self.positions.shape}")
        if len(self.seq_ids) != n:
            raise KVFormatError(f"{len(self.seq_ids)} seq-id entries for {n} cells")
        for name, arrs, types in (("K", self.k, self.k_types), ("V", self.v, self.v_types)):
            if len(arrs) != len(types):
                raise KVFormatError(f"{len(arrs)} {name} arrays but {len(types)} {name} types")
        if len(self.v) != len(self.k):
            raise KVFormatError(f"{len(self.k)} K layers but {len(self.v)} V layers")
        if n == 0:
            return
        if not self.k:
            raise KVFormatError(f"a state with {n} cells needs at least one layer")
        for il, (a, t) in enumerate(zip(self.k, self.k_types)):
            dt = _check_type(int(t), f"L{il}.K")
            if a.dtype.newbyteorder("<") != dt or a.ndim != 2 or a.shape[0] != n or a.shape[1] == 0:
                raise KVFormatError(
                    f"L{il}.K: array {a.dtype} {a.shape} does not match type {_type_name(t)} and "
                    f"({n}, n_embd_k_gqa > 0)"
                )
        for il, (a, t) in enumerate(zip(self.v, self.v_types)):
            dt = _check_type(int(t), f"L{il}.V")
            cells_axis = 1 if self.v_trans else 0
            if a.dtype.newbyteorder("<") != dt or a.ndim != 2 or a.shape[cells_axis] != n or a.shape[1 - cells_axis] == 0:
                expect = "(n_embd_v_gqa, n_cells)" if self.v_trans else "(n_cells, n_embd_v_gqa)"
                raise KVFormatError(
                    f"L{il}.V: array {a.dtype} {a.shape} does not match type {_type_name(t)} and {expect} with {n} cells"
                )

    # ---------------------------------------------------------------- serialisation
    def _meta_bytes(self) -> bytes:
        n = self.n_cells
        counts = np.fromiter((len(s) for s in self.seq_ids), dtype=np.int64, count=n)
        pos = np.asarray(self.positions, dtype="<i4")
        if n and np.all(counts == 1):
            table = np.empty((n, 3), dtype="<i4")
            table[:, 0] = pos
            table[:, 1] = 1
            table[:, 2] = np.concatenate(self.seq_ids)
            return table.tobytes()
        # general: per cell [pos, n_seq_id, ids...] laid out with vectorised scatter
        rec = 2 + counts
        starts = np.concatenate(([0], np.cumsum(rec)[:-1])) if n else np.zeros(0, np.int64)
        out = np.empty(int(rec.sum()), dtype="<i4")
        out[starts] = pos
        out[starts + 1] = counts
        if counts.sum():
            ids = np.concatenate(self.seq_ids).astype("<i4")
            cell_of_id = np.repeat(np.arange(n), counts)
            rank = np.arange(len(ids)) - np.repeat(np.cumsum(counts) - counts, counts)
            out[starts[cell_of_id] + 2 + rank] = ids
        return out.tobytes()

    def _parts(self) -> list[tuple[str, bytes | np.ndarray]]:
        """The blob as a sequence of named parts: 'meta' byte strings and 'Lx.K'/'Lx.V' value arrays."""
        self.validate()
        head = struct.pack("<IiII", SEQ_STATE_MAGIC, int(self.seq_id), 1, self.n_cells)
        if self.n_cells == 0:
            return [("meta", head)]
        parts: list[tuple[str, bytes | np.ndarray]] = [
            ("meta", head + self._meta_bytes() + struct.pack("<II", int(bool(self.v_trans)), self.n_layer))
        ]
        for il, (a, t, row) in enumerate(zip(self.k, self.k_types, self.k_row_sizes)):
            parts.append(("meta", struct.pack("<iQ", int(t), row)))
            parts.append((f"L{il}.K", a))
        for il, (a, t, row, el, width) in enumerate(
            zip(self.v, self.v_types, self.v_row_sizes, self.v_element_sizes, self.n_embd_v_gqa)
        ):
            if self.v_trans:
                parts.append(("meta", struct.pack("<iII", int(t), el, width)))
            else:
                parts.append(("meta", struct.pack("<iQ", int(t), row)))
            parts.append((f"L{il}.V", a))
        return parts

    @staticmethod
    def _array_bytes(a: np.ndarray) -> bytes:
        return np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes()

    def to_bytes(self) -> bytes:
        """Serialise exactly as llama.cpp would: ``to_bytes(parse(blob)) == blob``."""
        return b"".join(p if isinstance(p, bytes) else self._array_bytes(p) for _, p in self._parts())

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
        return hashlib.sha256(self.to_bytes()).hexdigest()

    def component_hashes(self) -> dict[str, str]:
        """SHA-256 of each value block in blob order (``"L0.K"``, ..., ``"L0.V"``, ...) and of
        ``"meta"``: all the other bytes of the blob (header, cell meta, per-layer type/size fields)
        concatenated in blob order."""
        meta = hashlib.sha256()
        out: dict[str, str] = {}
        for name, p in self._parts():
            if name == "meta":
                meta.update(p)
            else:
                out[name] = hashlib.sha256(self._array_bytes(p)).hexdigest()
        out["meta"] = meta.hexdigest()
        return out

    def copy(self) -> "KVState":
        """A deep, writable copy."""
        return KVState(
            positions=np.array(self.positions, dtype=np.int32, copy=True),
            seq_ids=tuple(np.array(s, dtype=np.int32, copy=True) for s in self.seq_ids),
            v_trans=bool(self.v_trans),
            k=[np.array(a, copy=True) for a in self.k],
            v=[np.array(a, copy=True) for a in self.v],
            k_types=[int(t) for t in self.k_types],
            v_types=[int(t) for t in self.v_types],
            seq_id=int(self.seq_id),
            n_stream=int(self.n_stream),
        )


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
        dt = _check_type(t, "make_state")
        if fill == "random":
            return rng.standard_normal(shape).astype(dt)
        if fill == "zeros":
            return np.zeros(shape, dtype=dt)
        if fill == "index":
            return (np.arange(int(np.prod(shape))) % 2048).reshape(shape).astype(dt)
        raise ValueError(f"unknown fill {fill!r}")

    k = [values((n_cells, w), t) for w, t in zip(kw, kt)]
    v = [values((w, n_cells) if v_trans else (n_cells, w), t) for w, t in zip(vw, vt)]
    return KVState(positions=pos, seq_ids=seq, v_trans=bool(v_trans), k=k, v=v, k_types=kt, v_types=vt, seq_id=seq_id)


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

    layer: int
    component: str  # "K" or "V"
    n_values: int
    nbytes: int
    changed_bytes: int
    changed_values: int
    max_abs: float
    l2: float
    ref_l2: float
    l2_rel: float

    def record(self) -> dict:
        return {
            "layer": self.layer, "component": self.component, "n_values": self.n_values,
            "nbytes": self.nbytes, "changed_bytes": self.changed_bytes,
            "changed_values": self.changed_values, "max_abs": self.max_abs, "l2": self.l2,
            "ref_l2": self.ref_l2, "l2_rel": self.l2_rel,
        }


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


def _as_f64(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


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
    for comp, xs, ys, rs, types in (("K", a.k, b.k, ref.k, a.k_types), ("V", a.v, b.v, ref.v, a.v_types)):
        for il, (x, y, r, t) in enumerate(zip(xs, ys, rs, types)):
            uview = _UINT_VIEW[int(t)]
            xb = np.ascontiguousarray(x, dtype=x.dtype.newbyteorder("<")).view(uview)
            yb = np.ascontiguousarray(y, dtype=y.dtype.newbyteorder("<")).view(uview)
            diff_bits = xb != yb
            changed_values = int(np.count_nonzero(diff_bits))
            changed_bytes = int(np.count_nonzero(xb.view(np.uint8) != yb.view(np.uint8))) if changed_values else 0
            if changed_values:
                with np.errstate(invalid="ignore", over="ignore"):
                    # only values whose stored bits differ count (identical NaNs / infs give 0)
                    d = np.where(diff_bits, _as_f64(x) - _as_f64(y), 0.0)
                    max_abs = float(np.max(np.abs(d)))
                    l2 = float(np.sqrt(np.sum(np.square(d))))
            else:
                max_abs, l2 = 0.0, 0.0
            with np.errstate(over="ignore", invalid="ignore"):
                ref_l2 = float(np.sqrt(np.sum(np.square(_as_f64(r)))))
            comps[f"L{il}.{comp}"] = ComponentDiff(
                layer=il, component=comp, n_values=int(x.size), nbytes=int(x.nbytes),
                changed_bytes=changed_bytes, changed_values=changed_values, max_abs=max_abs,
                l2=l2, ref_l2=ref_l2, l2_rel=_rel(l2, ref_l2),
            )
    cs = list(comps.values())
    l2 = float(np.sqrt(sum(c.l2 ** 2 for c in cs)))
    ref_l2 = float(np.sqrt(sum(c.ref_l2 ** 2 for c in cs)))
    changed_layers = [c.layer for c in cs if c.changed_bytes]
    positions_equal = bool(np.array_equal(a.positions, b.positions))
    seq_ids_equal = len(a.seq_ids) == len(b.seq_ids) and all(
        np.array_equal(s, t) for s, t in zip(a.seq_ids, b.seq_ids)
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
