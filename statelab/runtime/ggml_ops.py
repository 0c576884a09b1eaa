"""ggml through ctypes: graph-node capture with provenance, standalone operator graphs,
backend support queries and standalone compute.

This is part of :mod:`statelab.runtime`, the only package allowed to touch the native
libraries. Three pieces:

* :class:`GraphCapture`: an eval callback (a :class:`~statelab.runtime.context.TensorCapture`)
  that records, for every wanted graph node, its output (copied right after the node
  was computed), its data address and byte span, its op parameters, its sources (name,
  op, shape, strides, address, view source) and, on request, a copy of the sources as
  they are *at the time the node has just run* (an in-place consumer may already have
  overwritten them: that is what :mod:`statelab.audit.replay` checks). It also numbers
  the graph computations (micro-batches) of each ``llama_decode`` call.
* :class:`OpGraph`: a ``no_alloc`` ggml context in which tensors, views, permutes,
  ``mul_mat``, ``soft_max_ext``, ``concat`` and ``cont`` are built through ctypes; its
  tensors can be asked to any backend device (``ggml_backend_dev_supports_op``) or
  computed on one (``ggml_backend_dev_init``, ``ggml_backend_alloc_ctx_tensors``,
  ``ggml_backend_tensor_set``, ``ggml_backend_graph_compute``).
* :func:`ggml` binds the functions used here (libggml and the libraries it loads).
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from statelab.errors import ConfigError, StatelabError
from statelab.runtime.closing import Closing
from statelab.runtime.context import CapturedTensor, TensorCapture, read_tensor, tensor_info
from statelab.runtime.native import ggml_lib, list_devices

GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1
GGML_TYPE_I32 = 26
GGML_PREC_F32 = 10  # enum ggml_prec: GGML_PREC_DEFAULT = 0, GGML_PREC_F32 = 10
TYPE_CODES = {"f32": GGML_TYPE_F32, "f16": GGML_TYPE_F16, "i32": GGML_TYPE_I32}
_ELEM = {GGML_TYPE_F32: 4, GGML_TYPE_F16: 2, GGML_TYPE_I32: 4}
_NP = {GGML_TYPE_F32: np.float32, GGML_TYPE_F16: np.float16, GGML_TYPE_I32: np.int32}
GGML_TYPE_COUNT = 43  # enum ggml_type of the pinned ggml (ggml/include/ggml.h)


class GgmlError(StatelabError, RuntimeError):
    """A standalone ggml graph could not be built, allocated or computed."""


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


@lru_cache(maxsize=1)
def ggml():
    """libggml with the graph-building and backend functions bound (signatures set once)."""
    g = ggml_lib()
    vp, sz, i64, i32, f32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    sigs = {
        "ggml_init": ([_InitParams], vp),
        "ggml_free": ([vp], None),
        "ggml_tensor_overhead": ([], sz),
        "ggml_graph_overhead": ([], sz),
        "ggml_new_tensor_4d": ([vp, i32, i64, i64, i64, i64], vp),
        "ggml_view_4d": ([vp, vp, i64, i64, i64, i64, sz, sz, sz, sz], vp),
        "ggml_permute": ([vp, vp, i32, i32, i32, i32], vp),
        "ggml_mul_mat": ([vp, vp, vp], vp),
        "ggml_prec_set_acc": ([vp, i32], ctypes.c_bool),
        "ggml_soft_max_ext": ([vp, vp, vp, f32, f32], vp),
        "ggml_concat": ([vp, vp, vp, i32], vp),
        "ggml_cont": ([vp, vp], vp),
        "ggml_set_name": ([vp, ctypes.c_char_p], vp),
        "ggml_new_graph": ([vp], vp),
        "ggml_build_forward_expand": ([vp, vp], None),
        "ggml_backend_dev_init": ([vp, ctypes.c_char_p], vp),
        "ggml_backend_free": ([vp], None),
        "ggml_backend_name": ([vp], ctypes.c_char_p),
        "ggml_backend_alloc_ctx_tensors": ([vp, vp], vp),
        "ggml_backend_buffer_free": ([vp], None),
        "ggml_backend_tensor_set": ([vp, vp, sz, sz], None),
        "ggml_backend_graph_compute": ([vp, vp], i32),
        "ggml_backend_cpu_set_n_threads": ([vp, i32], None),
        "ggml_is_contiguous": ([vp], ctypes.c_bool),
        "ggml_rms_norm": ([vp, vp, f32], vp),
        "ggml_mul": ([vp, vp, vp], vp),
        "ggml_add": ([vp, vp, vp], vp),
        "ggml_type_size": ([i32], sz),
        "ggml_blck_size": ([i32], i64),
        "ggml_row_size": ([i32, i64], sz),
        "ggml_backend_dev_buffer_type": ([vp], vp),
        "ggml_backend_dev_backend_reg": ([vp], vp),
        "ggml_backend_reg_get_proc_address": ([vp, ctypes.c_char_p], vp),
        "ggml_backend_buft_name": ([vp], ctypes.c_char_p),
        "ggml_backend_buft_get_alloc_size": ([vp, vp], sz),
        "ggml_backend_buft_alloc_buffer": ([vp, sz], vp),
        "ggml_backend_buffer_get_base": ([vp], vp),
        "ggml_backend_tensor_alloc": ([vp, vp, vp], i32),
    }
    for name, (args, res) in sigs.items():
        fn = getattr(g, name)
        fn.argtypes = args
        fn.restype = res
    return g


# --------------------------------------------------------------------------- capture


@dataclass
class SourceInfo:
    """A source operand of a captured node, as the node saw it."""

    slot: int
    name: str
    op: str
    type: str
    ne: tuple
    nb: tuple
    addr: int  # data pointer
    nbytes: int
    view_src: str | None  # name of the tensor it views (None: not a view)
    view_src_addr: int | None
    view_offs: int
    data: np.ndarray | bytes | None = None  # read right after the consumer ran (want_srcs)
    base_data: np.ndarray | bytes | None = None  # the viewed tensor's data, same moment (views only)
    base_ne: tuple | None = None
    base_nb: tuple | None = None

    @property
    def span(self) -> tuple[int, int]:
        return (self.addr, self.addr + self.nbytes)


@dataclass
class CapturedNode(CapturedTensor):
    """A graph node's output with provenance (see :class:`GraphCapture`)."""

    graph: int = 0  # graph computation (micro-batch) index within its decode call
    index: int = 0  # node index within its graph (order of evaluation)
    addr: int = 0
    nbytes: int = 0
    op_params: tuple = ()
    view_src: str | None = None
    view_src_addr: int | None = None
    view_offs: int = 0
    srcs: list = field(default_factory=list)

    @property
    def span(self) -> tuple[int, int]:
        return (self.addr, self.addr + self.nbytes)


