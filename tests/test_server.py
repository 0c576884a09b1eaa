"""A running llama-server (built from the pinned sources by native/server.py) as a partner:
slots saved over HTTP become verified captures that continue as the server does, and
captures and subset-crossed states restored into the server continue there to the lab's
endpoints.  Traffic goes to 127.0.0.1 only."""
from __future__ import annotations

import json
import os

import pytest

from statelab.errors import ConfigError

pytestmark = [pytest.mark.model, pytest.mark.slow]

CAP = 8  # generated tokens compared
PROMPT = "def fibonacci(n):\n    "


def _binary():
    from statelab.lab.server import server_binary

    try:
        return server_binary()
    except ConfigError:
        return None


needs_server = pytest.mark.skipif(_binary() is None, reason="llama-server is not built: python native/server.py "
                                  "(install.sh builds it) or set STATELAB_LLAMA_SERVER")


def _threads():
    return int(os.environ.get("STATELAB_THREADS") or 0) or None


@pytest.fixture(scope="module")
def server_noflash(model):
    """llama-server with flash attention off (V stored transposed, as statelab's default captures)."""
    from statelab.lab.server import running_server

    with running_server(model.path, flash_attn="off", threads=_threads()) as sp:
        yield sp


@pytest.fixture(scope="module")
def server_default(model):
    """llama-server with its default attention (auto: flash attention on for CPU; V untransposed)."""
    from statelab.lab.server import running_server

    with running_server(model.path, threads=_threads()) as sp:
        yield sp


@needs_server
@pytest.mark.gemma
def test_gemma_slot_save_and_restore_with_swa_full(gemma):
    """Gemma 3 (iSWA): with ``--swa-full`` the server reuses a restored slot, and (a) and (b) hold.
    Without it a restored slot has no context checkpoints and the server re-processes the whole
    prompt, which ``continue_in_server`` refuses in one line (checked here too)."""
    from statelab.lab.formation import form, parse_schedule
    from statelab.lab.server import ServerError, check_restore, check_slot_save, running_server
    from statelab.runtime import ContextConfig

    cap = form(gemma, _prompt("a, b = 0, 1\n"), parse_schedule("A"), ContextConfig(n_ctx=1024))
    with running_server(gemma.path, flash_attn="off", threads=_threads()) as sp:
        with pytest.raises(ServerError, match="re-processed .* prompt tokens instead of reusing"):
            check_restore(sp.server, sp.slot_dir, gemma, cap, CAP)
    with running_server(gemma.path, flash_attn="off", threads=_threads(), extra=["--swa-full"]) as sp:
        chk = check_restore(sp.server, sp.slot_dir, gemma, cap, CAP)
        assert len(chk.lab) == CAP and chk.lab == chk.server
        chk, imported = check_slot_save(sp.server, sp.slot_dir, gemma, ContextConfig(n_ctx=1024), PROMPT, CAP)
        assert len(chk.lab) == CAP and chk.lab == chk.server and chk.detail["same_as_first_generation"]
        assert len(imported.state.part_list) == 2  # the full and the sliding-window cache


def _invoke(*args):
    """The CLI in process; a failure shows its exception."""
    from typer.testing import CliRunner

    from statelab.cli.main import app

    r = CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=True)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    assert r.exit_code == 0, r.output
    return r.output


def _prompt(extra: str = ""):
    from statelab import prompts

    return prompts.resolve("text:" + PROMPT + extra)


@needs_server
def test_slot_saved_over_http_continues_as_the_server(model, base_config, server_noflash):
    """(a) /completion, slot saved over HTTP, imported: the lab continues as the server does."""
    from statelab.lab.server import check_slot_save

    chk, cap = check_slot_save(server_noflash.server, server_noflash.slot_dir, model, base_config, PROMPT, CAP)
    assert len(chk.lab) == CAP, "the test prompt must not stop early"
    assert chk.lab == chk.server
    assert chk.detail["same_as_first_generation"]  # and as the server's first answer
    assert cap.identity["imported"]["format"].startswith("llama-server slot save")
    assert cap.identity["imported"]["server"]["url"] == server_noflash.url
    assert cap.identity["logits"]["source"] == "recomputed"
    assert cap.state.v_trans  # flash attention off: V transposed
    assert not any(f.name.startswith("statelab-slot") for f in server_noflash.slot_dir.iterdir())


@needs_server
def test_slot_saved_by_a_default_server_continues_as_the_server(model, base_config, server_default):
    """(a) with the server's default attention (flash attention on CPU: V untransposed)."""
    from statelab.lab.server import check_slot_save

    chk, cap = check_slot_save(server_default.server, server_default.slot_dir, model, base_config, PROMPT, CAP)
    assert not cap.state.v_trans
    assert len(chk.lab) == CAP and chk.lab == chk.server
    assert chk.detail["same_as_first_generation"]


