"""The lab's own operations on a long state of a real model: capture, verify, cross and export
times, each step's peak resident memory beside the state's size.

    .venv/bin/python benchmarks/state_scale.py --model FILE [--tokens 4096] [--backend cuda] [--json OUT]

One process, one model load. The prompt is HumanEval's prompts joined in order until it holds
at least ``--tokens`` tokens (the count reached is reported; the context is sized to it). Steps,
each through the library function its command calls, timed with ``perf_counter`` and with the
growth of the resident set's peak over what the process held before the step (``VmHWM`` reset
through ``/proc/self/clear_refs`` before it; ``ru_maxrss`` where that is not allowed, then a
whole-run peak). On a GPU backend the KV cache lives in device memory; host memory is what the
lab's own copies cost. The growth is split too, sampled every 2 ms: anonymous memory (what
the lab and llama.cpp allocate: copies, contexts) and file-backed pages (the mapped captures a
step reads, which the kernel can drop):

- capture A: ``form`` with schedule A (the prompt as one submission, ubatch 512) and
  ``save_capture`` (the archive written and sealed)
- capture B: the same with schedule B (128 tokens, then the rest), the donor of the cross
- verify: ``load_capture`` of A's folder as a read-only map (seal, every file's sha256, the KV
  payload's and per-component hashes; what every command does before it uses a capture)
- a context of A's configuration alone, created and closed: what llama.cpp allocates for it
  (on the CPU backend the KV cache itself), the part of the cross and import steps that is not
  the lab's
- cross: ``cross`` B -> A (the donor's whole KV imported into A's path, ``--cap`` tokens decoded)
- export: ``export_state_file`` (a ``llama_state_seq_save_file`` file) and ``import_state_file``
  (that file read back, checked and restored into a context: a verified capture)

The figures depend on the model's geometry and the backend, not on its weights: a synthetic model
of a published shape (``statelab model synth``) measures the lab at that size.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _rss import Peak, status  # noqa: E402  (benchmarks/: the script's own folder)


class Sampler:
    """The largest anonymous and file-backed resident sizes seen over a block (RssAnon and
    RssFile of /proc/self/status, read every 2 ms on a thread): copies the lab makes are
    anonymous memory; the pages of a mapped capture it reads are file-backed."""

    def __init__(self):
        import threading

        self.anon = self.file = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.anon = max(self.anon, status("RssAnon:"))
            self.file = max(self.file, status("RssFile:"))
            self._stop.wait(0.002)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def long_prompt(model, n_tokens: int):
    """HumanEval's prompts joined in order until the text holds at least n_tokens tokens."""
    from statelab import prompts
    from statelab.prompts import Prompt

    parts, n = [], 0
    for tid in prompts.humaneval_ids():
        parts.append(prompts.humaneval(tid).text)
        n = len(model.tokenize("\n".join(parts)))
        if n >= n_tokens:
            break
    text = "\n".join(parts)
    return Prompt(f"humaneval-joined-{len(parts)}", text, "HumanEval prompts 0.. joined"), n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path, help="GGUF file")
    ap.add_argument("--tokens", type=int, default=4096, help="at least this many prompt tokens (default 4096)")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: the library's default)")
    ap.add_argument("--cap", type=int, default=16, help="tokens decoded by the cross (default 16)")
    ap.add_argument("--json", type=Path, help="write the figures as JSON too")
    a = ap.parse_args(argv)

    from statelab.lab.archive import load_capture, save_capture
    from statelab.lab.formation import form, parse_schedule
    from statelab.lab.interop import export_state_file, import_state_file
    from statelab.lab.intervene import config_of, cross
    from statelab.paths import atomic_write_text
    from statelab.runtime import Context, ContextConfig, Model

    peak = Peak()
    rows: list[dict] = []

    def step(name, fn):
        peak.reset()
        before, anon0, file0 = status("VmRSS:"), status("RssAnon:"), status("RssFile:")
        with Sampler() as s:
            t0 = time.perf_counter()
            out = fn()
            dt = time.perf_counter() - t0
        rows.append({"step": name, "seconds": dt, "rss_before": before, "growth": max(0, peak.read() - before),
                     "anon_growth": max(0, s.anon - anon0), "file_growth": max(0, s.file - file0)})
        print(f"{name}: {rows[-1]['seconds']:.3f} s, peak growth {rows[-1]['growth'] / 2**20:.0f} MiB", flush=True)
        return out

    m = step("model load", lambda: Model(a.model, backend=a.backend))
    prompt, n = long_prompt(m, a.tokens)
    base = ContextConfig(backend=a.backend, n_ctx=n + a.cap + 8, **({"n_threads": a.threads} if a.threads else {}))
    with tempfile.TemporaryDirectory(prefix="state-scale-") as tmp:
        d = Path(tmp)
        cap_a = step("capture A (prefill)", lambda: form(m, prompt, parse_schedule("A"), base))
        step("capture A (archive written)", lambda: save_capture(cap_a, d / "A"))
        size = len(cap_a.blob)
        cap_b = step("capture B (prefill)", lambda: form(m, prompt, parse_schedule("B"), base))
        step("capture B (archive written)", lambda: save_capture(cap_b, d / "B"))
        cap_a = cap_b = None  # the captures live on as their archives
        ra = step("verify A (load, every hash)", lambda: load_capture(d / "A", mapped=True))
        step("a context of A's configuration alone (created, closed)", lambda: Context(m, config_of(ra)).close())
        rb = load_capture(d / "B", mapped=True)
        ep, acc = step(f"cross B -> A (import, {a.cap} tokens)", lambda: cross(m, rb, ra, cap=a.cap))
        step("export (llama.cpp state file)", lambda: export_state_file(ra, d / "A.state"))
        step("import (state file -> verified capture)", lambda: import_state_file(d / "A.state", m, config_of(ra)))
        file_size = (d / "A.state").stat().st_size
    m.close()

    geo = f"{n} tokens, state {size / 2**20:.1f} MiB (payload), state file {file_size / 2**20:.1f} MiB"
    print(f"\n{a.model.name} on {a.backend}: {geo}; cross changed {acc.changed_bytes} B, "
          f"first differing layer {acc.first_differing_layer}\n")
    print("| step | seconds | resident before (MiB) | peak growth (MiB) | growth / state | anonymous growth / state "
          "| file-backed growth / state |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['step']} | {r['seconds']:.3f} | {r['rss_before'] / 2**20:.0f} | {r['growth'] / 2**20:.0f} "
              f"| {r['growth'] / size:.2f} | {r['anon_growth'] / size:.2f} | {r['file_growth'] / size:.2f} |")
    if not peak.resettable:
        print("\n(peaks are the process's whole-run peak: /proc/self/clear_refs was not writable)")
    if a.json:
        atomic_write_text(a.json, json.dumps({"model": str(a.model), "backend": a.backend, "tokens": n, "state_bytes": size,
                                      "state_file_bytes": file_size, "steps": rows,
                                      "peak_resettable": peak.resettable}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
