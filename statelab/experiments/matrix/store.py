"""A study's output folder and its durable cell log.

    OUT/.lock                       held (flock) by the one process writing the folder
    OUT/spec.json                   the normalised spec and its hash (a different spec is refused;
                                    the hash is checked against the spec on every read)
    OUT/captures/<prompt>/<arm>/    each arm's capture, formed once (statelab.lab.archive format)
    OUT/controls/<prompt>.json      natural endpoints, shams, EMPTY/ALL controls, withheld reason
    OUT/cells.jsonl                 one JSON line per finished cell (written, flushed, fsynced)
    OUT/results.nc                  the compiled xarray Dataset (written atomically)
    OUT/report.md                   the Markdown report (written atomically)
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from statelab.experiments.folder import RunFolder
from statelab.experiments.records import check_record
from statelab.paths import atomic_write_text
from statelab.experiments.matrix.spec import FORMAT, StudyError, StudySpec, slug


class StudyDir(RunFolder):
    def __init__(self, out: str | os.PathLike):
        super().__init__(out, FORMAT, StudyError, "study")

    cells_path = property(lambda self: self.root / "cells.jsonl")
    results_path = property(lambda self: self.root / "results.nc")
    report_path = property(lambda self: self.root / "report.md")

    def capture_dir(self, prompt_id: str, arm: str) -> Path:
        return self.root / "captures" / slug(prompt_id) / arm

    def controls_path(self, prompt_id: str) -> Path:
        return self.root / "controls" / f"{slug(prompt_id)}.json"

    def claim(self, spec: StudySpec) -> bool:  # type: ignore[override]
        return super().claim(spec.hash, spec.record())

    # ------------------------------------------------------------------ controls
    def read_controls(self, prompt_id: str) -> dict | None:
        p = self.controls_path(prompt_id)
        if not p.is_file():
            return None
        try:
            return json.loads(p.read_text())
        except ValueError:
            return None

    def write_controls(self, prompt_id: str, rec: dict) -> None:
        atomic_write_text(self.controls_path(prompt_id), json.dumps(rec, indent=2, sort_keys=True))

    def all_controls(self) -> dict[str, dict]:
        out = {}
        d = self.root / "controls"
        if d.is_dir():
            for p in sorted(d.glob("*.json")):
                try:
                    rec = json.loads(p.read_text())
                except ValueError:
                    continue
                out[rec["prompt"]] = rec
        return out


class CellLog:
    """Append-only JSON lines.  A line that a killed writer left unfinished (no trailing
    newline) is cut off when the log is opened, so every kept line is a whole record."""

    def __init__(self, path: str | os.PathLike, schema: dict | None = None, values: dict | None = None,
                 error: type[Exception] = StudyError):
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
