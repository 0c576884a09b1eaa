"""Defaults that follow the data: sham of an imported capture, the capture's own model when
--model is omitted, n_batch for prompts over 512 tokens; positions checked on a real Gemma
state file; the memory an import takes."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import statelab_error as _one_line

CAP = 8
PROMPT = "def add(a, b):\n    return"


def _cli(*args):
    from statelab.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A SmolLM2 capture formed with schedule R, and its llama.cpp state file."""
    d = tmp_path_factory.mktemp("imp")
    assert _cli("capture", d / "r", "-p", PROMPT, "-s", "R").exit_code == 0
    assert _cli("export-state", d / "r", d / "r.bin").exit_code == 0
    return d


@pytest.mark.model
def test_sham_of_an_imported_capture_says_it_cannot_without_a_formation(exported, tmp_path):
    out = tmp_path / "imp"
    assert _cli("import-state", exported / "r.bin", out, "-p", PROMPT, "--logits", "recompute").exit_code == 0
    msg = _one_line(_cli("sham", out, "--cap", CAP), "sham cannot rebuild the natural path", "--schedule")
    assert "--allow-backend" not in msg and "FAILED CONTROL" not in msg


@pytest.mark.model
def test_sham_of_an_imported_capture_uses_the_stated_formation(exported, tmp_path):
    out = tmp_path / "imp"
    r = _cli("import-state", exported / "r.bin", out, "-p", PROMPT, "--logits", "recompute", "--schedule", "R")
    assert r.exit_code == 0, r.output
    man = json.loads((out / "manifest.json").read_text())
    assert man["schedule"]["n_ubatch"] == 1 and man["identity"]["context"]["n_ubatch"] == 1
    r = _cli("sham", out, "--cap", CAP)
    assert r.exit_code == 0 and "sham equals the natural endpoint" in r.output, r.output
    nat = json.loads(_cli("sham", exported / "r", "--cap", CAP, "--json").output)
    got = json.loads(_cli("sham", out, "--cap", CAP, "--json").output)
    assert got["tokens"] == nat["tokens"]
    # a formation that forms another state (A's multi-row kernel differs from R's one-row one on CPU)
    wrong = tmp_path / "wrong"
    assert _cli("import-state", exported / "r.bin", wrong, "-p", PROMPT, "--logits", "recompute", "-s", "A"
                ).exit_code == 0
    _one_line(_cli("sham", wrong, "--cap", CAP), "sham cannot use schedule A", "forms another state here")


@pytest.mark.model
@pytest.mark.gemma
def test_commands_find_the_capture_model_without_model(gemma, tmp_path):
    assert _cli("capture", tmp_path / "g", "-p", PROMPT, "--model", "gemma3").exit_code == 0
    for cmd in (("continue", tmp_path / "g"), ("sham", tmp_path / "g")):
        r = _cli(*cmd, "--cap", CAP)
        assert r.exit_code == 0, (cmd, r.output, r.exception)
    assert _cli("capture", tmp_path / "g2", "-p", PROMPT, "-s", "R", "--model", "gemma3").exit_code == 0
    r = _cli("cross", tmp_path / "g", tmp_path / "g2", "--cap", CAP)
    assert r.exit_code == 0, (r.output, r.exception)


@pytest.mark.model
def test_a_capture_whose_model_file_is_gone_or_differs_says_so_in_one_line(model, tmp_path):
    """A capture naming a model file that no longer exists, and one whose hash no known model has."""
    from statelab.lab.archive import load_capture, save_capture

    assert _cli("capture", tmp_path / "c", "-p", PROMPT).exit_code == 0
    c = load_capture(tmp_path / "c")
    gone = c.with_blob(c.blob)
    gone.identity["model_path"] = str(tmp_path / "moved.gguf")
    save_capture(gone, tmp_path / "gone")
    r = _cli("continue", tmp_path / "gone", "--cap", CAP)
    assert r.exit_code == 0, r.output  # found again by its hash among the known models (smollm2)
    other = c.with_blob(c.blob)
    other.identity["model_path"] = str(tmp_path / "moved.gguf")
    other.identity["model_sha256"] = "f" * 64
    save_capture(other, tmp_path / "other")
    _one_line(_cli("continue", tmp_path / "other", "--cap", CAP), "formed with model", "moved.gguf",
              "that file is not found", "give --model")
    (tmp_path / "moved.gguf").write_bytes(model.path.read_bytes()[:1 << 16])  # now a file with another hash
    _one_line(_cli("sham", tmp_path / "other", "--cap", CAP), "that file now has sha256")


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["A", "R"])
def test_schedules_take_prompts_over_512_tokens(model, tmp_path, schedule):
    from statelab import prompts

    text = " ".join(prompts.humaneval(f"HumanEval/{i}").text for i in range(5))
    text = model.detokenize(model.tokenize(text, add_special=False)[:520])  # just past one 512-token ubatch
    f = tmp_path / "long.txt"
    f.write_text(text)
    n = len(model.tokenize(text))
    assert 512 < n < 560
    r = _cli("capture", tmp_path / "c", "--prompt-file", f, "-s", schedule)
    assert r.exit_code == 0, (r.output, r.exception)
    man = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert man["schedule"]["n_batch"] == n and man["schedule"]["n_ubatch"] == (512 if schedule == "A" else 1)
    r = _cli("sham", tmp_path / "c", "--cap", 4)
    assert r.exit_code == 0 and "sham equals the natural endpoint" in r.output, r.output


