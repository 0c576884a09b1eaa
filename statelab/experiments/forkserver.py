"""Fresh processes without the interpreter start: a pre-imported fork server.

Every experiment unit (a study cell, a frontier unit, a campaign block) runs in a process
of its own whose llama.cpp context has decoded nothing else.  Starting a new interpreter
for each unit pays the interpreter start and the imports (numpy, xarray, pandas, networkx,
llama_cpp: about 0.7 s of CPU) every time.  The fork server pays them once:

    client (runner)                 server (python -m statelab.experiments.forkserver)
    ---------------                 ------------------------------------------------
    start() ----------------------> imports the worker modules and llama_cpp (the
                                    shared libraries are loaded, no backend is
                                    initialised, no model is loaded), gc.freeze(),
                                    listens on a Unix socket, prints READY
    run(fn, task) -- connect -----> accept; fork one child per request
                                      child: {"pid"} frame, set env, load its own model,
                                      run fn(task), {"result"} frame, _exit
    <-- {"pid"} {"result"} -------- (the child writes on the connection itself)
    <-- {"exit", "stderr"} -------- the server reaps the child and reports how it ended
    close() / EOF on stdin -------> kills what still runs, removes the socket, exits

The server and its children end with the runner, kill -9 included (:mod:`.lifeline`: the
server dies with the runner, each child with the server).  The server's folder
(``statelab-fork-PID-*`` in the temporary directory, PID the runner's) holds the socket and
the logs; the folders of runners that no longer run are removed by the next start.

CUDA and Vulkan do not survive fork(), so nothing in the server may initialise a backend:
the child calls ``llama_backend_init`` itself (``statelab.runtime.native.llama``), exactly
as a new interpreter would.  A child writes its stdout and stderr to a log file that the
server reads back (last lines) when the child has ended, so a crash is still explained.

Frames are a 4-byte big-endian length and a JSON object.  ``run`` never raises for what
happens inside the child: it returns ``(result, info)`` with ``result`` None when the child
ended without one (crash, kill, timeout) and ``info`` saying why.
"""
from __future__ import annotations

import gc
import importlib
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field

from statelab.errors import StatelabError
from statelab.experiments import lifeline
from statelab.paths import process_alive

READY = "STATELAB_FORKSERVER_READY"
# what every experiment unit needs, imported once in the server: the unit modules of every
# kind (statelab.experiments.kinds) and through them numpy, xarray and statelab; llama_cpp
# through statelab.runtime.native.preload (the libraries load, no backend is initialised)
DEFAULT_PRELOAD = ("numpy", "xarray", "statelab.experiments.kinds")
_HEAD = struct.Struct(">I")
_MAX_FRAME = 1 << 30


class ForkServerError(StatelabError):
    """The fork server could not be started or stopped answering."""


def send_frame(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj).encode()  # key order kept: a task's dict order can matter (panels)
    sock.sendall(_HEAD.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket) -> dict | None:
    """The next frame, or None at the end of the connection."""
    head = _recv_exact(sock, _HEAD.size)
    if head is None:
        return None
    (n,) = _HEAD.unpack(head)
    if n > _MAX_FRAME:
        raise ValueError(f"frame of {n} bytes")
    data = _recv_exact(sock, n)
    if data is None:
        return None
    return json.loads(data)


def resolve(ref: str):
    """``module:function`` -> the function."""
    mod, _, name = ref.partition(":")
    return getattr(importlib.import_module(mod), name)


def child_state(task: dict) -> dict:
    """What a forked child finds when it starts (a unit function for checks): which of
    ``task["modules"]`` are imported already, and whether llama.cpp's backend is initialised."""
    from statelab.runtime.native import llama

    return {"imported": [m for m in task.get("modules", []) if m in sys.modules],
            "backend_initialised": llama.cache_info().currsize > 0}


# ----------------------------------------------------------------------------- server


