"""Captures on disk: a folder with a manifest of sha256 per file and all identities.

    <dir>/manifest.json   format, prompt, schedule, identity, per-file sha256, KV hashes
    <dir>/tokens.npy      int32 prompt tokens
    <dir>/logits.npy      float32 initial logits of the last prompt position
    <dir>/kv.bin          the sequence-state payload (llama_state_seq_get_data)

Writes are atomic: everything goes to a temporary sibling folder which is renamed into
place.  Loading verifies every hash; importing checks model, geometry, KV type and backend.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from .errors import IdentityError, StatelabError
from .formation import Capture, Schedule
from .paths import read_json_record

FORMAT = "statelab.capture/1"


class ArchiveError(StatelabError):
    """An archive is missing, damaged, or does not match its manifest."""


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def write_files_atomic(dest: Path, files: dict[str, bytes], manifest: dict, overwrite: bool = False) -> Path:
    """Write files + manifest.json into a temporary sibling folder, then rename it to dest."""
    dest = Path(dest)
    if dest.exists() and not overwrite:
        raise ArchiveError(f"output already exists: {dest} (choose another path or pass overwrite)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        manifest = dict(manifest, files={name: _sha(data) for name, data in files.items()})
        payload = {**files, "manifest.json": json.dumps(manifest, indent=2, sort_keys=True).encode()}
        for name, data in payload.items():  # durable before the folder is renamed into place
            with open(tmp / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def read_verified(src: Path, fmt: str) -> tuple[dict, dict[str, bytes]]:
    src = Path(src)
    manifest = read_json_record(src / "manifest.json", fmt, ArchiveError,
                                missing="not a statelab archive (no manifest.json): {folder}",
                                invalid="manifest of {folder} is not valid JSON: {error}",
                                wrong_format="{folder} has format {got!r}, expected {want!r}")
    files = {}
    for name, digest in manifest.get("files", {}).items():
        p = src / name
        if not p.is_file():
            raise ArchiveError(f"{src}: file {name} listed in the manifest is missing")
        data = p.read_bytes()
        if _sha(data) != digest:
            raise ArchiveError(f"{src}: sha256 mismatch for {name} (archive damaged or edited)")
        files[name] = data
    return manifest, files


def save_capture(cap: Capture, dest: str | os.PathLike, overwrite: bool = False) -> Path:
    manifest = {
        "format": FORMAT,
        "prompt": {"id": cap.prompt_id, "sha256": cap.prompt_sha256, "n_tokens": cap.n_prompt},
        "schedule": cap.schedule.as_dict(),
        "identity": cap.identity,
        "hashes": cap.hashes(),
        "kv": {"sha256": cap.state.sha256(), "components": cap.state.component_hashes()},
        "extra": cap.extra,
    }
    files = {"tokens.npy": _npy_bytes(np.asarray(cap.tokens, np.int32)),
             "logits.npy": _npy_bytes(np.asarray(cap.logits, np.float32)),
             "kv.bin": cap.blob}
    return write_files_atomic(Path(dest), files, manifest, overwrite)


def load_capture(src: str | os.PathLike) -> Capture:
    from .kvstate import KVState, MemoryLayout

    manifest, files = read_verified(Path(src), FORMAT)
    for need in ("tokens.npy", "logits.npy", "kv.bin"):
        if need not in files:
            raise ArchiveError(f"{src}: manifest lists no {need}")
    tokens = np.load(io.BytesIO(files["tokens.npy"]), allow_pickle=False)
    logits = np.load(io.BytesIO(files["logits.npy"]), allow_pickle=False)
    blob = files["kv.bin"]
    ident = manifest.get("identity")
    rec = ident.get("memory") if isinstance(ident, dict) else None
    state = KVState.parse(blob, MemoryLayout.from_dict(rec) if isinstance(rec, dict) else None)
    if state.sha256() != manifest.get("kv", {}).get("sha256"):
        raise ArchiveError(f"{src}: KV payload hash differs from the manifest")
    try:
        cap = Capture(manifest["prompt"]["id"], manifest["prompt"]["sha256"], tokens, logits, blob,
                      Schedule.from_dict(manifest["schedule"]), manifest["identity"], manifest.get("extra", {}))
        hashes = manifest["hashes"]
    except (KeyError, TypeError) as e:
        raise ArchiveError(f"{src}: manifest lacks or mangles the field {e}") from None
    if cap.hashes() != hashes:
        raise ArchiveError(f"{src}: capture hashes differ from the manifest")
    cap.__dict__["_state"] = state
    return cap


def check_importable(cap: Capture, model, config, allow_other_backend: bool = False) -> None:
    """Refuse to import a capture into a context it does not belong to."""
    from .runtime.context import KV_TYPES

    ident = cap.identity
    if ident.get("model_sha256") != model.sha256:
        raise IdentityError(f"capture {cap.prompt_id} was formed with model {str(ident.get('model_sha256'))[:12]}…, "
                            f"this model is {model.sha256[:12]}…")
    st = cap.state
    info = model.info
    if st.n_layer != info.n_layer:
        raise IdentityError(f"capture has {st.n_layer} layers, the model has {info.n_layer}")
    if st.k and (st.n_embd_k_gqa[0] != info.n_embd_k_gqa):
        raise IdentityError(f"capture K width {st.n_embd_k_gqa[0]} differs from the model's {info.n_embd_k_gqa}")
    layout = model.memory_layout
    if layout is not None and st.n_layer and [p.kind for p in st.part_list] != [p.kind for p in layout.parts]:
        raise IdentityError(f"capture holds cache parts {[p.kind for p in st.part_list]}, the model writes "
                            f"{[p.kind for p in layout.parts]}")
    want_k, want_v = KV_TYPES[config.type_k], KV_TYPES[config.type_v]
    if st.k_types and (set(st.k_types) != {want_k} or set(st.v_types) != {want_v}):
        raise IdentityError(f"capture KV types K={sorted(set(st.k_types))} V={sorted(set(st.v_types))} differ from "
                            f"the context's {config.type_k}/{config.type_v}")
    if cap.n_prompt > config.n_ctx:
        raise IdentityError(f"capture has {cap.n_prompt} positions, more than n_ctx={config.n_ctx}")
    src_backend = ident.get("backend")
    if src_backend != config.backend and not allow_other_backend:
        raise IdentityError(f"capture was formed on backend {src_backend}, the recipient runs on {config.backend}; "
                            "pass --allow-backend (allow_other_backend=True) for a cross-backend transplant")
