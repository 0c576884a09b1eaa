#!/usr/bin/env python3
"""Build llama-cpp-python from the pinned sdist with statelab's patch series.

Standard library only, so it runs before anything else is installed.

    python native/build.py [--backend cpu|vulkan|cuda] [--sdist PATH] [--offline]

Steps: obtain the llama-cpp-python 0.3.36 sdist (pip download, or --sdist / the
cache), verify its sha256, apply ``native/patches/*.patch`` in name order to the
extracted tree, write a build identity into ``llama_cpp/statelab_build.json`` so
the runtime can read it back, build a wheel for the chosen backend and install
it into the running interpreter's environment.  Wheels are cached under
``$XDG_CACHE_HOME/statelab/wheels/<key>`` where the key hashes the sdist, the
patch series, the backend, the compiler, the CPU feature set and the CMake
arguments, so a second install of the same configuration compiles nothing.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

SDIST_NAME = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
SDIST_FILE = "llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
IDENTITY_FILE = "statelab_build.json"

HERE = Path(__file__).resolve().parent
PATCH_DIR = HERE / "patches"

# Shared objects must not export the C++ runtime they link: libggml-cuda built
# by nvcc otherwise exports libstdc++ symbols that shadow the interpreter's own
# (a PyTorch interpreter then crashes inside libllama's std::regex).
COMMON_CMAKE = [
    "-DLLAVA_BUILD=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DGGML_OPENMP=ON",
    "-DCMAKE_SHARED_LINKER_FLAGS=-Wl,--exclude-libs,ALL",
]
# One instruction set on every x86-64 host (x86-64-v3: AVX2, FMA, F16C, BMI2, no AVX512),
# not the host's own (-march=native, llama.cpp's default): ggml picks its CPU kernels at compile
# time, and an AVX512F build forms other KV states than an AVX2 one from the same prompt (which
# prefill ubatches agree, and where A and R part, both changed between CI hosts). Pinned, the
# CPU facts and the golden files are those of one build wherever it runs. A build for this
# host's own ISA: --cmake-arg=-DGGML_NATIVE=ON (a later argument wins; it enters the build key).
X86_ISA = "x86-64-v3"
ISA_CMAKE = ["-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON",
             "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF",
             "-DGGML_AVX_VNNI=OFF"]
X86_NEEDS = ("avx2", "fma", "f16c", "bmi2")


def isa_cmake(extra_cmake: list[str] | None = None) -> list[str]:
    """The pinned ISA's CMake arguments on x86-64 (none elsewhere, or when the caller asks for a
    native build); refuses a host that cannot run the pinned build."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    if any(a.startswith("-DGGML_NATIVE=") and a.split("=", 1)[1].upper() in ("ON", "1", "TRUE")
           for a in extra_cmake or []):
        return []
    flags = host_cpu_flags()
    missing = [f for f in X86_NEEDS if flags is not None and f not in flags]
    if missing:
        raise BuildError(f"this CPU lacks {', '.join(missing)}, which the pinned {X86_ISA} build needs; "
                         "build for it with --cmake-arg=-DGGML_NATIVE=ON (its CPU facts then differ "
                         "from the golden files)")
    return list(ISA_CMAKE)


BACKEND_CMAKE = {
    "cpu": [],
    "vulkan": ["-DGGML_VULKAN=ON"],
    # Hidden visibility keeps each library's inline C++ (std::regex internals included) private,
    # so libllama never binds to libggml-cuda's copies.
    "cuda": ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90", "-DCMAKE_CXX_VISIBILITY_PRESET=hidden",
             "-DCMAKE_CUDA_VISIBILITY_PRESET=hidden", "-DCMAKE_VISIBILITY_INLINES_HIDDEN=ON"],
}


class BuildError(RuntimeError):
    pass


