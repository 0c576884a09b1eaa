"""`statelab model derive`: a layer-truncated copy of the embedded model, written with gguf."""
from __future__ import annotations

import numpy as np
import pytest

from statelab.models import gguf_reader
from statelab.speculative.derive import DERIVED_FROM_KEY, DERIVED_LAYERS_KEY, derive_truncated, same_vocabulary
from statelab.errors import ConfigError, ModelError

N = 4


@pytest.fixture(scope="module")
def src():
    from statelab.models import default_model_path

    return default_model_path()


@pytest.fixture(scope="module")
def derived(src, tmp_path_factory):
    dst = tmp_path_factory.mktemp("derive") / "draft4.gguf"
    info = derive_truncated(None, dst, N)
    return dst, info


@pytest.fixture(scope="module")
def readers(src, derived):
    return gguf_reader(src), gguf_reader(derived[0])


def _write_vocab_file(path, tokens, bos=1, eos=2, model="gpt2"):
    """A tiny GGUF carrying only a tokenizer (no tensors), as a vocabulary to compare with."""
    from gguf import GGUFValueType, GGUFWriter

    w = GGUFWriter(path, "llama")
    w.add_key_value("tokenizer.ggml.model", model, GGUFValueType.STRING)
    w.add_key_value("tokenizer.ggml.tokens", tokens, GGUFValueType.ARRAY, sub_type=GGUFValueType.STRING)
    w.add_key_value("tokenizer.ggml.bos_token_id", bos, GGUFValueType.UINT32)
    w.add_key_value("tokenizer.ggml.eos_token_id", eos, GGUFValueType.UINT32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path


@pytest.mark.model
def test_summary_and_metadata(src, derived, readers):
    from statelab.models import model_sha256

    dst, info = derived
    rs, rd = readers
    assert info["n_layers"] == N and info["source_layers"] == 30 and info["architecture"] == "llama"
    assert info["sha256"] == model_sha256(dst) and info["size"] == dst.stat().st_size
    assert info["source_sha256"] == model_sha256(src)
    assert int(rd.fields["llama.block_count"].contents()) == N
    assert rd.fields["general.name"].contents() == rs.fields["general.name"].contents() + f" (first {N} layers)"
    assert rd.fields[DERIVED_FROM_KEY].contents() == model_sha256(src)
    assert int(rd.fields[DERIVED_LAYERS_KEY].contents()) == N
    changed = {"general.name", "llama.block_count", "GGUF.tensor_count", "GGUF.kv_count"}
    assert set(rd.fields) == set(rs.fields) | {DERIVED_FROM_KEY, DERIVED_LAYERS_KEY}
    for key, f in rs.fields.items():  # every other key, tokenizer arrays included, is unchanged
        if key in changed:
            continue
        g = rd.fields[key]
        assert g.types == f.types, key
        assert g.contents() == f.contents(), key
    assert rd.alignment == rs.alignment


@pytest.mark.model
def test_tensors_truncated_and_byte_identical(readers):
    rs, rd = readers
    names = [t.name for t in rd.tensors]
    assert not [n for n in names if n.startswith("blk.") and int(n.split(".")[1]) >= N]
    assert {int(n.split(".")[1]) for n in names if n.startswith("blk.")} == set(range(N))
    want = [t for t in rs.tensors if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < N]
    assert names == [t.name for t in want]
    assert "token_embd.weight" in names and "output_norm.weight" in names
    for a, b in zip(want, rd.tensors):
        assert b.tensor_type == a.tensor_type, a.name
        assert list(b.shape) == list(a.shape), a.name
        assert b.n_bytes == a.n_bytes, a.name
        assert np.array_equal(np.asarray(a.data).view(np.uint8), np.asarray(b.data).view(np.uint8)), a.name


@pytest.mark.model
def test_llama_cpp_loads_and_decodes(derived):
    from statelab.runtime import Context, ContextConfig, Model

    model = Model(derived[0])
    try:
        assert model.n_layer == N and model.n_vocab == 49152
        with Context(model, ContextConfig(backend="cpu", n_ctx=128)) as ctx:
            tokens = model.tokenize("def add(a, b):\n    return")
            ctx.decode(tokens, 0)
            out = []
            for i in range(4):
                logits = ctx.logits(-1)
                assert np.isfinite(logits).all()
                out.append(ctx.greedy(logits))
                ctx.decode([out[-1]], len(tokens) + i)
        assert len(out) == 4 and all(0 <= t < model.n_vocab for t in out)
    finally:
        model.close()


@pytest.mark.model
def test_same_vocabulary(src, derived, readers, tmp_path):
    ok, reason = same_vocabulary(src, derived[0])
    assert ok, reason
    assert "49152 tokens" in reason
    tokens = readers[1].fields["tokenizer.ggml.tokens"].contents()
    other = list(tokens)
    other[1234] = other[1234] + "_x"
    ok, reason = same_vocabulary(derived[0], _write_vocab_file(tmp_path / "one.gguf", other))
    assert not ok and "first at id 1234" in reason
    ok, reason = same_vocabulary(src, _write_vocab_file(tmp_path / "small.gguf", tokens[:100]))
    assert not ok and "49152 vs 100" in reason
    ok, reason = same_vocabulary(src, _write_vocab_file(tmp_path / "eos.gguf", tokens, eos=0))
    assert not ok and "EOS" in reason


@pytest.mark.model
def test_bad_inputs(src, derived, tmp_path):
    for n in (0, 30):
        with pytest.raises(ConfigError, match="between 1 and 29"):
            derive_truncated(src, tmp_path / f"bad{n}.gguf", n)
    with pytest.raises(ConfigError, match="output exists"):
        derive_truncated(src, derived[0], N)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"definitely not a model")
    with pytest.raises(ModelError, match="not a GGUF file"):
        derive_truncated(junk, tmp_path / "out.gguf", 2)
    with pytest.raises(ModelError, match="not a GGUF file"):
        same_vocabulary(src, junk)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junk.gguf"]  # nothing half-written left behind


@pytest.mark.model
def test_cli_derive(cli, tmp_path):
    from statelab.models import model_sha256

    out = tmp_path / "d1.gguf"
    r = cli("model", "derive", out, "--layers", "1")
    assert r.returncode == 0, r.stderr
    assert str(out) in r.stdout and f"sha256 {model_sha256(out)}" in r.stdout and "1 of 30 layers" in r.stdout
    r = cli("model", "derive", out, "--layers", "1")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: output exists: {out} (use --overwrite to replace it)"]