@needs_server
@pytest.mark.parametrize("flash_attn", [False, True], ids=["transposed-V", "flash-attn"])
def test_capture_restored_into_the_server_reaches_its_endpoint(model, request, flash_attn):
    """(b) a lab capture exported into the server's slot folder, restored, continued there."""
    from statelab.lab.formation import form, parse_schedule
    from statelab.lab.server import check_restore
    from statelab.runtime import ContextConfig

    sp = request.getfixturevalue("server_default" if flash_attn else "server_noflash")
    cap = form(model, _prompt("a, b = 0, 1\n"), parse_schedule("A"), ContextConfig(n_ctx=1024, flash_attn=flash_attn))
    assert bool(cap.state.v_trans) != flash_attn
    chk = check_restore(sp.server, sp.slot_dir, model, cap, CAP)
    assert len(chk.lab) == CAP and chk.lab == chk.server
    assert chk.detail["n_restored"] == cap.n_prompt


@needs_server
def test_subset_crossed_state_restored_into_the_server_gives_the_lab_endpoint(model, base_config, server_noflash):
    """(c) a subset cross (LATE_V from a schedule-A donor into a token-by-token recipient)."""
    from statelab.lab.formation import form, parse_schedule
    from statelab.lab.server import check_subset_cross

    p = _prompt("if n < 2:\n        return n\n")
    donor = form(model, p, parse_schedule("A"), base_config)
    recipient = form(model, p, parse_schedule("R"), base_config)
    chk = check_subset_cross(server_noflash.server, server_noflash.slot_dir, model, donor, recipient, "LATE_V", CAP)
    assert chk.detail["changed_bytes"] > 0  # the two schedules stored different values there
    assert chk.lab[0] == chk.detail["recipient_first"]  # the recipient's logits are kept
    assert len(chk.lab) == CAP and chk.lab == chk.server


def _invoke(*args):
    """The CLI in process; a failure shows its exception."""
    from typer.testing import CliRunner

    from statelab.cli.main import app

    r = CliRunner().invoke(app, [str(a) for a in args])
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    assert r.exit_code == 0, r.output
    return r.output


@needs_server
def test_slot_commands(model, server_noflash, tmp_path):
    """``statelab slot save`` writes a sealed capture; ``statelab slot restore --cap`` continues it in the server."""
    from statelab.lab.archive import load_capture
    from statelab.lab.server import lab_continuation

    sp = server_noflash
    sp.server.request("POST", "/slots/0?action=erase")
    sp.server.completion(PROMPT, 2, slot=0)
    _invoke("slot", "save", tmp_path / "cap", "--url", sp.url, "--slot", 0, "--slot-save-path", sp.slot_dir,
            "--source-backend", "cpu")
    cap = load_capture(tmp_path / "cap")  # the seal and every hash checked
    mine = lab_continuation(model, cap, CAP)
    sp.server.request("POST", "/slots/0?action=erase")
    out = _invoke("slot", "restore", tmp_path / "cap", "--url", sp.url, "--slot", 0, "--slot-save-path", sp.slot_dir,
                  "--cap", CAP, "--json")
    got = json.loads(out)
    assert got["restore"]["n_restored"] == cap.n_prompt
    assert got["tokens"] == mine


# --------------------------------------------------------------------------- one-line errors


def test_unreachable_server_is_one_line(cli, tmp_path):
    from conftest import one_line_error
    from statelab.lab.server import free_port

    r = cli("slot", "save", tmp_path / "out", "--url", f"http://127.0.0.1:{free_port()}", "--slot-save-path", tmp_path)
    one_line_error(r, "llama-server not reachable at http://127.0.0.1:")
    assert r.returncode == 2
    assert not (tmp_path / "out").exists()


def test_bad_url_is_one_line(cli, tmp_path):
    from conftest import one_line_error

    r = cli("slot", "save", tmp_path / "out", "--url", "ftp://example", "--slot-save-path", tmp_path)
    one_line_error(r, "--url must look like http://")


@needs_server
def test_server_refusals_are_one_line(model, base_config, server_noflash, tmp_path, cli):
    from conftest import one_line_error

    sp = server_noflash
    r = cli("slot", "save", tmp_path / "out", "--url", sp.url, "--slot", 7, "--slot-save-path", sp.slot_dir)
    one_line_error(r, "has 1 slot (0..0), not slot 7")  # llama-server itself would take slot 7 as slot 0
    # a folder that is not the server's: the saved file is not there
    other = tmp_path / "elsewhere"
    other.mkdir()
    sp.server.completion(PROMPT, 1, slot=0)
    r = cli("slot", "save", tmp_path / "out", "--url", sp.url, "--slot", 0, "--slot-save-path", other)
    one_line_error(r, "--slot-save-path")
    assert not (tmp_path / "out").exists()
    for f in sp.slot_dir.iterdir():  # what the server wrote for the refused save is still its own
        f.unlink()
    # a restore from a folder that is not the server's: the server finds no file
    from statelab.lab.archive import save_capture
    from statelab.lab.formation import form, parse_schedule

    save_capture(form(model, _prompt(), parse_schedule("A"), base_config), tmp_path / "cap")
    r = cli("slot", "restore", tmp_path / "cap", "--url", sp.url, "--slot-save-path", other)
    one_line_error(r, "HTTP 400", "Unable to restore slot", "--slot-save-path")
    assert not list(other.iterdir())  # the transfer file is removed
