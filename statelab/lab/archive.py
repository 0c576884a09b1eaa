"""Captures on disk: a folder with a sealed manifest of sha256 per file and all identities.

    <dir>/manifest.json   format, prompt, schedule, identity, per-file sha256, KV hashes, seal
    <dir>/tokens.npy      int32 prompt tokens
    <dir>/logits.npy      float32 initial logits of the last prompt position
    <dir>/kv.bin          the sequence-state payload (llama_state_seq_get_data)

The manifest is sealed: ``seal`` is the sha256 of its canonical form (every other field,
keys sorted, no whitespace), so no field can change unnoticed.  Writes are atomic:
everything goes to a temporary sibling folder which is renamed into place; overwriting
replaces only a folder that is an archive of the same kind holding nothing but its own
files.  Loading checks the seal, every file's sha256, every KV hash (whole payload and
per component) and that the fields agree with the files; importing checks model,
geometry, KV type and backend.
"""
from __future__ import annotations

import glob
import io
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from statelab.errors import IdentityError, StatelabError
from statelab.kvstate import KVFormatError, KVState, MemoryLayout, v_layout
from statelab.lab.formation import Capture, Schedule
from statelab.mapping import chunks, map_file, sha256_of
from statelab.paths import (REPLACED, clean_stale_temporaries, output_lock, read_json_record, rename_noreplace,
                            temp_prefix)
from statelab.runtime.context import KV_TYPES

FORMAT = "statelab.capture/2"  # /2: sealed manifest


class ArchiveError(StatelabError):
    """An archive is missing, damaged, or does not match its manifest."""


def _sha(data: bytes) -> str:
    return sha256_of(data)  # streamed: a mapped file's pages go back as they are hashed


def _npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def manifest_seal(manifest: dict) -> str:
    """sha256 of the manifest's canonical form: every field but ``seal``, keys sorted, no whitespace."""
    body = {k: v for k, v in manifest.items() if k != "seal"}
    return _sha(json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode())


def _check_replaceable(dest: Path, fmt: str) -> None:
    """Refuse to delete anything but an archive of the kind of ``fmt`` (any version) holding
    only its own files."""
    if not dest.is_dir() or dest.is_symlink():
        raise ArchiveError(f"refusing to overwrite {dest}: it is not an archive folder")
    try:
        old = json.loads((dest / "manifest.json").read_text())
    except (OSError, ValueError):
        raise ArchiveError(f"refusing to overwrite {dest}: it holds no readable statelab manifest") from None
    got = old.get("format") if isinstance(old, dict) else None
    if not isinstance(got, str) or got.rsplit("/", 1)[0] != fmt.rsplit("/", 1)[0]:  # any version of the kind
        raise ArchiveError(f"refusing to overwrite {dest}: it is not a {fmt} archive")
    listed = set(old.get("files") or {}) | {"manifest.json"}
    foreign = sorted(p.name for p in dest.iterdir() if p.name not in listed)
    if foreign:
        raise ArchiveError(f"refusing to overwrite {dest}: it holds files the archive does not list "
                           f"({', '.join(foreign[:5])})")


