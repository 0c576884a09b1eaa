#!/usr/bin/env bash
# The H200 session for llama-server as a partner (issue 29): a CUDA llama-server built from the
# pinned sources with the same patch series (native/server.py), started on 127.0.0.1, and the
# three partner checks of tests/test_server.py on CUDA (benchmarks/device/server_checks.py).
# Run from the repo root on the device machine; what travels is listed in common.sh.
# Steps (each one device call, made back to back; the machine is given back after 30 s idle):
#   setup    unpack, start the CUDA wheel build and after it the CUDA llama-server build, in the background
#   keep m1, keep m2  keep the first two parts of the model on the machine
#   model    join the SmolLM2 parts (m1, m2 kept; m3 travels now)
#   wait     wait for both builds (build times in the logs), doctor, the server's --version
#   checks   the three checks with the server's flash attention off and at its default (auto), lab and
#            server on CUDA, 16 tokens each; results (JSON rows, the printout, both build logs) in
#            $OUT/server.tgz. Exit status 1 when a check that ran differs.
set -uo pipefail
. "$(dirname "$0")/common.sh"
server_bin() { tail -1 $W/server-build.log; }
case "${1:-}" in
  setup)
    dev_setup --backend cuda
    rm -f $W/server.rc
    setsid nohup bash -c "cd $W && while [ ! -f $W/build.rc ]; do sleep 5; done; \
      python3 native/server.py --backend cuda --tree $W/llama_cpp_python-0.3.36 --no-install --jobs $(nproc) \
      > $W/server-build.log 2>&1; echo \$? > $W/server.rc" >/dev/null 2>&1 &
    ;;
  keep) dev_keep "$2" ;;
  model) dev_default_model ;;
  wait)
    dev_wait || exit 1
    while [ ! -f $W/server.rc ]; do sleep 5; done
    tail -3 $W/server-build.log; [ "$(cat $W/server.rc)" = 0 ] || exit 1
    sl doctor --backend cuda | tail -8
    "$(server_bin)" --version 2>&1 | tail -4
    ;;
  checks)
    R=$OUT/server; mkdir -p "$R"
    cp $W/build.log "$R/wheel-build.log"; cp $W/server-build.log "$R/server-build.log"
    STATELAB_LLAMA_SERVER="$(server_bin)" python3 benchmarks/device/server_checks.py --backend cuda --cap 16 \
      --out "$R/checks.json" 2>&1 | tee "$R/checks.txt" | tail -12
    rc=${PIPESTATUS[0]}
    tar -czf "$OUT/server.tgz" -C "$OUT" server && ls -la "$OUT"
    exit $rc
    ;;
  *) echo "usage: $0 setup|keep m1|model|wait|checks" >&2; exit 2 ;;
esac
