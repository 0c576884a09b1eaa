"""Carry a study run folder kept without captures (docs/findings/cuda/run) over to this code's
prompt identities, so that `RESUME_FROM` resumes it.

    python benchmarks/device/upgrade_run.py RUN SPEC

Before the chat-prompt change (issue 28), a ``chat:`` prompt's identity in a study's normal form
was the sha256 of its rendered text; now it is the sha256 of its message and of the model's
template (statelab.prompts.ChatPrompt.identity).  Everything else in the normal form is the
same, but the spec hash differs, so the kept CUDA run (its spec.json and every record carry
the old hash) is refused as "a study run of a different spec".  This script rewrites RUN (a
copy: it edits in place) only when the change is that one: every prompt whose recorded
identity differs must render, with this code and the spec's model, to the recorded sha256
(the same text), and the rest of the normal form must be equal.  Then spec.json gets the new
normal form and hash, and every record file in RUN the new hash in place of the old.  The
study's own resume check still applies on top: its controls form the captures again and it
refuses to go on unless they are the states the recorded cells crossed, byte for byte.
Files are rewritten through a temporary file and a rename.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

from statelab.errors import ConfigError, script_main
from statelab.experiments.matrix.spec import load_spec
from statelab.paths import atomic_write_text


def upgrade(run: Path, spec_path: str) -> tuple[str, str, list[str]]:
    """(old hash, new hash, the prompt ids whose identity was carried over)."""
    rec_path = run / "spec.json"
    if not rec_path.is_file():
        raise ConfigError(f"{run}: no spec.json (not a study run folder)")
    rec = json.loads(rec_path.read_text(encoding="utf-8"))
    spec = load_spec(spec_path)
    old, new = rec["normalized"], spec.normalized()
    new = json.loads(json.dumps(new))  # tuples as lists, as spec.json holds them
    if rec["spec_hash"] == spec.hash:
        return spec.hash, spec.hash, []
    if {k: v for k, v in old.items() if k != "prompts"} != {k: v for k, v in new.items() if k != "prompts"}:
        diff = sorted(k for k in set(old) | set(new) if k != "prompts" and old.get(k) != new.get(k))
        raise ConfigError(f"{run}: the spec differs in more than the prompt identities ({', '.join(diff)})")
    if [(p["spec"], p["id"]) for p in old["prompts"]] != [(p["spec"], p["id"]) for p in new["prompts"]]:
        raise ConfigError(f"{run}: the spec's prompts are not the run's prompts")
    carried = []
    for o, n, p in zip(old["prompts"], new["prompts"], spec.prompts):
        if o["sha256"] == n["sha256"]:
            continue
        rendered = getattr(p, "sha256", None)  # a chat: prompt renders here (its model loaded by llama.cpp)
        if rendered != o["sha256"]:
            raise ConfigError(f"{run}: prompt {p.id} renders to {rendered} with this code, not the recorded {o['sha256']}")
        carried.append(p.id)
    h_old, h_new = rec["spec_hash"], spec.hash
    for f in sorted(run.rglob("*")):
        if not f.is_file() or f.name == "spec.json":
            continue
        raw = f.read_bytes()
        text = (gzip.decompress(raw) if f.suffix == ".gz" else raw).decode("utf-8", errors="strict") \
            if f.suffix in (".gz", ".jsonl", ".json") else None
        if text is None or h_old not in text:
            continue
        text = text.replace(h_old, h_new)
        tmp = f.with_name(f".{f.name}.upgrade-tmp")
        tmp.write_bytes(gzip.compress(text.encode(), mtime=0) if f.suffix == ".gz" else text.encode())
        tmp.replace(f)
    rec.update(spec_hash=h_new, normalized=new)
    atomic_write_text(rec_path, json.dumps(rec, indent=1, sort_keys=True) + "\n")
    return h_old, h_new, carried


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("spec")
    a = ap.parse_args()
    h_old, h_new, carried = upgrade(a.run, a.spec)
    if h_old == h_new:
        print(f"{a.run}: already this code's spec hash {h_new[:12]}")
    else:
        print(f"{a.run}: spec hash {h_old[:12]} -> {h_new[:12]}; identities carried over for {', '.join(carried)}")


if __name__ == "__main__":
    sys.exit(script_main(main))
