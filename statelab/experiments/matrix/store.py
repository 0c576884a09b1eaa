"""A study's output folder (its cell log is the engine's :class:`~statelab.experiments.log.CellLog`).

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
from statelab.experiments.log import CellLog
from statelab.experiments.records import STUDY_CELL, STUDY_VALUES
from statelab.lab.archive import load_capture
from statelab.paths import atomic_write_text
from statelab.experiments.matrix.spec import FORMAT, StudyError, slug


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

    def log(self) -> CellLog:
        """The folder's cell log, every record checked against the study cell's schema."""
        return CellLog(self.cells_path, STUDY_CELL, STUDY_VALUES, error=StudyError)

    def natural_pairs(self) -> dict[str, tuple]:
        """The natural captures of the first two arms of each prompt, verified:
        ``"<prompt> A/R" -> (capture A, capture R)`` (prompts without both are left out)."""
        norm = self.read_spec()["normalized"]
        arms = list(norm["arms"])[:2]
        pairs = {}
        for p in norm["prompts"]:
            dirs = [self.capture_dir(p["id"], a) for a in arms]
            if len(arms) == 2 and all((d / "manifest.json").is_file() for d in dirs):
                pairs[f"{p['id']} {arms[0]}/{arms[1]}"] = tuple(load_capture(d) for d in dirs)
        return pairs

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
