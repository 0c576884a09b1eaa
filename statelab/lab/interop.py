"""Interop with the llama.cpp ecosystem: llama.cpp state files and llama-cpp-python states.

File formats of the pinned llama.cpp (``src/llama-context.cpp``; all integers little-endian):

sequence-state file (``llama_state_seq_save_file``; llama-server's ``/slots/{id}?action=save``)::

    u32 magic 'ggsq' (0x67677371)   u32 version 3   u32 n_token_count
    i32 tokens[n_token_count]
    the memory part of the sequence (``memory->state_write(io, seq_id)``)

whole-context file (``llama_state_save_file``)::

    u32 magic 'ggsn' (0x6767736e)   u32 version 10  u32 n_token_count
    i32 tokens[n_token_count]
    u32 arch_len, arch_len bytes    the model architecture (llm_arch_name)
    the memory part of the whole context (``memory->state_write(io, -1)``)

The whole-context stream after the tokens is exactly what ``llama_state_get_data`` returns
(``Llama.save_state().llama_state``).  Neither holds logits.  A statelab capture's KV blob is
``llama_state_seq_get_data``'s output: ``u32 0xaf143cd8, i32 seq_id`` and then the same
memory part, so conversion only adds or removes that 8-byte header; an import rewrites
the cells' sequence ids to 0 (llama-server saves slot N as sequence N).

Imports are verified before anything is written: header, token count against the cells,
positions, the tokens against the model's vocabulary (and the prompt when given), the
architecture (whole-context files), the KV geometry against the model, and finally the
real library must take the state and read it back byte for byte.
"""
from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from statelab.errors import IdentityError, StatelabError
from statelab.kvstate import KVFormatError, KVState, SEQ_STATE_MAGIC, is_quantised, type_name, v_layout
from statelab.lab.formation import Capture, REST, Schedule, context_config_for
from statelab.mapping import chunks
from statelab.models import file_sha256, read_model_info
from statelab.paths import atomic_write_pieces, output_lock
from statelab.runtime import Context, context_identity
from statelab.runtime.context import KV_TYPES
from statelab.runtime.statefile import make_llama_state

SEQ_FILE_MAGIC = 0x67677371  # 'ggsq' LLAMA_STATE_SEQ_MAGIC
SEQ_FILE_VERSION = 3  # LLAMA_STATE_SEQ_VERSION
WHOLE_FILE_MAGIC = 0x6767736E  # 'ggsn' LLAMA_SESSION_MAGIC
WHOLE_FILE_VERSION = 10  # LLAMA_SESSION_VERSION
KINDS = {"seq": (SEQ_FILE_MAGIC, SEQ_FILE_VERSION), "whole": (WHOLE_FILE_MAGIC, WHOLE_FILE_VERSION)}
_HEADER = struct.Struct("<III")
_MAX_ARCH = 256
LLAMA_TOKEN_NULL = -1
SERVER_TOKENS_VERSION = 1  # SERVER_TOKENS_STATE_VERSION of tools/server/server-common.cpp
LLAMA_DEFAULT_SEED = 0xFFFFFFFF


class InteropError(StatelabError):
    """A llama.cpp state file or llama-cpp-python state that cannot be imported or exported."""


@dataclass(frozen=True)
class StateFile:
    """A llama.cpp state file, split into its parts (nothing interpreted yet but the header)."""

    kind: str  # "seq" or "whole"
    version: int
    tokens: np.ndarray  # int32
    memory: bytes  # the memory part (what memory->state_write writes)
    arch: str | None  # whole-context files only
    source: str  # file name or a description
    sha256: str  # of the whole file
    token_packing: str = "plain"  # or llama-server's packed token list

    @property
    def format(self) -> str:
        name = "llama_state_seq_save_file" if self.kind == "seq" else "llama_state_save_file"
        return f"{name} v{self.version}"


def _u32(data: bytes, off: int, what: str, source: str) -> int:
    if off + 4 > len(data):
        raise InteropError(f"{source}: truncated file: {what} needs 4 bytes at offset {off}, the file has {len(data)}")
    return struct.unpack_from("<I", data, off)[0]


