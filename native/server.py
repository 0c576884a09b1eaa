#!/usr/bin/env python3
"""Build llama-server from the pinned sdist with statelab's patch series.

Standard library only, and the sdist, its verification and the patch series come from
``build.py`` (the same functions the wheel build uses), so the server runs the same
patched llama.cpp as statelab's own library.

    python native/server.py [--backend cpu|cuda] [--sdist PATH] [--tree DIR] [--offline] [--jobs N]

Steps: obtain and verify the llama-cpp-python 0.3.36 sdist, unpack it, apply
``native/patches/*.patch``, configure ``vendor/llama.cpp`` with CMake (static libraries,
no Web UI, no OpenSSL, no tests or examples) and build the one target ``llama-server``.
The binary and its build identity are cached under
``$XDG_CACHE_HOME/statelab/server/<key>`` (the key hashes the sdist, the patch series, the
backend, the compiler, the CPU feature set and the CMake arguments, as for the wheel), so a
second install compiles nothing; then it is copied to ``<prefix>/bin/llama-server`` of the
running interpreter's environment (``--no-install``: print the cached path only).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build  # noqa: E402  (native/build.py: sdist, patches, identity, cache key)

TARGET = "llama-server"
# Static libraries: one self-contained binary to cache and copy. No Web UI (neither the npm
# build nor the prebuilt download), no HTTPS (OpenSSL), no curl (LLAMA_CURL is gone from this
# llama.cpp; downloads need OpenSSL, which is off), no tests, examples or unified app.
SERVER_CMAKE = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_COMMON=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DGGML_OPENMP=ON",
]
BACKENDS = ("cpu", "cuda")


def server_identity(backend: str, extra_cmake: list[str] | None = None) -> dict:
    ident = build.identity(backend, extra_cmake=extra_cmake)
    ident.update(
        target=TARGET,
        cmake_args=SERVER_CMAKE + build.isa_cmake(extra_cmake) + build.BACKEND_CMAKE[backend]
        + list(extra_cmake or []),
        python_tag="-",  # a native binary: the interpreter does not enter the key
    )
    return ident


def build_server(sdist: Path | None, ident: dict, out_dir: Path, jobs: int, tree: Path | None = None) -> Path:
    with tempfile.TemporaryDirectory(prefix="statelab-server-") as tmp:
        tmp = Path(tmp)
        src, ident = build.prepare_tree(sdist, ident, tmp, tree)
        ident = dict(ident, build_key=build.build_key(ident),
                     built_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        bdir = tmp / "cmake-build"
        log = tmp / "build.log"
        t0 = time.time()
        with open(log, "w") as lf:
            for cmd in (["cmake", "-S", str(src / "vendor" / "llama.cpp"), "-B", str(bdir)] + ident["cmake_args"],
                        ["cmake", "--build", str(bdir), "--target", TARGET, "-j", str(jobs)]):
                lf.write("$ " + " ".join(cmd) + "\n")
                lf.flush()
                try:
                    r = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT)
                except OSError as e:
                    raise build.BuildError(f"cannot run {cmd[0]}: {e}")
                if r.returncode != 0:
                    keep = build.cache_root() / "last-server-build-failure.log"
                    keep.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(log, keep)
                    tail = log.read_text(errors="replace")[-3000:]
                    raise build.BuildError(f"llama-server build failed (full log: {keep}):\n{tail}")
        binary = bdir / "bin" / TARGET
        if not binary.is_file():
            raise build.BuildError(f"the build produced no {binary}")
        seconds = time.time() - t0
        print(f"[native] compiled {ident['backend']} llama-server in {seconds:.0f} s (jobs {jobs})", flush=True)
        ident["build_seconds"] = round(seconds, 1)
        ident["build_jobs"] = jobs
        staging = out_dir.with_name(out_dir.name + ".part")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        shutil.copy2(binary, staging / TARGET)
        (staging / build.IDENTITY_FILE).write_text(json.dumps(ident, indent=2, sort_keys=True))
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(staging, out_dir)
    return out_dir / TARGET


def install_server(binary: Path, prefix: Path) -> Path:
    """Copy the binary to ``prefix/bin`` and its identity beside it, each through a temporary
    file and a rename (never a half-copied executable)."""
    dst = prefix / "bin" / TARGET
    dst.parent.mkdir(parents=True, exist_ok=True)
    for src, to in ((binary.parent / build.IDENTITY_FILE, dst.with_name(TARGET + ".statelab_build.json")),
                    (binary, dst)):
        part = to.with_name(to.name + ".part")
        shutil.copy2(src, part)
        os.replace(part, to)
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--sdist", help="a local copy of the pinned sdist (verified by sha256)")
    ap.add_argument("--tree", help="build from an unpacked copy of the pinned sdist instead (not hash-verified)")
    ap.add_argument("--offline", action="store_true", help="never download")
    ap.add_argument("--jobs", type=int, default=2, help="parallel compile jobs (default 2)")
    ap.add_argument("--no-install", action="store_true", help="build or find the binary only; print its path")
    ap.add_argument("--prefix", default=sys.prefix, help="install into PREFIX/bin (default: this environment)")
    ap.add_argument("--print-key", action="store_true", help="print the cache key and exit")
    ap.add_argument("--cmake-arg", action="append", default=[], metavar="-DNAME=VALUE",
                    help="an extra CMake argument (repeatable; part of the build key)")
    args = ap.parse_args(argv)
    try:
        if args.backend not in BACKENDS:
            raise build.BuildError(f"unknown backend {args.backend!r} for llama-server; choose one of {list(BACKENDS)}")
        ident = server_identity(args.backend, args.cmake_arg)
        key = build.build_key(ident)
        if args.print_key:
            print(key)
            return 0
        out_dir = build.cache_root() / "server" / key
        binary = out_dir / TARGET
        if binary.is_file():
            print(f"[native] cached {args.backend} llama-server {key}", flush=True)
        else:
            print(f"[native] building {args.backend} llama-server {key} "
                  f"(patches: {', '.join(ident['patches']) or 'none'})", flush=True)
            sdist = None if args.tree else build.obtain_sdist(args.sdist, args.offline)
            binary = build_server(sdist, ident, out_dir, args.jobs,
                                  tree=Path(args.tree) if args.tree else None)
        if args.no_install:
            print(binary)
        else:
            dst = install_server(binary, Path(args.prefix))
            print(f"[native] installed llama-server ({args.backend}) at {dst} from {out_dir}", flush=True)
    except build.BuildError as e:
        print(f"native build error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
