"""Cross-backend transplant matrix: one prompt's state formed on each backend (schedule A),
each continued in a recipient of each backend through the common receiver.

    python benchmarks/device/cross_backend.py OUT -H 2 --backends cpu,cuda,vulkan --cap 64

Writes OUT/cross_backend.md (endpoint lengths, stop reasons and the first output index at which
each cell departs from the recipient's natural endpoint and from the donor's) and OUT/cross_backend.json.
Every capture and continuation is a fresh `statelab` process (the CLI), so each context has
decoded nothing else. Needs a build that holds every backend named (e.g. CUDA + Vulkan)."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from statelab.analysis.classes import first_difference
from statelab.errors import script_main
from statelab.paths import atomic_write_text


def sl(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "statelab.cli", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"statelab {' '.join(args)} failed: {r.stderr.strip()[-400:]}")
    return r.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("-H", "--humaneval", default="2")
    ap.add_argument("--backends", default="cpu,cuda,vulkan")
    ap.add_argument("--schedule", default="A")
    ap.add_argument("--cap", type=int, default=64)
    a = ap.parse_args()
    backends = a.backends.split(",")
    a.out.mkdir(parents=True, exist_ok=True)
    for b in backends:
        cap_dir = a.out / f"cap_{b}_{a.schedule}_he{a.humaneval}"
        if not cap_dir.exists():
            sl("capture", str(cap_dir), "-H", a.humaneval, "-s", a.schedule, "--backend", b)
    ep = {}
    for donor in backends:
        for rec in backends:
            args = ["continue", str(a.out / f"cap_{donor}_{a.schedule}_he{a.humaneval}"), "--backend", rec, "--cap", str(a.cap), "--json"]
            if donor != rec:
                args.append("--allow-backend")
            ep[donor, rec] = json.loads(sl(*args))
    rows = ["| donor (formed on) \\ recipient | " + " | ".join(backends) + " |",
            "| --- | " + " | ".join("---" for _ in backends) + " |"]
    for donor in backends:
        cells = []
        for rec in backends:
            e = ep[donor, rec]
            if donor == rec:
                cells.append(f"natural: {e['length']} tok, {e['stop_reason']}")
                continue
            vs_rec = first_difference(e["tokens"], ep[rec, rec]["tokens"])
            vs_don = first_difference(e["tokens"], ep[donor, donor]["tokens"])
            fmt = lambda d: "same" if d is None else f"differs at {d}"  # noqa: E731
            cells.append(f"{e['length']} tok, {e['stop_reason']}; vs recipient's natural: {fmt(vs_rec)}; "
                         f"vs donor's natural: {fmt(vs_don)}")
        rows.append(f"| {donor} | " + " | ".join(cells) + " |")
    text = (f"# Cross-backend transplants: HumanEval/{a.humaneval}, schedule {a.schedule}, cap {a.cap}\n\n"
            f"Command: `python benchmarks/device/cross_backend.py OUT -H {a.humaneval} --backends {a.backends} "
            f"--cap {a.cap}`. Rows: the backend that formed the state; columns: the recipient that continued it "
            "through the common receiver (`statelab continue CAP --backend X --allow-backend`). Diagonal: the "
            "natural endpoint on that backend. First differences are output indices (0 = first generated token).\n\n"
            + "\n".join(rows) + "\n")
    atomic_write_text(a.out / "cross_backend.md", text)
    atomic_write_text(a.out / "cross_backend.json", json.dumps(
        {f"{d}->{r}": e for (d, r), e in ep.items()}, indent=1))
    print(text)


if __name__ == "__main__":
    sys.exit(script_main(main))