class _Cursor:
    """Sequential reads from bytes or an open file (``read(n)`` -> bytes)."""

    def __init__(self, data=None, f=None, size: int = 0):
        self.data, self.f, self.size, self.off = data, f, size if data is None else len(data), 0

    def read(self, n: int) -> bytes:
        if self.f is not None:
            out = self.f.read(n)
        else:
            out = bytes(self.data[self.off:self.off + n])
        self.off += len(out)
        return out

    def rest(self) -> memoryview:
        """Everything after the cursor, with 8 free bytes in front (room for a sequence-state
        header, so the state can be parsed in place): one buffer, read once."""
        n = self.size - self.off
        buf = bytearray(8 + n)
        if self.f is not None:
            got = self.f.readinto(memoryview(buf)[8:])
            if got != n:
                raise InteropError(f"the file changed while it was read ({got} of {n} bytes)")
        else:
            buf[8:] = memoryview(self.data)[self.off:]
        self.off = self.size
        return memoryview(buf)


def _state_bound(model, n_tok: int) -> int:
    """The most bytes the memory part of a state of ``n_tok`` tokens of ``model`` can take
    (F32 K and V, every cache part holding every cell, per-layer fields, 256 KV streams)."""
    info = model.info
    parts = len(model.memory_layout.parts) if model.memory_layout is not None else 1
    per_cell = 12 + info.n_layer * (info.n_embd_k_gqa + info.n_embd_v_gqa) * 4
    return parts * (n_tok * per_cell + 32 * (info.n_layer + 1)) + 4 * 256 + 64


def parse_state_file(data, source: str = "state file", model=None) -> StateFile:
    """Split the bytes of a llama.cpp state file (either kind); refuse anything else with one line."""
    return _parse_stream(_Cursor(data), source, model)


def _parse_stream(cur: _Cursor, source: str, model=None, digest=None) -> StateFile:
    """The header and tokens are read and checked first (with ``model``: the size the state can
    take), and only then the rest of the file, into one buffer."""
    size = cur.size
    head = cur.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise InteropError(f"{source}: {size} bytes is too short for a llama.cpp state file "
                           f"(magic, version and token count take {_HEADER.size})")
    magic, version, n_tok = _HEADER.unpack_from(head, 0)
    kind = next((k for k, (m, _v) in KINDS.items() if m == magic), None)
    if kind is None:
        what = {b"GGUF": "a GGUF model file", b"\x93NUM": "a numpy file"}.get(head[:4], "a foreign file")
        raise InteropError(f"{source}: magic 0x{magic:08x} ({head[:4]!r}) is not a llama.cpp state file "
                           f"('ggsq' 0x{SEQ_FILE_MAGIC:08x} or 'ggsn' 0x{WHOLE_FILE_MAGIC:08x}); it looks like {what}")
    want = KINDS[kind][1]
    if version != want:
        raise InteropError(f"{source}: {kind} state file version {version}, the pinned llama.cpp reads version {want} "
                           "(re-save it with a matching llama.cpp)")
    if n_tok * 4 > size - cur.off:
        raise InteropError(f"{source}: token count {n_tok} needs {n_tok * 4} bytes but only {size - cur.off} follow "
                           "the header (truncated file or a wrong count)")
    tokens = np.frombuffer(cur.read(4 * n_tok), dtype="<i4").astype(np.int32)
    packing = "plain"
    if n_tok and tokens[0] == LLAMA_TOKEN_NULL:
        tokens, packing = unpack_server_tokens(tokens, source), f"llama-server packed v{SERVER_TOKENS_VERSION}"
    arch = None
    if kind == "whole":
        arch = _read_arch_stream(cur, source)
    if cur.off == size:
        raise InteropError(f"{source}: the file ends after the tokens: no state follows (truncated file)")
    if model is not None:
        bound = _state_bound(model, max(len(tokens), 1))
        if size - cur.off > bound:
            raise InteropError(f"{source}: {size - cur.off} bytes of state follow {len(tokens)} tokens, but a state "
                               f"of {len(tokens)} tokens of this model takes at most {bound} bytes: not a state of "
                               "this model (refused before reading it)")
    memory = cur.rest()
    if digest is None:
        digest = hashlib.sha256(cur.data).hexdigest()
    return StateFile(kind, version, tokens, memory[8:], arch, source, digest, packing)


def unpack_server_tokens(words: np.ndarray, source: str) -> np.ndarray:
    """The tokens of llama-server's packed list (``server_tokens::serialize``): i32 -1, u32 version,
    u32 n and n tokens, u32 n_media and media start indices, media chunks, zero padding."""
    w = np.asarray(words, dtype="<i4").view("<u4")

    def bad(why: str):
        return InteropError(f"{source}: llama-server token list: {why}")

    if len(w) < 3:
        raise bad("truncated header")
    if w[1] != SERVER_TOKENS_VERSION:
        raise bad(f"version {int(w[1])}, the pinned llama-server writes {SERVER_TOKENS_VERSION}")
    n = int(w[2])
    if 3 + n + 1 > len(w):
        raise bad(f"{n} tokens do not fit its {len(w)} words")
    n_media = int(w[3 + n])
    if n_media:
        raise bad(f"it holds {n_media} media chunk(s) (a multimodal prompt); only text slots can be imported")
    if np.any(w[4 + n:]):
        raise bad(f"{len(w) - 4 - n} words of trailing data")
    return w[3:3 + n].view("<i4").astype(np.int32)


