"""The real entry point (``python -m statelab.cli``) in a new interpreter, once or twice per
command group: exit status 0 on success, 2 with one line on a user's error, 2 with the usage line
on a usage error.  The behaviour behind each command is tested in process (``run_cli``); these
check that the process itself ends the same way."""
import json

import pytest

from conftest import one_line_error, run_cli_subprocess as run

pytestmark = pytest.mark.cli


def test_help_lists_every_group():
    r = run("--help")
    assert r.returncode == 0, r.stderr
    for group in ("generate", "capture", "import-state", "sweep", "study", "model", "spec", "frontier", "audit"):
        assert group in r.stdout, group


def test_usage_error_exits_2_with_the_usage_line():
    r = run("capture")
    assert r.returncode == 2 and "Usage:" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.model
def test_lab_generate_succeeds(tmp_path):
    r = run("generate", "-p", "def add(a, b):", "--cap", "2", "--threads", "1", "--json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["tokens"]) == 2


@pytest.mark.parametrize("args, needle", [
    (("generate", "-p", "hi", "--cap", "0"), "output cap"),                             # lab
    (("import-state", "no-such-file.bin", "out-never-written"), "no-such-file.bin"),    # interop
    (("study", "report", "no-such-folder"), "not a study output folder"),               # study
    (("spec", "campaign", "no-such.toml", "--out", "out-never-written"), "no-such.toml"),  # spec
    (("model", "derive", "out-never.gguf", "--layers", "0"), "layers"),                 # model
    (("frontier", "analyse", "no-such-folder"), "not a frontier run folder"),           # frontier
], ids=lambda v: v[0] if isinstance(v, tuple) else None)
def test_a_users_error_is_one_line_and_exit_2(args, needle):
    r = run(*args)
    assert r.returncode == 2, r.stderr
    one_line_error(r, needle)
