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
import threading
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


def pytest_collection_modifyitems(config, items):
    for item in items:
        for fixture in getattr(item, "fixturenames", ()):
            for mark in FIXTURE_MARKS.get(fixture, ()):
                if item.get_closest_marker(mark) is None:
                    item.add_marker(mark)


_model_loads = [0]


def pytest_configure(config):
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


# ------------------------------------------------------------------ golden runs started early

# The golden runs (tests/test_golden.py) take minutes together, and most tests in process use one
# core: when their tests are selected they start with the session, beside the other tests, in
# two chains of one run at a time (the speculative campaign, whose timed blocks run one at a
# time on one thread; the CI study, the frontier CI panels and the CI study on the batch
# executor), and each test compares what its run wrote (golden_output); a run its test asks
# for before the chain reached it runs then, in the test.  While they run, the tests' contexts
# default to one thread (STATELAB_THREADS; ggml's threads spin-wait on a busy core).
GOLDEN_RUNS = {  # name -> (kind of tests/golden_outputs.py, more command-line options)
    "ci": ("ci", ()),
    "frontier-ci": ("frontier-ci", ()),
    "spec-cpu": ("spec-cpu", ()),
    "ci-batch-1": ("ci", ("--executor", "batch", "--lanes", "1")),
    "ci-batch-2": ("ci", ("--executor", "batch", "--lanes", "2")),
}
BACKGROUND_GOLDEN = (("spec-cpu",), ("ci", "frontier-ci", "ci-batch-1", "ci-batch-2"))
_golden_lock = threading.Lock()
_golden_started: dict = {}  # name -> (process, output folder), or None: its test runs it
_golden_state = {"root": None, "stopping": False}


def golden_run_name(item) -> str | None:
    """The golden run a test of tests/test_golden.py compares (its ``kind`` or ``lanes``)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if item.path.name != "test_golden.py":
        return None
    if "kind" in params:
        return params["kind"]
    return f"ci-batch-{params['lanes']}" if "lanes" in params else None


def pytest_collection_finish(session):
    import tempfile

    if session.config.option.collectonly:
        return
    wanted = {golden_run_name(item) for item in session.items}
    chains = [[n for n in chain if n in wanted] for chain in BACKGROUND_GOLDEN]
    chains = [c for c in chains if c]
    if not chains:
        return
    os.environ.setdefault("STATELAB_THREADS", "1")
    _golden_state["root"] = Path(tempfile.mkdtemp(prefix="statelab-golden-"))
    for chain in chains:
        threading.Thread(target=_golden_chain, args=(chain,), name="golden-runs", daemon=True).start()


def _golden_chain(names: list[str]) -> None:
    from golden_outputs import start

    for name in names:
        with _golden_lock:
            if _golden_state["stopping"] or name in _golden_started:
                continue
            kind, extra = GOLDEN_RUNS[name]
            out = _golden_state["root"] / name / kind
            try:
                _golden_started[name] = (start(kind, out, extra=extra), out)
            except OSError:
                continue  # its test runs it (and reports what fails)
            proc = _golden_started[name][0]
        proc.wait()


def golden_output(name: str, tmp_path: Path) -> Path:
    """The output folder of the golden run ``name`` (GOLDEN_RUNS): the one started with the
    session, or, where none was, a run now into ``tmp_path``."""
    from golden_outputs import finish, run

    with _golden_lock:
        started = _golden_started.get(name)
        if started is None:
            _golden_started[name] = None  # the background chain leaves it to this test
    if started is not None:
        return finish(*started)
    kind, extra = GOLDEN_RUNS[name]
    return run(kind, tmp_path / kind, extra=extra)


def pytest_sessionfinish(session):
    import shutil

    from golden_outputs import stop

    with _golden_lock:
        _golden_state["stopping"] = True
        started = [s for s in _golden_started.values() if s is not None]
    for proc, _ in started:
        stop(proc)
    if _golden_state["root"] is not None:
        shutil.rmtree(_golden_state["root"], ignore_errors=True)
    _golden_started.clear()
