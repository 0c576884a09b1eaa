"""Derived model files: a layer-truncated copy of a GGUF model (a cheap draft model).

Only the `gguf` package is used here (no llama_cpp): the copy keeps the first N transformer
blocks (`blk.{i}.*`, i < N) and every non-block tensor (token embedding, output norm, output
head), byte for byte in their original quantisation types, and all metadata with
`{arch}.block_count` set to N (per-layer metadata arrays truncated to N). The tokenizer arrays
are copied from their raw bytes, so the derived file tokenizes exactly like its source.
"""
from __future__ import annotations

import re
from pathlib import Path

from statelab.errors import ConfigError, ModelError
from statelab.models import gguf_field_value, gguf_reader, model_sha256, resolve_model
from statelab.paths import atomic_path

_BLOCK = re.compile(r"^blk\.(\d+)\.")
DERIVED_FROM_KEY = "statelab.derived_from"
DERIVED_LAYERS_KEY = "statelab.derived_layers"


def _block_count(reader, path: Path) -> tuple[str, int]:
    arch_field = reader.fields.get("general.architecture")
    if arch_field is None:
        raise ModelError(f"GGUF file has no general.architecture: {path}")
    arch = str(arch_field.contents())
    bc = reader.fields.get(f"{arch}.block_count")
    if bc is None:
        raise ModelError(f"GGUF file has no {arch}.block_count: {path}")
    return arch, int(bc.contents())


def derive_truncated(src: Path | None, dst: Path, n_layers: int, overwrite: bool = False) -> dict:
    """Write to DST a copy of SRC (default: the embedded model) keeping its first N_LAYERS blocks.

    Returns a summary: path, size, sha256, source, source_sha256, architecture, name,
    n_layers, source_layers, tensors, tensors_dropped.
    """
    from gguf import GGUFValueType, GGUFWriter

    src = resolve_model(src)
    dst = Path(dst)
    if isinstance(n_layers, bool) or not isinstance(n_layers, int):
        raise ConfigError(f"the layer count must be an integer, got {n_layers!r}")
    if dst.exists() and not overwrite:
        raise ConfigError(f"output exists: {dst} (use --overwrite to replace it)")
    if dst.is_dir():
        raise ConfigError(f"output is a directory: {dst}")
    if dst.exists() and dst.resolve() == src:
        raise ConfigError(f"output is the source model itself: {dst}")

    reader = gguf_reader(src)
    arch, n_src = _block_count(reader, src)
    if not 1 <= n_layers < n_src:
        raise ConfigError(f"the layer count (--layers) must be between 1 and {n_src - 1} "
                          f"(the source has {n_src} blocks), got {n_layers}")
    src_sha = model_sha256(src)

    name_field = reader.fields.get("general.name")
    base_name = bytes(name_field.parts[name_field.data[0]]).decode("utf-8", "replace") \
        if name_field is not None else src.stem
    new_name = f"{base_name} (first {n_layers} layers)"

    kept, dropped = [], 0
    for t in reader.tensors:
        m = _BLOCK.match(t.name)
        if m is None or int(m.group(1)) < n_layers:
            kept.append(t)
        else:
            dropped += 1
    present = {int(m.group(1)) for t in kept if (m := _BLOCK.match(t.name))}
    if present != set(range(n_layers)):
        raise ModelError(f"{src} lacks tensors for blocks {sorted(set(range(n_layers)) - present)}")

    dst.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(dst) as tmp:
        writer = GGUFWriter(tmp, arch, endianess=reader.endianess)
        try:
            writer.data_alignment = reader.alignment
            for field in reader.fields.values():
                key = field.name
                if key.startswith("GGUF.") or key in ("general.architecture", DERIVED_FROM_KEY, DERIVED_LAYERS_KEY):
                    continue  # virtual fields, written by the writer itself, or replaced below
                if key == "general.name":
                    writer.add_key_value(key, new_name, GGUFValueType.STRING)
                    continue
                if key == f"{arch}.block_count":
                    writer.add_key_value(key, n_layers, field.types[0])
                    continue
                val, vtype, sub = gguf_field_value(field)
                if (vtype == GGUFValueType.ARRAY and sub != GGUFValueType.STRING and key.startswith(f"{arch}.")
                        and len(val) == n_src):
                    val = val[:n_layers]  # per-layer metadata (head counts, ffn lengths, window patterns ...)
                writer.add_key_value(key, val, vtype, sub_type=sub)
            if name_field is None:
                writer.add_key_value("general.name", new_name, GGUFValueType.STRING)
            writer.add_key_value(DERIVED_FROM_KEY, src_sha, GGUFValueType.STRING)
            writer.add_key_value(DERIVED_LAYERS_KEY, n_layers, GGUFValueType.UINT32)

            for t in kept:
                # the reader's data view is in numpy order (bytes per row for quantised types);
                # add_tensor_info turns it back into the element shape of raw_dtype
                writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, raw_dtype=t.tensor_type)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for t in kept:
                writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
            writer.flush()
        finally:
            writer.close()

    return {
        "path": str(dst.resolve()), "size": dst.stat().st_size, "sha256": model_sha256(dst),
        "source": str(src), "source_sha256": src_sha, "architecture": arch, "name": new_name,
        "n_layers": n_layers, "source_layers": n_src, "tensors": len(kept), "tensors_dropped": dropped,
    }


def _vocab(path: Path) -> dict:
    r = gguf_reader(path)

    def scalar(key):
        f = r.fields.get(key)
        return None if f is None else f.contents()

    tok = r.fields.get("tokenizer.ggml.tokens")
    tokens = None if tok is None else [bytes(tok.parts[i]) for i in tok.data]
    return {"model": scalar("tokenizer.ggml.model"), "tokens": tokens,
            "bos": scalar("tokenizer.ggml.bos_token_id"), "eos": scalar("tokenizer.ggml.eos_token_id")}


def same_vocabulary(a: Path, b: Path) -> tuple[bool, str]:
    """Whether two GGUF files share a vocabulary: tokenizer.ggml.tokens, the tokenizer model,
    and the BOS/EOS ids. Returns (ok, reason), reason one line either way."""
    pa, pb = resolve_model(a), resolve_model(b)
    va, vb = _vocab(pa), _vocab(pb)
    for p, v in ((pa, va), (pb, vb)):
        if v["tokens"] is None:
            return False, f"{p.name} has no tokenizer.ggml.tokens"
    if va["model"] != vb["model"]:
        return False, f"tokenizer models differ: {va['model']!r} vs {vb['model']!r}"
    ta, tb = va["tokens"], vb["tokens"]
    if len(ta) != len(tb):
        return False, f"vocabulary sizes differ: {len(ta)} vs {len(tb)} tokens"
    if ta != tb:
        i = next(i for i, (x, y) in enumerate(zip(ta, tb)) if x != y)
        n = sum(x != y for x, y in zip(ta, tb))
        return False, f"{n} token(s) differ, first at id {i}: {ta[i]!r} vs {tb[i]!r}"
    for k in ("bos", "eos"):
        if va[k] != vb[k]:
            return False, f"{k.upper()} ids differ: {va[k]} vs {vb[k]}"
    return True, (f"same vocabulary: {len(ta)} tokens, tokenizer {va['model']}, "
                  f"BOS {va['bos']}, EOS {va['eos']}")