def _child(conn: socket.socket, req: dict, log_path: str, t_fork: float) -> None:  # pragma: no cover - in child
    """In the forked child: report the pid, run the function, report the result, _exit."""
    code = 0
    try:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stdout = open(1, "w", closefd=False, buffering=1)
        sys.stderr = open(2, "w", closefd=False, buffering=1)
        send_frame(conn, {"pid": os.getpid()})
        os.environ.update(req.get("env") or {})
        t0 = time.perf_counter()
        result = resolve(req["fn"])(req["task"])
        send_frame(conn, {"result": result, "fork_s": t0 - t_fork, "run_s": time.perf_counter() - t0})
    except BaseException as e:  # noqa: BLE001 - anything here must become a frame, then exit
        code = 1
        try:
            traceback.print_exc()
            send_frame(conn, {"error": f"{type(e).__name__}: {' '.join(str(e).split())}"})
        except BaseException:  # noqa: BLE001
            pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _tail(path: str, n: int = 3) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 8192))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])


def serve(sock_path: str, preload: list[str]) -> int:  # pragma: no cover - runs in its own process
    # Ctrl-C reaches the whole process group: the children end (default action), the client
    # sees KeyboardInterrupt and closes the server, which ignores it and outlives its children
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    lifeline.die_with_parent()  # the runner's kill -9 ends the server (and so its children)
    server_pid = os.getpid()
    for m in preload:
        importlib.import_module(m)
        if m == "statelab.experiments.kinds":
            for unit_module in sys.modules[m].unit_modules():
                importlib.import_module(unit_module)
    from statelab.runtime.native import preload as preload_native  # after the requested modules

    preload_native()
    gc.collect()
    gc.freeze()  # children share the imported objects copy-on-write
    logs = os.path.dirname(sock_path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(256)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, tuple[socket.socket, str]] = {}
    sys.stdout.write(READY + "\n")
    sys.stdout.flush()
    stdin = sys.stdin.fileno()
    try:
        while True:
            ready, _, _ = select.select([listener, wake_r, stdin], [], [], 5.0)
            if stdin in ready and not os.read(stdin, 4096):
                break  # the client closed us (or died)
            if wake_r in ready:
                try:
                    while os.read(wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            if listener in ready:
                conn, _ = listener.accept()
                req = recv_frame(conn)
                if req is None:
                    conn.close()
                else:
                    n = len(children)
                    log_path = os.path.join(logs, f"child-{time.time_ns()}-{n}.log")
                    t_fork = time.perf_counter()
                    pid = os.fork()
                    if pid == 0:
                        listener.close()
                        os.close(wake_r)
                        os.close(wake_w)
                        signal.set_wakeup_fd(-1)
                        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                        signal.signal(signal.SIGINT, signal.SIG_DFL)
                        lifeline.die_with_parent(server_pid)
                        for c, _ in children.values():
                            c.close()
                        _child(conn, req, log_path, t_fork)
                    children[pid] = (conn, log_path)
            _reap(children, block=False)
    finally:
        for pid in list(children):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap(children, block=True)
        listener.close()
    return 0


def _reap(children: dict, block: bool) -> None:  # pragma: no cover - runs in the server
    while children:
        try:
            pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid not in children:
            continue
        conn, log_path = children.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        try:
            send_frame(conn, {"exit": code, "stderr": _tail(log_path)})
        except OSError:
            pass
        conn.close()
        try:
            os.unlink(log_path)
        except OSError:
            pass


# ----------------------------------------------------------------------------- client


@dataclass
class UnitInfo:
    """How a unit's process went: its pid, exit status, the wall time seen by the client,
    the fork latency and the run time inside the child, and why it gave no result."""
    pid: int | None = None
    exit: int | None = None
    wall_s: float = 0.0
    fork_s: float | None = None
    run_s: float | None = None
    error: str | None = None
    stderr: str = ""
    timing: dict = field(default_factory=dict)


class ForkServer:
    """A running fork server; thread-safe: each ``run`` has its own connection."""

    def __init__(self, preload: tuple[str, ...] | list[str] = DEFAULT_PRELOAD, env: dict | None = None):
        self._preload = list(preload)
        self._env = env
        self._proc: subprocess.Popen | None = None
        self._dir: str | None = None
        self._lock = threading.Lock()
        self.startup_s = 0.0

    @property
    def socket_path(self) -> str:
        return os.path.join(self._dir, "s")

    def start(self) -> "ForkServer":
        t0 = time.perf_counter()
        remove_stale_folders()
        self._dir = tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-")
        env = lifeline.child_env(self._env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        log = os.path.join(self._dir, "server.log")
        try:
            try:
                with open(log, "wb") as err:
                    self._proc = subprocess.Popen(
                        [sys.executable, "-m", "statelab.experiments.forkserver", self.socket_path, *self._preload],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env)
            except OSError as e:
                raise ForkServerError(f"cannot start the fork server: {e}") from None
            line = self._proc.stdout.readline().decode(errors="replace").strip()
        except BaseException:  # Ctrl-C (or no server) during the start: stop it now, leave no folder behind
            if self._proc is not None:
                self._proc.kill()
            self.close()
            raise
        if line != READY:
            self._proc.wait()
            tail = _tail(log)
            self.close()
            raise ForkServerError("the fork server did not start: " + (tail or line or "no output"))
        self.startup_s = time.perf_counter() - t0
        return self

    def __enter__(self) -> "ForkServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def run(self, fn: str, task: dict, env: dict | None = None, timeout: float | None = None):
        """Run ``fn`` (``module:function``) on ``task`` in a fresh forked child; returns
        ``(result or None, UnitInfo)``."""
        info = UnitInfo()
        t0 = time.perf_counter()
        if not self.alive():
            info.error = "the fork server is not running"
            return None, info
        result = None
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(self.socket_path)
                send_frame(s, {"fn": fn, "task": task, "env": env or {}})
                deadline = None if timeout is None else time.monotonic() + timeout
                while True:
                    if deadline is not None:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            if info.pid:
                                _kill(info.pid)
                            info.error = f"the unit's process ran past {timeout} s and was killed"
                            deadline = None
                            s.settimeout(30.0)
                        else:
                            s.settimeout(left)
                    try:
                        frame = recv_frame(s)
                    except socket.timeout:
                        continue
                    if frame is None:
                        break
                    if "pid" in frame:
                        info.pid = frame["pid"]
                    elif "result" in frame:
                        result = frame["result"]
                        info.fork_s, info.run_s = frame.get("fork_s"), frame.get("run_s")
                    elif "error" in frame:
                        info.error = frame["error"]
                    elif "exit" in frame:
                        info.exit, info.stderr = frame["exit"], frame.get("stderr", "")
                        break
        except (OSError, ValueError) as e:
            info.error = info.error or f"lost the connection to the fork server: {e}"
        info.wall_s = time.perf_counter() - t0
        if result is None and info.error is None:
            info.error = (f"the unit's process (pid {info.pid}) exited with status {info.exit} without a result"
                          + (f": {info.stderr}" if info.stderr else ""))
        return result, info

    def close(self) -> None:
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()
        self._cleanup()

    def _cleanup(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


FOLDER_PREFIX = "statelab-fork-"


def remove_stale_folders(tmp: str | None = None) -> list[str]:
    """Remove the fork-server folders (``statelab-fork-PID-*``) of runners that no longer
    run (a killed run leaves its folder); those of live processes are left alone."""
    tmp = tmp or tempfile.gettempdir()
    removed = []
    try:
        entries = list(os.scandir(tmp))
    except OSError:
        return removed
    for e in entries:
        pid = e.name[len(FOLDER_PREFIX):].split("-", 1)[0]
        if not e.name.startswith(FOLDER_PREFIX) or not pid.isdigit() or not e.is_dir(follow_symlinks=False):
            continue
        if process_alive(int(pid)):
            continue
        shutil.rmtree(e.path, ignore_errors=True)
        removed.append(e.path)
    return removed


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


if __name__ == "__main__":  # pragma: no cover - the server process
    sys.exit(serve(sys.argv[1], sys.argv[2:]))
