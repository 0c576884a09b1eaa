"""Interop with llama.cpp state files and llama-cpp-python states.

Synthetic tests check the file formats and every refusal; the model tests round-trip
through the real library (llama_state_seq_save_file / _load_file, llama_state_save_file /
_load_file) and a real llama_cpp.Llama on the embedded model."""
import struct

import numpy as np
import pytest

from statelab.lab.interop import (SEQ_FILE_MAGIC, WHOLE_FILE_MAGIC, InteropError, encode_state_file, parse_state_file,
                                  sequence_zero_state, split_whole_stream, whole_stream)
from statelab.kvstate import build_blob, make_state

from conftest import one_line_error


def _blob(n=5, seq_id=0, **kw):
    return build_blob(n, 2, 8, seq_id=seq_id, **kw)


# --------------------------------------------------------------------------- synthetic: formats


@pytest.mark.parametrize("kind, magic, version", [("seq", SEQ_FILE_MAGIC, 3), ("whole", WHOLE_FILE_MAGIC, 10)])
def test_encode_and_parse_round_trip(kind, magic, version):
    blob = _blob()
    toks = np.arange(5, dtype=np.int32) + 7
    data = encode_state_file(kind, toks, blob, arch="llama")
    assert struct.unpack_from("<III", data) == (magic, version, 5)
    sf = parse_state_file(data)
    assert sf.kind == kind and sf.tokens.tolist() == toks.tolist()
    assert sf.memory == blob[8:]  # the file holds the memory part without the sequence header
    assert sf.arch == ("llama" if kind == "whole" else None)
    assert sequence_zero_state(sf.memory, "x").to_bytes() == blob


def test_whole_stream_is_arch_string_then_memory():
    blob = _blob()
    stream = whole_stream(blob, "gemma3")
    assert stream[:4] == struct.pack("<I", 6) and stream[4:10] == b"gemma3" and stream[10:] == blob[8:]
    assert split_whole_stream(stream, "s") == ("gemma3", blob[8:])


def test_a_slot_saved_as_another_sequence_becomes_sequence_zero():
    # llama-server saves slot N as sequence N: its cells list N
    st = sequence_zero_state(_blob(seq_id=3)[8:], "slot3.bin")
    assert st.seq_id == 0 and all(s.tolist() == [0] for s in st.seq_ids)
    assert st.to_bytes() == _blob(seq_id=0)


def _server_packed(tokens, media=0):
    # server_tokens::serialize: i32 -1, u32 version 1, u32 n + tokens, u32 n_media + keys, chunks
    words = [-1, 1, len(tokens), *tokens, media] + ([7] if media else [])
    return np.asarray(words, dtype=np.int32)


def test_llama_server_packed_token_list_is_unpacked():
    blob = _blob()
    packed = _server_packed([11, 12, 13, 14, 15])
    sf = parse_state_file(encode_state_file("seq", packed, blob))
    assert sf.tokens.tolist() == [11, 12, 13, 14, 15] and sf.token_packing.startswith("llama-server packed")
    with pytest.raises(InteropError, match="media chunk"):
        parse_state_file(encode_state_file("seq", _server_packed([1, 2, 3, 4, 5], media=1), blob))
    bad = _server_packed([1, 2, 3, 4, 5])
    bad[1] = 9
    with pytest.raises(InteropError, match="version 9"):
        parse_state_file(encode_state_file("seq", bad, blob))


def test_a_file_of_a_multi_stream_cache_becomes_single_stream():
    # a non-unified KV cache (llama-server -np 4 without --kv-unified) writes one stream per sequence
    blob = _blob(seq_id=2)  # sequence 2 lives in stream 2 of 4: streams 0, 1 and 3 are empty
    memory = struct.pack("<III", 4, 0, 0) + blob[12:] + bytes(4)
    assert sequence_zero_state(memory, "x").to_bytes() == _blob(seq_id=0)
    ours = parse_state_file(encode_state_file("seq", np.arange(5), _blob(), n_stream=4)).memory
    assert ours == struct.pack("<I", 4) + _blob()[12:] + bytes(12)  # export: the cells in the first stream
    mem = bytearray(memory)
    mem[-4:] = struct.pack("<I", 3)  # a second stream claims cells
    with pytest.raises(InteropError, match="more than one"):
        sequence_zero_state(bytes(mem), "x")