def _source_info(ptr: int, slot: int, with_data: bool) -> SourceInfo:
    g = ggml()
    t = tensor_info(ptr)
    vs = t.view_src
    vs_name = tensor_info(vs).name.decode(errors="replace") if vs else None
    vs_addr = int(tensor_info(vs).data or 0) if vs else None
    data = read_tensor(ptr).data if with_data else None
    base = read_tensor(vs) if (with_data and vs) else None
    return SourceInfo(slot, t.name.decode(errors="replace"), g.ggml_op_desc(ptr).decode(),
                      g.ggml_type_name(t.type).decode(), tuple(int(x) for x in t.ne), tuple(int(x) for x in t.nb),
                      int(t.data or 0), int(g.ggml_nbytes(ptr)), vs_name, vs_addr, int(t.view_offs), data,
                      base.data if base is not None else None, base.ne if base is not None else None,
                      base.nb if base is not None else None)


class GraphCapture(TensorCapture):
    """Eval callback recording wanted graph nodes with provenance.

    want(name) -> bool selects nodes; want_srcs(name) -> bool additionally copies that
    node's sources as they are right after it ran; keep_data(name, op) -> bool (default:
    always) decides whether the output itself is copied (provenance is always recorded).
    reduce(node) may replace ``node.data`` right away (to bound memory).

    Graph computations within one decode call are told apart by the first node of a
    graph: its (name, op) reappearing starts the next micro-batch.
    """

    def __init__(self, want, want_srcs=None, keep_data=None, reduce=None):
        super().__init__(want)
        self.want_srcs = want_srcs or (lambda name: False)
        self.keep_data = keep_data
        self.reduce = reduce
        self.nodes: list[CapturedNode] = self.tensors  # same list
        self.graphs_per_call: dict[int, int] = {}
        self.error: BaseException | None = None
        self._call = None
        self._first = None
        self._graph = 0
        self._index = -1

    def _callback(self, ptr, ask, user_data):
        try:
            if ask:
                t = tensor_info(ptr)
                name = t.name.decode(errors="replace")
                key = (name, int(t.op))
                if self._call != self.calls:
                    self._call, self._first, self._graph, self._index = self.calls, key, 0, -1
                elif key == self._first:
                    self._graph += 1
                    self._index = -1
                self._index += 1
                self.graphs_per_call[self.calls] = self._graph + 1
                return bool(self.want(name))
            name = tensor_info(ptr).name.decode(errors="replace")
            if self.want(name):
                self.nodes.append(self._record(ptr, name))
            return True
        except BaseException as e:  # never unwind through C; surfaced by check()
            if self.error is None:
                self.error = e
            return True

    def _record(self, ptr: int, name: str) -> CapturedNode:
        g = ggml()
        t = tensor_info(ptr)
        op = g.ggml_op_desc(ptr).decode()
        keep = self.keep_data(name, op) if self.keep_data else True
        if keep:
            ct = read_tensor(ptr)
            data = ct.data
        else:
            data = None
        with_srcs = bool(self.want_srcs(name))
        srcs = [_source_info(s, i, with_srcs) for i, s in enumerate(t.src) if s]
        vs = t.view_src
        node = CapturedNode(name, op, g.ggml_type_name(t.type).decode(),
                            tuple(int(x) for x in t.ne), tuple(int(x) for x in t.nb), data, self.calls,
                            graph=self._graph, index=self._index, addr=int(t.data or 0),
                            nbytes=int(g.ggml_nbytes(ptr)), op_params=tuple(int(x) for x in t.op_params),
                            view_src=tensor_info(vs).name.decode(errors="replace") if vs else None,
                            view_src_addr=int(tensor_info(vs).data or 0) if vs else None,
                            view_offs=int(t.view_offs), srcs=srcs)
        if self.reduce is not None:
            self.reduce(node)
        return node

    def check(self) -> None:
        if self.error is not None:
            e, self.error = self.error, None
            raise GgmlError(f"graph capture failed inside the eval callback: {e!r}") from e

    def clear(self):
        super().clear()
        self.graphs_per_call.clear()


