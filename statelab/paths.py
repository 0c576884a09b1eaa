"""Cache locations, atomic file writes (temporary file in the same folder, then rename),
cleanup of the temporaries a killed process left, an exclusive lock on a folder, and
reading a JSON record that states its format.

Temporaries are named ``.NAME.HOST-PID.XXXXXXXX[.tmp]`` beside their target NAME: the next
write of the same target removes those whose process no longer runs on this host."""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

_OWNER = re.compile(r"^(?P<host>.+)-(?P<pid>\d+)\.")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def slug(text: str, fallback: str = "prompt", sep: str = "_") -> str:
    """The one file-name form of an id: every run of other characters than letters, digits and
    ``._-`` becomes ``sep`` (``HumanEval/2`` -> ``HumanEval_2``), no dot or separator at the ends."""
    return _UNSAFE.sub(sep, str(text)).strip("._" + sep) or fallback


def cache_dir() -> Path:
    base = os.environ.get("STATELAB_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "statelab")
    p = Path(base)
    p.mkdir(parents=True, exist_ok=True)
    return p


def temp_prefix(path: str | os.PathLike) -> str:
    """The name prefix of this process's temporaries for ``path``: ``.NAME.HOST-PID.``."""
    return f".{Path(path).name}.{socket.gethostname()}-{os.getpid()}."


def process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


REPLACED = "replaced"  # suffix of the previous version a replacing writer moved aside (see below)


def clean_stale_temporaries(path: str | os.PathLike) -> list[Path]:
    """Remove the temporaries (files or folders) that a killed process left for ``path``:
    siblings named by :func:`temp_prefix` whose process no longer runs on this host.  Those
    of live processes, of other hosts and every other name are left alone.  A writer killed
    while replacing ``path`` (after moving the old version aside as ``<prefix>replaced``, before
    renaming the new one into place) leaves ``path`` missing: the old version is put back."""
    path = Path(path)
    prefix, host = f".{path.name}.", socket.gethostname()
    removed = []
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return removed
    for e in entries:
        if not e.name.startswith(prefix):
            continue
        m = _OWNER.match(e.name[len(prefix):])
        if m is None or m["host"] != host or process_alive(int(m["pid"])):
            continue
        if e.name.endswith(REPLACED) and not os.path.lexists(path):
            os.replace(e.path, path)
            continue
        try:
            if e.is_dir(follow_symlinks=False):
                shutil.rmtree(e.path)
            else:
                os.unlink(e.path)
        except FileNotFoundError:  # another process cleaned it first
            pass
        removed.append(Path(e.path))
    return removed


@contextmanager
def exclusive_lock(lock_file: str | os.PathLike, error: Callable[[str], Exception], what: str,
                   remove: str | None = None) -> Iterator[Path]:
    """Hold an exclusive OS lock (``flock``) on ``lock_file`` (created if missing) for the
    block; the lock dies with the process.  If another process holds it, raise
    ``error(message)`` at once naming ``what`` and the holder's pid.  ``remove``: None keeps
    the file, "created" removes it when the block ends if this call created it (a refused
    command leaves a folder as it was), "always" removes it (a lock file of its own name).
    Removal is safe: a lock is only held on the file the path names (a process that locked
    a file removed meanwhile opens the path again)."""
    lock_file = Path(lock_file)
    for _ in range(100):
        try:
            fd, created = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:
            try:
                fd, created = os.open(lock_file, os.O_RDWR), False
            except FileNotFoundError:  # removed in between: try again
                continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise error(f"{what} is in use by another statelab process ({holder}); wait for it to finish "
                        "or choose another folder") from None
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.stat(lock_file).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the file was removed by its last holder: lock the one the path names now
    else:  # pragma: no cover - a hundred removals in a row
        raise error(f"{what}: cannot lock {lock_file}")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield lock_file
    finally:
        try:
            if remove == "always" or (remove == "created" and created):
                try:
                    os.unlink(lock_file)  # while still held: the next one creates (and locks) a new file
                except FileNotFoundError:
                    pass
        finally:
            os.close(fd)  # releases the lock


def output_lock(path: str | os.PathLike, error: Callable[[str], Exception]):
    """The lock of one output file or folder ``path`` (``.NAME-lock`` beside it, removed
    again; one that a killed writer left is taken over and removed by the next): one writer
    at a time; a second is refused at once with ``error``.  (Not ``.NAME.*``: those names
    are the writers' temporaries.)"""
    full = Path(os.path.abspath(path))  # "." and "dir/.." name a folder too
    lock = full.parent / f".{full.name or 'root'}-lock"
    return _output_lock(lock, error, path)


@contextmanager
def _output_lock(lock: Path, error: Callable[[str], Exception], path) -> Iterator[Path]:
    try:
        held = exclusive_lock(lock, error, f"output {path}", remove="always")
        held.__enter__()
    except OSError as e:  # a folder that cannot be written (missing, read-only, /proc...)
        raise error(f"cannot write {path}: {e.strerror or e}") from None
    try:
        yield lock
    except BaseException:
        if not held.__exit__(*sys.exc_info()):
            raise
    else:
        held.__exit__(None, None, None)


_RENAME_NOREPLACE = 1


def _renameat2():
    import ctypes

    try:
        f = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return f


def rename_noreplace(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename ``src`` to ``dst`` unless ``dst`` exists (FileExistsError then), atomically
    (``renameat2(RENAME_NOREPLACE)``; where the system lacks it: a hard link for a file, a
    rename that the kernel refuses over a non-empty folder for a folder)."""
    import ctypes
    import errno

    src, dst = os.fspath(src), os.fspath(dst)
    f = _renameat2()
    if f is not None:
        AT_FDCWD = -100
        if f(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        e = ctypes.get_errno()
        if e not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise OSError(e, os.strerror(e), dst)
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
    if os.path.isdir(src):
        os.rename(src, dst)
    else:
        os.link(src, dst)
        os.unlink(src)


def _process_umask() -> int:
    """The process's umask, read once at import (os.umask can only be read by setting it,
    which is not safe while other threads create files)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


_UMASK = _process_umask()


@contextmanager
def atomic_path(path: str | os.PathLike, replace: bool = True) -> Iterator[Path]:
    """Yield a temporary path in ``path``'s folder (which must exist) for the caller to write;
    when the block ends without error the file is fsynced and renamed to ``path``, otherwise
    it is removed.  The file gets the mode of an ordinary new file (0666 less the umask), not
    the 0600 of a temporary file.  ``replace=False``: an existing ``path`` (even one that
    appeared meanwhile) is never replaced: FileExistsError, and the temporary is removed."""
    path = Path(path)
    clean_stale_temporaries(path)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path), suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        os.chmod(tmp, 0o666 & ~_UMASK)
        yield Path(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            rename_noreplace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes, replace: bool = True) -> Path:
    return atomic_write_pieces(path, [data], replace)


