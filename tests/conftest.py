"""Shared fixtures: the real embedded model on CPU (session-scoped), HumanEval prompts, the CLI
in process (typer's runner) and in a subprocess, and the markers every test gets from what it uses.

Tiers (markers are enforced: ``--strict-markers``; see the README's test section):
``model`` the embedded model (the ``model`` fixture, or the model loaded any other way: a test
that loads it without the mark fails), ``gemma`` the Gemma 3 package, ``cli`` a real ``statelab``
subprocess (``cli_subprocess`` / ``run_cli_subprocess``), ``slow`` longer real-model runs."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STATELAB = [sys.executable, "-m", "statelab.cli"]

# fixture -> the markers a test that uses it gets
FIXTURE_MARKS = {"model": ("model",), "gemma": ("model", "gemma"), "cli_subprocess": ("cli",)}


@pytest.fixture(scope="session")
def model():
    from statelab.runtime import Model

    m = Model(None, backend="cpu")
    yield m
    m.close()


@pytest.fixture(scope="session")
def gemma():
    """Gemma 3 270M Q4_K_M on CPU (the second model family: an iSWA memory), session-scoped."""
    from statelab.models import gemma3_model_path
    from statelab.runtime import Model

    m = Model(gemma3_model_path(), backend="cpu")
    yield m
    m.close()


@pytest.fixture(scope="session")
def base_config():
    from statelab.runtime import ContextConfig

    return ContextConfig(backend="cpu", n_ctx=1024)


@pytest.fixture(scope="session")
def he():
    from statelab import prompts

    return prompts.humaneval


# ------------------------------------------------------------------ the CLI


def run_cli_subprocess(*args, env=None, timeout=600):
    """``python -m statelab.cli ARGS`` in a new interpreter (tests marked ``cli``: the behaviour
    is about processes, signals or the real entry point's exit status)."""
    _require_mark("cli", "runs the CLI in a subprocess")
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run(STATELAB + [str(a) for a in args], capture_output=True, text=True, env=e,
                          timeout=timeout, cwd=REPO)


PROCESS_ENV = {"PYTHONPATH", "LLAMA_CPP_LIB_PATH", "PYTHONHASHSEED", "LD_LIBRARY_PATH", "GGML_VK_VISIBLE_DEVICES"}


def run_cli(*args, env=None, timeout=None):
    """``statelab ARGS`` in this process: the entry point :func:`statelab.cli.main.main` itself
    (the same one-line errors and exit statuses 0/1/2/130) under typer's ``CliRunner``
    isolation (stdout, stderr and the ``env`` overrides captured and restored), run from the
    repository root like the subprocess.  Returns a ``CompletedProcess`` like
    :func:`run_cli_subprocess`; ``timeout`` is accepted for the same signature (pytest-timeout
    bounds the test)."""
    import importlib

    from typer.testing import CliRunner

    cli_main = importlib.import_module("statelab.cli.main")  # the module (statelab.cli.main is also the function)

    if set(env or ()) & PROCESS_ENV:
        raise ValueError(f"{sorted(set(env) & PROCESS_ENV)} act when an interpreter starts: use run_cli_subprocess")
    argv = ["statelab", *(str(a) for a in args)]
    saved = sys.argv, os.getcwd(), sys.unraisablehook, signal.getsignal(signal.SIGINT)
    code = 0
    with CliRunner().isolation(env=env) as (out, err, _):
        sys.argv = argv
        os.chdir(REPO)
        try:
            cli_main.main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except Exception:  # what the interpreter does with an uncaught error: the traceback, status 1
            traceback.print_exc()
            code = 1
        finally:
            sys.argv, cwd, sys.unraisablehook, sigint = saved
            os.chdir(cwd)
            if sigint is not None and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGINT, sigint)
            with contextlib.suppress(ValueError):
                sys.stdout.flush(), sys.stderr.flush()
        stdout, stderr = out.getvalue().decode(), err.getvalue().decode()
    return subprocess.CompletedProcess(argv, code, stdout, stderr)


@pytest.fixture
def cli():
    """The CLI in process (:func:`run_cli`)."""
    return run_cli


