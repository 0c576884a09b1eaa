#!/usr/bin/env bash
# The findings study on CUDA (issue 17): studies/findings-cuda.toml on the H200, then the
# time-bounded frontier panels and minimal selections of its class-B cells, then the findings
# tables.  Run from the repo root after `cuda_session.sh build` (the patched CUDA build in
# /opt/site, the embedded model laid out there):
#   MODEL=/opt/sl/SmolLM2-135M-Instruct.Q4_1.gguf OUT=/tmp/out bash benchmarks/device/findings_cuda.sh
# Resumable: run it again with the same RUN folder and finished cells, panels and searches
# are skipped.  Prints where the time went.  Environment:
#   MODEL    GGUF file (default: the spec's model, i.e. the embedded SmolLM2)
#   OUT      where the compact results go (results.nc, report.md, findings/) (default /tmp/out)
#   RUN      the study folder (default $W/runs/findings-cuda; keep it on the machine)
#   SPEC     the study spec (default studies/findings-cuda.toml)
#   BACKEND  override the spec's backend (e.g. cpu, to try this script without a GPU)
#   WORKERS  batch processes at once (default 2: one per process repeat, 63.4 cells/s on the H200 with
#            patch 0004 against 37.8 with 1; the processes time-slice the GPU, and 16 made a 0.2 s
#            cross take 14 s before patch 0004)
#   LANES    cells at once in the batch process, each in its own llama.cpp context (default 8)
#   FWORKERS processes for the panels and minimal searches (default 1)
#   FLANES   targets at once in each of them, each in its own contexts (default 8; 1: one forked
#            process per target, FWORKERS at a time, each initialising CUDA and loading the model)
#   PANEL_BUDGET, MINIMAL_BUDGET  seconds for the frontier panels / minimal searches (default 120 / 120;
#            MINIMAL_BUDGET=0 skips the searches)
#   PANEL_REPEATS  process repeats of every panel (default 1; 2: repeat-level contrasts; every panel's
#            repeat 0 runs before any repeat 1, so a budget that runs out leaves whole repeats first)
#   INDEPENDENT  1: panels and searches only for the class-B cells of directions not folded into
#            another (`findings-run --independent`: a folded direction repeats another byte for byte)
#   TABLES   0: no findings tables on the machine (`statelab study findings` makes them from the records
#            that come back, without a model or device)
#   RESUME_FROM  a folder with spec.json, controls/ and cells.jsonl.gz of an earlier session's run
#            (docs/findings/cuda/run/): a new RUN starts from its finished cells; the controls
#            form the captures again and the study refuses to go on unless they are the states
#            those cells crossed, byte for byte (a run kept under earlier chat: prompt identities
#            is carried over first: benchmarks/device/upgrade_run.py)
#   REPANEL  1: the kept panel records are left out, so every panel runs again (recording each
#            arm's top-1 margin and eps_inf at every output before t*)
set -uo pipefail
W=${W:-/opt/sl}
OUT=${OUT:-/tmp/out}
SPEC=${SPEC:-studies/findings-cuda.toml}
RUN=${RUN:-$W/runs/$(basename "$SPEC" .toml)}
WORKERS=${WORKERS:-2}
LANES=${LANES:-8}
FWORKERS=${FWORKERS:-1}
FLANES=${FLANES:-8}
PANEL_BUDGET=${PANEL_BUDGET:-120}
IND=""; [ "${INDEPENDENT:-0}" = 1 ] && IND=--independent
MINIMAL_BUDGET=${MINIMAL_BUDGET:-120}
export PYTHONUNBUFFERED=1 STATELAB_THREADS=${STATELAB_THREADS:-1}
[ -d /opt/site ] && export PYTHONPATH=/opt/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
sl() { "$PY" -m statelab.cli "$@"; }
mkdir -p "$OUT" "$(dirname "$RUN")" || exit 2