def cache_root() -> Path:
    base = os.environ.get("STATELAB_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "statelab")
    return Path(base)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def patch_series(upto: str | None = None) -> list[Path]:
    """The ordered patch series; with `upto`, only patches whose name sorts at or before it
    (e.g. upto="0001" gives the library without the attention-layout patch)."""
    patches = sorted(PATCH_DIR.glob("*.patch"))
    if upto is not None:
        patches = [p for p in patches if p.name[:len(upto)] <= upto]
    return patches


def patch_series_hash(patches: list[Path]) -> str:
    h = hashlib.sha256()
    for p in patches:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def compiler_id(backend: str) -> str:
    parts = []
    for cmd in (["c++", "--version"], ["nvcc", "--version"] if backend == "cuda" else None):
        if cmd is None:
            continue
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            raise BuildError(f"compiler not found: {cmd[0]} (needed for the {backend} build)")
        parts.append([ln for ln in out.splitlines() if ln.strip()][-1 if cmd[0] == "nvcc" else 0])
    return " | ".join(parts)


def _cpuinfo_flags_line() -> str | None:
    """The first ``flags`` line of /proc/cpuinfo (None where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return None


def host_cpu_flags() -> set[str] | None:
    line = _cpuinfo_flags_line()
    return None if line is None else set(line.split(":", 1)[1].split())


def cpu_signature() -> str:
    """The CPU feature flags (a build with --cmake-arg=-DGGML_NATIVE=ON targets this machine's ISA)."""
    line = _cpuinfo_flags_line()
    return platform.machine() if line is None else hashlib.sha256(line.encode()).hexdigest()[:16]


def _store(src: Path, dst: Path) -> None:
    """Copy src to dst through a sibling temporary file (dst never holds a partial copy)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    part = dst.with_suffix(".part")
    shutil.copyfile(src, part)
    os.replace(part, dst)


def _verify_sdist(src: Path) -> None:
    digest = sha256_file(src)
    if digest != SDIST_SHA256:
        raise BuildError(f"sdist {src} has sha256 {digest}, expected {SDIST_SHA256}")


def obtain_sdist(explicit: str | None, offline: bool) -> Path:
    cached = cache_root() / "sdist" / SDIST_FILE
    candidates = [Path(explicit)] if explicit else []
    if os.environ.get("STATELAB_SDIST"):
        candidates.append(Path(os.environ["STATELAB_SDIST"]))
    candidates.append(cached)
    for c in candidates:
        if c.is_file():
            src = c
            break
    else:
        if explicit:
            raise BuildError(f"sdist not found: {explicit}")
        if offline:
            raise BuildError(f"no cached sdist at {cached} and --offline given")
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                   "--no-binary=:all:", "--no-build-isolation", "-d", tmp,
                   f"{SDIST_NAME}=={SDIST_VERSION}"]
            r = subprocess.run(cmd, capture_output=True, text=True)
            got = Path(tmp) / SDIST_FILE
            if not got.is_file():
                raise BuildError("could not download the llama-cpp-python sdist:\n" + r.stderr[-2000:])
            _verify_sdist(got)  # before caching: a bad download must not become the cached copy
            _store(got, cached)
        return cached
    _verify_sdist(src)
    if src != cached and not cached.exists():
        _store(src, cached)
    return src


def apply_patches(tree: Path, patches: list[Path]) -> None:
    for p in patches:
        if shutil.which("patch"):
            cmd = ["patch", "-p1", "--forward", "--batch", "--no-backup-if-mismatch", "-d", str(tree), "-i", str(p)]
        else:  # an image without patch(1): git apply works outside a repository too
            cmd = ["git", "-C", str(tree), "apply", "-p1", str(p.resolve())]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise BuildError(f"patch {p.name} does not apply:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")


def build_key(ident: dict) -> str:
    keyed = {k: ident[k] for k in ("sdist_sha256", "patch_series_sha256", "backend",
                                    "compiler", "cpu_signature", "cmake_args", "python_tag")}
    return hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:20]


def identity(backend: str, upto: str | None = None, extra_cmake: list[str] | None = None) -> dict:
    patches = patch_series(upto)
    cmake_args = COMMON_CMAKE + isa_cmake(extra_cmake) + BACKEND_CMAKE[backend] + list(extra_cmake or [])
    return {
        "sdist": f"{SDIST_NAME}=={SDIST_VERSION}",
        "sdist_sha256": SDIST_SHA256,
        "patches": [p.name for p in patches],
        "patch_series_sha256": patch_series_hash(patches),
        "backend": backend,
        "compiler": compiler_id(backend),
        "cpu_signature": cpu_signature(),
        "cmake_args": cmake_args,
        "python_tag": f"{sys.implementation.name}{sys.version_info.major}{sys.version_info.minor}",
        "machine": platform.machine(),
    }


def prepare_tree(sdist: Path | None, ident: dict, tmp: Path, tree: Path | None = None) -> tuple[Path, dict]:
    """The sdist (or ``tree``, an unpacked copy of it) unpacked under ``tmp`` with the identity's
    patch series applied; returns the patched tree and the identity (marked when from ``tree``)."""
    if tree is None:
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
    else:
        if not (tree / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
            raise BuildError(f"{tree} is not an unpacked {SDIST_FILE} (no vendor/llama.cpp/CMakeLists.txt)")
        shutil.copytree(tree, tmp / SDIST_FILE.removesuffix(".tar.gz"), symlinks=True)
        ident = dict(ident, source="tree (unpacked sdist, not hash-verified)")
    tree = tmp / SDIST_FILE.removesuffix(".tar.gz")
    apply_patches(tree, [PATCH_DIR / n for n in ident["patches"]])
    return tree, ident


def build_wheel(sdist: Path | None, ident: dict, out_dir: Path, jobs: int, tree: Path | None = None) -> Path:
    """Build from the sdist, or from ``tree``, an unpacked copy of it (copied, then patched; used
    where the 73 MB sdist cannot travel, e.g. to a lent GPU machine)."""
    with tempfile.TemporaryDirectory(prefix="statelab-build-") as tmp:
        tmp = Path(tmp)
        tree, ident = prepare_tree(sdist, ident, tmp, tree)
        ident = dict(ident, build_key=build_key(ident),
                     built_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        (tree / "llama_cpp" / IDENTITY_FILE).write_text(json.dumps(ident, indent=2, sort_keys=True))
        env = dict(os.environ, CMAKE_ARGS=" ".join(ident["cmake_args"]),
                   CMAKE_BUILD_PARALLEL_LEVEL=str(jobs), FORCE_CMAKE="1")
        wheel_dir = tmp / "wheel"
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
               "-w", str(wheel_dir), str(tree)]
        log = tmp / "build.log"
        t0 = time.time()
        with open(log, "w") as lf:
            r = subprocess.run(cmd, env=env, stdout=lf, stderr=subprocess.STDOUT)
        if r.returncode != 0:
            keep = cache_root() / "last-build-failure.log"
            keep.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(log, keep)
            tail = log.read_text(errors="replace")[-3000:]
            raise BuildError(f"wheel build failed (full log: {keep}):\n{tail}")
        wheels = list(wheel_dir.glob("*.whl"))
        if len(wheels) != 1:
            raise BuildError(f"expected one wheel, found {wheels}")
        print(f"[native] compiled {ident['backend']} build in {time.time() - t0:.0f} s", flush=True)
        staging = out_dir.with_name(out_dir.name + ".part")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        shutil.copyfile(wheels[0], staging / wheels[0].name)
        (staging / IDENTITY_FILE).write_text(json.dumps(ident, indent=2, sort_keys=True))
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(staging, out_dir)
    return next(out_dir.glob("*.whl"))


def install_wheel(wheel: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--force-reinstall",
           str(wheel)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise BuildError(f"installing {wheel.name} failed:\n{r.stderr[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default=os.environ.get("STATELAB_BACKEND", "cpu"),
                    help="cpu (default), vulkan (includes the CPU backend) or cuda")
    ap.add_argument("--sdist", help="a local copy of the pinned sdist (verified by sha256)")
    ap.add_argument("--tree", help="build from an unpacked copy of the pinned sdist instead (not hash-verified)")
    ap.add_argument("--offline", action="store_true", help="never download")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--no-install", action="store_true", help="build or find the wheel only")
    ap.add_argument("--print-key", action="store_true", help="print the cache key and exit")
    ap.add_argument("--upto", help="apply only the patches up to this prefix (e.g. 0001: no layouts)")
    ap.add_argument("--cmake-arg", action="append", default=[], metavar="-DNAME=VALUE",
                    help="an extra CMake argument (repeatable; part of the build key), e.g. a toolchain "
                         "in its own prefix: -DVulkan_GLSLC_EXECUTABLE=/opt/vk/usr/bin/glslc")
    args = ap.parse_args(argv)
    try:
        if args.backend not in BACKEND_CMAKE:
            raise BuildError(f"unknown backend {args.backend!r}; choose one of {sorted(BACKEND_CMAKE)}")
        ident = identity(args.backend, args.upto, args.cmake_arg)
        key = build_key(ident)
        if args.print_key:
            print(key)
            return 0
        out_dir = cache_root() / "wheels" / key
        wheels = list(out_dir.glob("*.whl")) if out_dir.is_dir() else []
        if wheels:
            print(f"[native] cached {args.backend} build {key}", flush=True)
            wheel = wheels[0]
        else:
            print(f"[native] building {args.backend} build {key} "
                  f"(patches: {', '.join(ident['patches']) or 'none'})", flush=True)
            if args.tree:
                wheel = build_wheel(None, ident, out_dir, args.jobs, tree=Path(args.tree))
            else:
                wheel = build_wheel(obtain_sdist(args.sdist, args.offline), ident, out_dir, args.jobs)
        if not args.no_install:
            install_wheel(wheel)
            print(f"[native] installed {wheel.name} ({args.backend}) from {out_dir}", flush=True)
        else:
            print(wheel)
    except BuildError as e:
        print(f"native build error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