@pytest.fixture
def cli_subprocess():
    """The CLI in a new interpreter (:func:`run_cli_subprocess`); the test gets the ``cli`` mark."""
    return run_cli_subprocess


def one_line_error(r, *needles):
    """A failed CLI call that wrote exactly one line to stderr (no traceback) holding every needle."""
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]



def statelab_error(r, *needles):
    """A command refused in process (typer's CliRunner): a StatelabError, which statelab.cli.main
    prints as one line with exit 2, holding every needle."""
    from statelab.errors import StatelabError

    assert isinstance(r.exception, StatelabError), (r.exception, r.output)
    msg = str(r.exception)
    assert "\n" not in msg.strip(), msg
    for n in needles:
        assert n in msg, msg
    return msg

# ------------------------------------------------------------------ markers from what a test uses

_current: list = []  # the test item running now


def _require_mark(name: str, what: str) -> None:
    if _current and _current[-1].get_closest_marker(name) is None:
        pytest.fail(f"{_current[-1].nodeid} {what}: mark it @pytest.mark.{name}", pytrace=False)


_model_loads = [0]


def _count_model_loads():
    """Count model loads (statelab.runtime.Model), so that a test that loads a model without
    the ``model`` mark fails: ``-m "not model"`` stays the tier without a model."""
    try:
        from statelab.runtime import context
    except ImportError:  # no native build: the model tests cannot run anyway
        return
    init = context.Model.__init__

    def counted(self, *a, **k):
        _model_loads[0] += 1
        return init(self, *a, **k)

    context.Model.__init__ = counted


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    _current.append(item)
    before = _model_loads[0]
    try:
        res = yield
    finally:
        _current.pop()
    if _model_loads[0] != before and item.get_closest_marker("model") is None:
        pytest.fail(f"{item.nodeid} loads a model: mark it @pytest.mark.model", pytrace=False)
    return res


# ------------------------------------------------------------------ parallel workers (pytest-xdist)

# pyproject.toml's addopts run the suite on pytest-xdist workers (--numprocesses, --dist); without
# the plugin (``-p no:xdist``, or not installed) those options are accepted and ignored and the
# tests run serially in this process, like ``-n 0``.
def pytest_addoption(parser, pluginmanager):
    if not pluginmanager.has_plugin("xdist"):
        group = parser.getgroup("xdist", "pytest-xdist is not loaded: these options are ignored")
        group.addoption("--numprocesses", dest="numprocesses", default=0, help="ignored")
        group.addoption("--maxprocesses", dest="maxprocesses", default=None, help="ignored")
        group.addoption("--dist", dest="dist", default="no", help="ignored")


def is_worker(config) -> bool:
    """This process is a pytest-xdist worker (it runs tests the controller sends)."""
    return hasattr(config, "workerinput")


def is_controller(config) -> bool:
    """This process is the pytest-xdist controller (it runs no test; workers do)."""
    return not is_worker(config) and getattr(config.option, "dist", "no") != "no" and bool(
        getattr(config.option, "tx", None))


def _native_build_line() -> str:
    """The native build and the CPU features it was compiled for, first in every run's output:
    the CPU facts the tests and golden files hold (docs/backends.md, "CPU") are those of the
    pinned x86-64-v3 build (native/build.py), and a native build for the host may give others.  Asked in
    a subprocess (about 0.25 s), so that this process loads no native library."""
    code = ("from statelab.runtime.native import build_identity as b; i = b(); "
            "print(i.get('backend'), i.get('build_key'), '|', i.get('system_info'))")
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
        line = r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else \
            f"not read ({(r.stderr.strip().splitlines() or ['no output'])[-1]})"
    except (OSError, subprocess.SubprocessError) as e:
        line = f"not read ({e})"
    return f"statelab native build: {line}"


def pytest_configure(config):
    if not is_controller(config):  # the controller runs no test and loads no model
        _count_model_loads()


def pytest_sessionstart(session):
    config = session.config
    if is_worker(config):
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:  # shown under -q too (a report header is not)
        reporter.write_line(_native_build_line())
    # the session's golden runs live in one folder that this process (serial, or the controller,
    # before it starts its workers) chooses and its workers inherit through the environment
    root = Path(tempfile.mkdtemp(prefix="statelab-golden-"))
    _golden_state["root"] = root
    os.environ[GOLDEN_ROOT_ENV] = str(root)
    if is_controller(config):
        # one llama.cpp thread per worker: the workers and the golden runs share the cores, and
        # ggml's threads spin-wait on a busy core (the workers inherit the environment)
        os.environ.setdefault("STATELAB_THREADS", "1")