def write_files_atomic(dest: Path, files: dict[str, bytes], manifest: dict, overwrite: bool = False) -> Path:
    """Write files + the sealed manifest.json into a temporary sibling folder, then rename it
    to dest.  One writer per dest at a time (:func:`statelab.paths.output_lock`; a second is
    refused).  Without ``overwrite`` an existing dest, even one that appeared meanwhile, is
    never moved or replaced (the rename refuses to replace); with it dest is replaced only
    when it is an archive of the same format that holds nothing but its own files.
    Temporary folders that a killed writer left for dest are removed first."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(dest, ArchiveError):
        return _write_files_locked(dest, files, manifest, overwrite)


def _write_files_locked(dest: Path, files: dict[str, bytes], manifest: dict, overwrite: bool) -> Path:
    clean_stale_temporaries(dest)  # first: it puts back an old version a killed replacing writer moved aside
    if dest.exists() or dest.is_symlink():
        if not overwrite:
            raise _exists(dest)
        _check_replaceable(dest, manifest["format"])
    old = None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(dest), dir=dest.parent))
        manifest = dict(manifest, files={name: _sha(data) for name, data in files.items()})
        manifest["seal"] = manifest_seal(manifest)
        payload = {**files, "manifest.json": json.dumps(manifest, indent=2, sort_keys=True).encode()}
        for name, data in payload.items():  # durable before the folder is renamed into place
            with open(tmp / name, "wb") as f:
                for piece in chunks(data):  # a mapped payload streams through
                    f.write(piece)
                f.flush()
                os.fsync(f.fileno())
        if overwrite and dest.exists():  # a folder cannot be renamed over a full one: the old one steps aside first
            old = dest.with_name(temp_prefix(dest) + REPLACED)
            os.replace(dest, old)
        try:
            rename_noreplace(tmp, dest)
        except FileExistsError:
            raise _exists(dest) from None
    except BaseException:
        # this process's temporary folders for dest (the output lock makes them this call's): also
        # one that a Ctrl-C left between mkdtemp's mkdir and its return
        for t in dest.parent.glob(glob.escape(temp_prefix(dest)) + "*"):
            if t.name != temp_prefix(dest) + REPLACED:
                shutil.rmtree(t, ignore_errors=True)
        if old is not None and not dest.exists():
            os.replace(old, dest)
        raise
    if old is not None:
        shutil.rmtree(old)
    return dest


def _exists(dest: Path) -> ArchiveError:
    return ArchiveError(f"output already exists: {dest} (choose another path or pass overwrite)")


def read_manifest(src: Path, fmt: str) -> dict:
    """The manifest of archive ``src``: valid JSON of format ``fmt`` whose seal matches."""
    src = Path(src)
    manifest = read_json_record(src / "manifest.json", fmt, ArchiveError,
                                missing="not a statelab archive (no manifest.json): {folder}",
                                invalid="manifest of {folder} is not valid JSON: {error}",
                                wrong_format="{folder} has format {got!r}, expected {want!r}")
    if manifest.get("seal") != manifest_seal(manifest):
        raise ArchiveError(f"{src}: the manifest does not match its seal (manifest.json damaged or edited)")
    if not isinstance(manifest.get("files"), dict):
        raise ArchiveError(f"{src}: the manifest lists no files")
    return manifest


def read_verified(src: Path, fmt: str, mapped: tuple[str, ...] = ()) -> tuple[dict, dict[str, bytes]]:
    """The sealed manifest and every file it lists, each checked against its sha256. The files
    named in ``mapped`` come as read-only maps (:func:`statelab.mapping.map_file`: memoryviews
    that hold nothing resident once hashed), the others as bytes."""
    src = Path(src)
    manifest = read_manifest(src, fmt)
    files = {}
    for name, digest in manifest["files"].items():
        p = src / name
        if os.path.basename(name) != name or not p.is_file():
            raise ArchiveError(f"{src}: file {name} listed in the manifest is missing")
        data = map_file(p) if name in mapped else p.read_bytes()
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


def _npy(data: bytes, what: str, src, dtype) -> np.ndarray:
    try:
        arr = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ArchiveError(f"{src}: {what} is not a readable .npy array ({e})") from None
    if arr.ndim != 1 or arr.dtype != dtype:
        raise ArchiveError(f"{src}: {what} must be a 1-D {np.dtype(dtype).name} array, "
                           f"got {arr.dtype} shape {arr.shape}")
    return arr


def load_capture(src: str | os.PathLike, mapped: bool = False) -> Capture:
    """Read a capture and verify it: the manifest's seal, every file's sha256, the KV
    payload's hash and per-component hashes, the capture hashes and the token count.

    The state's arrays are read-only views of the payload (no copy). ``mapped``: the payload
    is a read-only map of ``kv.bin`` (a memoryview, see :mod:`statelab.mapping`) rather than
    bytes: verifying, comparing, crossing and exporting it then hold only the layer at hand,
    whatever the state's size."""
    manifest, files = read_verified(Path(src), FORMAT, ("kv.bin",) if mapped else ())
    for need in ("tokens.npy", "logits.npy", "kv.bin"):
        if need not in files:
            raise ArchiveError(f"{src}: manifest lists no {need}")
    tokens = _npy(files["tokens.npy"], "tokens.npy", src, np.int32)
    logits = _npy(files["logits.npy"], "logits.npy", src, np.float32)
    blob = files["kv.bin"]
    ident = manifest.get("identity")
    rec = ident.get("memory") if isinstance(ident, dict) else None
    try:
        state = KVState.view(blob, MemoryLayout.from_dict(rec) if isinstance(rec, dict) else None)  # no copy
        state.check_positions()
        kv = manifest["kv"]
        if state.sha256() != kv["sha256"]:
            raise ArchiveError(f"{src}: KV payload hash differs from the manifest")
        if state.component_hashes() != kv["components"]:
            raise ArchiveError(f"{src}: KV component hashes differ from the manifest")
        cap = Capture(manifest["prompt"]["id"], manifest["prompt"]["sha256"], tokens, logits, blob,
                      Schedule.from_dict(manifest["schedule"]), manifest["identity"], manifest.get("extra", {}))
        hashes = manifest["hashes"]
        n_tokens = manifest["prompt"]["n_tokens"]
    except KVFormatError as e:
        raise ArchiveError(f"{src}: kv.bin is not a readable state: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise ArchiveError(f"{src}: manifest lacks or mangles the field {e}") from None
    if cap.hashes() != hashes:
        raise ArchiveError(f"{src}: capture hashes differ from the manifest")
    if n_tokens != cap.n_prompt:
        raise ArchiveError(f"{src}: the manifest records {n_tokens} prompt tokens, tokens.npy holds {cap.n_prompt}")
    ctx = cap.identity.get("context") if isinstance(cap.identity, dict) else None
    sc = cap.schedule
    if isinstance(ctx, dict) and "n_ubatch" in ctx and (ctx["n_ubatch"], ctx.get("n_batch")) != (
            sc.n_ubatch, max(sc.n_batch, sc.n_ubatch)):
        raise ArchiveError(f"{src}: schedule {sc.name} (ubatch {sc.n_ubatch}) disagrees with the context it was "
                           f"formed in (ubatch {ctx.get('n_ubatch')}, batch {ctx.get('n_batch')})")
    cap.__dict__["_state"] = state
    return cap


def check_replaceable_capture(dest: str | os.PathLike) -> None:
    """Before ``save_capture(..., overwrite=True)`` on a user's path: an existing ``dest``
    must be a capture that verifies (a damaged capture or any other folder is left alone)."""
    dest = Path(dest)
    if not (dest.exists() or dest.is_symlink()):
        return
    try:
        load_capture(dest)
    except ArchiveError as e:
        raise ArchiveError(f"refusing to overwrite {dest}: not a verified statelab capture "
                           f"({' '.join(str(e).split())})") from None
    _check_replaceable(dest, FORMAT)  # and nothing in it but the capture's own files


def check_capture_dest(dest: str | os.PathLike, overwrite: bool = False) -> None:
    """Before forming a state for a user's output path: with ``overwrite`` an existing
    ``dest`` must be a capture that verifies, without it ``dest`` must not exist."""
    dest = Path(dest)
    if overwrite:
        check_replaceable_capture(dest)
    elif dest.exists() or dest.is_symlink():
        raise ArchiveError(f"output already exists: {dest} (choose another path, or --overwrite to replace a capture)")


def capture_model_path(cap: Capture) -> Path:
    """The model file a capture was formed with, found without ``--model``: the recorded path,
    else a model of the known short names (smollm2, gemma3), whichever has the recorded sha256."""
    from statelab.models import MODEL_ALIASES, model_sha256, resolve_model

    ident = cap.identity if isinstance(cap.identity, dict) else {}
    want, recorded = ident.get("model_sha256"), ident.get("model_path")
    if not isinstance(want, str):
        raise IdentityError(f"capture {cap.prompt_id} records no model identity: give --model")
    seen = []
    for cand in ([recorded] if isinstance(recorded, str) and recorded else []) + list(MODEL_ALIASES):
        try:
            path = resolve_model(cand)
        except StatelabError:  # not found, not a GGUF, a short name whose package is missing
            continue
        got = model_sha256(path)
        if got == want:
            return path
        seen.append((cand, got))
    where = f"model {recorded}" if recorded else "a model"
    if seen and seen[0][0] == recorded:
        why = f"that file now has sha256 {seen[0][1][:12]}…"
    else:
        why = "that file is not found" if recorded else "no model path is recorded"
    raise IdentityError(f"capture {cap.prompt_id} was formed with {where} (sha256 {want[:12]}…): {why} and no known "
                        "model has that hash; give --model")


def check_importable(cap: Capture, model, config, allow_other_backend: bool = False) -> None:
    """Refuse to import a capture into a context it does not belong to."""
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
    if st.n_layer and bool(st.v_trans) == bool(config.flash_attn):
        raise IdentityError(f"capture {cap.prompt_id}: state has {v_layout(st.v_trans)} but the recipient context "
                            f"runs {'with' if config.flash_attn else 'without'} flash attention (llama.cpp restores "
                            "a state only into a context of its V layout)")
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
