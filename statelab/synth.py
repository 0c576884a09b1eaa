"""Synthetic models of published shapes: ``statelab model synth``.

A shape (``statelab/data/shapes.toml``) is a published architecture's hyperparameters. The
model is a GGUF file written with ``gguf``: seeded random weights, the embedded SmolLM2
tokenizer (or another GGUF's), written as F16 first and then quantised by llama.cpp's own
quantiser (``statelab.runtime.quantize``). Its bytes depend only on (shape, type, seed,
tokenizer, this module's SYNTH_VERSION, numpy's generator and, for quantised types, the
llama.cpp source and patch series): the sha256 is recorded in an identity beside the file
and checked whenever a cached file is used.

Weights (fan_in = the row length, the input width of a projection):

- every projection and the token embedding: normal, std 1/sqrt(fan_in) (the embedding and
  output matrices: 1/sqrt(n_embd), so tied and untied models have logits of unit scale);
- the projections that end a residual branch (``attn_output``, ``ffn_down``) also times
  1/sqrt(2 n_layer), so the residual stream stays of unit scale over the whole depth;
- RMS norm weights (and Qwen3's Q/K norms) 1; Llama 3's ``rope_freqs`` the factors
  llama.cpp's converter computes from the published ``rope_scaling``.

Each tensor is generated in blocks of rows, block i of tensor NAME from its own seed,
sha256(version, seed, NAME, i): tensors can be written in any order and by any number of
threads with the same bytes, and memory holds one tensor (F16) at a time.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from functools import lru_cache
from importlib import resources
from pathlib import Path

import numpy as np

from statelab.errors import ConfigError, ModelError, one_of
from statelab.models import file_sha256, gguf_field_value, gguf_reader, model_sha256, resolve_model
from statelab.paths import atomic_path, atomic_write_text, cache_dir, temp_prefix

#: bump whenever the bytes a (shape, type, seed) gives change
SYNTH_VERSION = 1
SHAPES_FORMAT = "statelab-shapes-1"
IDENTITY_FORMAT = "statelab-synth-1"
IDENTITY_SUFFIX = ".synth.json"
ARCHS = ("llama", "qwen3")
#: elements per generated block (a block is whole rows: max(1, BLOCK_ELEMENTS // row length))
BLOCK_ELEMENTS = 1 << 20
MAX_SEED = 2**63 - 1
SYNTH_KEYS = {"shape": "statelab.synth.shape", "seed": "statelab.synth.seed",
              "version": "statelab.synth.version", "tokenizer": "statelab.synth.tokenizer_sha256"}


def _types() -> dict:
    from gguf import LlamaFileType

    return {"f16": LlamaFileType.MOSTLY_F16, "q8_0": LlamaFileType.MOSTLY_Q8_0,
            "q6_k": LlamaFileType.MOSTLY_Q6_K, "q4_k_m": LlamaFileType.MOSTLY_Q4_K_M}


TYPES = ("f16", "q8_0", "q6_k", "q4_k_m")


@dataclass(frozen=True)
class Shape:
    name: str
    arch: str
    source: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    vocab_published: int
    context_length: int
    rope_theta: float
    norm_eps: float
    qk_norm: bool
    tied_embeddings: bool
    rope_scaling: dict | None = None

    def as_dict(self) -> dict:
        return asdict(self)


_INT_FIELDS = ("n_layer", "n_embd", "n_ff", "n_head", "n_head_kv", "head_dim", "vocab_published", "context_length")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_context_length")


def _check_shape(name: str, d: dict, where: str) -> Shape:
    known = {f.name for f in fields(Shape)} - {"name"}
    extra, missing = set(d) - known, known - set(d) - {"rope_scaling"}
    if extra or missing:
        raise ConfigError(f"{where}: shape {name!r}: " + "; ".join(
            ([f"unknown keys {sorted(extra)}"] if extra else []) + ([f"missing keys {sorted(missing)}"] if missing else [])))
    for k in _INT_FIELDS:
        if isinstance(d[k], bool) or not isinstance(d[k], int) or d[k] < 1:
            raise ConfigError(f"{where}: shape {name!r}: {k} must be a positive integer, got {d[k]!r}")
    for k in ("rope_theta", "norm_eps"):
        if isinstance(d[k], bool) or not isinstance(d[k], (int, float)) or not d[k] > 0:
            raise ConfigError(f"{where}: shape {name!r}: {k} must be a positive number, got {d[k]!r}")
    for k in ("qk_norm", "tied_embeddings"):
        if not isinstance(d[k], bool):
            raise ConfigError(f"{where}: shape {name!r}: {k} must be true or false, got {d[k]!r}")
    if d["arch"] not in ARCHS:
        raise ConfigError(f"{where}: shape {name!r}: arch must be {one_of(ARCHS)}, got {d['arch']!r}")
    if d["qk_norm"] != (d["arch"] == "qwen3"):
        raise ConfigError(f"{where}: shape {name!r}: llama.cpp's {d['arch']} has "
                          f"{'a' if d['arch'] == 'qwen3' else 'no'} Q/K norm; qk_norm must be {d['arch'] == 'qwen3'}")
    if d["n_head"] % d["n_head_kv"]:
        raise ConfigError(f"{where}: shape {name!r}: n_head ({d['n_head']}) is not a multiple of n_head_kv")
    if d["head_dim"] % 2:
        raise ConfigError(f"{where}: shape {name!r}: head_dim must be even (RoPE), got {d['head_dim']}")
    rs = d.get("rope_scaling")
    if rs is not None:
        if not isinstance(rs, dict) or rs.get("type") != "llama3" or set(rs) != {"type", *_LLAMA3_KEYS}:
            raise ConfigError(f"{where}: shape {name!r}: rope_scaling must be {{type = \"llama3\", "
                              f"{', '.join(_LLAMA3_KEYS)}}}, got {rs!r}")
        if d["arch"] != "llama":
            raise ConfigError(f"{where}: shape {name!r}: llama3 rope_scaling needs arch llama")
    return Shape(name=name, **{k: (float(v) if k in ("rope_theta", "norm_eps") else v) for k, v in d.items()})


def read_shapes(path: str | os.PathLike | None = None) -> dict[str, Shape]:
    """Every shape of a shapes file (default: the one shipped in statelab/data), checked."""
    if path is None:
        text, where = resources.files("statelab").joinpath("data", "shapes.toml").read_text(), "shapes.toml"
    else:
        try:
            text, where = Path(path).read_text(), str(path)
        except OSError as e:
            raise ConfigError(f"cannot read the shapes file {path}: {e.strerror or e}") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{where} is not valid TOML: {e}") from None
    if doc.get("format") != SHAPES_FORMAT:
        raise ConfigError(f"{where} has format {doc.get('format')!r}, expected {SHAPES_FORMAT!r}")
    shapes = doc.get("shape")
    if not isinstance(shapes, dict) or not shapes:
        raise ConfigError(f"{where} defines no [shape.NAME] table")
    return {name: _check_shape(name, d, where) for name, d in shapes.items()}


@lru_cache(maxsize=1)
def shapes() -> dict[str, Shape]:
    return read_shapes()


def get_shape(name: str) -> Shape:
    known = shapes()
    if name not in known:
        raise ConfigError(f"unknown shape {name!r}; choose one of {one_of(sorted(known))}")
    return known[name]


def check_type(type_name: str) -> str:
    if type_name not in TYPES:
        raise ConfigError(f"unknown model type {type_name!r}; choose one of {one_of(TYPES)}")
    return type_name


def check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"the seed must be an integer from 0 to {MAX_SEED}, got {seed!r}")
    return seed


# --- weights -------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple  # numpy order: (rows, row length) for matrices; ggml's ne reversed
    init: str  # "normal", "ones" or "rope_freqs"
    std: float = 0.0

    @property
    def dtype(self):
        return np.float16 if self.init == "normal" else np.float32

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


def tensor_plan(shape: Shape, n_vocab: int) -> list[TensorPlan]:
    """The tensors llama.cpp's llama / qwen3 loader reads, in file order, with their init."""
    from gguf import MODEL_TENSOR, TENSOR_NAMES

    def tn(t, bid=None):
        return TENSOR_NAMES[t].format(bid=bid) + ".weight"

    e, q, kv, ff = shape.n_embd, shape.n_head * shape.head_dim, shape.n_head_kv * shape.head_dim, shape.n_ff
    branch = 1.0 / math.sqrt(2 * shape.n_layer)
    plan = [TensorPlan(tn(MODEL_TENSOR.TOKEN_EMBD), (n_vocab, e), "normal", 1 / math.sqrt(e))]
    if shape.rope_scaling is not None:
        plan.append(TensorPlan(tn(MODEL_TENSOR.ROPE_FREQS), (shape.head_dim // 2,), "rope_freqs"))
    for i in range(shape.n_layer):
        plan += [
            TensorPlan(tn(MODEL_TENSOR.ATTN_NORM, i), (e,), "ones"),
            TensorPlan(tn(MODEL_TENSOR.ATTN_Q, i), (q, e), "normal", 1 / math.sqrt(e)),
            TensorPlan(tn(MODEL_TENSOR.ATTN_K, i), (kv, e), "normal", 1 / math.sqrt(e)),
            TensorPlan(tn(MODEL_TENSOR.ATTN_V, i), (kv, e), "normal", 1 / math.sqrt(e)),
            TensorPlan(tn(MODEL_TENSOR.ATTN_OUT, i), (e, q), "normal", branch / math.sqrt(q)),
        ]
        if shape.qk_norm:
            plan += [TensorPlan(tn(MODEL_TENSOR.ATTN_Q_NORM, i), (shape.head_dim,), "ones"),
                     TensorPlan(tn(MODEL_TENSOR.ATTN_K_NORM, i), (shape.head_dim,), "ones")]
        plan += [
            TensorPlan(tn(MODEL_TENSOR.FFN_NORM, i), (e,), "ones"),
            TensorPlan(tn(MODEL_TENSOR.FFN_GATE, i), (ff, e), "normal", 1 / math.sqrt(e)),
            TensorPlan(tn(MODEL_TENSOR.FFN_DOWN, i), (e, ff), "normal", branch / math.sqrt(ff)),
            TensorPlan(tn(MODEL_TENSOR.FFN_UP, i), (ff, e), "normal", 1 / math.sqrt(e)),
        ]
    plan.append(TensorPlan(tn(MODEL_TENSOR.OUTPUT_NORM), (e,), "ones"))
    if not shape.tied_embeddings:
        plan.append(TensorPlan(tn(MODEL_TENSOR.OUTPUT), (n_vocab, e), "normal", 1 / math.sqrt(e)))
    return plan


def llama3_rope_factors(shape: Shape) -> np.ndarray:
    """Llama 3's per-frequency RoPE factors (the ``rope_freqs`` tensor), as llama.cpp's
    converter computes them from ``rope_scaling`` (conversion/llama.py)."""
    rs = shape.rope_scaling
    dim = shape.head_dim
    freqs = 1.0 / (shape.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    factor, low, high, old = (rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"],
                              rs["original_context_length"])
    low_wavelen, high_wavelen = old / low, old / high
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def block_seed(seed: int, name: str, block: int) -> np.random.SeedSequence:
    digest = hashlib.sha256(f"statelab-synth/{SYNTH_VERSION}/{seed}/{name}/{block}".encode()).digest()
    return np.random.SeedSequence(int.from_bytes(digest[:16], "little"))


def generate(t: TensorPlan, seed: int, shape: Shape, pool: ThreadPoolExecutor | None = None) -> np.ndarray:
    """The values of one tensor: blocks of whole rows, each from its own seed."""
    if t.init == "ones":
        return np.ones(t.shape, np.float32)
    if t.init == "rope_freqs":
        return llama3_rope_factors(shape)
    rows, cols = t.shape
    out = np.empty(t.shape, np.float16)
    per = max(1, BLOCK_ELEMENTS // cols)
    std = np.float32(t.std)

    def fill(b: int) -> None:
        r0 = b * per
        x = np.random.default_rng(block_seed(seed, t.name, b)).standard_normal((min(per, rows - r0), cols),
                                                                                 dtype=np.float32)
        x *= std
        out[r0:r0 + len(x)] = x

    blocks = range((rows + per - 1) // per)
    if pool is None:
        for b in blocks:
            fill(b)
    else:
        list(pool.map(fill, blocks))
    return out


# --- files ---------------------------------------------------------------------------------


def _tokenizer_fields(path: Path) -> tuple[list, int]:
    """The tokenizer.* metadata of a GGUF (as GGUFWriter.add_key_value arguments) and its token count."""
    reader = gguf_reader(path)
    out = [(f.name, *gguf_field_value(f)) for f in reader.fields.values() if f.name.startswith("tokenizer.")]
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ModelError(f"{path} has no tokenizer (tokenizer.ggml.tokens) to copy")
    return out, len(tokens.data)


def write_f16(shape: Shape, seed: int, dst: Path, tokenizer: Path, threads: int = 0) -> dict:
    """Write the F16 GGUF of (shape, seed) to DST (a path the caller renames into place)."""
    from gguf import GGUFValueType, GGUFWriter, LlamaFileType

    tok_fields, n_vocab = _tokenizer_fields(tokenizer)
    a = shape.arch
    w = GGUFWriter(dst, a)
    w.add_name(f"statelab synthetic {shape.name} (seed {seed})")
    w.add_description(f"random weights in the shape of {shape.source}; not a trained model")
    w.add_context_length(shape.context_length)
    w.add_embedding_length(shape.n_embd)
    w.add_block_count(shape.n_layer)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.norm_eps)
    w.add_vocab_size(n_vocab)
    w.add_file_type(LlamaFileType.MOSTLY_F16)
    for key, val, vtype, sub in tok_fields:
        w.add_key_value(key, val, vtype, sub_type=sub)
    tok_sha = model_sha256(tokenizer)
    w.add_key_value(SYNTH_KEYS["shape"], shape.name, GGUFValueType.STRING)
    w.add_key_value(SYNTH_KEYS["seed"], seed, GGUFValueType.UINT64)
    w.add_key_value(SYNTH_KEYS["version"], SYNTH_VERSION, GGUFValueType.UINT32)
    w.add_key_value(SYNTH_KEYS["tokenizer"], tok_sha, GGUFValueType.STRING)
    plan = tensor_plan(shape, n_vocab)
    for t in plan:
        w.add_tensor_info(t.name, t.shape, np.dtype(t.dtype), t.nbytes)
    n_threads = threads or min(os.cpu_count() or 1, 16)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        with ThreadPoolExecutor(n_threads) as pool:
            for t in plan:
                w.write_tensor_data(generate(t, seed, shape, pool))
        w.flush()
    finally:
        w.close()
    return {"n_vocab": n_vocab, "tensors": len(plan), "parameters": int(sum(np.prod(t.shape) for t in plan))}


def _cache_key(shape: Shape, type_name: str, seed: int, tok_sha: str) -> tuple[str, dict]:
    record = {"synth_version": SYNTH_VERSION, "shape": shape.as_dict(), "type": type_name, "seed": seed,
              "tokenizer_sha256": tok_sha, "numpy": np.__version__, "block_elements": BLOCK_ELEMENTS}
    if type_name != "f16":
        from statelab.runtime.quantize import quantizer_identity

        record["quantizer"] = quantizer_identity()
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16], record


def _cached(entry: Path, key: str) -> dict | None:
    """The identity of a complete, verified cache entry, else None."""
    ident_file = entry.with_name(entry.name + IDENTITY_SUFFIX)
    try:
        ident = json.loads(ident_file.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(ident, dict) or ident.get("format") != IDENTITY_FORMAT or ident.get("key") != key:
        return None
    if not entry.is_file() or entry.stat().st_size != ident.get("size") or model_sha256(entry) != ident.get("sha256"):
        return None
    return ident


class _Lock:
    """A blocking exclusive lock on a file (two processes asking for the same model: the
    second waits and then finds it in the cache)."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        os.close(self.fd)


def synthesize(shape_name: str, type_name: str = "q8_0", seed: int = 0, tokenizer=None, threads: int = 0,
               progress=None) -> dict:
    """The cached synthetic model of (shape, type, seed): built when missing, verified when
    present. Returns its identity (``path`` is the cache file) plus ``cached`` and ``seconds``."""
    shape, type_name, seed = get_shape(shape_name), check_type(type_name), check_seed(seed)
    tok = resolve_model(tokenizer)
    tok_sha = model_sha256(tok)
    key, record = _cache_key(shape, type_name, seed, tok_sha)
    folder = cache_dir() / "synth"
    folder.mkdir(parents=True, exist_ok=True)
    entry = folder / f"{shape.name}-{type_name}-s{seed}-{key}.gguf"
    t0 = time.perf_counter()
    with _Lock(folder / f".{entry.name}.lock"):
        ident = _cached(entry, key)
        if ident is not None:
            return dict(ident, path=str(entry), cached=True, seconds=round(time.perf_counter() - t0, 3))
        say = progress or (lambda msg: None)
        info, f16_sha = None, None
        if type_name == "f16":
            say(f"writing {entry.name} (F16)")
            with atomic_path(entry) as tmp:
                info = write_f16(shape, seed, tmp, tok, threads)
        else:
            from statelab.runtime.quantize import quantize_model

            fd, f16 = tempfile.mkstemp(prefix=temp_prefix(entry), suffix=".f16.tmp", dir=folder)
            os.close(fd)
            try:
                say(f"writing the F16 model ({shape.name}, seed {seed})")
                info = write_f16(shape, seed, Path(f16), tok, threads)
                f16_sha = file_sha256(f16)
                say(f"quantising to {type_name} with llama.cpp")
                with atomic_path(entry) as tmp:
                    quantize_model(f16, tmp, _types()[type_name], threads)
            finally:
                try:
                    os.unlink(f16)
                except OSError:
                    pass
        ident = {"format": IDENTITY_FORMAT, "key": key, "shape": shape.name, "type": type_name, "seed": seed,
                 "architecture": shape.arch, "sha256": model_sha256(entry), "size": entry.stat().st_size,
                 "f16_sha256": f16_sha, "tokenizer": {"path": str(tok), "sha256": tok_sha}, **info,
                 "recipe": record}
        atomic_write_text(entry.with_name(entry.name + IDENTITY_SUFFIX), json.dumps(ident, indent=1, sort_keys=True))
    return dict(ident, path=str(entry), cached=False, seconds=round(time.perf_counter() - t0, 3))


def synth_to(out: str | os.PathLike, shape_name: str, type_name: str = "q8_0", seed: int = 0,
             overwrite: bool = False, tokenizer=None, threads: int = 0, progress=None) -> dict:
    """The synthetic model as OUT (a hard link to the cache entry where the file system
    allows, else a copy; written atomically) and its identity as ``OUT.synth.json``; OUT's
    sha256 is checked against the identity."""
    out = Path(out)
    if out.is_dir():
        raise ConfigError(f"output is a directory: {out}")
    if out.exists() and not overwrite:
        raise ConfigError(f"output exists: {out} (use --overwrite to replace it)")
    ident = synthesize(shape_name, type_name, seed, tokenizer, threads, progress)
    src = Path(ident["path"])
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(out) as tmp:
            os.unlink(tmp)
            try:
                os.link(src, tmp)
            except OSError:
                shutil.copyfile(src, tmp)
    except OSError as e:
        raise ConfigError(f"cannot write {out}: {e.strerror or e}") from None
    got = model_sha256(out)
    if got != ident["sha256"]:
        raise ModelError(f"{out}: sha256 {got[:16]}… differs from the synthetic model's identity "
                         f"({ident['sha256'][:16]}…)")
    record = {k: v for k, v in ident.items() if k not in ("cached", "seconds")}
    record["path"], record["cache_path"] = str(out.resolve()), str(src)
    atomic_write_text(out.with_name(out.name + IDENTITY_SUFFIX), json.dumps(record, indent=1, sort_keys=True))
    return dict(record, cached=ident["cached"], seconds=ident["seconds"])


def check_synth(path: str | os.PathLike) -> dict:
    """A synthetic model file checked against its identity (``PATH.synth.json``): the identity
    when the sha256 and size match, ModelError otherwise."""
    path = Path(path)
    ident_file = path.with_name(path.name + IDENTITY_SUFFIX)
    try:
        ident = json.loads(ident_file.read_text())
    except OSError:
        raise ModelError(f"{path} has no synthetic-model identity ({ident_file.name})") from None
    except ValueError as e:
        raise ModelError(f"{ident_file} is not valid JSON: {e}") from None
    if not isinstance(ident, dict) or ident.get("format") != IDENTITY_FORMAT:
        raise ModelError(f"{ident_file} is not a synthetic-model identity (format {IDENTITY_FORMAT!r})")
    if not path.is_file():
        raise ModelError(f"model file not found: {path}")
    got = model_sha256(path)
    if got != ident.get("sha256"):
        raise ModelError(f"{path}: sha256 {got[:16]}… differs from its identity ({str(ident.get('sha256'))[:16]}…)")
    return ident
