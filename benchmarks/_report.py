"""Write one benchmark's section into docs/benchmarks.md (other sections are kept)."""
from __future__ import annotations

import platform
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from statelab.paths import atomic_write_text  # noqa: E402

DOC = REPO / "docs" / "benchmarks.md"
HEADER = ("# Benchmarks\n\nEvery number here was written by the script named in its section; "
          "ratios are measured side by side (interleaved rounds) in one run. Rerun a section with "
          "its command.\n")


def machine() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = "?"
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os

    return f"{time.strftime('%Y-%m-%d')}, commit {commit}, {cpu}, {os.cpu_count()} cores"


def update_section(key: str, title: str, body: str, doc: Path = DOC) -> None:
    text = doc.read_text() if doc.exists() else HEADER
    start, end = f"<!-- bench:{key} -->", f"<!-- /bench:{key} -->"
    block = f"{start}\n## {title}\n\n{body.rstrip()}\n{end}"
    pat = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    text = pat.sub(lambda _m: block, text) if pat.search(text) else text.rstrip() + "\n\n" + block + "\n"
    atomic_write_text(doc, text)
