#!/usr/bin/env bash
# The H200 session for the lab at the paper's model sizes (issue 26, item 3): synthetic models
# of the published shapes are made on the device itself (`statelab model synth`: seeded random
# weights, the embedded SmolLM2 tokenizer, llama.cpp's quantiser), so nothing large travels;
# then, per model, qualification of QB/PQ/GS (and M0) against R, the verify cost by rows 1..8
# in QB and in unrepaired MQ, and the partition A/B/C state and endpoint classes.
# Random weights say nothing about text: acceptance counts and endpoints here are those of
# random-weight models (exactness and cost are what they measure).
# Run from the repo root on the device machine; what travels is listed in common.sh (the
# SmolLM2 parts are the tokenizer's source). Steps (each one device call, made back to back):
#   setup              unpack, start the CUDA build in the background
#   keep m1            keep the first SmolLM2 part on the machine
#   model              join the SmolLM2 parts (m2 travels now)
#   wait               wait for the build, doctor
#   synth [M ...]      make models M = SHAPE:TYPE (default: $MODELS) under $W/models, and ci:q8_0 first
#                      (its sha256 beside the one the CPU machine made: docs/models.md); ~1.5 min per
#                      8B model (F16 written, then quantised); one call per 8B model is safer
#   qualify [M ...]    `statelab spec run` on $PROMPTS (8) with arms $ARMS, the n-gram drafter, k 3,
#                      cap $CAP: per prompt a JSON, per model a Markdown table (M0 counted)
#   rows [M ...]       verify cost by rows 1..8 (k 7, fixed shape): QB and MQ (benchmarks/speculative.py's
#                      rows_sweep with the model and k overridden on studies/spec-cuda-ngram.toml)
#   partition [M ...]  `statelab sweep` A,B,C,R on $LONG (prompts over 128 tokens: B and C split them)
#   e1 [M ...]         the paper's E1: `statelab audit e1` (first, middle, last layer x prefill, continuation
#                      x q 1..4 x MQ, PQ, QB = 72 contexts, plus the standalone replay) on HumanEval/2
#   all [M ...]        qualify, rows, partition and e1 one model after another (check the time: 10 min a call)
# Every step that measures also packs everything measured so far into $OUT/synth.tgz (one tarball;
# the last call's is the whole session).
set -uo pipefail
. "$(dirname "$0")/common.sh"
MODELS=${MODELS:-"qwen3-0.6b:q8_0 smollm2-1.7b:q8_0 qwen3-8b:q8_0 qwen3-8b:q4_k_m"}
PROMPTS=${PROMPTS:-"HumanEval/101 HumanEval/104 HumanEval/107 HumanEval/110 HumanEval/113 HumanEval/116 HumanEval/119 HumanEval/122"}
LONG=${LONG:-"HumanEval/10 HumanEval/17 HumanEval/20"}
ARMS=${ARMS:-"R,M0,M_QB,M_PQ,M_GS,C_QB,C_PQ,C_GS"}
CAP=${CAP:-64}
BACKEND=${BACKEND:-cuda}   # cpu: a dry run of the recipe on a machine without the GPU
RES=$W/synth-results
mkdir -p $W/models "$RES"

path_of() { echo "$W/models/${1%%:*}-${1##*:}.gguf"; }   # SHAPE:TYPE -> its file

# the E1 results.nc files (tens of MB each: frozen operands) stay under $W/synth-results; reports travel
pack() { tar -czf "$OUT/synth.tgz" --exclude='*.nc' -C $W synth-results && ls -la "$OUT/synth.tgz"; }

synth_one() {   # SHAPE:TYPE
  local m=$1 f; f=$(path_of "$1")
  [ -f "$f" ] && { echo "$m: $f exists"; return 0; }
  local timer=(); [ -x /usr/bin/time ] && timer=(/usr/bin/time -f "$m: %e s wall, %M KiB peak")
  "${timer[@]}" python3 -m statelab.cli model synth "$f" --shape "${m%%:*}" --type "${m##*:}" 2>&1 \
    | tee -a "$RES/synth.txt"
  cp "$f.synth.json" "$RES/" 2>/dev/null
}

qualify_one() {
  local m=$1 f d; f=$(path_of "$1"); d=$RES/qualify/${m/:/-}; mkdir -p "$d"
  for p in $PROMPTS; do
    sl spec run -H "$p" --arms "$ARMS" --draft ngram:1-8 --k 3 --cap "$CAP" --backend "$BACKEND" --model "$f" \
      --json "$d/${p//\//_}.json" 2>&1 | tail -12 | tee -a "$d/spec_run.txt"
  done
  python3 benchmarks/qualification_table.py "$d"/*.json | tee "$d/qualification.md"
}

rows_one() {
  local m=$1 f; f=$(path_of "$1"); mkdir -p "$RES/rows"
  python3 - "$f" "$BACKEND" <<'EOF' 2>&1 | tee "$RES/rows/${m/:/-}.md"
import sys
sys.path.insert(0, "benchmarks")
from speculative import rows_sweep
from statelab.experiments.campaign import CampaignSpec
spec = CampaignSpec.load("studies/spec-cuda-ngram.toml", model=sys.argv[1], k=7, backend=sys.argv[2])
print(f"model {sys.argv[1]}, rows 1..{spec.spec_config().rows}\n")
print(rows_sweep(spec))
EOF
}

partition_one() {
  local m=$1 f d; f=$(path_of "$1"); d=$RES/partition; mkdir -p "$d"
  for p in $LONG; do
    sl sweep -H "$p" --schedules A,B,C,R --backend "$BACKEND" --model "$f" --cap "$CAP" 2>&1 | tail -14 \
      | tee -a "$d/${m/:/-}.txt"
  done
}

e1_one() {
  local m=$1 f; f=$(path_of "$1"); mkdir -p "$RES/e1"
  sl audit e1 -H 2 --backend "$BACKEND" --model "$f" --out "$RES/e1/${m/:/-}" 2>&1 | tail -30 \
    | tee "$RES/e1/${m/:/-}.txt"
}

step=${1:-}; shift || true
[ $# -gt 0 ] && set -- "$@" || set -- $MODELS
case "$step" in
  setup) dev_setup --backend cuda ;;
  keep) dev_keep "$1" ;;
  model) dev_default_model ;;
  wait) dev_wait && sl doctor --backend cuda | tail -25 ;;
  synth)
    synth_one ci:q8_0
    for m in "$@"; do synth_one "$m" || exit 1; done
    df -h $W | tail -1; pack ;;
  qualify) for m in "$@"; do qualify_one "$m"; done; pack ;;
  rows) for m in "$@"; do rows_one "$m"; done; pack ;;
  partition) for m in "$@"; do partition_one "$m"; done; pack ;;
  e1) for m in "$@"; do e1_one "$m"; done; pack ;;
  all) for m in "$@"; do qualify_one "$m"; rows_one "$m"; partition_one "$m"; e1_one "$m"; done; pack ;;
  *) echo "usage: $0 setup|keep m1|model|wait|synth [SHAPE:TYPE ...]|qualify [..]|rows [..]|partition [..]|e1 [..]|all [..]" >&2
     exit 2 ;;
esac
