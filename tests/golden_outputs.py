"""Golden outputs of the three CI-sized experiments, normalised, and the script that makes them.

The records and reports of ``studies/ci.toml`` (study), ``studies/frontier-ci.toml``
(frontier panels) and ``studies/spec-ci.toml`` (speculative campaign) must not change
when the experiment machinery is reorganised.  :func:`normalise` reduces an output folder
to what is deterministic: every JSON / JSON-lines record and manifest without timings,
process ids, hosts and absolute paths; the NetCDF results as plain data; the Markdown
reports with durations and throughputs masked; for the campaign, the request records
without their times and the contrasts without the time ratios (the times are measured, not
reproduced).  Figures (PNG, HTML) are left out: they are drawings of the same data.

Regenerate the golden files with the code of a given checkout (the first ones came from
commit 040dab2, before the fork server and the engine):

    PYTHONPATH=CHECKOUT STATELAB_THREADS=1 python tests/golden_outputs.py [--runs DIR]

writes tests/golden/{ci,frontier-ci,spec-ci}.json.  ``tests/test_golden.py`` runs the three
with the current code and compares.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from statelab.models import default_model_path

REPO = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).resolve().parent / "golden"
STUDIES = {  # name -> (cli arguments before --out, spec)
    "ci": ("study", "run", "studies/ci.toml"),
    "frontier-ci": ("frontier", "run", "studies/frontier-ci.toml"),
    "spec-ci": ("spec", "campaign", "studies/spec-ci.toml"),
}
# keys whose values are measured or name a process, a machine, a moment or a location
VOLATILE = {"timing", "pid", "host", "seconds", "wall_s", "started", "created", "created_at", "time", "t_s",
            "executor_overhead", "cells_seconds",
            "seal"}  # the seal of a manifest that holds a pid or a time
# the build's identity: a patch that changes no result (0004) changes these, in both the golden
# files and the outputs
BUILD = {"build_key", "patch_series_sha256"}
VOLATILE |= BUILD
# campaign fields that are times or derived from them: request seconds, where a cycle's time
# went (t_*), the ratio estimates, their intervals, session contrasts and threshold verdicts
CAMPAIGN_TIMES = re.compile(r"^(seconds|t_\w+|estimate|lower|upper|session_log_contrasts|above_threshold)$")
SKIP_SUFFIXES = {".png", ".html", ".lock", ".npz", ".npy", ".bin", ".log"}
SKIP_NAMES = {"runs.jsonl"}  # one line per invocation: executor, timings
_DURATION = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?(?= ?(?:s|ms|cells/min|tokens/s|x)\b)")
_PAREN_TIMES = re.compile(r"\d+ distinct worker processes")


def _paths(out: Path) -> list[tuple[str, str]]:
    """Absolute locations replaced by placeholders, longest first."""
    pairs = [(str(out.resolve()), "<OUT>"), (str(out), "<OUT>")]
    for env in ("STATELAB_GOLDEN_CHECKOUT",):
        if os.environ.get(env):
            pairs.append((os.environ[env], "<REPO>"))
    pairs.append((str(REPO), "<REPO>"))
    pairs.append((str(default_model_path()), "<MODEL>"))  # the embedded model lives in the venv
    return sorted(set(pairs), key=lambda p: -len(p[0]))


def _text(s: str, paths) -> str:
    for a, b in paths:
        s = s.replace(a, b)
    # any other checkout or venv path of the same files
    s = re.sub(r"/[^\s'\"`()]*?/(selectors|studies)(?=/|$)", r"<REPO>/\1", s)
    return s


def golden(kind: str) -> dict:
    """The golden files of ``kind`` as stored, without the build's identity (``BUILD``)."""
    def strip(obj):
        if isinstance(obj, dict):
            return {k: strip(v) for k, v in obj.items() if k not in BUILD}
        return [strip(v) for v in obj] if isinstance(obj, list) else obj
    return strip(json.loads((GOLDEN / f"{kind}.json").read_text()))


def assert_golden(out: Path, kind: str, how: str = "") -> None:
    """The output folder ``out`` of ``kind``, normalised, equals the golden files (``how``: how
    it was made, for the message), with a diff of the first file that differs."""
    import difflib

    want, got = golden(kind), normalise(out, kind)
    assert sorted(got) == sorted(want), f"{kind}{how}: other files: {sorted(set(got) ^ set(want))}"
    for name in want:
        if got[name] != want[name]:
            a = json.dumps(want[name], indent=1, sort_keys=True).splitlines()
            b = json.dumps(got[name], indent=1, sort_keys=True).splitlines()
            diff = "\n".join(list(difflib.unified_diff(a, b, "golden", "now", lineterm="", n=2))[:40])
            raise AssertionError(f"{kind}/{name} differs{how}:\n{diff}")


def _json(obj, paths, drop=VOLATILE, times: re.Pattern | None = None):
    if isinstance(obj, dict):
        return {k: _json(v, paths, drop, times) for k, v in sorted(obj.items())
                if k not in drop and not (times is not None and times.search(k))}
    if isinstance(obj, list):
        return [_json(v, paths, drop, times) for v in obj]
    if isinstance(obj, str):
        return _text(obj, paths)
    return obj