def _read_arch(data: bytes, off: int, source: str) -> tuple[str, int]:
    cur = _Cursor(data)
    cur.off = off
    arch = _read_arch_stream(cur, source)
    return arch, cur.off


def _read_arch_stream(cur: _Cursor, source: str) -> str:
    at = cur.off
    raw = cur.read(4)
    if len(raw) < 4:
        raise InteropError(f"{source}: truncated file: architecture name length needs 4 bytes at offset {at}, "
                           f"the file has {cur.size}")
    n = struct.unpack("<I", raw)[0]
    if n == 0 or n > _MAX_ARCH or cur.off + n > cur.size:
        raise InteropError(f"{source}: architecture name of {n} bytes at offset {at} does not fit "
                           "(truncated or not a whole-context state)")
    try:
        return cur.read(n).decode("ascii")
    except UnicodeDecodeError:
        raise InteropError(f"{source}: the architecture name at offset {at + 4} is not ASCII") from None


def read_state_file(path: str | os.PathLike, model=None) -> StateFile:
    """A llama.cpp state file, read in bounded memory: the header and tokens first (checked;
    with ``model`` also the size a state of that many tokens can take), then the state into
    one buffer; the file's sha256 is computed in chunks."""
    p = Path(path)
    if not p.is_file():
        raise InteropError(f"state file not found (or not a file): {p}")
    with open(p, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        sf = _parse_stream(_Cursor(f=f, size=size), str(p), model, digest="")
    return replace(sf, sha256=file_sha256(p))


def whole_stream(blob: bytes, arch: str) -> bytes:
    """The whole-context stream (``llama_state_get_data``) of a single-sequence capture blob."""
    return b"".join(state_file_pieces("whole", [], blob, arch)[2:])


def split_whole_stream(data: bytes, source: str) -> tuple[str, bytes]:
    """(architecture, memory part) of a ``llama_state_get_data`` stream."""
    arch, off = _read_arch(data, 0, source)
    if off == len(data):
        raise InteropError(f"{source}: the state stream ends after the architecture name")
    return arch, bytes(data[off:])


def _memory_part(blob, n_stream: int = 1) -> list:
    """The capture blob without its sequence header, as pieces (views of the blob, no copy);
    with ``n_stream`` > 1 as a cache of that many streams whose first holds the cells."""
    st = KVState.view(blob)  # a capture's blob is checked before it is handed on
    if st.seq_id != 0:
        raise InteropError(f"the capture's state is for sequence {st.seq_id}, expected 0")
    mem = memoryview(blob).cast("B")
    if n_stream == 1:
        return [mem[8:]]
    if len(st.part_list) != 1:
        raise InteropError("a state of several caches (iSWA) is written with one stream only")
    return [struct.pack("<I", n_stream), mem[12:], bytes(4 * (n_stream - 1))]


def state_file_pieces(kind: str, tokens, blob, arch: str | None = None, n_stream: int = 1) -> list:
    """The bytes of a llama.cpp state file (see :func:`encode_state_file`) as consecutive pieces:
    the header, the tokens, the architecture record (whole-context files), then the memory part
    as views of ``blob``; written one after the other, no copy of the state is made."""
    if kind not in KINDS:
        raise InteropError(f"unknown state file kind {kind!r}: use 'seq' (llama_state_seq_save_file, llama-server "
                           "slots) or 'whole' (llama_state_save_file)")
    if not 1 <= int(n_stream) <= 256:
        raise InteropError(f"n_stream must be 1..256, got {n_stream}")
    toks = np.ascontiguousarray(tokens, dtype="<i4")
    magic, version = KINDS[kind]
    head = [_HEADER.pack(magic, version, len(toks)), toks.tobytes()]
    if kind == "whole":
        if not arch:
            raise InteropError("a whole-context state file records the model architecture: give the model")
        a = arch.encode("ascii")
        head.append(struct.pack("<I", len(a)) + a)
    return head + _memory_part(blob, int(n_stream))


def encode_state_file(kind: str, tokens, blob: bytes, arch: str | None = None, n_stream: int = 1) -> bytes:
    """The bytes of a llama.cpp state file holding ``tokens`` and a capture's sequence-0 blob.
    ``n_stream``: the KV streams of the receiving context (a non-unified cache has one per
    sequence, and llama.cpp restores only a file with as many); the cells go in the first."""
    return b"".join(state_file_pieces(kind, tokens, blob, arch, n_stream))


# --------------------------------------------------------------------------- import


def single_stream(memory: bytes, source: str) -> tuple[bytes, int, int]:
    """A memory part of a cache with several streams (a non-unified KV cache: one stream per
    sequence) whose cells all lie in one stream, as a single-stream memory part.
    Returns (memory, n_stream, index of the non-empty stream)."""
    n_stream = _u32(memory, 0, "n_stream", source)
    if n_stream <= 1:
        return memory, n_stream, 0
    off = 4
    for s in range(n_stream):
        if _u32(memory, off, f"cell count of stream {s}", source):
            tail = memory[len(memory) - 4 * (n_stream - 1 - s):]
            if len(tail) != 4 * (n_stream - 1 - s) or any(tail):
                raise InteropError(f"{source}: the state's cells lie in more than one of its {n_stream} KV streams; "
                                   "import a file of one sequence")
            return struct.pack("<I", 1) + memory[off:len(memory) - len(tail)], n_stream, s
        off += 4
    return struct.pack("<II", 1, 0), n_stream, 0


def sequence_zero_state(memory, source: str) -> KVState:
    """Parse a memory part as one sequence and rewrite its cells to sequence 0 (a capture's form).
    A memory part read by :func:`read_state_file` is parsed in place (its arrays are views of
    the file's buffer, which has room for the sequence header in front): no copy is made."""
    memory = single_stream(memory, source)[0]
    head = struct.pack("<Ii", SEQ_STATE_MAGIC, -1)
    if isinstance(memory, memoryview) and isinstance(memory.obj, bytearray) and \
            len(memory.obj) == len(memory) + 8 and memory.c_contiguous:
        framed = memoryview(memory.obj)
        framed[:8] = head
    else:
        framed = head + bytes(memory)
    try:
        st = KVState.parse(framed, copy=False)
    except KVFormatError as e:
        raise InteropError(f"{source}: the state does not parse: {e}") from None
    seqs = [p.seq_ids for p in st.part_list if len(p.seq_ids)]  # every cache part (iSWA: two)
    counts = np.concatenate([np.fromiter((len(x) for x in s), dtype=np.int64, count=len(s)) for s in seqs]) \
        if seqs else np.zeros(0, np.int64)
    ids = np.concatenate([np.concatenate(s) for s in seqs]) if seqs else np.zeros(0, np.int32)
    if np.any(counts != 1) or np.unique(ids).size > 1:
        raise InteropError(f"{source}: the state holds the cells of sequences {sorted(set(ids.tolist()))} "
                           f"(shared cells: {int(np.count_nonzero(counts != 1))}); save one sequence with "
                           "llama_state_seq_save_file and import that")
    views = st.__dict__.get("meta_views") or []
    if isinstance(framed, memoryview) and len(views) == len([p for p in st.part_list if p.n_cells]):
        # the cells' tables lie in the file's buffer: rewritten there, the buffer is the capture's
        # blob (no second copy of the state)
        for table in views:
            table[:, 2] = 0
        framed[4:8] = struct.pack("<i", 0)
        st.__dict__["framed_blob"] = framed
    st.seq_id = 0  # the parsed cell meta (arrays of their own) says the same
    st.seq_ids = tuple(np.zeros((st.n_cells, 1), dtype=np.int32))
    if st.parts:
        st.parts = [replace(p, seq_ids=tuple(np.zeros((p.n_cells, 1), dtype=np.int32))) for p in st.parts]
        st.parts[0].positions = st.positions
    return st


def _blob_of(st: KVState):
    """The capture blob of a sequence-0 state: the file's buffer itself when the state was
    rewritten in place there (the codec's round trip makes it what :meth:`KVState.to_bytes`
    would give; its arrays are validated), else :meth:`KVState.to_bytes`."""
    framed = st.__dict__.get("framed_blob")
    if framed is None:
        return st.to_bytes()
    st.validate()
    return framed.obj  # a bytearray: hashed, saved and restored as it is


def _kv_type_name(t: int) -> str:
    names = {v: k for k, v in KV_TYPES.items()}
    if t not in names:
        raise InteropError(f"KV type {t} has no context setting here (supported: {', '.join(KV_TYPES)})")
    return names[t]


def check_tokens(tokens: np.ndarray, model, source: str, arch: str | None = None) -> None:
    """What the file says before its state is read: the architecture and the tokens' vocabulary."""
    info = model.info
    if arch is not None and arch != info.architecture:
        raise IdentityError(f"{source}: saved by a {arch!r} model, this model is {info.architecture!r}")
    if len(tokens) == 0:
        raise InteropError(f"{source}: the file lists no tokens (an empty state)")
    out = np.flatnonzero((tokens < 0) | (tokens >= model.n_vocab))
    if out.size:
        raise IdentityError(f"{source}: token {int(tokens[out[0]])} at index {int(out[0])} is outside this model's "
                            f"vocabulary of {model.n_vocab} ({out.size} such tokens): saved with another model's "
                            "vocabulary")


def check_against_model(tokens: np.ndarray, st: KVState, model, source: str) -> None:
    """The parsed state's cells and geometry against the file's tokens and the model."""
    info = model.info
    n = len(tokens)
    if n != st.n_cells:
        raise InteropError(f"{source}: the file lists {n} tokens but its state holds {st.n_cells} cells")
    if st.n_layer != info.n_layer:
        raise IdentityError(f"{source}: the state has {st.n_layer} layers, the model has {info.n_layer}: "
                            "saved with another model")
    widths = (set(st.n_embd_k_gqa), set(st.n_embd_v_gqa))
    if widths != ({info.n_embd_k_gqa}, {info.n_embd_v_gqa}):
        raise IdentityError(f"{source}: K/V widths {sorted(widths[0])}/{sorted(widths[1])} differ from the model's "
                            f"{info.n_embd_k_gqa}/{info.n_embd_v_gqa}: saved with another model")
    layout = model.memory_layout
    parts = st.part_list
    if layout is not None and st.parts and len(layout.parts) == len(parts):
        for p, pl in zip(parts, layout.parts):  # the window of each part, for the position check
            p.n_swa, p.swa_type = pl.n_swa, pl.swa_type
    try:
        st.check_positions()
    except KVFormatError as e:
        raise InteropError(f"{source}: {e}") from None


def check_prompt_tokens(model, prompt, tokens: np.ndarray, source: str) -> int:
    """The file's tokens must be the prompt as the model tokenizes it, possibly followed by more
    (a server slot saved after a completion holds the generated tokens too): how many follow."""
    want = model.tokenize(prompt.text)
    n = min(len(want), len(tokens))
    diff = np.flatnonzero(want[:n] != tokens[:n])
    if not diff.size and len(tokens) >= len(want):
        return len(tokens) - len(want)
    at = int(diff[0]) if diff.size else n
    raise IdentityError(f"{source}: its tokens are not {prompt.id} as this model tokenizes it: first difference at "
                        f"token {at} ({len(tokens)} tokens in the file, {len(want)} from the prompt)")


@dataclass(frozen=True)
class Incoming:
    """A state from outside statelab, split into tokens and a memory part, and where it came from."""

    tokens: np.ndarray
    memory: bytes
    arch: str | None
    source: str
    origin: dict  # format, file name, sha256 ...
    logits: np.ndarray | None = None  # logits the source itself carries (LlamaState scores)


LOGITS_MODES = ("none", "recompute", "state")


def recompute_last_logits(ctx, tokens: np.ndarray) -> np.ndarray:
    """With the state restored in ``ctx``: drop the last cell and decode the last token alone
    at its position (a one-row decode over the imported cells 0..n-2); its FP32 logits."""
    n = len(tokens)
    if not ctx.seq_rm(0, n - 1, -1):
        raise InteropError("the recipient could not remove the last cell to re-evaluate it")
    ctx.decode(tokens[n - 1:], n - 1)
    return ctx.logits(-1)


def _source_logits(inc: Incoming, logits: str, n_vocab: int) -> np.ndarray | None:
    """The logits the capture takes without a recipient ('state', 'none'); None for 'recompute'."""
    if logits not in LOGITS_MODES:
        raise InteropError(f"logits must be one of {', '.join(LOGITS_MODES)}, got {logits!r}")
    if logits == "none":
        return np.full(n_vocab, np.nan, dtype=np.float32)
    if logits == "recompute":
        return None
    lg = None if inc.logits is None else np.asarray(inc.logits, dtype=np.float32)
    # a Llama made without logits_all=True never writes its scores: the row is uninitialised memory,
    # all zeros in practice, which no model's logits are
    if lg is None or lg.shape != (n_vocab,) or not np.all(np.isfinite(lg)) or np.ptp(lg) == 0:
        raise InteropError(f"{inc.source}: the source carries no usable logits (a file holds none; a Llama made "
                           "without logits_all=True keeps none): use logits='recompute' or 'none'")
    return lg


CARRIED_TOLERANCE = 0.1  # of the recomputed row's range (see check_carried_logits)


def check_carried_logits(carried: np.ndarray, recomputed: np.ndarray, source: str) -> float:
    """Refuse carried logits that are not the state's own: ``Llama(logits_all=False)`` never
    writes its scores, so the saved row is whatever the memory held (zeros, or another
    request's logits).  The state's KV, restored in the recipient, gives the last token's logits
    again (one-row decode): a row the state carries may differ from it by what batch geometry
    changes, not by more than ``CARRIED_TOLERANCE`` of its range.  SmolLM2 on CPU, HumanEval/2:
    the state's own row (one 512-row submission) is 1.6 % of the range from the re-evaluation,
    the row of the position before it 48 % (tests/test_interop.py).  Returns the gap as a share
    of the range, which the capture's identity records (``logits.gap_of_range``)."""
    span = float(np.ptp(recomputed))
    gap = float(np.max(np.abs(carried - recomputed)))
    if not gap <= CARRIED_TOLERANCE * span:
        raise InteropError(f"{source}: the logits it carries are not its state's (they differ from the recipient's "
                           f"re-evaluation of the last token by {gap:.3g}, {gap / span:.1%} of the range; a Llama made "
                           "without logits_all=True keeps none): use logits='recompute' or 'none'")
    return gap / span


def attention_for_state(st: KVState, flash_attn: bool | None, source: str) -> bool:
    """The recipient's attention mode for a state: llama.cpp stores V untransposed exactly when
    flash attention is on (``v_trans = !flash_attn``), so the state decides; ``flash_attn``
    (an option) must agree with it. An empty state takes the option (default off)."""
    if not st.n_layer:
        return bool(flash_attn)
    want = not st.v_trans
    if flash_attn is not None and bool(flash_attn) != want:
        raise InteropError(f"{source}: state has {v_layout(st.v_trans)} but the recipient was asked to run "
                           f"{'with' if flash_attn else 'without'} flash attention; llama.cpp restores a state only "
                           f"into a context of its V layout: use {'--flash-attn' if want else '--no-flash-attn'} "
                           "or leave the option out")
    quant_v = sorted({type_name(t) for t in st.v_types if is_quantised(t)})
    if quant_v and st.v_trans:  # the codec refuses it already; kept for states built by hand
        raise InteropError(f"{source}: state has {v_layout(True)} of quantised type {quant_v[0]}, which llama.cpp "
                           "never writes (a quantised V needs flash attention)")
    return want


def _recipient_config(st: KVState, config, n: int, source: str, flash_attn: bool | None = None):
    """The recipient context: the caller's configuration with the state's KV types, its V layout
    (flash attention on for an untransposed V) and room for it."""
    kt, vt = {int(t) for t in st.k_types}, {int(t) for t in st.v_types}
    if len(kt) > 1 or len(vt) > 1:
        raise InteropError(f"{source}: layers store different KV types; a context has one K and one V type")
    fa = attention_for_state(st, flash_attn, source)
    types = {} if not kt else dict(type_k=_kv_type_name(kt.pop()), type_v=_kv_type_name(vt.pop()))
    return config.with_(**types, flash_attn=fa, n_ctx=max(config.n_ctx, n + 1))


def reads_back(ctx, blob, tokens) -> bool:
    """Whether sequence 0 of ``ctx`` reads back as ``blob``, in bounded memory: the library
    writes it to a temporary file of its own (``llama_state_seq_save_file``: header, tokens,
    then the memory part, written layer by layer), compared with the blob in 1 MiB chunks;
    no second in-memory copy of the state is made."""
    import tempfile

    from statelab.runtime import statefile

    with tempfile.TemporaryDirectory(prefix="statelab-readback-") as d:
        path = Path(d) / "seq.bin"
        statefile.seq_save_file(ctx, path, tokens)
        mem = memoryview(blob)[8:]
        with open(path, "rb") as f:
            f.seek(_HEADER.size + 4 * len(tokens))
            step, off = 1 << 20, 0
            while chunk := f.read(step):
                if mem[off:off + len(chunk)] != chunk:
                    return False
                off += len(chunk)
        return off == len(mem)


def restore_in_recipient(model, config, blob: bytes, tokens: np.ndarray, source: str, recompute: bool):
    """The real library takes the state and reads it back byte for byte; with ``recompute`` the
    last token's logits are re-evaluated there (:func:`recompute_last_logits`)."""
    n = len(tokens)
    with Context(model, config) as ctx:
        ctx.state_set(blob)
        if not reads_back(ctx, blob, tokens):
            raise InteropError(f"{source}: the state read back from llama.cpp differs from the imported one")
        if ctx.seq_pos_max(0) != n - 1:
            raise InteropError(f"{source}: restored state ends at position {ctx.seq_pos_max(0)}, expected {n - 1}")
        return recompute_last_logits(ctx, tokens) if recompute else None


_LOGITS_HOW = {
    "none": {"source": "absent", "note": "the file holds no logits; import again with logits recomputed to continue"},
    "recompute": {"source": "recomputed", "how": "the imported cells 0..n-2 restored in a fresh recipient context "
                  "(see 'recipient'), the last token decoded alone at position n-1 (one-row decode)"},
    "state": {"source": "carried by the source state (the last row of its scores)",
              "checked": f"within {CARRIED_TOLERANCE:g} of the range of the recipient's one-row re-evaluation"},
}
IMPORTED = "Imported"  # the schedule name of an imported state whose formation is unknown
_UNKNOWN = ["backend", "device", "build", "schedule (prompt submissions and ubatch)", "context parameters"]


def imported_identity(inc: Incoming, model, config, prompt, logits: str, source_backend: str | None) -> dict:
    """Identities of an imported capture: what the file says, what was checked, the rest unknown."""
    recipient = context_identity(model, config)
    checked = "tokens within the vocabulary, KV geometry" + (", architecture" if inc.arch else "") + \
        (", prompt tokenization" if prompt is not None else "") + "; the file records no model hash"
    return dict(recipient, origin="imported", backend=source_backend or "unknown", device="unknown",
                build_key="unknown", build_backend="unknown", sdist_sha256="unknown", patch_series_sha256="unknown",
                unknown=_UNKNOWN if not source_backend else _UNKNOWN[1:], model_checked=checked,
                imported=dict(inc.origin, n_tokens=len(inc.tokens)), logits=_LOGITS_HOW[logits],
                recipient={k: recipient[k] for k in ("backend", "device", "build_key", "context")})


def import_incoming(inc: Incoming, model, config, *, prompt=None, logits: str = "none",
                    source_backend: str | None = None, flash_attn: bool | None = None,
                    schedule: Schedule | None = None) -> Capture:
    """A verified capture from an incoming state (see the module docstring for the checks).
    ``schedule``: the formation the state is said to come from (prompt submissions and
    ubatch), recorded as stated; ``sham`` rebuilds it and checks that it forms this state."""
    lg = _source_logits(inc, logits, model.n_vocab)
    tokens = inc.tokens
    check_tokens(tokens, model, inc.source, inc.arch)
    st = sequence_zero_state(inc.memory, inc.source)
    check_against_model(tokens, st, model, inc.source)
    after = check_prompt_tokens(model, prompt, tokens, inc.source) if prompt is not None else None
    if schedule is not None:
        schedule = schedule.fitted(len(tokens))  # n_batch as capture would raise it
        schedule.submissions(len(tokens))  # the stated formation must fit the tokens
        config = context_config_for(schedule, config)
    config = _recipient_config(st, config, len(tokens), inc.source, flash_attn)
    blob = _blob_of(st)
    recomputed = restore_in_recipient(model, config, blob, tokens, inc.source, logits != "none")
    identity = imported_identity(inc, model, config, prompt, logits, source_backend)
    if lg is not None and logits == "state":
        identity["logits"] = dict(identity["logits"], gap_of_range=check_carried_logits(lg, recomputed, inc.source))
    if after is not None:
        identity["imported"]["tokens_after_prompt"] = after
    if prompt is not None:
        pid, psha = prompt.id, prompt.sha256
    else:
        pid = f"imported:{Path(inc.source).name}"
        psha = hashlib.sha256(model.detokenize(tokens).encode()).hexdigest()
    if schedule is not None:
        identity["formation"] = "stated at import (the file records none); sham checks that it forms this state"
        identity["unknown"] = [u for u in identity["unknown"] if not u.startswith("schedule")]
        sched = schedule
    else:
        sched = Schedule(IMPORTED, (REST,), config.n_ubatch, config.n_batch)  # capitalised: rich keeps "[Imported]"
    return Capture(pid, psha, tokens, recomputed if lg is None else lg, blob, sched, identity,
                   {"origin": "imported", "prompt_text": "given" if prompt is not None else "unknown (detokenized)"})


def incoming_from_file(sf: StateFile) -> Incoming:
    return Incoming(sf.tokens, sf.memory, sf.arch, sf.source,
                    {"format": sf.format, "file": Path(sf.source).name, "sha256": sf.sha256,
                     "tokens": sf.token_packing, "n_stream": single_stream(sf.memory, sf.source)[1]})


def import_state_file(path, model, config, **kw) -> Capture:
    """``statelab import-state``: a llama.cpp state file (either kind) as a verified capture."""
    return import_incoming(incoming_from_file(read_state_file(path, model)), model, config, **kw)


# --------------------------------------------------------------------------- export


def model_arch(capture: Capture, model_path=None) -> str:
    """The architecture of the capture's model (read from its GGUF header; the hash must match)."""
    path = model_path or capture.identity.get("model_path")
    if not path:
        raise InteropError("the capture does not name its model file: give the model")
    info = read_model_info(path)
    if info.sha256 != capture.identity.get("model_sha256"):
        raise IdentityError(f"model {path} is not the capture's model ({str(capture.identity.get('model_sha256'))[:12]}…)")
    return info.architecture


def export_state_file(capture: Capture, path, kind: str = "seq", model_path=None, overwrite: bool = False,
                      n_stream: int = 1) -> Path:
    """``statelab export-state``: write a capture as a llama.cpp state file (atomically)."""
    p = Path(path)
    if p.exists() and not (overwrite and p.is_file()):
        raise InteropError(f"output already exists: {p}" + ("" if p.is_file() else " (not a file)"))
    arch = model_arch(capture, model_path) if kind == "whole" else None
    pieces = state_file_pieces(kind, capture.tokens, capture.blob, arch, n_stream)  # views: the state streams out
    p.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(p, InteropError):  # one writer; without overwrite a file that appeared meanwhile stays
        try:
            return atomic_write_pieces(p, (c for piece in pieces for c in chunks(piece)), replace=overwrite)
        except FileExistsError:
            raise InteropError(f"output already exists: {p}") from None


# --------------------------------------------------------------------------- llama-cpp-python


def incoming_from_llama_state(state, source: str = "LlamaState") -> Incoming:
    """A ``llama_cpp.LlamaState`` (``Llama.save_state()``) as an incoming state."""
    try:
        n = int(state.n_tokens)
        data = bytes(state.llama_state)[: int(state.llama_state_size)]
        tokens = np.asarray(state.input_ids, dtype=np.int32)[:n].copy()
        scores = np.asarray(state.scores)
    except (AttributeError, TypeError, ValueError) as e:
        raise InteropError(f"{source}: not a llama_cpp.LlamaState ({e})") from None
    if len(tokens) != n:
        raise InteropError(f"{source}: n_tokens {n} but only {len(tokens)} input ids")
    arch, memory = split_whole_stream(data, source)
    last = scores[n - 1] if scores.ndim == 2 and scores.shape[0] >= n and n else None
    return Incoming(tokens, memory, arch, source,
                    {"format": "llama_cpp.LlamaState (llama_state_get_data)", "sha256": hashlib.sha256(data).hexdigest(),
                     "seed": int(state.seed)}, last)


def capture_from_llama_state(state, model, config, **kw) -> Capture:
    """A verified capture from a ``llama_cpp.LlamaState``; ``logits='state'`` takes the last row of
    its scores (only meaningful for a ``Llama(logits_all=True)``), ``'recompute'`` re-evaluates."""
    return import_incoming(incoming_from_llama_state(state), model, config, **kw)


def capture_to_llama_state(capture: Capture, n_ctx: int, score_rows: int | None = None, model_path=None,
                           seed: int = LLAMA_DEFAULT_SEED):
    """A ``llama_cpp.LlamaState`` that ``Llama.load_state`` restores (a Llama with context ``n_ctx``;
    ``score_rows``: how many rows its scores hold, n_ctx with logits_all else n_batch)."""
    n = capture.n_prompt
    if n >= n_ctx:
        raise InteropError(f"the capture has {n} tokens; a Llama with n_ctx={n_ctx} cannot continue from it")
    input_ids = np.zeros(n_ctx, dtype=np.intc)
    input_ids[:n] = capture.tokens
    rows = n if score_rows is None else min(n, int(score_rows))
    scores = np.zeros((rows, len(capture.logits)), dtype=np.single)
    if np.all(np.isfinite(capture.logits)):
        scores[-1] = capture.logits
    data = whole_stream(capture.blob, model_arch(capture, model_path))
    return make_llama_state(input_ids, scores, n, data, seed)
