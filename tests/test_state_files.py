"""States as llama.cpp writes them: flash attention (untransposed V) and quantised V caches
through export -> import -> continue; positions of every cache part checked on import and
load; state files read with bounded memory."""
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
from statelab.kvstate import KVFormatError, KVState, make_iswa_state, make_state

CAP = 8
PROMPT = "def add(a, b):\n    return"

# every KV type llama.cpp takes, with flash attention on and off where it allows it
# (a q8_0 V needs flash attention; a q8_0 K does not)
COMBOS = [("f32", "f32", False), ("f32", "f32", True), ("f16", "f16", False), ("f16", "f16", True),
          ("bf16", "bf16", False), ("bf16", "bf16", True), ("q8_0", "f16", False), ("q8_0", "q8_0", True)]


# --------------------------------------------------------------------------- positions (synthetic)


def _iswa(n=12, n_swa=5):
    return make_iswa_state(n, 6, swa_layers=(0, 1, 2, 4), n_swa=n_swa)


def test_legal_positions_pass():
    st = _iswa()
    assert st.part_list[1].positions.tolist() == list(range(7, 12))
    st.check_positions()
    make_state(9, 2).check_positions()


def _with_positions(st: KVState, part: int, positions) -> KVState:
    out = st.copy()
    out.part_list[part].positions[:] = positions
    if part == 0:
        out.positions = out.part_list[0].positions
    return KVState.parse(out.to_bytes(), st.parts and _layout_of(st))


def _layout_of(st):
    from statelab.kvstate import MemoryLayout, PartLayout

    return MemoryLayout("iswa", tuple(PartLayout(p.kind, p.layers, p.n_swa, p.swa_type) for p in st.parts),
                        6, "synthetic")


@pytest.mark.parametrize("part, positions, needle", [
    (1, [7, 8, 10, 9, 11], "swa cache: cell 2 holds position 10, expected 9"),
    (1, [7, 8, 8, 10, 11], "swa cache: cell 2 holds position 8 a second time (first at cell 1)"),
    (1, [6, 7, 8, 9, 10], "swa cache: cell 0 holds position 6 outside the window's positions 7..11"),
    (0, [0, 1, 3, 2] + list(range(4, 12)), "full cache: cell 2 holds position 3, expected 2"),
    (0, [0, 1, 1, 3] + list(range(4, 12)), "full cache: cell 2 holds position 1, expected 2"),
])
def test_swapped_or_duplicated_positions_are_refused_naming_part_cell_position(part, positions, needle):
    st = _with_positions(_iswa(), part, positions)
    with pytest.raises(KVFormatError) as e:
        st.check_positions()
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_plain_cache_must_hold_zero_to_n_minus_one():
    st = make_state(5, 2, positions=[0, 1, 2, 4, 3])
    with pytest.raises(KVFormatError, match="KV cache: cell 3 holds position 4, expected 3"):
        st.check_positions()


def test_a_sliding_window_part_with_a_cell_too_many_is_refused():
    st = make_iswa_state(12, 6, swa_layers=(0, 1, 2, 4), n_swa=6)  # holds 6..11
    layout = _layout_of(st)
    narrow = type(layout)(layout.kind, (layout.parts[0], type(layout.parts[1])("swa", layout.parts[1].layers, 5,
                                                                             layout.parts[1].swa_type)), 6)
    with pytest.raises(KVFormatError, match="swa cache: cell 0 holds position 6 outside the window's positions 7..11"):
        KVState.parse(st.to_bytes(), narrow).check_positions()


def test_capture_load_refuses_swapped_positions(tmp_path):
    """A sealed capture whose kv.bin (and manifest) were rewritten with swapped positions:
    the seal and hashes match, the positions do not."""
    from statelab.lab.archive import ArchiveError, load_capture, save_capture
    from statelab.lab.formation import Capture, Schedule

    st = _iswa()
    bad = _with_positions(st, 1, [7, 9, 8, 10, 11])
    ident = {"memory": _layout_of(st).as_dict(), "model_sha256": "0" * 64}
    cap = Capture("p", "0" * 64, np.arange(12, dtype=np.int32), np.zeros(4, np.float32), bad.to_bytes(),
                  Schedule("A"), ident)
    save_capture(cap, tmp_path / "c")
    with pytest.raises(ArchiveError, match="swa cache: cell 1 holds position 9, expected 8"):
        load_capture(tmp_path / "c")


