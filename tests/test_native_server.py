"""native/server.py: the llama-server build's cache key and cache lookup (no compiling here;
tests/test_server.py runs the built binary)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

NATIVE = Path(__file__).resolve().parents[1] / "native"


@pytest.fixture(scope="module")
def server_mod():
    sys.path.insert(0, str(NATIVE))
    spec = importlib.util.spec_from_file_location("statelab_native_server", NATIVE / "server.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_key_is_its_own_and_follows_the_configuration(server_mod):
    b = server_mod.build
    ident = server_mod.server_identity("cpu")
    key = b.build_key(ident)
    assert key == b.build_key(server_mod.server_identity("cpu"))  # stable
    assert key != b.build_key(b.identity("cpu"))  # not the wheel's
    assert key != b.build_key(server_mod.server_identity("cpu", ["-DGGML_NATIVE=OFF"]))
    assert ident["patches"] == [p.name for p in b.patch_series()]  # the whole series
    for arg in ("-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"):
        assert arg in ident["cmake_args"]


def test_a_cached_binary_is_found_and_installed_without_compiling(server_mod, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("STATELAB_CACHE", str(tmp_path / "cache"))
    key = server_mod.build.build_key(server_mod.server_identity("cpu"))
    cached = tmp_path / "cache" / "server" / key
    cached.mkdir(parents=True)
    (cached / "llama-server").write_bytes(b"#!/bin/sh\necho fake\n")
    (cached / "llama-server").chmod(0o755)
    (cached / "statelab_build.json").write_text(json.dumps({"build_key": key}))

    def no_build(*a, **k):
        raise AssertionError("compiled although the binary is cached")

    monkeypatch.setattr(server_mod, "build_server", no_build)
    assert server_mod.main(["--prefix", str(tmp_path / "env")]) == 0
    out = capsys.readouterr().out
    assert f"cached cpu llama-server {key}" in out
    installed = tmp_path / "env" / "bin" / "llama-server"
    assert installed.read_bytes() == (cached / "llama-server").read_bytes() and installed.stat().st_mode & 0o111
    assert json.loads((tmp_path / "env" / "bin" / "llama-server.statelab_build.json").read_text())["build_key"] == key
    assert not list((tmp_path / "env" / "bin").glob("*.part"))


def test_unknown_backend_is_one_line(server_mod, capsys):
    assert server_mod.main(["--backend", "vulkan", "--print-key"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown backend 'vulkan' for llama-server" in err[0]


def test_the_cpu_build_is_pinned_to_x86_64_v3(server_mod, monkeypatch):
    """native/build.py: on x86-64 every build (wheel and server) carries the x86-64-v3 flags, not
    -march=native; --cmake-arg=-DGGML_NATIVE=ON asks for the host's own (another key); a host that
    cannot run x86-64-v3 is refused in one line; other architectures get no flags."""
    b = server_mod.build
    monkeypatch.setattr(b.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(b, "host_cpu_flags", lambda: {"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw"})
    for ident in (b.identity("cpu"), b.identity("vulkan"), server_mod.server_identity("cpu")):
        assert set(b.ISA_CMAKE) <= set(ident["cmake_args"]) and "-DGGML_AVX512=OFF" in ident["cmake_args"]
    native = b.identity("cpu", extra_cmake=["-DGGML_NATIVE=ON"])
    assert "-DGGML_NATIVE=OFF" not in native["cmake_args"]
    assert b.build_key(native) != b.build_key(b.identity("cpu"))
    monkeypatch.setattr(b, "host_cpu_flags", lambda: {"avx", "sse4_2"})
    with pytest.raises(b.BuildError, match="lacks avx2, fma, f16c, bmi2") as e:
        b.identity("cpu")
    assert "\n" not in str(e.value) and "GGML_NATIVE=ON" in str(e.value)
    assert "-DGGML_NATIVE=OFF" not in b.identity("cpu", extra_cmake=["-DGGML_NATIVE=ON"])["cmake_args"]
    monkeypatch.setattr(b.platform, "machine", lambda: "aarch64")
    assert not any("GGML_NATIVE" in a for a in b.identity("cpu")["cmake_args"])


@pytest.mark.model
def test_the_installed_build_runs_the_pinned_instruction_set():
    """The build the tests run (and the golden files came from) is the x86-64-v3 one."""
    import platform
    import subprocess

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the instruction set is pinned on x86-64 only")
    code = ("import json; from statelab.runtime.native import build_identity as b; i = b(); "
            "print(json.dumps([i.get('cmake_args'), i.get('system_info')]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-1500:]
    args, info = json.loads(r.stdout.strip().splitlines()[-1])
    assert "-DGGML_NATIVE=OFF" in args and "-DGGML_AVX2=ON" in args
    assert "AVX2 = 1" in info and "FMA = 1" in info and "AVX512" not in info, info
