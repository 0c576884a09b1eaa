"""Loading llama_cpp (the patched native build) and the ggml pieces it does not bind.

This package is the only place in statelab that imports llama_cpp.
"""
from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import tempfile
from dataclasses import dataclass
from functools import lru_cache

from statelab.errors import ConfigError, NativeBuildError, one_of


@dataclass(frozen=True)
class Backend:
    """A backend statelab builds for, with everything that depends on which one it is (the one place):
    its devices' ggml registry and the defaults measured on it (docs/findings.md)."""
    name: str
    registry: str | None  # ggml's registry of its devices (None: the CPU backend, always present)
    arms: tuple[str, ...]  # the schedule presets that form different states on it: the demo's partition arms,
    #                        the first two its selector-matrix and frontier directions (both ways)
    tasks: tuple[str, ...]  # demo prompts whose natural endpoints differ between those arms
    matrix_tasks: tuple[str, ...]  # one prompt longer than 128 tokens (PREFIX and TAIL differ), one shorter


_GPU = dict(arms=("A", "B", "C"), tasks=("HumanEval/10", "HumanEval/20", "HumanEval/86"),
            matrix_tasks=("HumanEval/10", "HumanEval/86"))
# CPU (the pinned x86-64-v3 build, native/build.py): batched prefill is bitwise equal for A, B and C
# unless a micro-batch holds one row, token by token (R) differs; HumanEval/17 (167 tokens) and /13 (72) have A/R natural endpoints
# that differ within 48 outputs (at 6 and 20), /4 at 6 (benchmarks/arm_divergence.py)
BACKEND = {b.name: b for b in (
    Backend("cpu", None, ("A", "R"), ("HumanEval/4", "HumanEval/13", "HumanEval/17"), ("HumanEval/17", "HumanEval/13")),
    Backend("cuda", "CUDA", **_GPU),
    Backend("vulkan", "Vulkan", **_GPU),
)}
BACKENDS = tuple(BACKEND)
IDENTITY_FILE = "statelab_build.json"
INSTALL_HINT = "run ./install.sh (or: python native/build.py --backend cpu) to build it"


def check_backend(backend: str) -> str:
    """The one parser of backend names: ``backend`` when it is one of :data:`BACKENDS`; ConfigError
    naming them otherwise."""
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose one of {one_of(BACKENDS)}")
    return backend


def backend_info(backend: str) -> Backend:
    """The :class:`Backend` of a name (checked)."""
    return BACKEND[check_backend(backend)]


def prepare_backend(backend: str) -> None:
    """Set what must be set before ggml registers its backends.

    llama.cpp ignores CPU-type Vulkan devices (lavapipe) unless GGML_VK_VISIBLE_DEVICES
    names them; the variable is read once, when the Vulkan backend registers.
    """
    if check_backend(backend) == "vulkan":
        os.environ.setdefault("GGML_VK_VISIBLE_DEVICES", "0")


@lru_cache(maxsize=1)
def llama():
    """The llama_cpp module, with the backend initialised once per process."""
    try:
        mod = importlib.import_module("llama_cpp")
    except ImportError as e:
        raise NativeBuildError(f"the native build (llama_cpp) is not installed: {e}; {INSTALL_HINT}") from None
    except (OSError, RuntimeError) as e:
        raise NativeBuildError(f"the native library failed to load: {e}; {INSTALL_HINT}") from None
    mod.llama_log_set(_LOG_CB, None)
    # Backends register on first use and some print straight to stderr (a Vulkan build on a
    # machine without a usable device says "ggml_vulkan: No devices found."); register them
    # now with stderr captured, shown only with STATELAB_NATIVE_LOG set.
    with _captured_stderr() as text:
        mod.llama_backend_init()
        mod.llama_cpp._lib.llama_max_devices()
        importlib.import_module("llama_cpp._ggml").libggml.ggml_backend_dev_count()
    if os.environ.get("STATELAB_NATIVE_LOG") and text:
        os.write(2, text[0])
    return mod


@contextlib.contextmanager
def _captured_stderr():
    out: list[bytes] = []
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out.append(tmp.read())


# llama.cpp logs go nowhere unless STATELAB_NATIVE_LOG is set (errors still surface as exceptions).
@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _LOG_CB(level, text, user_data):  # pragma: no cover - called from C
    if os.environ.get("STATELAB_NATIVE_LOG"):
        os.write(2, text or b"")


def lib():
    """The ctypes CDLL of libllama."""
    return llama().llama_cpp._lib