def test_a_state_of_two_sequences_is_refused():
    st = make_state(4, 2, 8)
    st.seq_ids = (np.array([0], np.int32), np.array([0, 1], np.int32), np.array([1], np.int32), np.array([1], np.int32))
    st.seq_id = -1
    with pytest.raises(InteropError, match="sequences"):
        sequence_zero_state(st.to_bytes()[8:], "two.bin")


@pytest.mark.parametrize("mutate, needle", [
    (lambda d: d[:7], "too short"),
    (lambda d: b"GGUF" + d[4:], "GGUF model file"),
    (lambda d: b"\x00\x01\x02\x03" + d[4:], "not a llama.cpp state file"),
    (lambda d: d[:4] + struct.pack("<I", 2) + d[8:], "version 2"),
    (lambda d: d[:8] + struct.pack("<I", 10 ** 6) + d[12:], "token count 1000000"),
    (lambda d: d[:12 + 4 * 5], "no state follows"),
])
def test_bad_headers_are_refused(mutate, needle):
    data = encode_state_file("seq", np.arange(5), _blob())
    with pytest.raises(InteropError, match=needle):
        parse_state_file(mutate(data))


def test_a_truncated_state_does_not_parse():
    sf = parse_state_file(encode_state_file("seq", np.arange(5), _blob())[:-3])
    with pytest.raises(InteropError, match="truncated"):
        sequence_zero_state(sf.memory, "cut.bin")


def test_whole_file_with_a_broken_architecture_name():
    data = encode_state_file("whole", np.arange(5), _blob(), arch="llama")
    bad = data[:32] + struct.pack("<I", 10 ** 6) + data[36:]  # the u32 after 5 tokens
    with pytest.raises(InteropError, match="architecture name"):
        parse_state_file(bad)


def test_unknown_kind_is_refused():
    with pytest.raises(InteropError, match="unknown state file kind"):
        encode_state_file("slot", np.arange(5), _blob())


# --------------------------------------------------------------------------- real model


@pytest.fixture(scope="module")
def arms(model, base_config, he):
    """HumanEval/2 formed with A and R (their states differ on CPU), with natural endpoints."""
    from statelab.lab.formation import PRESETS
    from statelab.lab.intervene import natural

    p = he("HumanEval/2")
    return p, {s: natural(model, p, PRESETS[s], base_config, CAP) for s in ("A", "R")}


CAP = 24


def _save_as_slot(model, capture, path, slot=2, whole=False):
    """What the pinned llama-server does on POST /slots/{slot}?action=save with 4 slots and no
    unified KV: llama_state_seq_save_file of sequence `slot`, its tokens packed by
    server_tokens::serialize (here: the capture restored into sequence `slot` of a 4-sequence
    context)."""
    from statelab.lab.intervene import config_of
    from statelab.runtime import Context
    from statelab.runtime import statefile

    cfg = config_of(capture).with_(n_seq_max=1 if whole else 4)  # 4 sequences: 4 KV streams (not unified)
    blob = capture.blob if whole else capture.blob[:8] + struct.pack("<I", 4) + capture.blob[12:] + bytes(12)
    with Context(model, cfg) as ctx:
        ctx.state_set(blob, seq_id=0 if whole else slot)
        if whole:
            statefile.save_file(ctx, path, capture.tokens)
        else:
            statefile.seq_save_file(ctx, path, _server_packed(capture.tokens.tolist()), seq_id=slot)


@pytest.mark.model
def test_library_slot_file_imports_byte_for_byte_with_recomputed_logits(model, base_config, arms, tmp_path):
    from statelab.lab.interop import import_state_file
    from statelab.lab.intervene import import_and_continue

    p, got = arms
    cap_r, nat_r = got["R"]
    f = tmp_path / "slot2.bin"
    _save_as_slot(model, cap_r, f, slot=2)
    assert f.read_bytes()[:4] == struct.pack("<I", SEQ_FILE_MAGIC)
    imp = import_state_file(f, model, base_config, prompt=p, logits="recompute", source_backend="cpu")
    assert imp.identity["imported"]["tokens"].startswith("llama-server packed")
    assert imp.identity["imported"]["n_stream"] == 4
    assert imp.blob == cap_r.blob  # slot 2's cells became sequence 0's, nothing else changed
    assert imp.prompt_sha256 == p.sha256 and imp.identity["origin"] == "imported"
    assert imp.identity["logits"]["source"] == "recomputed"
    # R decodes the last token alone over the same cells: the recomputation is the same computation
    assert imp.logits.tobytes() == cap_r.logits.tobytes()
    ep = import_and_continue(model, base_config, imp.blob, imp.logits, imp.n_prompt, CAP)
    assert ep.same(nat_r)