# ------------------------------------------------------------------ golden runs started early

# The golden runs (tests/test_golden.py) take minutes together, and most tests use one core:
# when their tests are selected they start with the session, beside the other tests, in two
# chains of one run at a time (the speculative campaign, whose timed blocks run one at a time on
# one thread; the CI study, the frontier CI panels and the CI study on the batch executor), and
# each test compares what its run wrote (golden_output).  Each run happens once per session,
# whichever process asks first: the chains run in the process that runs no test under
# pytest-xdist (the controller; serially, this process), and a test that asks for a run the chain
# has not reached runs it itself.  A run is claimed by creating ``ROOT/NAME/claim`` (O_EXCL);
# whoever claimed it writes ``ROOT/NAME/rc`` when it ends, and the others wait for that file.
# While they run, the tests' contexts default to one thread (STATELAB_THREADS; ggml's threads
# spin-wait on a busy core).  The golden tests run last (pytest_collection_modifyitems), when
# their runs are done or nearly.
GOLDEN_RUNS = {  # name -> (kind of tests/golden_outputs.py, more command-line options)
    "ci": ("ci", ()),
    "frontier-ci": ("frontier-ci", ()),
    "spec-ci": ("spec-ci", ()),
    "ci-batch-1": ("ci", ("--executor", "batch", "--lanes", "1")),
    "ci-batch-2": ("ci", ("--executor", "batch", "--lanes", "2")),
}
BACKGROUND_GOLDEN = (("spec-ci",), ("ci", "frontier-ci", "ci-batch-1", "ci-batch-2"))
GOLDEN_ROOT_ENV = "STATELAB_TEST_GOLDEN_ROOT"  # set by the session's first process for its workers
_golden_lock = threading.Lock()
_golden_procs: dict = {}  # name -> the process this process started for it
_golden_threads: list = []  # this process's chains
_golden_state = {"root": None, "stopping": False, "chains": False}