@lru_cache(maxsize=1)
def ggml_lib():
    """libggml (backend registry, tensor access) as loaded by llama_cpp."""
    llama()
    mod = importlib.import_module("llama_cpp._ggml")
    g = mod.libggml
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    sigs = {
        "ggml_backend_dev_count": ([], sz),
        "ggml_backend_dev_get": ([sz], vp),
        "ggml_backend_dev_name": ([vp], ctypes.c_char_p),
        "ggml_backend_dev_description": ([vp], ctypes.c_char_p),
        "ggml_backend_dev_type": ([vp], ctypes.c_int),
        "ggml_backend_dev_memory": ([vp, ctypes.POINTER(sz), ctypes.POINTER(sz)], None),
        "ggml_backend_dev_backend_reg": ([vp], vp),
        "ggml_backend_reg_name": ([vp], ctypes.c_char_p),
        "ggml_backend_dev_supports_op": ([vp, vp], ctypes.c_bool),
        "ggml_backend_tensor_get": ([vp, vp, sz, sz], None),
        "ggml_nbytes": ([vp], sz),
        "ggml_op_name": ([ctypes.c_int], ctypes.c_char_p),
        "ggml_op_desc": ([vp], ctypes.c_char_p),
        "ggml_type_name": ([ctypes.c_int], ctypes.c_char_p),
    }
    for name, (args, res) in sigs.items():
        fn = getattr(g, name)
        fn.argtypes = args
        fn.restype = res
    return g


DEV_TYPES = {0: "CPU", 1: "GPU", 2: "IGPU", 3: "ACCEL", 4: "META"}


@dataclass(frozen=True)
class Device:
    index: int
    name: str
    description: str
    type: str
    registry: str
    memory_free: int
    memory_total: int
    handle: int

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "handle"}


def list_devices() -> list[Device]:
    g = ggml_lib()
    out = []
    for i in range(g.ggml_backend_dev_count()):
        d = g.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        g.ggml_backend_dev_memory(d, ctypes.byref(free), ctypes.byref(total))
        reg = g.ggml_backend_dev_backend_reg(d)
        out.append(Device(i, g.ggml_backend_dev_name(d).decode(), g.ggml_backend_dev_description(d).decode(),
                          DEV_TYPES.get(g.ggml_backend_dev_type(d), "?"),
                          g.ggml_backend_reg_name(reg).decode() if reg else "?",
                          free.value, total.value, d))
    return out


def devices_for_backend(backend: str) -> list[Device]:
    """Devices of a backend: 'cpu' has none (the CPU backend is always present)."""
    want = backend_info(backend).registry
    if want is None:
        return []
    devices = list_devices()
    found = [d for d in devices if d.registry.lower() == want.lower()]
    if not found:
        have = ", ".join(f"{d.registry}:{d.name}" for d in devices) or "none"
        raise ConfigError(f"backend {backend!r} has no device in this build/machine (devices: {have})")
    return found


def _identity_file(package_dir: str) -> dict:
    with open(os.path.join(package_dir, IDENTITY_FILE)) as f:
        return json.load(f)


def build_identity() -> dict:
    """The identity native/build.py wrote into the installed llama_cpp package."""
    mod = llama()
    path = os.path.join(os.path.dirname(mod.__file__), IDENTITY_FILE)
    try:
        ident = _identity_file(os.path.dirname(mod.__file__))
    except OSError:
        raise NativeBuildError(f"llama_cpp is installed but has no statelab build identity ({path}); "
                               f"it was not built by native/build.py; {INSTALL_HINT}") from None
    except ValueError as e:
        raise NativeBuildError(f"the statelab build identity {path} is not valid JSON: {e}; {INSTALL_HINT}") from None
    ident["llama_cpp_python"] = getattr(mod, "__version__", "?")
    if os.environ.get("LLAMA_CPP_LIB_PATH"):  # llama_cpp then loads libllama from there, not from the build
        ident["lib_override"] = os.environ["LLAMA_CPP_LIB_PATH"]
    ident["system_info"] = mod.llama_print_system_info().decode(errors="replace").strip()
    return ident


def installed_build_key() -> str:
    """The installed build's key (native/build.py's identity file) read without importing
    llama_cpp or initialising a backend; with LLAMA_CPP_LIB_PATH the library's folder is added
    (llama_cpp then loads it from there); "unknown" where there is no identity file."""
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    key = "unknown"
    if spec is not None and spec.origin:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            key = str(_identity_file(os.path.dirname(spec.origin)).get("build_key", "unknown"))
    override = os.environ.get("LLAMA_CPP_LIB_PATH")
    return f"{key}@{override}" if override else key


def preload() -> None:
    """Import llama_cpp and its ggml binding (the shared libraries load) WITHOUT initialising
    a backend: what a fork server may do before it forks (CUDA and Vulkan do not survive
    fork; each child initialises its backend itself through :func:`llama`)."""
    try:
        importlib.import_module("llama_cpp")
        importlib.import_module("llama_cpp._ggml")
    except ImportError as e:
        raise NativeBuildError(f"the native build (llama_cpp) is not installed: {e}; {INSTALL_HINT}") from None
    except (OSError, RuntimeError) as e:
        raise NativeBuildError(f"the native library failed to load: {e}; {INSTALL_HINT}") from None
