#!/usr/bin/env bash
# Vulkan on a real GPU (NVIDIA's Vulkan driver on the lent H200), next to CUDA in one build.
# Run from the repo root on the device machine. Besides what benchmarks/device/common.sh lists:
#   .dev/vkdeb/   Debian 12 glslc, libshaderc1, libvulkan-dev, spirv-headers (unpacked into /opt/vk, not /)
#   .gl/          the Vulkan/EGL loaders (device README, "Headless rendering"; unpacked into /)
# Steps (each one device call, made back to back):
#   bash benchmarks/device/vulkan_session.sh setup     # unpack, start the CUDA+Vulkan build in the background
#                                                      # (349 s with 16 jobs); `setup vulkan`: Vulkan alone, for
#                                                      # the Vulkan findings study (no CUDA kernels to compile)
#                                                      # carry .dev/m1 with it and setup keeps the model's
#                                                      # first part (kit.sh makes it 16 MB for that)
#   bash benchmarks/device/vulkan_session.sh part1     # keep the first part, where setup did not carry it (.dev/m1)
#   bash benchmarks/device/vulkan_session.sh part2     # keep the second (carry .dev/m2)
#   bash benchmarks/device/vulkan_session.sh model     # join them with the third (carry .dev/m3), check sha256
#   bash benchmarks/device/vulkan_session.sh wait      # wait for the build, doctor on the Vulkan device
#   bash benchmarks/device/vulkan_session.sh run       # doctor, decode, sweep, admission, spec arms, 3x3 transplants
#   bash benchmarks/device/vulkan_session.sh demo      # the full statelab demo on the Vulkan device
#   bash benchmarks/device/vulkan_session.sh qb        # patch 0007, QB on Vulkan: admission, the layout oracle (locator
#                                                      # ub1 against ub4:QB with every row's logits, and ub4:MQ),
#                                                      # C_QB/M_QB qualification on HumanEval/0 and /2, the n-gram campaign
#                                                      # (studies/spec-cuda-ngram.toml on Vulkan) with the verify-cost sweep
#                                                      # by rows in QB, and the same sweep in MQ (arm C0); $OUT/vk_qb.tgz
#                                                      # With BUDGET=S a campaign starts no new block after S seconds and
#                                                      # the next `qb` call resumes it (its folder lives in $W)
set -uo pipefail
. "$(dirname "$0")/common.sh"
vk_env
R=$OUT/vk
case "${1:-}" in
  setup) dev_setup_vulkan "${2:-cuda}"
    ;;
  part1) dev_keep m1 ;;
  part2) dev_keep m2 ;;
  model) dev_default_model ;;
  wait)
    dev_wait || exit 1
    mkdir -p "$R"; cp $W/build.log "$R/build.log"
    sl doctor --backend vulkan 2>&1 | tee "$R/doctor.txt"
    ;;
  run)
    mkdir -p "$R"
    sl doctor --backend vulkan > "$R/doctor.txt" 2>&1
    sl generate -H 0 --cap 64 --backend vulkan 2>&1 | tee "$R/generate.txt"
    python3 benchmarks/decode.py --backend vulkan --rounds 5 --tokens 128 --no-write 2>&1 | tee "$R/decode_vulkan.txt"
    sl sweep -H 10 --backend vulkan --cap 128 --json "$R/sweep_he10.json" > "$R/sweep.txt" 2>&1
    sl audit backends --backend vulkan > "$R/admission.txt" 2>&1
    for t in 0 2 4 9; do
      sl spec run -H $t --backend vulkan --cap 128 --arms R,M0,M_PQ,M_GS,C_PQ,C_GS --draft self \
        --json "$R/spec_he$t.json" >> "$R/spec.txt" 2>&1
    done
    sl spec run -H 2 --backend vulkan --cap 16 --arms R,M_QB --draft self > "$R/spec_qb.txt" 2>&1
    python3 benchmarks/device/cross_backend.py "$R/cross" -H 2 --backends cpu,cuda,vulkan --cap 64 > "$R/cross.txt" 2>&1
    rm -rf "$R"/cross/cap_*; tar -czf "$OUT/vk_run.tgz" -C "$R/.." vk; tail -30 "$R/cross.txt"
    ;;
  demo)
    mkdir -p "$R"
    sl demo --backend vulkan --out "$R/demo" > "$R/demo.txt" 2>&1; tail -40 "$R/demo.txt"
    tar -czf "$OUT/vk_demo.tgz" -C "$R/.." vk
    ;;
  qb)
    R=$W/vkqb; mkdir -p "$R"   # kept on the machine while it is warm: a resumed call skips what is done
    python3 -c 'from statelab.runtime import layouts, prepare_backend; prepare_backend("vulkan")
print("patch 0007 (QB on Vulkan):", layouts.vulkan_qb_available())' 2>&1 | tee "$R/patch.txt"
    sl audit backends --backend vulkan > "$R/admission.txt" 2>&1; grep -E "^\| QB \| 4 " "$R/admission.txt"
    if [ ! -f "$R/locate.txt" ]; then
      LOCATE_ARGS="--logits all --max-tokens 64" locate_each "$R" vulkan smollm2: ub4:QB ub4:MQ
      for t in 0 2; do
        sl spec run -H $t --backend vulkan --cap 64 --arms R,M_QB,C_QB --draft ngram:1-8 --fixed-rows \
          --json "$R/spec_qb_he$t.json" >> "$R/spec_qb.txt" 2>&1
      done
    fi
    tail -n 40 "$R/locate.txt" "$R/spec_qb.txt"
    sed -e 's/^backend = "cuda"/backend = "vulkan"/' studies/spec-cuda-ngram.toml > "$R/spec-vulkan-ngram.toml"
    mq_spec "$R/spec-vulkan-ngram.toml" "$R/spec-vulkan-mq.toml"
    for s in ngram mq; do
      python3 benchmarks/speculative.py "$R/spec-vulkan-$s.toml" --rows --no-write --out "$W/vk-$s" \
        ${BUDGET:+--budget $BUDGET} 2>&1 | tee "$R/campaign-$s.txt" | tail -25
      [ "${PIPESTATUS[0]}" = 3 ] && exit 3   # unfinished: the next `qb` call resumes it
      rm -rf "$R/vk-$s"; cp -r "$W/vk-$s" "$R/"
    done
    tar -czf "$OUT/vk_qb.tgz" -C "$W" vkqb
    ;;
  *) echo "usage: $0 setup|part1|part2|model|wait|run|demo|qb" >&2; exit 2 ;;
esac