# --------------------------------------------------------------------------- standalone graphs


@dataclass(eq=False)
class Tensor:
    """A tensor of an :class:`OpGraph` (pointer plus what was asked for)."""

    ptr: int
    name: str
    graph: "OpGraph"

    @property
    def info(self):
        return tensor_info(self.ptr)

    @property
    def ne(self) -> tuple:
        return tuple(int(x) for x in self.info.ne)

    @property
    def nb(self) -> tuple:
        return tuple(int(x) for x in self.info.nb)

    @property
    def type(self) -> int:
        return int(self.info.type)

    @property
    def op(self) -> str:
        return ggml().ggml_op_desc(self.ptr).decode()

    @property
    def srcs(self) -> list["Tensor"]:
        return [self.graph._wrap(s) for s in self.info.src if s]

    def describe(self) -> dict:
        t = self.info
        vs = t.view_src
        return {"name": self.name, "op": self.op, "type": ggml().ggml_type_name(t.type).decode(),
                "ne": list(self.ne), "nb": list(self.nb),
                "view_of": tensor_info(vs).name.decode(errors="replace") if vs else None,
                "view_offs": int(t.view_offs)}

    def set_op_params(self, params) -> None:
        """Overwrite the op parameters (int32 words, e.g. frozen from a captured node)."""
        t = self.info
        words = list(params)[:len(t.op_params)]
        for i, w in enumerate(words):
            t.op_params[i] = int(w)


