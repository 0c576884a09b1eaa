"""Model and context: explicit configuration, decode with per-row logits, state get/set,
FP32 logits, the native greedy sampler, eval-callback capture."""
from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import asdict, dataclass, replace

import numpy as np

from statelab.errors import ConfigError, DecodeError, ModelError, one_of
from statelab.kvstate import KV_TYPE_NAMES, is_quantised
from statelab.limits import check_threads, check_tokens
from statelab.models import ModelInfo, read_model_info, resolve_model
from statelab.runtime.closing import Closing
from statelab.runtime.native import build_identity, check_backend, devices_for_backend, ggml_lib, llama, prepare_backend

KV_TYPES = dict(KV_TYPE_NAMES)  # f32, f16, bf16, q8_0 -> ggml type


@dataclass(frozen=True)
class ContextConfig:
    """Everything that shapes a context's numerics, stated explicitly."""

    n_ctx: int = 1024
    n_batch: int = 512
    n_ubatch: int = 512
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool = False
    n_threads: int = 0  # 0: $STATELAB_THREADS, else os.cpu_count()
    n_gpu_layers: int | None = None  # None: 0 on cpu, all layers on a device backend
    backend: str = "cpu"
    device: int = 0  # index among the backend's devices
    n_seq_max: int = 1

    def __post_init__(self):
        check_backend(self.backend)
        for name in ("n_ctx", "n_batch", "n_ubatch"):
            check_tokens(name, getattr(self, name))
        check_threads("the thread count", self.n_threads)
        if self.n_ubatch > self.n_batch:
            raise ConfigError(f"n_ubatch ({self.n_ubatch}) must not exceed n_batch ({self.n_batch})")
        for name in ("type_k", "type_v"):
            if getattr(self, name) not in KV_TYPES:
                raise ConfigError(f"{name} must be one of {one_of(KV_TYPES)}, got {getattr(self, name)!r}")
        if is_quantised(KV_TYPES[self.type_v]) and not self.flash_attn:
            raise ConfigError(f"a quantised V cache ({self.type_v}) needs flash attention in llama.cpp "
                              "(--flash-attn); K alone may be quantised without it")

    @property
    def threads(self) -> int:
        if self.n_threads:
            return self.n_threads
        env = os.environ.get("STATELAB_THREADS") or "0"
        try:
            n = check_threads("STATELAB_THREADS", int(env))
        except ValueError:
            raise ConfigError(f"STATELAB_THREADS must be an integer, got {env!r}") from None
        return n or os.cpu_count() or 1

    def with_(self, **kw) -> "ContextConfig":
        return replace(self, **kw)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["n_threads"] = self.threads
        return d


