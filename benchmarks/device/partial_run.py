"""A findings run that did not finish, kept compactly, and what its records say.

    python benchmarks/device/partial_run.py pack RUN DEST     # RUN: the folder findings-partial brought back
    python benchmarks/device/partial_run.py summary DEST      # e.g. docs/findings/vulkan/partial

``pack`` writes DEST/spec.json, controls.jsonl.gz (one control per line), cells-unequal.jsonl.gz
(the whole records of the prompts whose arms formed more than one state) and cells-compact.jsonl.gz
(every cell's key, class, endpoint sha256, length, changed bytes, same_cross_as, process, start and
cell seconds in its batch process), gzip without a time stamp, so packing the same run twice gives
the same bytes.  ``summary`` prints the counts docs/findings.md cites: the prompts with one state
(and each prompt's rest after 128 tokens), the classes of the recorded cells, the span and rate of
the batch processes, the independent class-B coordinates of the other prompts (directions whose
arms are byte-identical folded), and the crosses a study of the whole spec decodes when a cross is
named by the bytes it imports (``cells.cross_identity``)."""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import Counter
from pathlib import Path

from statelab.experiments.findings_inputs import jsonl as records  # plain or gzipped JSON lines

COMPACT = ("key", "klass", "endpoint_sha256", "length", "changed_bytes", "same_cross_as", "pid")


def _write_gz(path: Path, lines) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0, compresslevel=9) as o:
        for line in lines:  # no name and no time in the header: the same records, the same bytes
            o.write(line.encode())
    tmp.replace(path)


def one_state(control: dict) -> bool:
    return all(p["kv_identical"] for p in control["arm_pairs"].values())


def pack(run: Path, dest: Path) -> int:
    controls = [json.loads(p.read_text()) for p in sorted((run / "controls").glob("*.json"))]
    gz, plain = run / "cells.jsonl.gz", run / "cells.jsonl"
    raw = gzip.decompress(gz.read_bytes()).decode() if gz.is_file() else plain.read_text() if plain.is_file() else ""
    lines = raw.splitlines(keepends=True)
    lines = lines if not lines or lines[-1].endswith("\n") else lines[:-1]  # a line still being written is left out
    cells = [json.loads(line) for line in lines]
    if not (run / "spec.json").is_file() or not controls or not cells:
        print(f"error: {run}: no spec.json, controls or cell records (a findings run folder?)", file=sys.stderr)
        return 2
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "spec.json").write_bytes((run / "spec.json").read_bytes())
    unequal = {c["prompt"] for c in controls if not one_state(c)}
    _write_gz(dest / "controls.jsonl.gz", (json.dumps(c, sort_keys=True, separators=(",", ":")) + "\n" for c in controls))
    _write_gz(dest / "cells-unequal.jsonl.gz", (line for line, r in zip(lines, cells) if r["prompt"] in unequal))  # as recorded
    _write_gz(dest / "cells-compact.jsonl.gz", (json.dumps(
        {**{k: r[k] for k in COMPACT if k in r}, "batch_started_s": round(r["timing"]["batch_started_s"], 3),
         "cell_s": round(r["timing"]["cell_s"], 4)}, separators=(",", ":")) + "\n" for r in cells))
    print(f"{dest}: {len(controls)} controls, {len(cells)} cells ({len(unequal)} prompts with two states kept whole)")
    return 0


