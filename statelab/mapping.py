"""Read-only memory maps of large files (KV payloads), whose pages are given back as they are used.

A state of an 8B model is hundreds of MiB. Read through :func:`map_file`, it costs no memory
until its bytes are touched, and the codec gives the pages of each piece back to the kernel
(:func:`release`) once it has hashed, compared, copied or written it: the pages stay in the
page cache (a second pass reads them from there), but they leave the process's resident set,
so streaming over two mapped states never holds either whole. :func:`release` is a no-op for
anything that is not a view of such a map (bytes, bytearrays, arrays of their own), so every
caller may call it on whatever it was given.

Only read-only shared maps are released (dropping a page of one loses nothing); a file that
is mapped must not be changed in place meanwhile (statelab writes files whole and renames
them into place, never in place).
"""
from __future__ import annotations

import hashlib
import mmap
import os

import numpy as np
from numpy.lib.array_utils import byte_bounds

__all__ = ["CHUNK", "chunks", "is_mapped", "map_file", "release", "sha256_of"]

#: bytes hashed, copied or written between two releases
CHUNK = 16 << 20
_PAGE = mmap.PAGESIZE


class _Map(mmap.mmap):
    """A read-only shared map that knows its own address (for :func:`release`)."""

    addr: int = 0


def map_file(path: str | os.PathLike) -> memoryview:
    """The bytes of ``path`` as a read-only memoryview of a shared map (an empty file: an empty
    view of ``b""``). The map lives as long as a view of it does."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if not size:
            return memoryview(b"")
        m = _Map(f.fileno(), size, access=mmap.ACCESS_READ)
    m.addr = int(np.frombuffer(m, dtype=np.uint8, count=1).ctypes.data)
    return memoryview(m)


def _root(obj):
    """The object that owns ``obj``'s memory (through array bases and memoryviews)."""
    seen = 0
    while seen < 64:
        seen += 1
        if isinstance(obj, np.ndarray) and obj.base is not None:
            obj = obj.base
        elif isinstance(obj, memoryview):
            obj = obj.obj
        else:
            return obj
    return obj


def is_mapped(obj) -> bool:
    """True when ``obj`` (an array or memoryview) lies in a map made by :func:`map_file`."""
    return isinstance(_root(obj), _Map)


def release(obj) -> None:
    """Give back the resident pages under ``obj`` (an array or memoryview of a map made by
    :func:`map_file`; anything else: nothing happens). The bytes stay readable."""
    m = _root(obj)
    if not isinstance(m, _Map) or m.closed:
        return
    if isinstance(obj, memoryview):
        if not obj.nbytes or not obj.c_contiguous:
            return
        obj = np.frombuffer(obj.cast("B"), dtype=np.uint8)
    if not isinstance(obj, np.ndarray) or not obj.size:
        return
    lo, hi = byte_bounds(obj)
    start = max(0, (lo - m.addr) // _PAGE * _PAGE)
    end = min(len(m), hi - m.addr)
    if end > start:
        m.madvise(mmap.MADV_DONTNEED, start, end - start)


def chunks(buf, size: int = CHUNK):
    """Consecutive views of at most ``size`` bytes of a bytes-like ``buf``, each released (when
    mapped) once the caller asks for the next: ``for c in chunks(b): f.write(c)`` streams a
    mapped buffer with no more than one chunk resident."""
    mv = memoryview(buf).cast("B")
    for off in range(0, len(mv), size):
        c = mv[off:off + size]
        yield c
        release(c)


def sha256_of(buf) -> str:
    """sha256 of a bytes-like ``buf``, streamed (:func:`chunks`)."""
    h = hashlib.sha256()
    for c in chunks(buf):
        h.update(c)
    return h.hexdigest()
