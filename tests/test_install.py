"""A built, non-editable install (``pip install .``) run from another folder: the package
carries selectors/, studies/ and prompts/ and finds them there, not in a checkout."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.cli]

TINY = """name = "tiny"
description = "three named selectors, one prompt, one direction"
backend = "cpu"
threads = 1
n_ctx = 1024
cap = 8
repeats = 1
prompts = ["HumanEval/2"]
selectors = ["EMPTY", "ALL", "LATE"]
directions = ["A->R"]

[arms]
A = "A"
R = "R"
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """statelab built from a copy of the sources and installed into a folder of its own
    (``pip install --target``; the dependencies are this interpreter's)."""
    root = tmp_path_factory.mktemp("install")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for name in ("statelab", "selectors", "studies", "prompts"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "_data"))
    target = root / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(src)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    shutil.rmtree(src)  # nothing may come from the sources any more
    env = {k: v for k, v in os.environ.items() if k not in ("STATELAB_SELECTORS", "PYTHONPATH")}
    env.update(PYTHONPATH=str(target), STATELAB_THREADS="1")
    return target, env


def test_the_installed_package_finds_its_data_folders(installed, tmp_path):
    target, env = installed
    code = ("import json, statelab, statelab.resources as r, statelab.selection as s;"
            "print(json.dumps([statelab.__file__, *(str(r.data_dir(n)) for n in r.DATA_DIRS),"
            " [str(d) for d in s.default_search_dirs()], s.list_selectors()]))")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    init, selectors, studies, prompts, search, names = json.loads(r.stdout)
    data = target / "statelab" / "_data"
    assert Path(init) == target / "statelab" / "__init__.py"
    assert (Path(selectors), Path(studies), Path(prompts)) == (data / "selectors", data / "studies", data / "prompts")
    assert search == [str(data / "selectors")]
    assert {"EMPTY", "ALL", "LATE", "FULL", "SWA"} <= set(names)
    assert sorted(p.name for p in (data / "studies").glob("*.toml")) == sorted(p.name for p in (REPO / "studies").glob("*.toml"))
    # an installed study spec, named as the docs name it (studies/NAME.toml) from another folder,
    # resolves its selectors (named and ../selectors/layers/...) and prompts
    code = ("from statelab.experiments.matrix.spec import load_spec;"
            "s = load_spec('studies/findings-ci.toml', check_model=False); print(len(s.selectors), s.path)")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    n, path = r.stdout.split()
    assert int(n) == 8 and Path(path) == data / "studies" / "findings-ci.toml"


def test_statelab_runs_a_study_of_named_selectors_from_another_folder(installed, tmp_path):
    target, env = installed
    (tmp_path / "tiny.toml").write_text(TINY)
    exe = target / "bin" / "statelab"
    r = subprocess.run([str(exe), "study", "run", "tiny.toml", "--out", "out", "--workers", "1"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    cells = [json.loads(ln) for ln in (tmp_path / "out" / "cells.jsonl").read_text().splitlines() if ln.strip()]
    assert {c["selector"] for c in cells} == {"EMPTY", "ALL", "LATE"}
    assert all(c["status"] == "ok" for c in cells), cells
    spec = json.loads((tmp_path / "out" / "spec.json").read_text())
    assert str(target / "statelab" / "_data" / "selectors") in json.dumps(spec)