def golden_run_name(item) -> str | None:
    """The golden run a test of tests/test_golden.py compares (its ``kind`` or ``lanes``)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if item.path.name != "test_golden.py":
        return None
    if "kind" in params:
        return params["kind"]
    return f"ci-batch-{params['lanes']}" if "lanes" in params else None


def _golden_name_of_nodeid(nodeid: str) -> str | None:
    """:func:`golden_run_name` from a test id (the controller has ids, not items)."""
    if "test_golden.py::" not in nodeid or not nodeid.endswith("]"):
        return None
    param = nodeid[nodeid.rindex("[") + 1:-1]
    return param if param in GOLDEN_RUNS else (f"ci-batch-{param}" if f"ci-batch-{param}" in GOLDEN_RUNS else None)


def _golden_root() -> Path:
    if _golden_state["root"] is None:  # a worker: the folder its controller chose
        _golden_state["root"] = Path(os.environ[GOLDEN_ROOT_ENV])
    return _golden_state["root"]


def _golden_claim(name: str) -> bool:
    """Claim the run ``name`` for this process: True for the one process that gets it."""
    folder = _golden_root() / name
    folder.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(folder / "claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    return True


def _golden_run_claimed(name: str) -> None:
    """Run ``name`` (claimed by this process) and write its return code, also when interrupted
    (-9: stopped) so that no other process waits for it forever."""
    from golden_outputs import start, stop

    kind, extra = GOLDEN_RUNS[name]
    folder = _golden_root() / name
    rc = -9
    try:
        with _golden_lock:
            if _golden_state["stopping"]:
                return
            try:
                proc = _golden_procs[name] = start(kind, folder / kind, extra=extra)
            except OSError as e:
                (folder / f"{kind}.stderr").write_text(f"could not start the run: {e}")
                rc = 127
                return
        try:
            rc = proc.wait()
        finally:
            stop(proc)  # interrupted (Ctrl-C): its process group too
    finally:
        tmp = folder / f"rc.{os.getpid()}.tmp"
        with contextlib.suppress(OSError):  # the session may have removed the folder (stopping)
            tmp.write_text(str(rc))
            os.replace(tmp, folder / "rc")


def _golden_wait(name: str, chain: bool = False) -> None:
    """Wait for the run ``name`` that another process (or this one's chain) claimed (``chain``:
    a chain waits only until the session stops)."""
    folder = _golden_root() / name
    while not (folder / "rc").exists():
        if chain and _golden_state["stopping"]:
            return
        try:
            owner = int((folder / "claim").read_text() or 0)
        except (OSError, ValueError):
            owner = 0
        if owner and owner != os.getpid():
            try:
                os.kill(owner, 0)
            except ProcessLookupError:
                if not (folder / "rc").exists():
                    raise RuntimeError(f"golden run {name}: the process that ran it ({owner}) ended without a result")
        time.sleep(0.5)


def pytest_collection_modifyitems(config, items):
    for item in items:
        for fixture in getattr(item, "fixturenames", ()):
            for mark in FIXTURE_MARKS.get(fixture, ()):
                if item.get_closest_marker(mark) is None:
                    item.add_marker(mark)
    # the golden tests last: their runs started with the session (stable: the same order in
    # every worker)
    items.sort(key=lambda item: golden_run_name(item) is not None)


def _start_golden_chains(wanted: set) -> None:
    with _golden_lock:
        if _golden_state["chains"] or _golden_state["stopping"]:
            return
        _golden_state["chains"] = True
    chains = [[n for n in chain if n in wanted] for chain in BACKGROUND_GOLDEN]
    chains = [c for c in chains if c]
    if not chains:
        return
    os.environ.setdefault("STATELAB_THREADS", "1")
    for chain in chains:
        t = threading.Thread(target=_golden_chain, args=(chain,), name="golden-runs", daemon=True)
        _golden_threads.append(t)
        t.start()


def pytest_collection_finish(session):
    config = session.config
    if config.option.collectonly or is_worker(config) or is_controller(config):
        return
    _start_golden_chains({golden_run_name(item) for item in session.items})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """The controller: the first worker's collection says which golden runs the session needs."""
    _start_golden_chains({_golden_name_of_nodeid(i) for i in ids})


def _golden_chain(names: list[str]) -> None:
    for name in names:
        if _golden_state["stopping"]:
            return
        if _golden_claim(name):
            _golden_run_claimed(name)
        else:  # a test runs it: one run at a time in this chain
            _golden_wait(name, chain=True)


def golden_output(name: str) -> Path:
    """The output folder of the golden run ``name`` (GOLDEN_RUNS), run once in the session:
    by the chain that started with it, by another worker's test, or now by this test."""
    from golden_outputs import STUDIES

    if _golden_claim(name):
        _golden_run_claimed(name)
    else:
        _golden_wait(name)
    kind = GOLDEN_RUNS[name][0]
    folder = _golden_root() / name
    rc = int((folder / "rc").read_text())
    if rc != 0:
        err = (folder / f"{kind}.stderr").read_text() if (folder / f"{kind}.stderr").exists() else ""
        raise RuntimeError(f"{' '.join(STUDIES[kind][:2])} {STUDIES[kind][2]} ({name}) exited {rc}: "
                           f"{err.strip()[-2000:]}")
    return folder / kind


def pytest_sessionfinish(session):
    """Stop the runs this process started (none left running unless the session was
    interrupted: a worker's runs ended in its tests, the controller's chains after every worker
    ended) and remove the session's folder (the process that chose it)."""
    import shutil

    from golden_outputs import stop

    with _golden_lock:
        _golden_state["stopping"] = True
        started = list(_golden_procs.values())
    for proc in started:
        stop(proc)
    for t in _golden_threads:  # a stopped chain writes its run's return code, then ends
        t.join(timeout=10)
    _golden_procs.clear()
    root = _golden_state["root"]
    if not is_worker(session.config) and root is not None:
        for _ in range(40):  # interrupted, a worker may still be writing a return code
            shutil.rmtree(root, ignore_errors=True)
            if not root.exists():
                break
            time.sleep(0.25)
