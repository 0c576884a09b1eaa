#!/usr/bin/env bash
# pack_run.sh RUN DEST: a findings study folder as RESUME_FROM takes it (benchmarks/device/findings_cuda.sh):
# spec.json, controls/, runs.jsonl, cells.jsonl.gz and findings/{minimal,panels}.jsonl.gz. Only whole lines
# of the record files are kept, so it may run while the study is still writing them (findings-partial).
# Exits 1 when RUN holds no spec.json or controls/.
set -uo pipefail
run=$1 dest=$2
mkdir -p "$dest/findings" && cp -r "$run/spec.json" "$run/controls" "$dest/" || exit 1
cp "$run/runs.jsonl" "$dest/" 2>/dev/null
whole() { head -n "$(wc -l < "$1")" "$1" | gzip > "$2"; }   # whole lines only
[ -f "$run/cells.jsonl" ] && whole "$run/cells.jsonl" "$dest/cells.jsonl.gz"
for k in minimal panels; do [ -f "$run/findings/$k.jsonl" ] && whole "$run/findings/$k.jsonl" "$dest/findings/$k.jsonl.gz"; done
exit 0