def _markdown(s: str, paths) -> str:
    s = _text(s, paths)
    s = _DURATION.sub("<t>", s)
    return _PAREN_TIMES.sub("<n> distinct worker processes", s)


def _netcdf(path: Path, paths, times: re.Pattern | None) -> dict:
    import xarray as xr

    with xr.open_dataset(path) as ds:
        ds = ds.load()
    keep = [v for v in ds.data_vars if not (times is not None and times.search(v))]
    d = ds[keep].to_dict(data="list")

    def clean(x):
        if isinstance(x, float) and np.isnan(x):
            return "nan"
        if isinstance(x, (np.floating, np.integer, np.bool_)):
            return clean(x.item())
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        if isinstance(x, np.ndarray):
            return clean(x.tolist())
        return x

    return _json(clean(d), paths, drop=VOLATILE | {"encoding"})


def normalise(out: Path, kind: str) -> dict:
    """``{relative path: normalised content}`` of one output folder."""
    out = Path(out)
    paths = _paths(out)
    times = CAMPAIGN_TIMES if kind == "spec-ci" else None
    files = {}
    for f in sorted(out.rglob("*")):
        rel = f.relative_to(out).as_posix()
        if not f.is_file() or f.suffix in SKIP_SUFFIXES or f.name in SKIP_NAMES or f.name.startswith("."):
            continue
        if f.suffix == ".json":
            files[rel] = _json(json.loads(f.read_text()), paths, times=times)
        elif f.suffix == ".jsonl":
            recs = [_json(json.loads(ln), paths, times=times) for ln in f.read_text().splitlines() if ln.strip()]
            files[rel] = sorted(recs, key=lambda r: json.dumps(r, sort_keys=True))
        elif f.suffix == ".md":
            files[rel] = _markdown(f.read_text(), paths) if kind != "spec-ci" else _campaign_md(f.read_text(), paths)
        elif f.suffix == ".nc":
            files[rel] = _netcdf(f, paths, times)
        else:
            files[rel] = {"bytes": f.stat().st_size}
    return files


def _campaign_md(s: str, paths) -> list[str]:
    """A campaign report without its measurements: decimals (times, ratios, intervals, time
    shares) masked, and a ratio row kept as its name and note (its verdict is measured)."""
    keep = []
    for line in _text(s, paths).splitlines():
        cells = line.split("|")
        if line.startswith("|") and len(cells) > 3 and "[" in line and "]" in line:  # a ratio with its interval
            line = f"|{cells[1]}| <measured> |{cells[-2]}|"
        elif ": lowest prompt " in line:  # which prompt is lowest and how many fall below 1 are measured
            line = line.split(": lowest prompt ")[0] + ": lowest prompt <measured>"
        keep.append(re.sub(r"\d+\.\d+", "<x>", line))
    return keep


def start(kind: str, out: Path, python: str = sys.executable, env: dict | None = None,
          extra: tuple = ()) -> subprocess.Popen:
    """Start one of the three with the ``statelab`` that ``python`` imports (PYTHONPATH decides);
    ``extra``: more command-line options (e.g. another executor).  :func:`finish` waits for it."""
    cmd = [python, "-m", "statelab.cli", *STUDIES[kind][:2], str(REPO / STUDIES[kind][2]), "--out", str(out), *extra]
    e = dict(os.environ if env is None else env)
    e.setdefault("STATELAB_THREADS", "1")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.stderr", "w") as err:  # a file: a pipe could fill while nobody reads
        return subprocess.Popen(cmd, cwd=str(REPO), env=e, stdout=subprocess.DEVNULL, stderr=err, text=True,
                                start_new_session=True)  # its own process group: stop() ends its workers too


def finish(proc: subprocess.Popen, out: Path) -> Path:
    out = Path(out)
    if proc.wait() != 0:
        err = (out.parent / f"{out.name}.stderr").read_text()
        raise RuntimeError(f"{' '.join(proc.args)} exited {proc.returncode}: {err.strip()[-2000:]}")
    return out


def stop(proc: subprocess.Popen) -> None:
    """End a run that :func:`start` started, with the processes it started."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        proc.wait()


def run(kind: str, out: Path, python: str = sys.executable, env: dict | None = None, extra: tuple = ()) -> Path:
    """Run one of the three (see :func:`start`) and wait for it."""
    return finish(start(kind, out, python, env, extra), out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, default=None, help="existing output folders NAME/ to normalise "
                                                            "(default: run the three now into a temporary folder)")
    ap.add_argument("--only", choices=sorted(STUDIES), action="append")
    args = ap.parse_args(argv)
    GOLDEN.mkdir(exist_ok=True)
    root = args.runs or Path(tempfile.mkdtemp(prefix="statelab-golden-"))
    for kind in args.only or sorted(STUDIES):
        out = root / kind
        if args.runs is None:
            print(f"running {kind} -> {out}", flush=True)
            run(kind, out)
        data = normalise(out, kind)
        # one line per output file (compact): small in the repository; the test prints a readable diff
        lines = [f"{json.dumps(k)}: {json.dumps(v, sort_keys=True, separators=(',', ':'))}" for k, v in sorted(data.items())]
        (GOLDEN / f"{kind}.json").write_text("{\n" + ",\n".join(lines) + "\n}\n")
        print(f"{GOLDEN / (kind + '.json')}: {len(data)} files", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
