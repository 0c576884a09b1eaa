#!/usr/bin/env bash
# The CUDA side of the row-invariant weight products (issue 12): run from the repo root on a
# machine with an NVIDIA GPU, after the sdist and the models are in $W (as for cuda_session.sh:
# $W/llama_cpp_python-0.3.36.tar.gz, $W/SmolLM2-135M-Instruct.Q4_1.gguf, $W/gemma-3-270m-q4_k_m.gguf).
#   W=/opt/sl OUT=/tmp/out bash benchmarks/device/cuda_weights.sh build|audit|qualify|locate|campaign
# BACKEND=cpu runs audit/qualify/locate on the CPU build instead (how docs/weight-products.md's CPU
# qualification table was made, with SMOL/GEMMA pointing at the local model files).
# build: cuda_session.sh's CUDA build (the whole patch series, 0003 included).
# audit: `statelab audit matmul` for both models on CPU and CUDA (q = 1..8, with and without the
#        repair): which weight types' small-batch paths (mmvq, mmvf, mmq) are row-invariant.
# qualify: R, M0, M_QB, M_QB+W, C_QB, C_QB+W on 8 HumanEval prompts at cap 128, both models.
# locate: ub1 versus ub4:QB and ub4:QB+W on both models.
# campaign: the price of the repair (QB+W versus QB request-time ratios), written to $OUT.
set -uo pipefail
W=${W:-/opt/sl}
OUT=${OUT:-/tmp/statelab-cuda-weights}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/opt/site:$PWD STATELAB_CACHE=$W/cache
SMOL=${SMOL:-$W/SmolLM2-135M-Instruct.Q4_1.gguf}
GEMMA=${GEMMA:-$W/gemma-3-270m-q4_k_m.gguf}
BACKEND=${BACKEND:-cuda}
PROMPTS="0 2 4 9 10 12 16 20"
sl() { python3 -m statelab.cli "$@"; }
case "${1:-build}" in
  build)
    # the same build as cuda_session.sh (the patch series includes 0003), then the doctor
    W="$W" OUT="$OUT" bash benchmarks/device/cuda_session.sh build
    ;;
  audit)
    for m in smollm2:"$SMOL" gemma3:"$GEMMA"; do
      sl audit matmul --model "${m#*:}" --backend "$BACKEND" --out "$OUT/matmul_${m%%:*}" 2>&1 | tee "$OUT/matmul_${m%%:*}.txt"
    done
    ;;
  qualify)
    for m in smollm2:"$SMOL" gemma3:"$GEMMA"; do
      for t in $PROMPTS; do
        sl spec run -H $t --model "${m#*:}" --backend "$BACKEND" --cap 128 --arms R,M0,M_QB,M_QB+W,C_QB,C_QB+W \
          --draft self --json "$OUT/spec_${m%%:*}_he$t.json" 2>&1 | tee -a "$OUT/spec_${m%%:*}.txt"
      done
      python3 benchmarks/qualification_table.py "$OUT"/spec_${m%%:*}_he*.json | tee "$OUT/qualification_${m%%:*}.md"
    done
    ;;
  locate)
    for m in smollm2:"$SMOL" gemma3:"$GEMMA"; do
      for b in ub4:QB ub4:QB+W; do
        sl locate -H 2 --model "${m#*:}" --backend "$BACKEND" -a ub1 -b "$b" --out "$OUT/locate_${m%%:*}_${b/:/_}" \
          2>&1 | tail -20 | tee -a "$OUT/locate.txt"
      done
    done
    ;;
  campaign)
    for s in spec-cpu-weights spec-cpu-gemma-weights; do
      sed -e 's/^backend = "cpu"/backend = "cuda"/' -e 's/^threads = 1/threads = 0/' -e "s#^model = .*#model = \"$GEMMA\"#" \
        "studies/$s.toml" > "$OUT/${s/cpu/cuda}.toml"
      sl spec campaign "$OUT/${s/cpu/cuda}.toml" --out "$OUT/campaign_${s/cpu/cuda}" 2>&1 | tee "$OUT/campaign_${s/cpu/cuda}.txt"
    done
    ;;
esac
