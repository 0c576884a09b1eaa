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
#   setup-vk           the same with one CUDA + Vulkan build (carry .gl and .dev/vkdeb too: kit.sh makes them);
#                      then BACKEND=vulkan runs qualify, rows, partition, e1, scale and cells on NVIDIA's Vulkan
#                      driver (F16 KV cache, the default), into result folders named with the backend
#   keep m1, keep m2   keep the first two SmolLM2 parts on the machine
#   model              join the SmolLM2 parts (m1, m2 kept; m3 travels now)
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
#   scale [M ...]      the lab's own operations on a $TOKENS-token state (default 4096): capture, verify, cross,
#                      export and import times and peak memory (benchmarks/state_scale.py), one model load each
#   cells [M ...]      the study engine's cells per second: studies/findings-cuda.toml cut to $CELL_PROMPTS
#                      HumanEval prompts, its 22 named selectors and one repeat, with the model and backend
#                      applied, on the batch executor (1 process x $LANES lanes); the rate from the run's records
#                      (M "smollm2": the embedded model, for the same figure at 135M)
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
TOKENS=${TOKENS:-4096}
CELL_PROMPTS=${CELL_PROMPTS:-4}
LANES=${LANES:-8}
RES=$W/synth-results
mkdir -p $W/models "$RES"
vk_env

# SHAPE:TYPE -> its results' name (the backend added where it is not CUDA)
tag() { local t=${1/:/-}; [ "$BACKEND" = cuda ] || t=$t-$BACKEND; echo "$t"; }

path_of() { echo "$W/models/${1%%:*}-${1##*:}.gguf"; }   # SHAPE:TYPE -> its file

# only the text results travel (reports, tables, JSON, capture manifests): E1's results.nc and its
# captures' tensors.npz (tens of MB per model: frozen operands) stay under $W/synth-results
pack() {
  (cd $W && find synth-results -type f \( -name '*.md' -o -name '*.txt' -o -name '*.json' \) | sort \
    | tar -czf "$OUT/synth.tgz" -T -) && ls -la "$OUT/synth.tgz"
}

synth_one() {   # SHAPE:TYPE
  local m=$1 f; f=$(path_of "$1")
  [ -f "$f" ] && { echo "$m: $f exists"; return 0; }
  local timer=(); [ -x /usr/bin/time ] && timer=(/usr/bin/time -f "$m: %e s wall, %M KiB peak")
  "${timer[@]}" python3 -m statelab.cli model synth "$f" --shape "${m%%:*}" --type "${m##*:}" 2>&1 \
    | tee -a "$RES/synth.txt"
  cp "$f.synth.json" "$RES/" 2>/dev/null
}

qualify_one() {
  local m=$1 f d; f=$(path_of "$1"); d=$RES/qualify/$(tag "$m"); mkdir -p "$d"
  for p in $PROMPTS; do
    sl spec run -H "$p" --arms "$ARMS" --draft ngram:1-8 --k 3 --cap "$CAP" --backend "$BACKEND" --model "$f" \
      --json "$d/${p//\//_}.json" 2>&1 | tail -12 | tee -a "$d/spec_run.txt"
  done
  python3 benchmarks/qualification_table.py "$d"/*.json | tee "$d/qualification.md"
}

rows_one() {
  local m=$1 f; f=$(path_of "$1"); mkdir -p "$RES/rows"
  python3 - "$f" "$BACKEND" <<'EOF' 2>&1 | tee "$RES/rows/$(tag "$m").md"
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
      | tee -a "$d/$(tag "$m").txt"
  done
}

e1_one() {
  local m=$1 f; f=$(path_of "$1"); mkdir -p "$RES/e1"
  sl audit e1 -H 2 --backend "$BACKEND" --model "$f" --out "$RES/e1/$(tag "$m")" 2>&1 | tail -30 \
    | tee "$RES/e1/$(tag "$m").txt"
}

scale_one() {
  local m=$1 f; f=$(path_of "$1"); mkdir -p "$RES/scale"
  python3 benchmarks/state_scale.py --model "$f" --tokens "$TOKENS" --backend "$BACKEND" \
    --json "$RES/scale/$(tag "$m").json" 2>&1 | tee "$RES/scale/$(tag "$m").md"
}

cells_one() {   # SHAPE:TYPE, or "smollm2" for the embedded model
  local m=$1 f spec run; mkdir -p "$RES/cells"
  if [ "$m" = smollm2 ]; then f=""; else f=$(path_of "$1"); fi
  spec=studies/.cells-$(tag "$m").toml; run=$W/runs/cells-$(tag "$m")
  python3 - "$f" "$BACKEND" "$CELL_PROMPTS" studies/findings-cuda.toml "$spec" <<'EOF' || return 1
import json, re, sys
model, backend, n, src, dst = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
text = open(src, encoding="utf-8").read()
heval = re.findall(r'"(HumanEval/\d+)"', text)[:n]
text = re.sub(r'(?ms)^prompts = \[.*?\]\n', "prompts = " + json.dumps(heval) + "\n", text)
text = re.sub(r'(?m)^ *"\.\./selectors/layers/\*\.toml",\n', "", text)  # per-layer selectors name SmolLM2's 30 layers
text = re.sub(r'(?m)^repeats = .*$', "repeats = 1", text)
text = re.sub(r'(?m)^name = .*$', f'name = "cells-{backend}"', text)
text = re.sub(r'(?m)^backend = .*$', f"backend = {json.dumps(backend)}", text)
if model:
    text = re.sub(r'(?m)^(name = .*)$', lambda g: g.group(1) + f"\nmodel = {json.dumps(model)}", text, count=1)
open(dst, "w", encoding="utf-8").write(text)
EOF
  rm -rf "$run"
  local t0=$SECONDS
  sl study run "$spec" --out "$run" --executor batch --workers 1 --lanes "$LANES" 2>&1 | tail -3
  echo "$m: study run $((SECONDS - t0)) s wall (model loads, controls and compile included)" | tee "$RES/cells/$(tag "$m").txt"
  python3 benchmarks/device/findings_time.py "$run" --shape "1 process x $LANES lanes" 2>&1 | head -3 \
    | tee -a "$RES/cells/$(tag "$m").txt"
  rm -f "$spec"
}

step=${1:-}; shift || true
[ $# -gt 0 ] && set -- "$@" || set -- $MODELS
case "$step" in
  setup) dev_setup --backend cuda ;;
  setup-vk) dev_setup_vulkan ;;
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
  scale) for m in "$@"; do scale_one "$m"; done; pack ;;
  cells) for m in "$@"; do cells_one "$m"; done; pack ;;
  all) for m in "$@"; do qualify_one "$m"; rows_one "$m"; partition_one "$m"; e1_one "$m"; done; pack ;;
  *) echo "usage: $0 setup|setup-vk|keep m1|model|wait|synth [SHAPE:TYPE ...]|qualify [..]|rows [..]|partition [..]|e1 [..]|scale [..]|cells [..]|all [..]" >&2
     exit 2 ;;
esac