# the spec as run: beside the original (its prompt and selector paths are relative to it),
# with MODEL and BACKEND applied; removed on exit
RUNSPEC="$(dirname "$SPEC")/.run-$(basename "$SPEC")"
trap 'rm -f "$RUNSPEC"' EXIT
"$PY" - "$SPEC" "$RUNSPEC" "${MODEL:-}" "${BACKEND:-}" <<'EOF' || exit 2
import json, re, sys
src, dst, model, backend = sys.argv[1:5]
text = open(src, encoding="utf-8").read()
if backend:
    text, n = re.subn(r'(?m)^backend = .*$', f'backend = {json.dumps(backend)}', text)
    assert n == 1, "the spec has no backend line"
if model:
    text = re.sub(r'(?m)^model = .*\n', '', text)
    text = re.sub(r'(?m)^(name = .*)$', lambda m: m.group(1) + f'\nmodel = {json.dumps(model)}', text, count=1)
open(dst, "w", encoding="utf-8").write(text)
EOF

if [ -n "${RESUME_FROM:-}" ] && [ ! -f "$RUN/spec.json" ]; then
  mkdir -p "$RUN/findings" && cp -r "$RESUME_FROM/spec.json" "$RESUME_FROM/controls" "$RUN/" \
    && gzip -dc "$RESUME_FROM/cells.jsonl.gz" > "$RUN/cells.jsonl" || exit 2
  for k in minimal panels; do  # finished panels and searches are not run again
    if [ "$k" = panels ] && [ "${REPANEL:-0}" = 1 ]; then continue
    elif [ -f "$RESUME_FROM/findings/$k.jsonl.gz" ]; then gzip -dc "$RESUME_FROM/findings/$k.jsonl.gz" > "$RUN/findings/$k.jsonl"
    elif [ -f "$RESUME_FROM/findings/$k.jsonl" ]; then cp "$RESUME_FROM/findings/$k.jsonl" "$RUN/findings/"; fi
  done
  echo "== resuming from $RESUME_FROM: $(wc -l < "$RUN/cells.jsonl") cell records"
  # a run kept under earlier prompt identities (chat: prompts, before issue 28) carried over, checked
  "$PY" benchmarks/device/upgrade_run.py "$RUN" "$RUNSPEC" || exit 2
fi

t() { date +%s.%N; }
T0=$(t)
echo "== study run ($RUNSPEC -> $RUN, $WORKERS batch process(es) at once, $LANES lanes)"
sl study run "$RUNSPEC" --out "$RUN" --executor batch --workers "$WORKERS" --lanes "$LANES" 2>&1 | tail -4 | tee "$OUT/study_run.txt"
RC_RUN=${PIPESTATUS[0]}
T1=$(t)
echo "== frontier panels of class-B cells (budget ${PANEL_BUDGET} s)"
sl study findings-run "$RUN" --kind panels --budget "$PANEL_BUDGET" --workers "$FWORKERS" --lanes "$FLANES" $IND --repeats "${PANEL_REPEATS:-1}" 2>&1 | tail -2 | tee "$OUT/panels.txt"
T2=$(t)
if [ "$MINIMAL_BUDGET" != 0 ]; then
  echo "== minimal selections of class-B cells (budget ${MINIMAL_BUDGET} s)"
  sl study findings-run "$RUN" --kind minimal --budget "$MINIMAL_BUDGET" --workers "$FWORKERS" --lanes "$FLANES" $IND 2>&1 | tail -2 | tee "$OUT/minimal.txt"
fi
T3=$(t)
if [ "${TABLES:-1}" = 1 ]; then
  echo "== findings tables"
  sl study findings "$RUN" --out "$OUT/findings" 2>&1 | tail -2
fi
mkdir -p "$OUT/findings"
T4=$(t)
cp "$RUN/results.nc" "$RUN/report.md" "$OUT/" 2>/dev/null
for k in minimal panels; do [ -f "$RUN/findings/$k.jsonl" ] && cp "$RUN/findings/$k.jsonl" "$OUT/findings/"; done
bash "$(dirname "$0")/pack_run.sh" "$RUN" "$OUT/run"   # what RESUME_FROM takes

echo "== where the time went"
"$PY" benchmarks/device/findings_time.py "$RUN" --phases "$T0" "$T1" "$T2" "$T3" "$T4" \
  --shape "$WORKERS process(es) x $LANES lanes" | tee "$OUT/time.txt"
exit "$RC_RUN"
