#!/usr/bin/env bash
# The H200 session for the n-gram drafter campaign (issue 13) and the CUDA side of the
# row-invariant weight products (issue 12), with one CUDA build of the whole patch series.
# Run from the repo root on the device machine; what travels is listed in common.sh, plus
#   .dev/g0 .. .dev/g4 and .dev/gemma.sha256: Gemma 3 270M Q4_K_M (253 MB) in five parts.
# Steps (each one device call, made back to back; the machine is given back after 30 s idle):
#   setup              unpack, start the CUDA build in the background
#   keep NAME          keep one part (.dev/m1, .dev/g0 .. g3) on the machine
#   model              join the SmolLM2 parts (m2 travels now)
#   gemma              join the Gemma parts (g4 travels now)
#   wait               wait for the build, doctor
#   drafter [SPEC]     benchmarks/speculative.py on SPEC (default studies/spec-cuda-ngram.toml) with the
#                      verify-cost sweep; results in $OUT/drafter.tgz. With BUDGET=S it starts no new
#                      block after S seconds and the next call resumes it (the campaign lives in $W)
#   weights            audit matmul (both models), qualification of the +W arms on Gemma 3 and SmolLM2,
#                      the locator on Gemma 3; results in $OUT/weights.tgz
#   findings-start     the findings study on CUDA (benchmarks/device/findings_cuda.sh, its environment
#                      passed on) in the background, from a copy of the repo under $W (later calls
#                      replace the working tree); it outlives the call while the machine is warm.
#                      RESUME_FROM=docs/findings/cuda/run continues the last session's run
#   import-bench       benchmarks/state_import.py on CUDA: state import/export with and without patch 0004
#                      (builds the series up to 0003 too, about 4.5 min); the section in $OUT/state_import.txt
#   findings-wait S    wait at most S seconds for it, print its progress; once it has ended, its
#                      results in $OUT/findings_cuda.tgz
set -uo pipefail
. "$(dirname "$0")/common.sh"
case "${1:-}" in
  setup) dev_setup --backend cuda ;;
  keep) dev_keep "$2" ;;
  model) dev_default_model ;;
  gemma) dev_join $W/gemma.gguf "$(cat .dev/gemma.sha256)" g0 g1 g2 g3 g4 && rm -f $W/g? ;;
  wait) dev_wait && sl doctor --backend cuda | tail -25 ;;
  drafter)
    R=$OUT/drafter; mkdir -p "$R"
    python3 benchmarks/speculative.py "${2:-studies/spec-cuda-ngram.toml}" --rows --no-write --out "$W/campaign" ${BUDGET:+--budget $BUDGET} \
      2>&1 | tee "$R/speculative.txt" | tail -60
    cp -r $W/campaign "$R/"; tar -czf "$OUT/drafter.tgz" -C "$OUT" drafter
    ;;
  weights)
    R=$OUT/weights; mkdir -p "$R"
    SMOL=$W/model.gguf GEMMA=$W/gemma.gguf OUT=$R bash benchmarks/device/cuda_weights.sh "${2:-audit}" 2>&1 | tail -40
    tar -czf "$OUT/weights_${2:-audit}.tgz" -C "$OUT" weights
    ;;
  findings-start)
    rm -rf $W/repo $W/findings.rc $W/fout && mkdir -p $W/repo
    cp -r statelab studies selectors prompts benchmarks $W/repo/
    if [ -n "${RESUME_FROM:-}" ]; then   # an earlier session's run folder (docs/findings/cuda/run)
      rm -rf $W/resume && cp -r "$RESUME_FROM" $W/resume && export RESUME_FROM=$W/resume
    fi
    setsid nohup bash -c "cd $W/repo && PYTHONPATH=/opt/site:$W/repo OUT=$W/fout bash benchmarks/device/findings_cuda.sh \
      > $W/findings.log 2>&1; echo \$? > $W/findings.rc" >/dev/null 2>&1 &
    sleep 2; echo "started: $W/findings.log"
    ;;
  findings-wait)
    end=$(( $(date +%s) + ${2:-500} ))
    while [ ! -f $W/findings.rc ] && [ "$(date +%s)" -lt "$end" ]; do sleep 10; done
    tail -c 1500 $W/findings.log; echo
    f=$W/runs/findings-cuda/cells.jsonl; [ -f "$f" ] && echo "cells recorded: $(wc -l < "$f")"
    if [ -f $W/findings.rc ]; then
      echo "ended with status $(cat $W/findings.rc)"; cp $W/findings.log $W/fout/ 2>/dev/null
      tar -czf "$OUT/findings_cuda.tgz" -C $W fout && ls -la "$OUT"
    fi
    ;;
  import-bench)
    python3 benchmarks/state_import.py --backend cuda --tree $W/llama_cpp_python-0.3.36 --no-write 2>&1 \
      | tee "$OUT/state_import.txt" | tail -20
    ;;
  *) echo "usage: $0 setup|keep NAME|model|gemma|wait|drafter [SPEC]|weights [audit|qualify|locate|campaign]|findings-start|findings-wait S|import-bench" >&2; exit 2 ;;
esac
