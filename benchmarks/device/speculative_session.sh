#!/usr/bin/env bash
# The H200 session for the n-gram drafter campaign (issue 13) and the CUDA side of the
# row-invariant weight products (issue 12), with one CUDA build of the whole patch series.
# Run from the repo root on the device machine; what travels is listed in common.sh, plus
#   .dev/g0 .. .dev/g6 and .dev/gemma.sha256: Gemma 3 270M Q4_K_M (253 MB) in seven parts.
# Steps (each one device call, made back to back; the machine is given back after 30 s idle):
#   setup              unpack, start the CUDA build in the background
#   keep NAME          keep one part (.dev/m1 m2, .dev/g0 .. g5) on the machine
#   model              join the SmolLM2 parts (m1, m2 kept; m3 travels now)
#   gemma              join the Gemma parts (g0 .. g5 kept; g6 travels now)
#   wait               wait for the build, doctor
#   drafter [SPEC]     benchmarks/speculative.py on SPEC (default studies/spec-cuda-ngram.toml) with the
#                      verify-cost sweep; results in $OUT/drafter.tgz. With BUDGET=S it starts no new
#                      block after S seconds and the next call resumes it (the campaign lives in $W/campaign$TAG);
#                      SESSIONS=N and K_MAX=K override the spec's
#   weights            audit matmul (both models), qualification of the +W arms on Gemma 3 and SmolLM2,
#                      the locator on Gemma 3; results in $OUT/weights.tgz
#   findings-start     the findings study on CUDA (benchmarks/device/findings_cuda.sh, its environment
#                      passed on) in the background, from a copy of the repo under $W (later calls
#                      replace the working tree); it outlives the call while the machine is warm.
#                      RESUME_FROM=docs/findings/cuda/run continues the last session's run;
#                      SPEC=studies/findings-vulkan.toml runs it on Vulkan (the CUDA + Vulkan build of
#                      vulkan_session.sh setup; NVIDIA's Vulkan driver through vk_env); TAG=x starts a
#                      second run beside a first (its own repo copy, log, results: pass the same TAG
#                      and SPEC to findings-wait and findings-partial), e.g. a CPU study on the
#                      machine's cores while the Vulkan one holds the GPU
#   import-bench       benchmarks/state_import.py on CUDA: state import/export with and without patch 0004
#                      (builds the series up to 0003 too, about 4.5 min); the section in $OUT/state_import.txt
#   findings-partial   the records so far, while the run goes on, in $OUT/findings_partial.tgz (pack_run.sh:
#                      spec.json, controls/, cells, finished panels and searches: a later session's RESUME_FROM;
#                      the Vulkan study: Vulkan-alone build 97 s, 16,256 cells in 378 s, docs/findings.md)
#   findings-wait S    wait at most S seconds for it, print its progress; once it has ended, its
#                      results in $OUT/findings_cuda.tgz
#   exact              patch 0005 (row-invariance hint) on CUDA: audit matmul with the hinted column (both
#                      models), the locator ub1 against ub8:QB and ub8:MQ (both models), the n-gram campaign at
#                      k 7 (8-row verifies) on SmolLM2 and Gemma 3 with the verify-cost sweep by rows (1..8) in QB,
#                      and the same sweep in MQ (arm C0); results in $OUT/exact.tgz
#   gemma-panel        the panel's 12 HumanEval prompts on Gemma 3 (the drafter step on a spec derived from
#                      studies/spec-cuda-panel.toml; SESSIONS=2 as in docs/benchmarks.md)
#   qbcols             patch 0006 (QB attention products in one launch): benchmarks/qb_columns.py on both models
#                      (QB / QB one product per query / MQ by rows), audit e1 and the locator ub1 against
#                      ub4:QB, ub8:QB, ub8:MQ on both models; results in $OUT/qbcols.tgz
#   panel KIND...      the held-out panel (studies/spec-cuda-panel.toml) once per gate kind named (shadow, gain,
#                      off), on BACKEND (default cuda; vulkan needs the CUDA+Vulkan build of vulkan_session.sh setup),
#                      with the verify-cost sweep; SESSIONS=N overrides the spec's; with BUDGET=S a campaign starts
#                      no new block after S seconds and the next call resumes it; results in $OUT/panel.tgz
#   plain-cycle [ARG]  benchmarks/plain_cycle.py on BACKEND (default cuda; ROUNDS, default 5; its other
#                      arguments passed on, e.g. --prompt chat:prompts/panel/explain-compound-interest.txt): where a cycle
#                      without proposals loses to R's one-token step, the plain-regime loop against the general
#                      cycle (host work outside the decode call); $OUT/plain_cycle_BACKEND.txt
#   wheel-out          the CUDA wheel built here, in parts of 15 MiB under $OUT (a later session carries them
#                      back as .dev/cudawhl/ instead of building again: see `wheel-in`)
#   wheel-in           install the wheel carried back in .dev/cudawhl/ (parts joined, sha256 checked)
set -uo pipefail
. "$(dirname "$0")/common.sh"
# findings_here STEP: the findings run of this machine in $run, or one line and exit 1 on a bare machine
# (a machine given back after 30 s idle comes back bare: said at once instead of waiting S seconds)
T=${TAG:-}   # TAG=x: a second findings run beside the first (its own repo copy, log and results)
findings_here() {
  [ -f $W/findings$T.log ] || { echo "$1: no findings run on this machine ($W/findings$T.log missing: a bare machine, the earlier one was given back?)" >&2; exit 1; }
  run=$W/runs/$(basename "${SPEC:-studies/findings-cuda.toml}" .toml)
}
case "${1:-}" in
  setup) dev_setup --backend cuda ;;
  keep) dev_keep "$2" ;;
  model) dev_default_model ;;
  gemma) dev_join $W/gemma.gguf gemma.sha256 && rm -f $W/g? ;;
  wait) dev_wait && sl doctor --backend cuda | tail -25 ;;
  drafter)
    R=$OUT/drafter; mkdir -p "$R"
    python3 benchmarks/speculative.py "${2:-studies/spec-cuda-ngram.toml}" --rows --no-write --out "$W/campaign${TAG:-}" \
      ${BUDGET:+--budget $BUDGET} ${SESSIONS:+--sessions $SESSIONS} ${K_MAX:+--k-max $K_MAX} \
      2>&1 | tee "$R/speculative.txt" | tail -60
    cp -r "$W/campaign${TAG:-}" "$R/"; tar -czf "$OUT/drafter.tgz" -C "$OUT" drafter
    ;;
  panel)
    R=$OUT/panel; mkdir -p "$R"; BE=${BACKEND:-cuda}; [ "$BE" = vulkan ] && vk_env
    for g in "${@:2}"; do
      case $g in off) v=false ;; gain) v=true ;; *) v="\"$g\"" ;; esac
      spec=studies/spec-$BE-panel-$g.toml   # beside the panel's spec: its chat: paths are relative to it
      sed -e "s/^gate = true/gate = $v/" -e "s/^backend = \"cuda\"/backend = \"$BE\"/" studies/spec-cuda-panel.toml > "$spec"
      python3 benchmarks/speculative.py "$spec" --rows --no-write --out "$W/panel-$BE-$g" ${BUDGET:+--budget $BUDGET} \
        ${SESSIONS:+--sessions $SESSIONS} 2>&1 | tee "$R/$BE-$g.txt" | grep -E "R/C_QB|qualified|tokens/call|^\| C_QB \| [0-9]"
      st=${PIPESTATUS[0]}; rm -rf "$R/panel-$BE-$g"; cp -r "$W/panel-$BE-$g" "$R/"
      [ "$st" = 3 ] && break   # unfinished: the next call resumes it
    done
    tar -czf "$OUT/panel.tgz" -C "$OUT" panel
    ;;
  plain-cycle)
    BE=${BACKEND:-cuda}; [ "$BE" = vulkan ] && vk_env
    python3 benchmarks/plain_cycle.py --backend "$BE" --rounds "${ROUNDS:-5}" "${@:2}" 2>&1 | tee "$OUT/plain_cycle_$BE.txt" | tail -16
    exit "${PIPESTATUS[0]}"
    ;;
  weights)
    R=$OUT/weights; mkdir -p "$R"
    SMOL=$W/model.gguf GEMMA=$W/gemma.gguf OUT=$R bash benchmarks/device/cuda_weights.sh "${2:-audit}" 2>&1 | tail -40
    tar -czf "$OUT/weights_${2:-audit}.tgz" -C "$OUT" weights
    ;;
  findings-start)
    rm -rf $W/repo$T $W/findings$T.rc $W/fout$T && mkdir -p $W/repo$T
    cp -r statelab studies selectors prompts benchmarks $W/repo$T/
    if [ -n "${RESUME_FROM:-}" ]; then   # an earlier session's run folder (docs/findings/cuda/run)
      rm -rf $W/resume$T && cp -r "$RESUME_FROM" $W/resume$T && export RESUME_FROM=$W/resume$T
    fi
    vk_env   # a Vulkan spec finds NVIDIA's Vulkan driver (nothing changes for CUDA)
    setsid nohup bash -c "cd $W/repo$T && PYTHONPATH=/opt/site:$W/repo$T OUT=$W/fout$T bash benchmarks/device/findings_cuda.sh \
      > $W/findings$T.log 2>&1; echo \$? > $W/findings$T.rc" >/dev/null 2>&1 &
    sleep 2; echo "started: $W/findings$T.log"
    ;;
  findings-wait)
    findings_here "$1"
    end=$(( $(date +%s) + ${2:-500} ))
    while [ ! -f $W/findings$T.rc ] && [ "$(date +%s)" -lt "$end" ]; do sleep 10; done
    tail -c 1500 $W/findings$T.log; echo
    [ -f "$run/cells.jsonl" ] && echo "cells recorded: $(wc -l < "$run/cells.jsonl")"
    if [ -f $W/findings$T.rc ]; then
      echo "ended with status $(cat $W/findings$T.rc)"; cp $W/findings$T.log $W/fout$T/findings.log 2>/dev/null
      tar -czf "$OUT/findings_cuda$T.tgz" -C $W fout$T && ls -la "$OUT"
    fi
    ;;
  findings-partial)   # the records so far (the run goes on): what RESUME_FROM takes in a later session
    findings_here "$1"; rm -rf $W/partial$T; bash benchmarks/device/pack_run.sh "$run" $W/partial$T/run || exit 1
    tail -c 600 $W/findings$T.log; echo; echo "cells kept: $(gzip -dc $W/partial$T/run/cells.jsonl.gz | wc -l)"
    tar -czf "$OUT/findings_partial$T.tgz" -C $W/partial$T run && ls -la "$OUT"
    ;;
  import-bench)
    python3 benchmarks/state_import.py --backend cuda --tree $W/llama_cpp_python-0.3.36 --no-write 2>&1 \
      | tee "$OUT/state_import.txt" | tail -20
    ;;
  exact)
    R=$OUT/exact; mkdir -p "$R"
    SMOL=$W/model.gguf GEMMA=$W/gemma.gguf OUT=$R bash benchmarks/device/cuda_weights.sh audit > "$R/audit.log" 2>&1
    grep -h "cases computed" "$R"/matmul_*.txt
    for m in smollm2:$W/model.gguf gemma3:$W/gemma.gguf; do locate_each "$R" cuda "$m" ub8:QB ub8:MQ ub4:QB; done
    tail -n 60 "$R/locate.txt"
    sed -e 's/^k = 3/k = 7/' studies/spec-cuda-ngram.toml > "$R/spec-cuda-ngram-k7.toml"
    sed -e "s#^backend = \"cuda\"#backend = \"cuda\"\nmodel = \"$W/gemma.gguf\"#" "$R/spec-cuda-ngram-k7.toml" > "$R/spec-cuda-gemma-k7.toml"
    mq_spec "$R/spec-cuda-ngram-k7.toml" "$R/spec-cuda-mq-k7.toml"
    for s in ngram-k7 gemma-k7 mq-k7; do
      python3 benchmarks/speculative.py "$R/spec-cuda-$s.toml" --rows --no-write --out "$W/c-$s" 2>&1 | tee "$R/campaign-$s.txt" | tail -25
      cp -r "$W/c-$s" "$R/"
    done
    tar -czf "$OUT/exact.tgz" -C "$OUT" exact
    ;;
  gemma-panel)   # the held-out panel's 12 HumanEval prompts on Gemma 3 (its GGUF has no chat template for the prose half)
    python3 - "$W/gemma.gguf" <<'PY'
