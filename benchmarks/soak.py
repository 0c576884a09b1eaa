"""Soak: many requests (capture -> subset cross -> continue) in one process and in a
long-lived worker process; resident memory and open file descriptors must stay flat and
every endpoint must equal the first request's.

    .venv/bin/python benchmarks/soak.py --requests 1000 [--cap 8] [--task HumanEval/2]

One request: form the prompt's state with schedule A and archive it (statelab.lab.archive, a
new folder), load it back verified, subset cross L0_V + LATE from it into the recipient
(the prompt formed once with schedule R), continue from the archived capture through the
common receiver (as `statelab continue`), delete the folder.  Mode "in-process" runs the
requests in this process; mode "worker" starts `soak.py --serve` once and sends it the
requests one by one over a pipe (the worker loads the model once and serves them all).
RSS and the number of open fds are sampled every --every requests (in-process: this
process; worker: the worker's pid); growth = last sample / the sample at the end of the
warm-up - 1.  Goal: growth < 5 % for both, endpoints all equal.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from _report import machine, update_section

from statelab import prompts
from statelab.errors import script_main
from statelab.lab.archive import load_capture, save_capture
from statelab.lab.formation import PRESETS, form
from statelab.lab.intervene import sham, subset_cross
from statelab.runtime import ContextConfig, Model
from statelab.selection import load_selector, select

GOAL = 0.05


def _ep_hash(ep) -> str:
    return hashlib.sha256(ep.tokens.astype("<i4").tobytes() + bytes([ep.eog])).hexdigest()[:16]


class Server:
    """The state of one soak process: the model, the recipient capture, the selection."""

    def __init__(self, task: str, cap: int, tmp: Path):
        self.model = Model()
        self.base = ContextConfig()
        self.p = prompts.resolve(task)
        self.cap = cap
        self.tmp = tmp
        self.recipient = form(self.model, self.p, PRESETS["R"], self.base)
        st = self.recipient.state
        self.sel = select(load_selector("L0_V"), st) | select(load_selector("LATE"), st)

    def request(self, i: int) -> dict:
        folder = self.tmp / f"req-{i}"
        save_capture(form(self.model, self.p, PRESETS["A"], self.base), folder)
        donor = load_capture(folder)
        crossed, acc = subset_cross(self.model, donor, self.recipient, self.sel, self.cap)
        cont = sham(self.model, donor, self.cap)
        shutil.rmtree(folder)
        return {"cross": _ep_hash(crossed), "continue": _ep_hash(cont), "changed_bytes": acc.changed_bytes,
                "kv": donor.hashes()["kv"][:16]}


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _serve(task: str, cap: int) -> int:
    """Worker mode: one JSON request per stdin line ({"i": N}), one JSON result per stdout line."""
    with tempfile.TemporaryDirectory(prefix="soak-worker-") as tmp:
        srv = Server(task, cap, Path(tmp))
        sys.stdout.write(json.dumps({"ready": os.getpid()}) + "\n")
        sys.stdout.flush()
        for line in sys.stdin:
            req = json.loads(line)
            sys.stdout.write(json.dumps(srv.request(int(req["i"]))) + "\n")
            sys.stdout.flush()
    return 0


def soak(mode: str, n: int, warmup: int, every: int, task: str, cap: int) -> dict:
    t0 = time.perf_counter()
    proc = None
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        if mode == "in-process":
            srv = Server(task, cap, Path(tmp))
            pid, call = os.getpid(), srv.request
        else:
            proc = subprocess.Popen([sys.executable, __file__, "--serve", "--task", task, "--cap", str(cap)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
            pid = json.loads(proc.stdout.readline())["ready"]

            def call(i):
                proc.stdin.write(json.dumps({"i": i}) + "\n")
                line = proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"the worker exited with status {proc.wait()}")
                return json.loads(line)
        me = psutil.Process(pid)
        first, samples, unequal = None, [], []
        t1 = time.perf_counter()
        for i in range(n):
            r = call(i)
            if first is None:
                first = r
            elif r != first:
                unequal.append(i)
            if (i + 1) % every == 0 or i + 1 == n:
                samples.append({"request": i + 1, "rss": me.memory_info().rss, "fds": _fds(pid)})
        seconds = time.perf_counter() - t1
        if proc is not None:
            proc.stdin.close()
            proc.wait(timeout=60)
    base = next(s for s in samples if s["request"] >= warmup)
    last = samples[-1]
    peak = max(s["rss"] for s in samples if s["request"] >= warmup)
    return {"mode": mode, "requests": n, "warmup": warmup, "seconds": seconds, "setup_s": t1 - t0,
            "rss_warm": base["rss"], "rss_last": last["rss"], "rss_peak": peak,
            "rss_growth": last["rss"] / base["rss"] - 1, "fds_warm": base["fds"], "fds_last": last["fds"],
            "fds_growth": last["fds"] / base["fds"] - 1, "unequal": unequal, "first": first, "samples": samples}


def markdown(results: list[dict], args) -> str:
    cmd = (f"`.venv/bin/python benchmarks/soak.py --requests {args.requests} --warmup {args.warmup} "
           f"--cap {args.cap} --task {shlex.quote(args.task)}`")
    lines = [f"Command: {cmd} (STATELAB_THREADS=1)  ", f"Machine: {machine()}", "",
             f"One request: capture ({args.task}, schedule A, archived and loaded back verified) -> subset cross "
             f"L0_V + LATE into the recipient (schedule R, formed once) -> continue from the capture through the "
             f"common receiver; cap {args.cap}.  Growth is the last sample over the sample after {args.warmup} "
             f"warm-up requests; goal < {GOAL:.0%}. s/request is wall time on a machine that may run other jobs, "
             "the modes one after the other: not a comparison of the modes.", "",
             "| mode | requests | s/request | RSS after warm-up | RSS last | RSS peak | RSS growth | fds after warm-up "
             "| fds last | fd growth | endpoints equal to the first | goal |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ok = r["rss_growth"] < GOAL and r["fds_growth"] < GOAL and not r["unequal"]
        mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
        lines.append(f"| {r['mode']} | {r['requests']} | {r['seconds'] / r['requests']:.3f} | {mib(r['rss_warm'])} | "
                     f"{mib(r['rss_last'])} | {mib(r['rss_peak'])} | {r['rss_growth']:+.2%} | {r['fds_warm']} | "
                     f"{r['fds_last']} | {r['fds_growth']:+.2%} | {r['requests'] - len(r['unequal'])} of "
                     f"{r['requests']} | {'met' if ok else 'NOT met'} |")
    f = results[0]["first"]
    lines += ["", f"First request: cross endpoint {f['cross']}, continue endpoint {f['continue']}, "
                  f"{f['changed_bytes']} bytes changed by the subset cross, donor KV {f['kv']}."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--cap", type=int, default=8)
    ap.add_argument("--task", default="text:def is_prime(n):", help="a short prompt keeps 1,000 requests cheap")
    ap.add_argument("--modes", default="in-process,worker")
    ap.add_argument("--json", type=Path, help="also write every sample here")
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        return _serve(a.task, a.cap)
    if not 0 < a.warmup < a.requests:
        ap.error("--warmup must be between 0 and --requests")
    results = []
    for mode in a.modes.split(","):
        r = soak(mode, a.requests, a.warmup, a.every, a.task, a.cap)
        print(f"{mode}: {a.requests} requests in {r['seconds']:.0f} s; RSS {r['rss_warm'] / 2**20:.1f} -> "
              f"{r['rss_last'] / 2**20:.1f} MiB ({r['rss_growth']:+.2%}), fds {r['fds_warm']} -> {r['fds_last']} "
              f"({r['fds_growth']:+.2%}), {len(r['unequal'])} endpoints differ from the first", flush=True)
        results.append(r)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    md = markdown(results, a)
    print(md)
    if not a.no_write:
        update_section("soak", "Soak: capture -> subset cross -> continue", md)
    firsts = {json.dumps(r["first"], sort_keys=True) for r in results}
    if len(firsts) != 1:
        print("the modes' first endpoints differ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(script_main(main))