def atomic_write_pieces(path: str | os.PathLike, pieces: Iterable, replace: bool = True) -> Path:
    """``path`` holding the byte pieces (bytes-like objects) one after the other, written
    atomically as :func:`atomic_path` does, piece by piece: nothing is joined in memory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path, replace) as tmp:
        with open(tmp, "wb") as f:
            for piece in pieces:
                f.write(piece)
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode())


def atomic_write_netcdf(path: str | os.PathLike, ds) -> Path:
    """An xarray Dataset as NETCDF4 (netcdf4 engine), written atomically with the mode of an
    ordinary new file: the one NetCDF writer of every experiment, audit and report."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        ds.to_netcdf(tmp, engine="netcdf4", format="NETCDF4")
    return path


def read_json_record(file: Path, fmt: str, error: Callable[[str], Exception], *, missing: str,
                     invalid: str = "{file} is not valid JSON: {error}",
                     wrong_format: str = "{file} has format {got!r}, expected {want!r}") -> dict:
    """Read the JSON object in ``file`` and check that its ``format`` is ``fmt``.

    A missing file, invalid JSON or another format raise ``error(message)``; the messages are
    templates formatted with ``folder`` (the file's folder), ``file``, ``error`` (the JSON
    error, for ``invalid``), ``got`` and ``want`` (the formats, for ``wrong_format``)."""
    file = Path(file)
    folder = file.parent
    if not file.is_file():
        raise error(missing.format(folder=folder, file=file))
    try:
        record = json.loads(file.read_text())
    except ValueError as e:
        raise error(invalid.format(folder=folder, file=file, error=e)) from None
    got = record.get("format") if isinstance(record, dict) else None
    if got != fmt:
        raise error(wrong_format.format(folder=folder, file=file, got=got, want=fmt))
    return record