class Model(Closing):
    """A loaded GGUF model with its identity and metadata."""

    def __init__(self, path=None, backend: str = "cpu", n_gpu_layers: int | None = None, device: int = 0):
        prepare_backend(backend)
        self.path = resolve_model(path)
        self.info: ModelInfo = read_model_info(self.path)
        L = llama()
        self.backend = backend
        params = L.llama_model_default_params()
        self._devs = None
        if backend == "cpu":
            params.n_gpu_layers = 0
            self._devs = (ctypes.c_void_p * 1)(None)  # empty list: CPU only
        else:
            devs = devices_for_backend(backend)
            if not 0 <= device < len(devs):
                raise ConfigError(f"backend {backend} has {len(devs)} device(s); device {device} does not exist")
            self._devs = (ctypes.c_void_p * 2)(devs[device].handle, None)
            params.n_gpu_layers = -1 if n_gpu_layers is None else n_gpu_layers
        params.devices = ctypes.addressof(self._devs)
        self.device_name = "CPU" if backend == "cpu" else devs[device].name
        ptr = L.llama_model_load_from_file(str(self.path).encode(), params)
        if not ptr:
            raise ModelError(f"llama.cpp could not load the model: {self.path}")
        self.ptr = ptr
        self.vocab = L.llama_model_get_vocab(ptr)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.n_layer = L.llama_model_n_layer(ptr)
        # the memory kind as llama.cpp decides it, checked against the GGUF-derived metadata
        kind = ("hybrid" if L.llama_model_is_hybrid(ptr) else "recurrent" if L.llama_model_is_recurrent(ptr)
                else "iswa" if self.info.memory_kind == "iswa" else "kv")
        n_swa = int(L.llama_model_n_swa(ptr))
        if kind != self.info.memory_kind or (kind == "iswa" and n_swa != self.info.n_swa):
            self.close()
            raise ModelError(f"{self.path.name}: llama.cpp keeps a {kind} memory (window {n_swa}), the GGUF "
                             f"metadata suggests {self.info.memory_kind} (window {self.info.n_swa})")
        self.memory_kind = kind

    @property
    def memory_layout(self):
        """The :class:`~statelab.kvstate.MemoryLayout` of this model's sequence states (None: unknown)."""
        return self.info.memory_layout()

    @property
    def sha256(self) -> str:
        return self.info.sha256

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> np.ndarray:
        L = llama()
        data = text.encode()
        n_max = len(data) + 16
        buf = (L.llama_token * n_max)()
        n = L.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            buf = (L.llama_token * (-n))()
            n = L.llama_tokenize(self.vocab, data, len(data), buf, -n, add_special, parse_special)
        return np.frombuffer(buf, dtype=np.int32, count=n).copy()

    def detokenize(self, tokens) -> str:
        L = llama()
        toks = np.ascontiguousarray(tokens, dtype=np.int32)
        n_max = 8 * len(toks) + 64
        buf = ctypes.create_string_buffer(n_max)
        arr = toks.ctypes.data_as(ctypes.POINTER(L.llama_token))
        n = L.llama_detokenize(self.vocab, arr, len(toks), buf, n_max, False, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = L.llama_detokenize(self.vocab, arr, len(toks), buf, -n, False, False)
        return buf.raw[:n].decode(errors="replace")

    def is_eog(self, token: int) -> bool:
        return bool(llama().llama_vocab_is_eog(self.vocab, int(token)))

    def close(self):
        # exactly once: the pointer is taken before the native free, so a second call (the
        # finaliser after an interrupted close, a Ctrl-C between the two lines) frees nothing
        ptr, self.ptr = getattr(self, "ptr", None), None
        if ptr:
            llama().llama_model_free(ptr)


@dataclass
class CapturedTensor:
    name: str
    op: str
    type: str
    ne: tuple
    nb: tuple
    data: np.ndarray | bytes
    call: int = 0  # index of the graph computation (decode/ubatch) in which it was seen

    @property
    def layer(self) -> int | None:
        tail = self.name.rsplit("-", 1)
        return int(tail[1]) if len(tail) == 2 and tail[1].isdigit() else None


class _GGMLTensor(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


_NP_TYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


def tensor_info(ptr: int) -> _GGMLTensor:
    return _GGMLTensor.from_address(ptr)


def read_tensor(ptr: int) -> CapturedTensor:
    """Copy a graph tensor's data to host (any backend) as a strided numpy view of its span."""
    g = ggml_lib()
    t = tensor_info(ptr)
    nbytes = g.ggml_nbytes(ptr)
    raw = ctypes.create_string_buffer(nbytes)
    g.ggml_backend_tensor_get(ptr, raw, 0, nbytes)
    ne = tuple(int(x) for x in t.ne)
    nb = tuple(int(x) for x in t.nb)
    dt = _NP_TYPES.get(t.type)
    if dt is not None:
        flat = np.frombuffer(raw.raw, dtype=np.uint8)
        arr = np.lib.stride_tricks.as_strided(flat.view(dt) if nbytes % np.dtype(dt).itemsize == 0 else flat,
                                              shape=ne[::-1], strides=nb[::-1]).copy()
        data = arr
    else:
        data = raw.raw
    return CapturedTensor(t.name.decode(errors="replace"), g.ggml_op_desc(ptr).decode(),
                          g.ggml_type_name(t.type).decode(), ne, nb, data)


class TensorCapture:
    """Eval callback that copies the outputs of graph nodes whose name passes `want(name)`.

    Captured arrays are numpy with shape ne reversed (ggml's ne[0] is the last numpy axis).
    """

    def __init__(self, want):
        self.want = want
        self.tensors: list[CapturedTensor] = []
        self.calls = 0
        self._cb = llama().ggml_backend_sched_eval_callback(self._callback)

    def _callback(self, ptr, ask, user_data):
        try:
            name = tensor_info(ptr).name.decode(errors="replace")
            if ask:
                return bool(self.want(name))
            if self.want(name):
                ct = read_tensor(ptr)
                ct.call = self.calls
                self.tensors.append(ct)
            return True
        except Exception:  # never unwind through C
            return True

    def clear(self):
        self.tensors.clear()


# llama.cpp contexts are created and freed one at a time per process: creating or freeing a
# context while another thread does the same is what llama.cpp issue 11804 reports CUDA
# errors for; decoding goes on in parallel (each lane in its own context).
_CONTEXT_LIFECYCLE = threading.Lock()


class Context(Closing):
    """A llama context over one model with an explicit configuration."""

    def __init__(self, model: Model, config: ContextConfig | None = None, capture: TensorCapture | None = None):
        self.model = model
        self.config = config or ContextConfig(backend=model.backend)
        if self.config.backend != model.backend:
            raise ConfigError(f"context backend {self.config.backend} differs from the model's {model.backend}")
        L = llama()
        p = L.llama_context_default_params()
        c = self.config
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = c.n_ctx, c.n_batch, c.n_ubatch, c.n_seq_max
        p.n_threads = p.n_threads_batch = c.threads
        p.type_k, p.type_v = KV_TYPES[c.type_k], KV_TYPES[c.type_v]
        p.flash_attn_type = 1 if c.flash_attn else 0  # LLAMA_FLASH_ATTN_TYPE_ENABLED / _DISABLED
        p.no_perf = False
        on_cpu = c.backend == "cpu"
        p.offload_kqv = not on_cpu
        p.op_offload = not on_cpu
        self.capture = capture
        if capture is not None:
            p.cb_eval = capture._cb
            p.cb_eval_user_data = None
        with _CONTEXT_LIFECYCLE:
            ptr = L.llama_init_from_model(model.ptr, p)
        if not ptr:
            raise ConfigError(f"llama.cpp could not create a context with {c.as_dict()}")
        self.ptr = ptr
        self.n_ctx = L.llama_n_ctx(ptr)
        self.mem = L.llama_get_memory(ptr)
        # llama.cpp itself caps n_batch at n_ctx: no decode call can be longer than the context
        self._batch_cap = min(c.n_batch, self.n_ctx)  # >= 1 (ContextConfig checks it)
        self._batch = L.llama_batch_init(self._batch_cap, 0, 1)
        # every row belongs to exactly one sequence: n_seq_id is written once here, not per decode
        ones = np.ones(self._batch_cap, dtype=np.int32)  # named: .ctypes.data does not keep the array alive
        ctypes.memmove(self._batch.n_seq_id, ones.ctypes.data, ones.nbytes)
        self.n_vocab = model.n_vocab
        self._greedy = L.llama_sampler_init_greedy()
        self._cand = np.zeros(self.n_vocab, dtype=[("id", np.int32), ("logit", np.float32), ("p", np.float32)])
        self._cand["id"] = np.arange(self.n_vocab, dtype=np.int32)
        self.n_decode_calls = 0

    # -- decoding ---------------------------------------------------------
    def decode(self, tokens, pos0: int, logits=None, seq_id: int = 0) -> None:
        """Decode `tokens` at positions pos0.. in one llama_decode call.

        logits: None (last row only), "all", "none", or a boolean sequence per row.
        """
        if logits is None and type(tokens) is list and len(tokens) == 1 and 0 <= pos0 < self.n_ctx:  # one-token step
            self._decode_one(int(tokens[0]), pos0, seq_id)
            return
        toks = np.asarray(tokens, dtype=np.int32).ravel()
        n = len(toks)
        if n == 0:
            raise ConfigError("decode needs at least one token")
        if pos0 < 0 or pos0 + n > self.n_ctx:
            raise ConfigError(f"positions {pos0}..{pos0 + n - 1} do not fit n_ctx={self.n_ctx}")
        if n > self._batch_cap:
            raise ConfigError(f"a decode call of {n} tokens exceeds n_batch={self._batch_cap}")
        if logits is None:
            want = np.zeros(n, dtype=bool)
            want[-1] = True
        elif isinstance(logits, str):
            if logits not in ("all", "none"):
                raise ConfigError(f"logits must be None, 'all', 'none' or a per-row list, got {logits!r}")
            want = np.full(n, logits == "all")
        else:
            want = np.asarray(logits, dtype=bool).ravel()
            if len(want) != n:
                raise ConfigError(f"{len(want)} logits flags for {n} tokens")
        b = self._batch
        b.n_tokens = n
        ctypes.memmove(b.token, toks.ctypes.data, 4 * n)
        pos = np.arange(pos0, pos0 + n, dtype=np.int32)
        ctypes.memmove(b.pos, pos.ctypes.data, 4 * n)
        for i in range(n):
            b.seq_id[i][0] = seq_id
        flags = want.astype(np.int8)  # named: a temporary would be freed before memmove reads it
        ctypes.memmove(b.logits, flags.ctypes.data, n)
        self._submit(n, pos0)

    def _decode_one(self, token: int, pos: int, seq_id: int) -> None:
        """decode([token], pos): the same batch, its one row set without numpy temporaries (a
        continuation decodes one token per call, so this is the per-token host work)."""
        b = self._batch
        b.n_tokens = 1
        b.token[0], b.pos[0], b.seq_id[0][0], b.logits[0] = token, pos, seq_id, 1
        self._submit(1, pos)

    def _submit(self, n: int, pos0: int) -> None:
        if self.capture is not None:
            self.capture.calls = self.n_decode_calls
        rc = llama().llama_decode(self.ptr, self._batch)
        self.n_decode_calls += 1
        if rc != 0:
            raise DecodeError(f"llama_decode returned {rc} for {n} tokens at position {pos0}")

    def logits(self, row: int = -1) -> np.ndarray:
        """FP32 copy of the logits of a row of the last decode call (-1: the last row that had logits)."""
        L = llama()
        p = L.llama_get_logits_ith(self.ptr, row)
        if not p:
            raise DecodeError(f"no logits for row {row} of the last decode call")
        return np.ctypeslib.as_array(p, shape=(self.n_vocab,)).copy()

    def greedy(self, logits: np.ndarray) -> int:
        """Apply the native greedy sampler to a given FP32 logits vector."""
        L = llama()
        lg = np.asarray(logits, dtype=np.float32)
        if lg.shape != (self.n_vocab,):
            raise ConfigError(f"logits vector has shape {lg.shape}, expected ({self.n_vocab},)")
        if not np.all(np.isfinite(lg)):
            raise DecodeError("logits contain NaN or infinite values")
        cand = self._cand
        cand["logit"] = lg
        cand["p"] = 0.0
        arr = L.llama_token_data_array(
            data=cand.ctypes.data_as(ctypes.POINTER(L.llama_token_data)), size=self.n_vocab,
            selected=-1, sorted=False)
        L.llama_sampler_apply(self._greedy, ctypes.byref(arr))
        return int(cand["id"][arr.selected])

    def greedy_row(self, row: int = -1) -> int:
        """The greedy choice on a row's logits of the last decode call, read in place: one
        vectorised argmax, the first maximum, which is the choice of the native greedy sampler
        (greedy(logits(row)); tests/test_speculative.py holds the two equal).  The sampler's own
        llama_sampler_sample builds a candidate array of the whole vocabulary first, about
        0.1 ms per token on SmolLM2 (docs/benchmarks.md, "Greedy decode"): the receiver's
        per-token overhead."""
        p = llama().llama_get_logits_ith(self.ptr, row)
        if not p:
            raise DecodeError(f"no logits for row {row} of the last decode call")
        return int(self._first_max(p, 1)[0])

    def synchronize(self) -> None:
        """Wait until the device has finished the last decode call (a no-op cost on CPU)."""
        llama().llama_synchronize(self.ptr)

    def argmax_rows(self, n: int) -> np.ndarray:
        """Greedy choices of the first n output rows of the last decode call, read in place
        (one vectorised argmax, no copy): the first maximum, as the native greedy sampler picks."""
        p = llama().llama_get_logits(self.ptr)
        if not p:
            raise DecodeError("no logits from the last decode call")
        return self._first_max(p, n)

    def _first_max(self, p, n: int) -> np.ndarray:
        """Per row of the n logits rows at pointer p (read in place): the index of the first
        maximum; a chosen NaN (numpy's argmax picks the first NaN) is refused."""
        lg = np.ctypeslib.as_array(p, shape=(n, self.n_vocab))
        choice = lg.argmax(axis=1)
        if not np.isfinite(lg[np.arange(n), choice]).all():
            raise DecodeError("logits contain NaN values")
        return choice

    # -- memory / state ---------------------------------------------------
    def clear(self) -> None:
        llama().llama_memory_clear(self.mem, True)

    def seq_rm(self, seq_id: int = 0, p0: int = -1, p1: int = -1) -> bool:
        return bool(llama().llama_memory_seq_rm(self.mem, seq_id, p0, p1))

    def seq_pos_max(self, seq_id: int = 0) -> int:
        return int(llama().llama_memory_seq_pos_max(self.mem, seq_id))

    def state_get(self, seq_id: int = 0) -> bytes:
        L = llama()
        n = L.llama_state_seq_get_size(self.ptr, seq_id)
        buf = (ctypes.c_uint8 * n)()
        w = L.llama_state_seq_get_data(self.ptr, buf, n, seq_id)
        if w != n:
            raise DecodeError(f"llama_state_seq_get_data wrote {w} of {n} bytes")
        return bytes(buf)

    def state_matches(self, blob, seq_id: int = 0, chunk: int = 1 << 24) -> bool:
        """Whether the sequence's state reads back as ``blob`` byte for byte: one read-back
        buffer, compared in chunks (no copy of either side, whatever the state's size)."""
        L = llama()
        want = np.frombuffer(blob, dtype=np.uint8)
        n = L.llama_state_seq_get_size(self.ptr, seq_id)
        if n != len(want):
            return False
        buf = (ctypes.c_uint8 * n)()
        w = L.llama_state_seq_get_data(self.ptr, buf, n, seq_id)
        if w != n:
            raise DecodeError(f"llama_state_seq_get_data wrote {w} of {n} bytes")
        got = np.frombuffer(buf, dtype=np.uint8)
        return all(np.array_equal(got[i:i + chunk], want[i:i + chunk]) for i in range(0, n, chunk))

    def state_set(self, blob: bytes, seq_id: int = 0) -> None:
        L = llama()
        # handed over where it lies, never copied (llama.cpp only reads it): bytes, a bytearray or a
        # read-only map of a capture's kv.bin
        view = np.frombuffer(blob, dtype=np.uint8)
        buf = view.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        n = len(view)
        r = L.llama_state_seq_set_data(self.ptr, buf, n, seq_id)
        del view, buf
        if r != n:
            raise DecodeError(f"llama_state_seq_set_data consumed {r} of {n} bytes "
                              "(state rejected by llama.cpp: wrong geometry, type or context size)")

    # -- perf ---------------------------------------------------------------
    def perf(self) -> dict:
        d = llama().llama_perf_context(self.ptr)
        return {"t_p_eval_ms": d.t_p_eval_ms, "t_eval_ms": d.t_eval_ms, "n_p_eval": d.n_p_eval,
                "n_eval": d.n_eval}

    def perf_reset(self) -> None:
        llama().llama_perf_context_reset(self.ptr)

    def close(self):
        # exactly once per native object: each handle is taken (and the attribute cleared)
        # before its free, so a second call (the finaliser after a close that a Ctrl-C
        # interrupted) frees nothing twice; a handle an interrupted __init__ never made is skipped
        ptr, self.ptr = getattr(self, "ptr", None), None
        batch, self._batch = getattr(self, "_batch", None), None
        greedy, self._greedy = getattr(self, "_greedy", None), None
        if not (ptr or batch is not None or greedy):
            return
        L = llama()
        if batch is not None:
            L.llama_batch_free(batch)
        if greedy:
            L.llama_sampler_free(greedy)
        if ptr:
            with _CONTEXT_LIFECYCLE:
                L.llama_free(ptr)


class ContextPool(Closing):
    """Contexts kept for reuse, one per configuration, by ONE thread (a lane of a batch
    process or a search that runs many crosses): :meth:`get` returns the configuration's
    context with its memory cleared (``llama_memory_clear``), created on first use.  A
    cleared context holds no cell, so the next state import starts at cell 0 and decodes as
    in a new context (tests/test_context_pool.py compares endpoints bitwise); what is saved
    is the context's creation (buffers, graph reservation, a device backend's set-up)."""

    def __init__(self, model: Model):
        self.model = model
        self._contexts: dict[ContextConfig, Context] = {}
        self.created = 0  # contexts made (the rest of the get() calls reused one)

    def get(self, config: ContextConfig) -> Context:
        ctx = self._contexts.get(config)
        if ctx is None or ctx.ptr is None:
            ctx = self._contexts[config] = Context(self.model, config)
            self.created += 1
        else:
            ctx.clear()
        return ctx

    def close(self):
        for ctx in self._contexts.values():
            ctx.close()
        self._contexts.clear()


def context_identity(model: Model, config: ContextConfig) -> dict:
    b = build_identity()
    return {
        "model_sha256": model.sha256, "model_path": str(model.path), "backend": config.backend,
        "device": model.device_name, "build_key": b.get("build_key"), "build_backend": b.get("backend"),
        "sdist_sha256": b.get("sdist_sha256"), "patch_series_sha256": b.get("patch_series_sha256"),
        "context": config.as_dict(),
        "memory": None if model.memory_layout is None else model.memory_layout.as_dict(),
    }


__all__ = ["ContextConfig", "Model", "Context", "TensorCapture", "CapturedTensor", "context_identity",
           "read_tensor"]