@pytest.mark.model
def test_whole_context_file_from_the_library_imports(model, base_config, arms, tmp_path):
    from statelab.lab.interop import import_state_file

    _p, got = arms
    cap_a = got["A"][0]
    f = tmp_path / "session.bin"
    _save_as_slot(model, cap_a, f, whole=True)
    assert f.read_bytes()[:4] == struct.pack("<I", WHOLE_FILE_MAGIC)
    imp = import_state_file(f, model, base_config)
    assert imp.blob == cap_a.blob and imp.tokens.tolist() == cap_a.tokens.tolist()
    assert imp.identity["backend"] == "unknown" and not np.isfinite(imp.logits).any()


@pytest.mark.model
@pytest.mark.parametrize("kind, streams", [("seq", 1), ("whole", 1), ("seq", 4)])
def test_exported_file_restores_in_the_real_library_and_continues_identically(model, arms, tmp_path, kind, streams):
    from statelab.lab.interop import export_state_file
    from statelab.lab.intervene import config_of
    from statelab.lab.receiver import continue_greedy
    from statelab.runtime import Context
    from statelab.runtime import statefile

    _p, got = arms
    cap_a, nat_a = got["A"]
    f = export_state_file(cap_a, tmp_path / f"a.{kind}", kind, n_stream=streams)
    seq = streams - 1  # with 4 streams (a 4-slot server without a unified cache): restore into slot 3
    with Context(model, config_of(cap_a).with_(n_seq_max=streams)) as ctx:
        toks = statefile.seq_load_file(ctx, f, seq) if kind == "seq" else statefile.load_file(ctx, f)
        assert toks.tolist() == cap_a.tokens.tolist()
        # what the library holds now, read back from the slot (4 streams: only slot 3's is non-empty)
        assert sequence_zero_state(ctx.state_get(seq)[8:], "restored").to_bytes() == cap_a.blob
        if seq == 0:  # the receiver decodes sequence 0: continue in the context the file was loaded into
            ep = continue_greedy(ctx, cap_a.logits, cap_a.n_prompt, CAP)
            assert ep.same(nat_a)


