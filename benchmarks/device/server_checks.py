#!/usr/bin/env python3
"""The three llama-server partner checks (tests/test_server.py) on one backend, as a record.

    STATELAB_LLAMA_SERVER=PATH python3 benchmarks/device/server_checks.py --backend cuda --out checks.json

For each attention mode of the server (flash attention off, and the server's default, auto),
a llama-server is started on 127.0.0.1 with the embedded model (all layers on the device for
a device backend) and the lab works on the same backend:
  (a) slot save: /completion, the slot saved over HTTP and imported (logits recomputed); the
      lab's continuation against the server's own from the saved cells;
  (b) restore: a lab capture (schedule A) restored into the slot and continued there against
      the lab's continuation;
  (c) subset cross: LATE (K and V of the late layers) from a schedule-A donor into a token-by-token recipient, restored
      and continued there against the lab's crossed endpoint.
Every check is a row of the JSON record (token ids of both sides, equal or not, or the one-line
error); the exit status is 0 when every check that ran gave equal tokens, else 1.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from statelab import prompts  # noqa: E402
from statelab.errors import StatelabError  # noqa: E402
from statelab.lab.formation import form, parse_schedule  # noqa: E402
from statelab.lab.server import (check_restore, check_slot_save, check_subset_cross, running_server,  # noqa: E402
                                 server_binary)
from statelab.runtime import ContextConfig, Model  # noqa: E402

PROMPT = "def fibonacci(n):\n    "


def run(args) -> list[dict]:
    rows: list[dict] = []
    model = Model(None, backend=args.backend)
    extra = ["-ngl", "999"] if args.backend != "cpu" else []
    for fa in ("off", "auto"):
        t0 = time.time()
        with running_server(model.path, flash_attn=fa, extra=extra, threads=args.threads) as sp:
            tags = {"server_flash_attn": fa, "backend": args.backend, "server_start_s": round(time.time() - t0, 2)}
            run_mode(sp, model, args, tags, rows)
    model.close()
    return rows


def record(rows: list[dict], name: str, tags: dict, fn) -> None:
    t = time.time()
    try:
        row = fn().as_dict()
    except StatelabError as e:
        row = {"check": name, "equal": None, "error": " ".join(str(e).split())}
    row.update(tags, seconds=round(time.time() - t, 2))
    rows.append(row)
    print(json.dumps(row), flush=True)


def run_mode(sp, model, args, tags: dict, rows: list[dict]) -> None:
    """The three checks against one running server."""
    base = ContextConfig(backend=args.backend, n_ctx=1024, n_threads=args.threads or 0)
    record(rows, "slot save -> import -> continue", tags,
           lambda: check_slot_save(sp.server, sp.slot_dir, model, base, PROMPT, args.cap)[0])
    cfg = base.with_(flash_attn=_server_flash(sp))  # the lab forms its states in the server's attention mode
    p = prompts.resolve("text:" + PROMPT + "a, b = 0, 1\n")
    record(rows, "capture -> restore -> continue", tags,
           lambda: check_restore(sp.server, sp.slot_dir, model, form(model, p, parse_schedule("A"), cfg), args.cap))
    q = prompts.resolve("text:" + PROMPT + "if n < 2:\n        return n\n")
    record(rows, "subset cross LATE -> restore -> continue", tags,
           lambda: check_subset_cross(sp.server, sp.slot_dir, model, form(model, q, parse_schedule("A"), cfg),
                                      form(model, q, parse_schedule("R"), cfg), "LATE", args.cap))


def _server_flash(sp) -> bool:
    """Whether the server stores V untransposed (flash attention): read from a slot it saves."""
    from statelab.lab.interop import read_state_file, sequence_zero_state

    sp.server.completion(PROMPT, 1, slot=0)
    sp.server.save_slot(0, "probe.bin")
    try:
        sf = read_state_file(sp.slot_dir / "probe.bin")
        return not sequence_zero_state(sf.memory, "probe").v_trans
    finally:
        (sp.slot_dir / "probe.bin").unlink(missing_ok=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--cap", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = ap.parse_args()
    print(f"llama-server: {server_binary()}", flush=True)
    rows = run(args)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))
    ran = [r for r in rows if r["equal"] is not None]
    print(f"{sum(r['equal'] for r in ran)}/{len(ran)} checks equal; {len(rows) - len(ran)} refused", flush=True)
    return 0 if all(r["equal"] for r in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