# --------------------------------------------------------------------------- bounded reading


def test_header_is_checked_before_the_rest_is_read(tmp_path):
    """A 'state file' of 64 MiB with a sane header and 5 tokens: refused from its size
    before the 64 MiB are read, with a peak far below the file's size."""
    from statelab.lab.interop import SEQ_FILE_MAGIC, SEQ_FILE_VERSION

    f = tmp_path / "huge.bin"
    with open(f, "wb") as fh:
        fh.write(struct.pack("<III", SEQ_FILE_MAGIC, SEQ_FILE_VERSION, 5) + struct.pack("<5i", 1, 2, 3, 4, 5))
        fh.truncate(1 << 30)  # 1 GiB, sparse
    code = textwrap.dedent(f"""
        import resource, sys
        from statelab.lab.interop import InteropError, read_state_file
        from statelab.models import read_model_info

        class M:  # what the size bound reads of a model: SmolLM2's geometry
            info = read_model_info(None)
            memory_layout = None
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            read_state_file({str(f)!r}, M())
        except InteropError as e:
            print("REFUSED", e)
        print("PEAK_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "REFUSED" in r.stdout, r.stdout + r.stderr
    assert "refused before reading it" in r.stdout
    peak_kb = int(r.stdout.split("PEAK_KB")[1])
    assert peak_kb < 64 * 1024, peak_kb  # far below the 1 GiB file


def test_parse_in_place_makes_views_not_copies():
    blob = bytearray(make_state(4, 2).to_bytes())
    st = KVState.parse(blob, copy=False)
    st.k[0][0, 0] = np.float16(7.0)
    assert KVState.parse(bytes(blob)).k[0][0, 0] == np.float16(7.0)


# --------------------------------------------------------------------------- real models


def _round_trip(m, cfg, tmp_path, tag):
    """capture -> export-state -> import-state (attention from the state) -> continue."""
    from statelab import prompts
    from statelab.lab.archive import load_capture, save_capture
    from statelab.lab.formation import PRESETS
    from statelab.lab.interop import export_state_file, import_state_file
    from statelab.lab.intervene import config_of, import_and_continue, natural

    p = prompts.resolve("text:" + PROMPT)
    cap, nat = natural(m, p, PRESETS["A"], cfg, CAP)
    assert cap.state.v_trans == (not cfg.flash_attn)
    f = export_state_file(cap, tmp_path / f"{tag}.bin")
    # the recipient is given plain defaults: types and attention come from the state
    imp = import_state_file(f, m, cfg.with_(flash_attn=False, type_k="f16", type_v="f16"), prompt=p,
                            logits="recompute")
    assert imp.blob == cap.blob  # byte-equal KV
    save_capture(imp, tmp_path / tag)
    back = load_capture(tmp_path / tag)
    rc = config_of(back)
    assert rc.flash_attn == cfg.flash_attn and (rc.type_k, rc.type_v) == (cfg.type_k, cfg.type_v)
    ep = import_and_continue(m, rc, back.blob, cap.logits, back.n_prompt, CAP)
    assert ep.same(nat), (tag, ep.tokens, nat.tokens)
    return cap, back


@pytest.mark.model
@pytest.mark.parametrize("tk, tv, fa", COMBOS)
def test_every_kv_type_and_attention_round_trips_smollm2(model, base_config, tmp_path, tk, tv, fa):
    _round_trip(model, base_config.with_(type_k=tk, type_v=tv, flash_attn=fa, n_ctx=128), tmp_path,
                f"{tk}-{tv}-{int(fa)}")


@pytest.mark.model
@pytest.mark.gemma
@pytest.mark.slow
@pytest.mark.parametrize("tk, tv, fa", COMBOS)
def test_every_kv_type_and_attention_round_trips_gemma(gemma, base_config, tmp_path, tk, tv, fa):
    _round_trip(gemma, base_config.with_(type_k=tk, type_v=tv, flash_attn=fa, n_ctx=128), tmp_path,
                f"{tk}-{tv}-{int(fa)}")


def _cli(*args):
    from statelab.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])




@pytest.mark.model
def test_a_state_saved_by_plain_llama_cpp_imports_and_continues(model, tmp_path):
    """llama.cpp's own context defaults (flash attention on for CPU in this build): the state
    llama_state_seq_save_file writes has an untransposed V; import-state takes the recipient's
    attention from it, and refuses --no-flash-attn naming the V layout."""
    import llama_cpp

    toks = model.tokenize(PROMPT)
    llm = llama_cpp.Llama(model_path=str(model.path), n_ctx=128, n_threads=1, n_threads_batch=1, verbose=False,
                          flash_attn=True)
    try:
        llm.eval(toks.tolist())
        n = llm._ctx.ctx and llama_cpp.llama_state_seq_save_file(
            llm._ctx.ctx, str(tmp_path / "plain.bin").encode(), 0,
            (llama_cpp.llama_token * len(toks))(*toks.tolist()), len(toks))
    finally:
        llm.close()
    assert n > 0
    from statelab.kvstate import KVState as _K
    from statelab.lab.interop import read_state_file

    sf = read_state_file(tmp_path / "plain.bin")
    assert not _K.parse(struct.pack("<Ii", 0xAF143CD8, -1) + bytes(sf.memory)).v_trans  # flash attention's layout

    _one_line(_cli("import-state", tmp_path / "plain.bin", tmp_path / "no", "--no-flash-attn", "-p", PROMPT),
              "state has untransposed V (flash attention) but", "--flash-attn")
    assert not (tmp_path / "no").exists()
    r = _cli("import-state", tmp_path / "plain.bin", tmp_path / "imp", "-p", PROMPT, "--logits", "recompute",
             "--source-backend", "cpu")
    assert r.exit_code == 0, r.output
    man = json.loads((tmp_path / "imp" / "manifest.json").read_text())
    assert man["identity"]["context"]["flash_attn"] is True
    r = _cli("continue", tmp_path / "imp", "--cap", CAP, "--json")
    assert r.exit_code == 0, r.output
    # the same continuation as a statelab capture formed with flash attention and the same submission
    r2 = _cli("capture", tmp_path / "fa", "-p", PROMPT, "--flash-attn")
    assert r2.exit_code == 0, r2.output
    r3 = _cli("continue", tmp_path / "fa", "--cap", CAP, "--json")
    assert json.loads(r.output)["tokens"] == json.loads(r3.output)["tokens"]


@pytest.mark.model
def test_cli_flash_attention_capture_exports_imports_continues_and_refuses_a_mismatched_cross(model, tmp_path):
    d = tmp_path
    assert _cli("capture", d / "fa", "-p", PROMPT, "--flash-attn", "--cache-type-v", "q8_0",
                "--cache-type-k", "q8_0").exit_code == 0
    assert _cli("export-state", d / "fa", d / "fa.bin").exit_code == 0
    r = _cli("import-state", d / "fa.bin", d / "imp", "-p", PROMPT, "--logits", "recompute", "--source-backend", "cpu")
    assert r.exit_code == 0, r.output
    a = json.loads(_cli("continue", d / "fa", "--cap", CAP, "--json").output)
    b = json.loads(_cli("continue", d / "imp", "--cap", CAP, "--json").output)
    assert a["tokens"] == b["tokens"]
    r = _cli("import-state", d / "fa.bin", d / "no", "-p", PROMPT, "--no-flash-attn")
    _one_line(r, "untransposed V (flash attention)")
    # crosses between flash-attention captures (A's state into R's path) run
    assert _cli("capture", d / "fa_r", "-p", PROMPT, "-s", "R", "--flash-attn", "--cache-type-v", "q8_0",
                "--cache-type-k", "q8_0").exit_code == 0
    r = _cli("cross", d / "fa", d / "fa_r", "--cap", CAP, "--json")
    assert r.exit_code == 0, (r.output, r.exception)
    assert json.loads(r.output)["length"] >= 1
    # a flash-attention donor into a recipient path without flash attention: the V layout is named
    assert _cli("capture", d / "plain", "-p", PROMPT, "--cache-type-k", "q8_0", "--cache-type-v", "f16"
                ).exit_code == 0
    _one_line(_cli("cross", d / "fa", d / "plain", "--cap", CAP), "untransposed V (flash attention)",
              "without flash attention")
