"""Shared fixtures: the real embedded model on CPU (session-scoped), HumanEval prompts."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STATELAB = [sys.executable, "-m", "statelab.cli"]


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


def run_cli(*args, env=None, timeout=600):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run(STATELAB + [str(a) for a in args], capture_output=True, text=True, env=e,
                          timeout=timeout, cwd=REPO)


@pytest.fixture
def cli():
    return run_cli


def one_line_error(r, *needles):
    """A failed CLI call that wrote exactly one line to stderr (no traceback) holding every needle."""
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]