def summary(d: Path) -> int:
    controls, compact = records(d / "controls.jsonl"), records(d / "cells-compact.jsonl")  # both .gz
    if not (d / "spec.json").is_file() or not controls or not compact:
        print(f"error: {d}: no spec.json, controls.jsonl.gz or cells-compact.jsonl.gz (made by `pack`?)", file=sys.stderr)
        return 2
    spec = json.loads((d / "spec.json").read_text())["normalized"]
    full = records(d / "cells-unequal.jsonl")
    total = len(spec["prompts"]) * len(spec["selectors"]) * len(spec["directions"]) * spec["repeats"]
    single = {c["prompt"] for c in controls if one_state(c)}
    print(f"cells recorded: {len(compact)} of {total}")
    print(f"prompts with one state (every arm pair byte-identical): {len(single)} of {len(controls)}")
    for c in sorted(controls, key=lambda c: c["n_prompt"]):
        print(f"  {c['prompt']}: {c['n_prompt']} tokens, rest after 128: {c['n_prompt'] - 128}, "
              f"{'one state' if c['prompt'] in single else 'two states'}")
    mine = [c for c in compact if c["key"].split("|")[0] in single]
    print(f"cells of one-state prompts: {len(mine)}, classes {dict(Counter(c['klass'] for c in mine))}, "
          f"with changed bytes: {sum(c['changed_bytes'] != 0 for c in mine)}")
    print(f"cells of two-state prompts: {len(full)}, by prompt and class "
          f"{dict(sorted(Counter((r['prompt'], r['klass']) for r in full).items()))}")
    spans = {}
    for c in compact:
        spans[c["pid"]] = max(spans.get(c["pid"], 0.0), c["batch_started_s"] + c["cell_s"])
    span = max(spans.values())
    own = sum(not c.get("same_cross_as") for c in compact)
    print(f"batch processes: {len(spans)}, last cell ended {span:.1f} s after its process started; "
          f"{len(compact) / span:.1f} cells/s; {own} cells decoded their own cross ({own / span:.1f}/s)")
    # independent class-B coordinates: B in every repeat, a direction whose arms formed the state
    # of another direction's arms folded into it (C into B where their states are byte-identical)
    arms_kv = {c["prompt"]: {a: v["kv"] for a, v in c["arms"].items()} for c in controls}
    by: dict = {}
    for r in full:
        kv = arms_kv[r["prompt"]]
        coord = by.setdefault((r["prompt"], r["selector"], kv[r["donor"]], kv[r["recipient"]]), [set(), set()])
        coord[0].add(r["klass"])
        coord[1].add(r["direction"])
    b = sorted(f"{p} {s} {'/'.join(sorted(dirs))}" for (p, s, _, _), (k, dirs) in by.items() if k == {"B"})
    print(f"independent class-B coordinates: {len(b)}")
    for x in b:
        print(f"  {x}")
    # decodes with crosses named by their imported bytes (cells.cross_identity: the imported state,
    # the recipient's logits and context configuration): on a two-state prompt the cells that ran
    # their own cross, less those that changed no byte (one per prompt, recipient and repeat instead);
    # on a one-state prompt one per distinct recipient and repeat
    by_prompt = {c["prompt"]: c for c in controls}

    def recipient(prompt: str, arm: str) -> tuple:
        a, cfg = by_prompt[prompt]["arms"][arm], spec["arms"][arm]
        return a["kv"], a["logits"], cfg["n_batch"], cfg["n_ubatch"]

    ran = [r for r in full if not r.get("same_cross_as")]
    zero = {(r["prompt"], recipient(r["prompt"], r["recipient"]), r["repeat"]) for r in ran if r["changed_bytes"] == 0}
    two = len(ran) - sum(r["changed_bytes"] == 0 for r in ran) + len(zero)
    arms = {d.split("->")[1] for d in spec["directions"]}
    per = [len({recipient(p, a) for a in arms}) for p in sorted(single)]
    one = sum(per) * spec["repeats"]
    print(f"decodes when crosses are named by their bytes: {two + one} ({two} on two-state prompts, where this "
          f"run decoded {len(ran)}; {one} on one-state prompts: {sorted(set(per))} distinct recipients of "
          f"{len(arms)} per prompt x {spec['repeats']} repeats)")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("run", type=Path)
    p.add_argument("dest", type=Path)
    s = sub.add_parser("summary")
    s.add_argument("dest", type=Path)
    a = ap.parse_args(argv)
    folder = a.run if a.cmd == "pack" else a.dest
    if not folder.is_dir():
        print(f"error: {folder}: no such folder", file=sys.stderr)
        return 2
    return pack(a.run, a.dest) if a.cmd == "pack" else summary(a.dest)


if __name__ == "__main__":
    sys.exit(main())
