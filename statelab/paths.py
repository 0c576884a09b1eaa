"""Cache locations, atomic file writes (temporary file in the same folder, then rename) and
reading a JSON record that states its format."""
from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def cache_dir() -> Path:
    base = os.environ.get("STATELAB_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "statelab")
    p = Path(base)
    p.mkdir(parents=True, exist_ok=True)
    return p


@contextmanager
def atomic_path(path: str | os.PathLike, umask_mode: bool = False) -> Iterator[Path]:
    """Yield a temporary path in ``path``'s folder (which must exist) for the caller to write;
    when the block ends without error the file is fsynced and renamed to ``path``, otherwise
    it is removed.  The temporary file is created empty with mode 0600; with ``umask_mode`` it
    gets the mode of an ordinary new file instead (0666 less the umask)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        if umask_mode:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        yield Path(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode())


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
    if record.get("format") != fmt:
        raise error(wrong_format.format(folder=folder, file=file, got=record.get("format"), want=fmt))
    return record
