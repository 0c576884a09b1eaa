"""The durable log of every experiment kind: append-only JSON lines, each record written,
flushed and fsynced by the run folder's one writer before anything else sees it, read back
checked against the kind's record schema (:mod:`statelab.experiments.records`)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from statelab.errors import ConfigError
from statelab.experiments.records import check_record


class CellLog:
    """Append-only JSON lines.  A line that a killed writer left unfinished (no trailing
    newline) is cut off when the log is opened, so every kept line is a whole record."""

    def __init__(self, path: str | os.PathLike, schema: dict | None = None, values: dict | None = None,
                 error: type[Exception] = ConfigError):
        """``schema`` (status -> field -> JSON types, :mod:`statelab.experiments.records`): every
        record read back is checked against it, one line naming the file, line and field."""
        self.path = Path(path)
        self.schema, self.values, self.error = schema, values, error
        self.lines: list[int] = []  # the line of each record of the last records() call
        self.repaired = self._repair()

    def _repair(self) -> int:
        if not self.path.is_file():
            return 0
        data = self.path.read_bytes()
        if not data or data.endswith(b"\n"):
            return 0
        keep = data.rfind(b"\n") + 1
        with open(self.path, "r+b") as f:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
        return len(data) - keep

    def records(self) -> list[dict]:
        if not self.path.is_file():
            return []
        out, lines = [], []
        for i, line in enumerate(self.path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                raise self.error(f"{self.path}: line {i} is not valid JSON (the log was edited?)") from None
            if self.schema is not None:
                check_record(rec, self.schema, self.path, i, self.error, self.values)
            out.append(rec)
            lines.append(i)
        self.lines = lines
        return out

    def done(self, spec_hash: str | None = None) -> dict[str, dict]:
        """key -> the first successful record (later duplicates, which a correct runner never
        writes, are ignored)."""
        return first_ok(self.records(), spec_hash)

    def append(self, record: dict) -> None:
        line = json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())


def first_ok(records: list[dict], spec_hash: str | None = None) -> dict[str, dict]:
    """key -> the first successful record of ``spec_hash`` (any spec when None) among ``records``."""
    out: dict[str, dict] = {}
    for r in records:
        if r.get("status") == "ok" and (spec_hash is None or r.get("spec_hash") == spec_hash):
            out.setdefault(r["key"], r)
    return out