@pytest.mark.model
@pytest.mark.gemma
@pytest.mark.parametrize("where, cells, needle", [
    ("swa", (1, 2), "swa cache: cell 1 holds position 2, expected 1"),
    ("swa", (3, 1), "swa cache: cell 3 holds position 1 a second time (first at cell 1)"),
    ("full", (0, 4), "full cache: cell 0 holds position 4, expected 0"),
])
def test_a_gemma_state_file_with_swapped_or_duplicated_positions_is_refused(gemma, tmp_path, where, cells, needle):
    """A real Gemma 3 slot file whose sliding-window (or full) cache cells were edited: refused in
    one line naming the part, the cell and the position; nothing written."""
    from statelab.kvstate import KVState
    from statelab.lab.interop import SEQ_FILE_MAGIC, SEQ_FILE_VERSION, read_state_file
    from statelab.runtime import Context, ContextConfig
    from statelab.runtime import statefile

    toks = gemma.tokenize(PROMPT)
    f = tmp_path / "g.bin"
    with Context(gemma, ContextConfig(n_ctx=64)) as ctx:
        ctx.decode(toks, 0)
        statefile.seq_save_file(ctx, f, toks)
    sf = read_state_file(f)
    st = KVState.parse(struct.pack("<Ii", 0xAF143CD8, 0) + bytes(sf.memory), gemma.memory_layout)
    part = st.part_list[0 if where == "full" else 1]
    assert part.positions.tolist() == list(range(len(toks)))  # a short prompt: the window sees every cell
    a, b = cells
    if where == "full" or b < a:  # duplicate (b < a) or swap
        new = part.positions.copy()
        if b < a:
            new[a] = new[b]
        else:
            new[a], new[b] = new[b], new[a]
        part.positions[:] = new
    else:
        part.positions[[a, b]] = part.positions[[b, a]]
    if where == "full":
        st.positions = part.positions
    head = struct.pack("<III", SEQ_FILE_MAGIC, SEQ_FILE_VERSION, len(toks)) + toks.astype("<i4").tobytes()
    (tmp_path / "bad.bin").write_bytes(head + st.to_bytes()[8:])
    _one_line(_cli("import-state", tmp_path / "bad.bin", tmp_path / "out", "--model", "gemma3"), needle)
    assert not (tmp_path / "out").exists()


@pytest.mark.model
def test_import_peak_memory_is_bounded(model, tmp_path):
    """The memory an import of a real 900-token state (15 MB) takes over the model and a
    recipient context of its own: at most 1.5x the state (the file is read into one buffer
    that becomes the capture's blob, restored and read back without further copies)."""
    from statelab import prompts

    text = " ".join(prompts.humaneval(f"HumanEval/{i}").text for i in range(6))
    f = tmp_path / "long.txt"
    f.write_text(text)
    assert _cli("capture", tmp_path / "c", "--prompt-file", f, "--n-ctx", "1024").exit_code == 0
    assert _cli("export-state", tmp_path / "c", tmp_path / "s.bin").exit_code == 0
    size = (tmp_path / "s.bin").stat().st_size
    code = textwrap.dedent(f"""
        from statelab.runtime import Context, ContextConfig, Model
        from statelab.lab.interop import import_state_file

        def status(key):
            for line in open("/proc/self/status"):
                if line.startswith(key):
                    return int(line.split()[1]) * 1024

        def costs(fn):  # (the peak resident memory fn adds over what was resident before it, its result)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM (the peak) to the current resident size
            before = status("VmRSS:")
            out = fn()
            return status("VmHWM:") - before, out
        m = Model(None)
        cfg = ContextConfig(n_ctx=1024)
        Context(m, cfg).close()  # warm: the first context's one-time allocations
        ctx_cost, _ = costs(lambda: Context(m, cfg).close())
        imp_cost, c = costs(lambda: import_state_file({str(tmp_path / "s.bin")!r}, m, cfg))
        print("PEAKS", ctx_cost, imp_cost, len(c.blob))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "PEAKS" in r.stdout, r.stdout + r.stderr[-2000:]
    ctx_cost, imp_cost, n = (int(x) for x in r.stdout.split("PEAKS")[1].split())
    assert n == size - 12 - 4 * int(np.load(tmp_path / "c" / "tokens.npy").size) + 8  # the blob is the state
    extra = imp_cost - ctx_cost
    print(f"state {size} B; a recipient context {ctx_cost} B; import {imp_cost} B: beyond its context {extra} B "
          f"({extra / size:.2f}x the state)")
    assert extra <= 1.5 * size, (extra, size)

