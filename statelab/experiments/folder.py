"""An experiment's output folder: one writer at a time, claimed by a spec hash.

    OUT/.lock       held (flock) by the one process writing the folder; a second writer is
                    refused at once with one line; removed again by the process that made it
    OUT/spec.json   {"format", "spec_hash", "normalized", ...}: the normalised spec and its
                    hash (sha256 of the normal form's JSON, keys sorted).  A folder of
                    another spec is refused, and so is an edited spec.json (its normal form
                    no longer matches its hash)

Every kind's folder (study, frontier run) is one of these; the kind adds its own files.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from statelab.paths import atomic_write_text, exclusive_lock, read_json_record

LOCK_NAME = ".lock"


def normalized_hash(normalized: dict) -> str:
    """The spec hash: sha256 of the normalised spec's JSON with sorted keys."""
    return hashlib.sha256(json.dumps(normalized, sort_keys=True).encode()).hexdigest()


class RunFolder:
    def __init__(self, out: str | os.PathLike, fmt: str, error: type[Exception], kind: str):
        self.root = Path(out)
        self.fmt, self.error, self.kind = fmt, error, kind

    spec_path = property(lambda self: self.root / "spec.json")

    @contextmanager
    def writer(self, create: bool = True) -> Iterator["RunFolder"]:
        """Be the one process writing this folder (an OS lock on OUT/.lock, released when the
        block ends or the process dies).  ``create``: make the folder if missing (removed
        again if the block leaves it empty)."""
        made = False
        if not self.root.is_dir():
            if not create or self.root.exists():
                raise self.error(f"{self.root} is not a {self.kind} output folder (no spec.json)")
            self.root.mkdir(parents=True)
            made = True
        # the lock file goes again with the lock when this process made it: a refused command
        # (another spec, not a run folder, a report of a folder without results) leaves the
        # folder as it was
        with exclusive_lock(self.root / LOCK_NAME, self.error, f"{self.kind} folder {self.root}", remove="created"):
            try:
                yield self
            finally:
                if made and [p.name for p in self.root.iterdir()] == [LOCK_NAME]:
                    (self.root / LOCK_NAME).unlink()
                    self.root.rmdir()

    def read_spec(self) -> dict:
        """OUT/spec.json, its normalised spec checked against its hash (an edit is refused)."""
        rec = read_json_record(self.spec_path, self.fmt, self.error,
                               missing=f"{{folder}} is not a {self.kind} output folder (no spec.json)")
        try:
            same = normalized_hash(rec["normalized"]) == rec["spec_hash"]
        except (KeyError, TypeError, ValueError):
            same = False
        if not same:
            raise self.error(f"{self.spec_path}: the normalised spec does not match its hash (spec.json edited or "
                             "damaged); restore it or name a new --out")
        return rec

    def check(self, spec_hash: str) -> bool:
        """Refuse a folder that holds another spec's results.  True when resuming."""
        if self.spec_path.is_file():
            old = self.read_spec()
            if old["spec_hash"] != spec_hash:
                raise self.error(
                    f"{self.root} holds a {self.kind} run of a different spec (hash {old['spec_hash'][:12]}, "
                    f"this spec {spec_hash[:12]}); name a new --out to run the changed spec")
            return True
        if self.root.exists() and any(p.name != LOCK_NAME for p in self.root.iterdir()):
            raise self.error(f"{self.root} exists, is not empty and holds no spec.json; name a new --out")
        return False

    def claim(self, spec_hash: str, record: dict) -> bool:
        """Check the folder and, when new, write OUT/spec.json.  True when resuming."""
        resuming = self.check(spec_hash)
        if not resuming:
            self.root.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.spec_path, json.dumps(record, indent=2, sort_keys=True))
        return resuming