import re, sys
s = open("studies/spec-cuda-panel.toml").read()
s = re.sub(r'\n    "chat:[^\n]*', "", s)                      # the prose prompts
s = re.sub(r"prose = \[[^\]]*\]\n", "", s, flags=re.S)      # and their group
s = s.replace('backend = "cuda"', f'backend = "cuda"\nmodel = "{sys.argv[1]}"')
open("studies/spec-cuda-panel-gemma.toml", "w").write(s)
PY
    TAG=gemma bash "$0" drafter studies/spec-cuda-panel-gemma.toml
    ;;
  qbcols)
    R=$OUT/qbcols; mkdir -p "$R"
    python3 benchmarks/qb_columns.py studies/spec-cuda-panel.toml --no-write 2>&1 | tee "$R/rows_smollm2.txt" | tail -12
    python3 benchmarks/qb_columns.py studies/spec-cuda-ngram.toml --model $W/gemma.gguf --k-max 7 --no-write 2>&1 \
      | tee "$R/rows_gemma3.txt" | tail -12
    for m in smollm2:$W/model.gguf gemma3:$W/gemma.gguf; do
      sl audit e1 --backend cuda --model "${m#*:}" --out "$R/e1_${m%%:*}" > "$R/e1_${m%%:*}.txt" 2>&1
      tail -4 "$R/e1_${m%%:*}.txt"
      locate_each "$R" cuda "$m" ub4:QB ub8:QB ub8:MQ
    done
    tail -n 40 "$R/locate.txt"
    tar -czf "$OUT/qbcols.tgz" -C "$OUT" qbcols
    ;;
  wheel-out)
    whl=$(tail -1 $W/build.log); ls -la "$whl"; sha256sum "$whl" | tee "$OUT/cudawhl.sha256"
    split -b 15M -d -a 1 "$whl" "$OUT/cudawhl.part"; echo "$(basename "$whl")" > "$OUT/cudawhl.name"; ls -la "$OUT"
    ;;
  wheel-in)
    mkdir -p $W /opt/site; n=$(cat .dev/cudawhl/cudawhl.name)
    cat .dev/cudawhl/cudawhl.part* > "$W/$n" && (cd $W && sed "s#  .*#  $n#" "$OLDPWD/.dev/cudawhl/cudawhl.sha256" | sha256sum -c) || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --target /opt/site .dev/whl/*.whl
    python3 -m pip install -q --no-index --no-deps --no-compile --target /opt/site --upgrade "$W/$n" && echo "$W/$n" >> $W/build.log
    echo 0 > $W/build.rc
    ;;
  *) echo "usage: $0 setup|keep NAME|model|gemma|wait|drafter [SPEC]|weights [audit|qualify|locate|campaign]|findings-start|findings-wait S|findings-partial|import-bench|exact|gemma-panel|qbcols|panel KIND...|plain-cycle|wheel-out|wheel-in" >&2; exit 2 ;;
esac