@pytest.mark.model
def test_cli_import_diff_and_export(cli, model, arms, tmp_path):
    from statelab.lab.archive import save_capture

    _p, got = arms
    local = save_capture(got["A"][0], tmp_path / "local")
    server = tmp_path / "slot0.bin"
    _save_as_slot(model, got["R"][0], server, slot=0)
    r = cli("import-state", server, tmp_path / "imported", "-H", "2", "--logits", "recompute",
            env={"STATELAB_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    r = cli("diff", local, tmp_path / "imported")
    assert r.returncode == 0, r.stderr
    from statelab.api import diff

    ds = diff(local, tmp_path / "imported")
    L, pos = ds.attrs["first_layer"], ds.attrs["first_position"]
    assert L >= 0 and pos >= 0  # A and R differ on CPU
    assert f"first difference: layer {L} (" in r.stdout and f"at position {pos};" in r.stdout
    # the imported server state crosses into the local path (its backend is recorded as unknown)
    one_line_error(cli("cross", tmp_path / "imported", local, "--cap", "4"), "--allow-backend")
    r = cli("cross", tmp_path / "imported", local, "--cap", "4", "--allow-backend", "--json",
            env={"STATELAB_THREADS": "1"})
    assert r.returncode == 0 and '"length": 4' in r.stdout, r.stderr
    r = cli("export-state", tmp_path / "imported", tmp_path / "back.bin", "--streams", "4")
    assert r.returncode == 0, r.stderr
    back, orig = (tmp_path / "back.bin").read_bytes(), server.read_bytes()
    n = got["R"][0].n_prompt  # the export lists tokens plainly (the server reads both), the rest is the same
    assert back[12 + 4 * n:] == orig[12 + 4 * (n + 4):] and back[12:12 + 4 * n] == orig[24:24 + 4 * n]


def _bad_files(model, cap, tmp_path):
    good = encode_state_file("seq", cap.tokens, cap.blob)
    n = cap.n_prompt
    other_vocab = cap.tokens.copy()
    other_vocab[5] = 262143  # a Gemma 3 token id: SmolLM2's vocabulary has 49152
    gemma_like = make_state(n, 18, 256, seed=1).to_bytes()  # 18 layers, K/V width 256: Gemma 3 270M's geometry
    files = {
        "truncated": (good[: len(good) // 2], "truncated"),
        "foreign": (model.path.read_bytes()[:4096], "GGUF model file"),
        "magic": (b"ggsx" + good[4:], "not a llama.cpp state file"),
        "version": (good[:4] + struct.pack("<I", 4) + good[8:], "version 4"),
        "count": (encode_state_file("seq", cap.tokens[:-1], cap.blob), f"lists {n - 1} tokens but its state holds {n}"),
        "vocab": (encode_state_file("seq", other_vocab, cap.blob), "another model's vocabulary"),
        "geometry": (encode_state_file("seq", cap.tokens, gemma_like), "18 layers"),
        "arch": (encode_state_file("whole", cap.tokens, cap.blob, arch="gemma3"), "'gemma3' model"),
    }
    out = {}
    for name, (data, needle) in files.items():
        (tmp_path / name).write_bytes(data)
        out[name] = (tmp_path / name, needle)
    return out


@pytest.mark.model
def test_bad_files_give_one_line_and_write_nothing(cli, model, arms, tmp_path):
    _p, got = arms
    for name, (path, needle) in _bad_files(model, got["A"][0], tmp_path).items():
        out = tmp_path / f"out_{name}"
        r = cli("import-state", path, out)
        one_line_error(r, needle)
        assert r.returncode == 2
        assert not out.exists() and not list(tmp_path.glob(f".out_{name}*")), name


@pytest.mark.model
def test_a_slot_saved_after_a_completion_diffs_on_the_prompt_cells(cli, model, base_config, arms, tmp_path):
    """A server slot saved after a completion holds the prompt and the generated tokens: the
    import takes the prompt as a prefix, diff compares the cells both captures hold."""
    from statelab.lab.archive import save_capture
    from statelab.lab.formation import PRESETS, form
    from statelab.prompts import resolve

    p, got = arms
    cap_a, nat_a = got["A"]
    longer = form(model, resolve("text:" + p.text + model.detokenize(nat_a.tokens[:3])), PRESETS["A"], base_config)
    assert longer.tokens[: cap_a.n_prompt].tolist() == cap_a.tokens.tolist()  # the prompt, then 3 more
    f = tmp_path / "after.bin"
    f.write_bytes(encode_state_file("seq", longer.tokens, longer.blob))
    r = cli("import-state", f, tmp_path / "imp", "-H", "2")
    assert r.returncode == 0, r.stderr
    local = save_capture(got["R"][0], tmp_path / "local")
    r = cli("diff", local, tmp_path / "imp")
    assert r.returncode == 0, r.stderr
    assert f"compared the first {cap_a.n_prompt} cells" in r.stdout and "first difference: layer" in r.stdout
    from statelab.api import diff

    d = diff(tmp_path / "imp", local)
    assert d.attrs["compared_cells"] == cap_a.n_prompt and d.attrs["first_layer"] >= 0


@pytest.mark.model
def test_prompt_that_does_not_match_the_tokens_is_refused(cli, model, arms, tmp_path):
    _p, got = arms
    f = tmp_path / "a.bin"
    f.write_bytes(encode_state_file("seq", got["A"][0].tokens, got["A"][0].blob))
    r = cli("import-state", f, tmp_path / "x", "-H", "3")
    one_line_error(r, "not HumanEval/3")
    assert not (tmp_path / "x").exists()


@pytest.mark.model
def test_capture_without_logits_refuses_to_continue_with_one_line(cli, model, arms, tmp_path):
    _p, got = arms
    f = tmp_path / "a.bin"
    f.write_bytes(encode_state_file("seq", got["A"][0].tokens, got["A"][0].blob))
    one_line_error(cli("import-state", f, tmp_path / "imp", "--logits", "state"), "no usable logits")
    assert cli("import-state", f, tmp_path / "imp").returncode == 0
    one_line_error(cli("continue", tmp_path / "imp", "--cap", "4", "--allow-backend"), "no initial logits")


@pytest.mark.model
def test_export_refuses_to_overwrite(cli, arms, tmp_path):
    from statelab.lab.archive import save_capture

    _p, got = arms
    c = save_capture(got["A"][0], tmp_path / "c")
    (tmp_path / "exists.bin").write_bytes(b"keep")
    one_line_error(cli("export-state", c, tmp_path / "exists.bin"), "already exists")
    assert (tmp_path / "exists.bin").read_bytes() == b"keep"


# --------------------------------------------------------------------------- llama-cpp-python


def _llama(model, **kw):
    import llama_cpp

    return llama_cpp.Llama(model_path=str(model.path), n_ctx=256, n_threads=1, n_threads_batch=1, flash_attn=False,
                           verbose=False, **kw)


def _saved_state(model, tokens, logits_all: bool):
    """``Llama.save_state()`` after one ``eval`` of ``tokens`` (one submission, ubatch 512: schedule A)."""
    llm = _llama(model, logits_all=logits_all)
    try:
        llm.eval(tokens.tolist())
        return llm.save_state()
    finally:
        llm.close()


@pytest.mark.model
def test_llama_state_to_capture_equals_statelab_capture(model, base_config, arms):
    from statelab.lab.interop import CARRIED_TOLERANCE, capture_from_llama_state
    from statelab.lab.intervene import import_and_continue

    p, got = arms
    cap_a, nat_a = got["A"]
    state = _saved_state(model, cap_a.tokens, logits_all=True)
    imp = capture_from_llama_state(state, model, base_config, prompt=p, logits="state", source_backend="cpu")
    assert imp.blob == cap_a.blob
    # the carried row is the state's own: near the recipient's one-row re-evaluation, not equal to it
    # (docs/api.md quotes this gap, which `pytest tests/test_interop.py -k equals_statelab -rP` prints)
    gap = imp.identity["logits"]["gap_of_range"]
    print(f"carried logits {gap:.1%} of the range from the recipient's re-evaluation")
    assert 0 <= gap <= CARRIED_TOLERANCE
    ep = import_and_continue(model, base_config, imp.blob, imp.logits, imp.n_prompt, CAP)
    assert ep.same(nat_a)


@pytest.mark.model
def test_llama_state_without_logits_all_has_no_state_logits(model, base_config, arms):
    """Without logits_all llama-cpp-python never writes its scores: the saved row is uninitialised
    memory (zeros, or what an earlier request left there), so logits='state' is refused instead
    of starting the continuation from it."""
    from statelab.lab.interop import InteropError, capture_from_llama_state

    p, got = arms
    state = _saved_state(model, got["A"][0].tokens, logits_all=False)
    with pytest.raises(InteropError, match="no usable logits|not its state's"):
        capture_from_llama_state(state, model, base_config, prompt=p, logits="state", source_backend="cpu")


@pytest.mark.model
def test_llama_state_logits_of_another_position_are_refused(model, base_config, arms):
    """Scores that are real logits but not the state's own (what an unwritten row can hold when
    the memory had another request's scores) are refused: the last row replaced by the row
    before it differs from the recipient's re-evaluation by far more than batch geometry does."""
    from statelab.lab.interop import InteropError, capture_from_llama_state

    p, got = arms
    state = _saved_state(model, got["A"][0].tokens, logits_all=True)
    n = state.n_tokens
    state.scores[n - 1] = state.scores[n - 2]
    with pytest.raises(InteropError, match="not its state's") as refused:
        capture_from_llama_state(state, model, base_config, prompt=p, logits="state", source_backend="cpu")
    print(refused.value)  # the gap docs/api.md quotes (`-rP` prints it)


@pytest.mark.model
def test_capture_to_llama_state_continues_in_llama(model, arms):
    from statelab.lab.interop import capture_to_llama_state

    _p, got = arms
    cap_r, nat_r = got["R"]
    llm = _llama(model)
    try:
        llm.load_state(capture_to_llama_state(cap_r, llm.n_ctx(), score_rows=llm.scores.shape[0]))
        out = []
        for tok in llm.generate(cap_r.tokens.tolist(), temp=0.0, top_k=1, repeat_penalty=1.0):
            out.append(tok)
            if len(out) == CAP or llm.token_eos() == tok:
                break
    finally:
        llm.close()
    # Llama re-evaluates the last prompt token alone after load_state: for R that is R's own computation
    assert out == nat_r.tokens.tolist()[: len(out)] and len(out) == nat_r.length


@pytest.mark.model
def test_a_gemma_slot_file_is_refused_by_smollm2(cli, tmp_path, gemma):
    """A real Gemma 3 sequence-state file (llama_state_seq_save_file) imported with the embedded
    SmolLM2: another model's state, refused with one line, nothing written."""
    from statelab.runtime import Context, ContextConfig
    from statelab.runtime import statefile

    gm = gemma
    with Context(gm, ContextConfig(n_ctx=64)) as ctx:
        toks = gm.tokenize("def add(a, b):")
        ctx.decode(toks, 0)
        statefile.seq_save_file(ctx, tmp_path / "gemma.bin", toks)
    out = tmp_path / "imported"
    one_line_error(cli("import-state", tmp_path / "gemma.bin", out), "another model's vocabulary")
    assert not out.exists()