class OpGraph(Closing):
    """A ``no_alloc`` ggml context to build operator graphs in; optionally computed on a device."""

    def __init__(self, max_tensors: int = 256):
        g = ggml()
        size = g.ggml_tensor_overhead() * max_tensors + g.ggml_graph_overhead() + 1024
        self.ctx = g.ggml_init(_InitParams(size, None, True))
        if not self.ctx:
            raise GgmlError("ggml_init failed")
        self._tensors: dict[int, Tensor] = {}
        self._placed: list = []  # buffers of tensors placed in a chosen buffer type
        self._buffer = None
        self._backend = None
        self._n = 0

    # -- building -----------------------------------------------------------
    def _wrap(self, ptr, name: str | None = None) -> Tensor:
        if not ptr:
            raise GgmlError("ggml returned a null tensor")
        ptr = int(ptr)
        if ptr in self._tensors:
            return self._tensors[ptr]
        if name is None:
            self._n += 1
            name = f"t{self._n}"
        ggml().ggml_set_name(ptr, name.encode()[:63])
        tt = Tensor(ptr, name, self)
        self._tensors[ptr] = tt
        return tt

    def new_tensor(self, type_: int | str, ne, name: str) -> Tensor:
        code = TYPE_CODES[type_] if isinstance(type_, str) else int(type_)
        ne4 = (list(ne) + [1, 1, 1, 1])[:4]
        if any(int(x) < 1 for x in ne4):
            raise ConfigError(f"tensor {name}: every extent must be >= 1, got {tuple(ne4)}")
        return self._wrap(ggml().ggml_new_tensor_4d(self.ctx, code, *[int(x) for x in ne4]), name)

    def view_4d(self, a: Tensor, ne, nb123, offset: int = 0, name: str | None = None) -> Tensor:
        ne4 = [int(x) for x in ne]
        nb = [int(x) for x in nb123]
        self._check_view(a, ne4, nb, offset)
        return self._wrap(ggml().ggml_view_4d(self.ctx, a.ptr, *ne4, *nb, int(offset)), name)

    @staticmethod
    def _check_view(a: Tensor, ne, nb123, offset):
        """ggml asserts (aborting the process) when a view leaves its source; refuse first."""
        es = _ELEM.get(a.type)
        if es is None:
            raise GgmlError(f"views of type {a.type} are not supported here")
        last = offset + es * 1 + sum((n - 1) * s for n, s in zip(ne, [es] + list(nb123)))
        src_bytes = ggml().ggml_nbytes(a.ptr)
        if offset < 0 or last > src_bytes:
            raise GgmlError(f"view of {a.name} reads bytes up to {last}, past its {src_bytes} bytes")

    def permute(self, a: Tensor, axes, name: str | None = None) -> Tensor:
        return self._wrap(ggml().ggml_permute(self.ctx, a.ptr, *[int(x) for x in axes]), name)

    def mul_mat(self, a: Tensor, b: Tensor, name: str | None = None, prec_f32: bool = True) -> Tensor:
        if a.ne[0] != b.ne[0] or b.ne[2] % a.ne[2] or b.ne[3] % a.ne[3]:
            raise GgmlError(f"mul_mat({a.name} {a.ne}, {b.name} {b.ne}): shapes cannot be multiplied/broadcast")
        t = self._wrap(ggml().ggml_mul_mat(self.ctx, a.ptr, b.ptr), name)
        if prec_f32:
            ggml().ggml_prec_set_acc(t.ptr, GGML_PREC_F32)
        return t

    def soft_max_ext(self, a: Tensor, mask: Tensor | None, scale: float, max_bias: float = 0.0,
                     name: str | None = None) -> Tensor:
        if mask is not None:
            if mask.ne[0] != a.ne[0] or mask.ne[1] < a.ne[1] or a.ne[2] % mask.ne[2] or a.ne[3] % mask.ne[3]:
                raise GgmlError(f"soft_max_ext: mask {mask.ne} does not fit {a.ne}")
        return self._wrap(ggml().ggml_soft_max_ext(self.ctx, a.ptr, mask.ptr if mask is not None else None,
                                                   float(scale), float(max_bias)), name)

    def rms_norm(self, a: Tensor, eps: float, name: str | None = None) -> Tensor:
        return self._wrap(ggml().ggml_rms_norm(self.ctx, a.ptr, float(eps)), name)

    def mul(self, a: Tensor, b: Tensor, name: str | None = None) -> Tensor:
        return self._wrap(ggml().ggml_mul(self.ctx, a.ptr, b.ptr), name)

    def add(self, a: Tensor, b: Tensor, name: str | None = None) -> Tensor:
        return self._wrap(ggml().ggml_add(self.ctx, a.ptr, b.ptr), name)

    def operand(self, type_name: str, ne, nb, data, name: str):
        """A tensor with exactly the extents and byte strides `ne`/`nb` holding `data`.

        Contiguous operands are plain tensors (data: numpy of shape ne[::-1] or raw bytes,
        e.g. quantised weights); strided ones (permuted or sliced views) are views with the
        same strides over a base buffer the logical values are scattered into. Returns
        (tensor, {base tensor: base array or bytes}) for :meth:`compute`.
        """
        code = type_code(type_name)
        ne4 = tuple(int(x) for x in (list(ne) + [1, 1, 1, 1])[:4])
        nb4 = tuple(int(x) for x in nb)
        if nb4 == contiguous_nb(code, ne4):
            t = self.new_tensor(code, ne4, name)
            return t, {t: data}
        dt = _NP.get(code)
        if dt is None:
            raise GgmlError(f"operand {name}: strided {type_name} operands are not supported")
        es = _ELEM[code]
        span = es + sum((n - 1) * b for n, b in zip(ne4, nb4))
        if span % es:
            raise GgmlError(f"operand {name}: strides {nb4} are not multiples of the element size")
        buf = np.zeros(span // es, dtype=dt)
        np.lib.stride_tricks.as_strided(buf, shape=ne4[::-1], strides=nb4[::-1])[...] = np.asarray(data, dtype=dt)
        base = self.new_tensor(code, (span // es,), name + ".base")
        view = self.view_4d(base, ne4, nb4[1:], 0, name)
        return view, {base: buf}

    def concat(self, a: Tensor, b: Tensor, dim: int, name: str | None = None) -> Tensor:
        return self._wrap(ggml().ggml_concat(self.ctx, a.ptr, b.ptr, int(dim)), name)

    def cont(self, a: Tensor, name: str | None = None) -> Tensor:
        return self._wrap(ggml().ggml_cont(self.ctx, a.ptr), name)

    def place(self, t: Tensor, buft) -> None:
        """Allocate tensor `t` in buffer type `buft` (a handle from :func:`weight_buffer_types`), as a
        model loader places a weight (e.g. CPU_REPACK on CPU); its data is set by :meth:`compute`.
        Place it after building the ops that use it and before asking :meth:`supports`: an extra
        buffer type answers supports_op from where the weight lives."""
        g = ggml()
        size = g.ggml_backend_buft_get_alloc_size(buft, t.ptr)
        buf = g.ggml_backend_buft_alloc_buffer(buft, size)
        if not buf:
            raise GgmlError(f"could not allocate {size} bytes of {g.ggml_backend_buft_name(buft).decode()}")
        self._placed.append(buf)
        if g.ggml_backend_tensor_alloc(buf, t.ptr, g.ggml_backend_buffer_get_base(buf)) != 0:
            raise GgmlError(f"could not place {t.name} in {g.ggml_backend_buft_name(buft).decode()}")

    # -- asking and computing ----------------------------------------------
    @staticmethod
    def supports(device_handle: int, t: Tensor) -> bool:
        return bool(ggml().ggml_backend_dev_supports_op(device_handle, t.ptr))

    def compute(self, outputs: list[Tensor], inputs: dict, device=None, threads: int | None = None) -> dict:
        """Allocate every tensor on a device, upload `inputs` ({Tensor: numpy array of its
        logical shape ne[::-1], contiguous}), compute the graph of `outputs` and return
        {name: numpy array (ne reversed)} for the outputs."""
        g = ggml()
        dev = device if device is not None else _cpu_device()
        if self._backend is not None:
            raise GgmlError("an OpGraph is computed once; build a new one")
        backend = g.ggml_backend_dev_init(dev.handle, None)
        if not backend:
            raise GgmlError(f"could not initialise a backend on {dev.name}")
        self._backend = backend
        if dev.type == "CPU":
            n = threads or int(os.environ.get("STATELAB_THREADS") or 0) or os.cpu_count() or 1
            g.ggml_backend_cpu_set_n_threads(backend, int(n))
        buf = g.ggml_backend_alloc_ctx_tensors(self.ctx, backend)
        if not buf:
            raise GgmlError("ggml_backend_alloc_ctx_tensors failed")
        self._buffer = buf
        for t, arr in inputs.items():
            if isinstance(arr, (bytes, bytearray)):
                nbytes = g.ggml_nbytes(t.ptr)
                if len(arr) != nbytes:
                    raise GgmlError(f"input {t.name}: {len(arr)} bytes for a {nbytes}-byte tensor")
                raw = ctypes.create_string_buffer(bytes(arr), nbytes)
                g.ggml_backend_tensor_set(t.ptr, raw, 0, nbytes)
                continue
            want = _NP.get(t.type)
            a = np.ascontiguousarray(arr, dtype=want)
            if a.shape != t.ne[::-1] and a.size != int(np.prod(t.ne)):
                raise GgmlError(f"input {t.name}: array of shape {a.shape} for tensor ne {t.ne}")
            if not g.ggml_is_contiguous(t.ptr):
                raise GgmlError(f"input {t.name} is not contiguous")
            nbytes = g.ggml_nbytes(t.ptr)
            if a.nbytes != nbytes:
                raise GgmlError(f"input {t.name}: {a.nbytes} bytes for a {nbytes}-byte tensor")
            g.ggml_backend_tensor_set(t.ptr, a.ctypes.data, 0, nbytes)
        graph = g.ggml_new_graph(self.ctx)
        for o in outputs:
            g.ggml_build_forward_expand(graph, o.ptr)
        rc = g.ggml_backend_graph_compute(backend, graph)
        if rc != 0:
            raise GgmlError(f"ggml_backend_graph_compute returned status {rc}")
        out = {}
        for o in outputs:
            out[o.name] = read_tensor(o.ptr).data
        return out

    def close(self):
        # exactly once: every handle is taken (its attribute cleared) before its free
        placed, self._placed = getattr(self, "_placed", None) or [], []
        buffer, self._buffer = getattr(self, "_buffer", None), None
        backend, self._backend = getattr(self, "_backend", None), None
        ctx, self.ctx = getattr(self, "ctx", None), None
        if not (placed or buffer or backend or ctx):
            return
        g = ggml()
        for buf in placed:
            g.ggml_backend_buffer_free(buf)
        if buffer:
            g.ggml_backend_buffer_free(buffer)
        if backend:
            g.ggml_backend_free(backend)
        if ctx:
            g.ggml_free(ctx)


@lru_cache(maxsize=1)
def _type_codes() -> dict:
    g = ggml()
    out = {}
    for code in range(GGML_TYPE_COUNT):  # ggml_type_name does not bound-check
        nm = g.ggml_type_name(code)
        if nm:
            out.setdefault(nm.decode(errors="replace"), code)
    return out


def type_code(type_name: str) -> int:
    """ggml type code of a type name ('f32', 'f16', 'q4_1', ...)."""
    codes = _type_codes()
    if type_name not in codes:
        raise GgmlError(f"unknown ggml type {type_name!r}")
    return codes[type_name]


def contiguous_nb(code: int, ne) -> tuple:
    g = ggml()
    nb0 = int(g.ggml_type_size(code))
    nb1 = int(g.ggml_row_size(code, int(ne[0])))
    return (nb0, nb1, nb1 * int(ne[1]), nb1 * int(ne[1]) * int(ne[2]))


def _cpu_device():
    for d in list_devices():
        if d.type == "CPU":
            return d
    raise GgmlError("no CPU backend device registered")


def backend_devices(kinds=("CPU", "GPU", "IGPU", "ACCEL")) -> list:
    """Registered backend devices (CPU first) that can be asked supports_op."""
    devs = [d for d in list_devices() if d.type in kinds]
    return sorted(devs, key=lambda d: (d.type != "CPU", d.index))


def weight_buffer_types(device) -> list[tuple[str, int]]:
    """(name, handle) of the buffer types a weight can live in on `device`: its default buffer type,
    then the extra ones its backend offers (CPU: CPU_REPACK and others, which a model loader tries first)."""
    g = ggml()
    out = []
    default = g.ggml_backend_dev_buffer_type(device.handle)
    if default:
        out.append((g.ggml_backend_buft_name(default).decode(), default))
    reg = g.ggml_backend_dev_backend_reg(device.handle)
    fp = g.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts") if reg else None
    if fp:
        extra = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(fp)(device.handle)
        i = 0
        while extra and extra[i]:
            out.append((g.ggml_backend_buft_name(extra[i]).decode(), extra[i]))
            i += 1
    return out


def numpy_dtype(type_name: str):
    return {"f32": np.float32, "f16": np.float16, "i32": np.int32}.get(type_name)


__all__ = ["CapturedNode", "GgmlError", "GraphCapture", "OpGraph", "SourceInfo", "Tensor", "backend_devices",
           "contiguous_nb", "ggml", "numpy_dtype", "type_code", "weight_buffer_types", "GGML_TYPE_F16",
           "GGML_TYPE_F32"]
