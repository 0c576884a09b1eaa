"""Synthetic models of published shapes (`statelab model synth`) and every lab capability on
the `ci` shape: Qwen3 with QK norm, head dim 128, 32 query / 8 KV heads (the 8B models'
attention geometry) on 4 layers of width 256, Q8_0, on CPU.

The model is built once into the user cache (seconds) and reused from there. Its weights are
random: these tests check exactness and accounting (bitwise equalities, byte counts), never
what the text says."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from statelab.errors import ConfigError, ModelError
from statelab.kvstate import KVState, compare
from statelab.lab.formation import PRESETS, form
from statelab.lab.intervene import cross, natural, sham, subset_cross
from statelab.selection import apply_subset, load_selector, select
from statelab.synth import (BLOCK_ELEMENTS, SYNTH_KEYS, check_synth, generate, get_shape, read_shapes, shapes,
                            synth_to, synthesize, tensor_plan)

pytestmark = pytest.mark.model
CAP = 6
TASK = "HumanEval/10"  # 160 tokens with the SmolLM2 tokenizer: B (128 + rest) and C (ubatch 128) split it


@pytest.fixture(scope="module")
def ci_ident():
    return synthesize("ci", "q8_0", 0)


@pytest.fixture(scope="module")
def ci(ci_ident):
    from statelab.runtime import Model

    m = Model(ci_ident["path"], backend="cpu")
    yield m
    m.close()


@pytest.fixture(scope="module")
def cfg(base_config):
    """One thread: on a loaded machine llama.cpp's spinning threads cost more than this model's
    work (token-by-token prefill of 160 tokens: about 1 s with one thread, 27 s with two)."""
    return base_config.with_(n_threads=1)


@pytest.fixture(scope="module")
def prompt(he):
    return he(TASK)


@pytest.fixture(scope="module")
def arms(ci, cfg, prompt):
    return {s: natural(ci, prompt, PRESETS[s], cfg, CAP) for s in ("A", "B", "C", "R")}


def run_main(monkeypatch, capsys, *args):
    """The CLI in this process (statelab.cli.main: one-line errors, exit statuses)."""
    from statelab.cli import main

    monkeypatch.setattr(sys, "argv", ["statelab", *map(str, args)])
    with pytest.raises(SystemExit) as e:
        main()
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


# --------------------------------------------------------------------------- the shapes and the file


def test_shapes_file_holds_the_published_shapes():
    s = shapes()
    assert {"qwen3-0.6b", "qwen3-8b", "smollm2-1.7b", "llama-3.2-1b", "llama-3.1-8b", "ci"} <= set(s)
    for name in ("qwen3-8b", "llama-3.1-8b", "ci"):
        assert (s[name].n_head, s[name].n_head_kv, s[name].head_dim) == (32, 8, 128)
    assert s["qwen3-0.6b"].qk_norm and not s["llama-3.1-8b"].qk_norm
    assert s["llama-3.2-1b"].rope_scaling["factor"] == 32.0 and s["qwen3-8b"].rope_scaling is None
    assert all(x.source for x in s.values())


def test_shapes_give_the_published_parameter_counts():
    """With the published vocabulary the tensor plan has the published models' parameters:
    Llama-3.1-8B 8,030,261,248 (plus the 64 rope_freqs factors, which converters add), Qwen3's
    model cards' non-embedding counts (0.44B, 6.95B), SmolLM2-1.7B's 1.71B."""
    def count(name, vocab=None, skip=("rope_freqs.weight",)):
        s = get_shape(name)
        return sum(int(np.prod(t.shape)) for t in tensor_plan(s, vocab or s.vocab_published) if t.name not in skip)

    assert count("llama-3.1-8b") == 8_030_261_248
    emb = ("token_embd.weight", "output.weight")
    assert round(count("qwen3-0.6b", skip=emb) / 1e9, 2) == 0.44 and round(count("qwen3-8b", skip=emb) / 1e9, 2) == 6.95
    assert round(count("smollm2-1.7b") / 1e9, 2) == 1.71
    assert count("qwen3-0.6b", 49152) == 490_799_104  # the synthetic file: SmolLM2's 49152 tokens


@pytest.mark.parametrize("edit, needle", [
    (("n_layer = 4", "n_layer = 0"), "positive integer"),
    (('arch = "qwen3"\nsource = "statelab', 'arch = "gpt9"\nsource = "statelab'), "arch must be"),
    (("qk_norm = true\ntied_embeddings = true\n", "qk_norm = false\ntied_embeddings = true\n"), "Q/K norm"),
    (("n_ff = 512", "n_ff = 512\nwidth = 3"), "unknown keys"),
    (('format = "statelab-shapes-1"', 'format = "x"'), "format"),
])
def test_bad_shapes_file(tmp_path, edit, needle):
    from importlib import resources

    text = resources.files("statelab").joinpath("data", "shapes.toml").read_text()
    assert edit[0] in text
    f = tmp_path / "shapes.toml"
    f.write_text(text.replace(edit[0], edit[1]))
    with pytest.raises(ConfigError, match=needle):
        read_shapes(f)


def test_the_file_is_a_qwen3_gguf_of_the_shape_with_the_smollm2_tokenizer(ci_ident, ci):
    from gguf import GGMLQuantizationType

    from statelab.models import default_model_path
    from statelab.models import gguf_reader
    from statelab.speculative.derive import same_vocabulary

    r = gguf_reader(ci.path)

    def get(k):
        return r.fields[k].contents()

    assert get("general.architecture") == "qwen3"
    assert (get("qwen3.block_count"), get("qwen3.embedding_length"), get("qwen3.feed_forward_length")) == (4, 256, 512)
    assert (get("qwen3.attention.head_count"), get("qwen3.attention.head_count_kv")) == (32, 8)
    assert get("qwen3.attention.key_length") == get("qwen3.attention.value_length") == 128
    assert get(SYNTH_KEYS["shape"]) == "ci" and get(SYNTH_KEYS["seed"]) == 0
    assert same_vocabulary(ci.path, default_model_path())[0]
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types["blk.0.attn_q.weight"] == GGMLQuantizationType.Q8_0
    assert types["blk.3.attn_q_norm.weight"] == types["output_norm.weight"] == GGMLQuantizationType.F32
    assert "output.weight" not in types  # tied embeddings
    assert ci.n_vocab == 49152 and ci.n_layer == 4 and ci.info.n_embd_k_gqa == 1024
    assert ci_ident["sha256"] == ci.sha256 and ci_ident["n_vocab"] == 49152


def test_same_recipe_same_bytes_in_a_fresh_cache(ci_ident, tmp_path, monkeypatch):
    """Rebuilt from nothing (another cache folder, one thread instead of all): the same bytes.
    Another seed gives other weights; the F16 file holds exactly what generate() gives for a
    tensor, whatever the order (per-tensor, per-block seeds)."""
    from statelab.models import gguf_reader

    monkeypatch.setenv("STATELAB_CACHE", str(tmp_path / "cache"))
    again = synthesize("ci", "q8_0", 0, threads=1)
    assert not again["cached"] and again["sha256"] == ci_ident["sha256"]
    assert again["f16_sha256"] == ci_ident["f16_sha256"]
    assert synthesize("ci", "q8_0", 0)["cached"]
    other = synthesize("ci", "f16", 1)
    assert other["f16_sha256"] is None and other["sha256"] != ci_ident["f16_sha256"]
    shape = get_shape("ci")
    plan = {t.name: t for t in tensor_plan(shape, 49152)}
    r = gguf_reader(other["path"])
    for name in ("blk.2.ffn_down.weight", "token_embd.weight"):  # token_embd: 12 blocks of 4096 rows
        stored = next(t for t in r.tensors if t.name == name)
        assert np.array_equal(np.asarray(stored.data).view(np.float16), generate(plan[name], 1, shape))
    assert plan["token_embd.weight"].shape[0] > BLOCK_ELEMENTS // 256  # more than one block
    x = generate(plan["blk.0.attn_q.weight"], 1, shape).astype(np.float32)
    assert abs(x.std() * np.sqrt(256) - 1) < 0.01  # std 1/sqrt(fan_in)
    down = generate(plan["blk.0.ffn_down.weight"], 1, shape).astype(np.float32)
    assert abs(down.std() * np.sqrt(512 * 2 * 4) - 1) < 0.01  # residual branch: also 1/sqrt(2 n_layer)


def test_out_file_identity_is_checked(ci_ident, tmp_path):
    out = tmp_path / "m" / "ci.gguf"
    r = synth_to(out, "ci", "q8_0", 0)
    assert r["cached"] and r["sha256"] == ci_ident["sha256"] and out.is_file()
    ident = json.loads((tmp_path / "m" / "ci.gguf.synth.json").read_text())
    assert ident["sha256"] == ci_ident["sha256"] and ident["recipe"]["shape"]["head_dim"] == 128
    assert check_synth(out)["shape"] == "ci"
    with pytest.raises(ConfigError, match="output exists"):
        synth_to(out, "ci", "q8_0", 0)
    data = bytearray(out.read_bytes())
    out.unlink()  # a fresh inode: the cache entry (a hard link target) stays intact
    data[-1] ^= 1
    out.write_bytes(bytes(data))
    with pytest.raises(ModelError, match="differs from its identity"):
        check_synth(out)
    assert synthesize("ci", "q8_0", 0)["sha256"] == ci_ident["sha256"]


@pytest.mark.parametrize("args, needle", [
    (("--shape", "qwen3-9b"), "unknown shape 'qwen3-9b'"),
    (("--shape", "ci", "--type", "q5_0"), "unknown model type 'q5_0'"),
    (("--shape", "ci", "--seed", "-1"), "the seed must be an integer"),
])
def test_cli_bad_input_is_one_line(monkeypatch, capsys, tmp_path, args, needle):
    rc, _out, err = run_main(monkeypatch, capsys, "model", "synth", tmp_path / "x.gguf", *args)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and needle in lines[0], err
    assert not any(tmp_path.iterdir())


def test_cli_synth_and_shapes(monkeypatch, capsys, tmp_path, ci_ident):
    rc, out, err = run_main(monkeypatch, capsys, "model", "synth", tmp_path / "ci.gguf", "--shape", "ci")
    assert rc == 0, err
    assert f"sha256 {ci_ident['sha256']}" in out and "(from the cache)" in out
    rc, _out, err = run_main(monkeypatch, capsys, "model", "synth", tmp_path, "--shape", "ci")
    assert rc == 2 and "output is a directory" in err
    rc, out, _err = run_main(monkeypatch, capsys, "model", "shapes")
    assert rc == 0 and "llama-3.1-8b" in out and "14336" in out


# --------------------------------------------------------------------------- the lab on the ci shape


def test_capture_of_every_arm_and_codec_round_trip(ci, cfg, prompt, arms):
    n = len(ci.tokenize(prompt.text))
    for name, (c, _ep) in arms.items():
        st = KVState.parse(c.blob, ci.memory_layout)
        assert st.to_bytes() == c.blob, name
        assert st.n_layer == 4 and st.n_embd_k_gqa == [1024] * 4 and st.positions.tolist() == list(range(n))
        assert st.k[0].shape == (n, 1024) and st.k[0].dtype == np.float16  # F16 K rows: 8 heads x 128 values
        assert np.isfinite(c.logits).all()
    for type_k in ("f32", "q8_0"):
        c = form(ci, prompt, PRESETS["A"], cfg.with_(type_k=type_k))
        assert KVState.parse(c.blob, ci.memory_layout).to_bytes() == c.blob


def test_partition_classes_on_cpu(arms):
    """CPU: every ubatch >= 2 forms the same state bitwise (A = B = C); token by token (R) does not,
    from layer 1 on: layer 0's K and V are projections of the embeddings (Q8_0 weight products are
    row-invariant on CPU), the first difference is layer 0's attention (kq-0), which layer 1's
    K and V inherit."""
    (ca, ea), (cb, eb), (cc, ec), (cr, er) = (arms[s] for s in "ABCR")
    assert ca.blob == cb.blob == cc.blob and ca.logits.tobytes() == cb.logits.tobytes() == cc.logits.tobytes()
    assert ea.same(eb) and ea.same(ec)
    d = compare(ca.state, cr.state)
    assert d.changed_bytes > 0 and d.first_differing_layer == 1


def test_shams_equal_natural(ci, arms):
    for name in ("A", "R"):
        c, nat = arms[name]
        assert sham(ci, c, CAP).same(nat), name


def test_whole_cross_reproduces_the_donor_both_ways(ci, arms):
    (ca, ea), (cr, er) = arms["A"], arms["R"]
    d = compare(ca.state, cr.state)
    for donor, recipient, want in ((ca, cr, ea), (cr, ca, er)):
        ep, acc = cross(ci, donor, recipient, logits_from="donor", cap=CAP)
        assert ep.same(want) and acc.verified and acc.changed_bytes == d.changed_bytes


@pytest.mark.parametrize("selector", ["L0_K", "EARLY", "K_ALL"])
def test_subset_cross_accounts_every_byte(ci, arms, selector):
    (ca, _), (cr, _) = arms["A"], arms["R"]
    sel = select(load_selector(selector), cr.state)
    ep, acc = subset_cross(ci, ca, cr, sel, CAP)
    mixed = apply_subset(cr.state, ca.state, sel)
    assert acc.verified and acc.selected_bytes == sel.selected_bytes > 0
    assert acc.changed_bytes == compare(cr.state, mixed).changed_bytes
    assert ep.length == CAP or ep.eog


def test_selector_terms_on_eight_kv_heads_of_128(arms, tmp_path):
    st = arms["A"][0].state
    n = st.k[0].shape[0]
    (tmp_path / "H3.toml").write_text("[[term]]\nheads = [3]\ncomponent = \"K\"\nlayers = [1]\n")
    h3 = select(load_selector(tmp_path / "H3.toml"), st)
    assert h3.k_bytes[1] == n * 128 * 2 and sum(h3.k_bytes) == n * 256 and not any(h3.v_bytes)
    cols = np.flatnonzero(h3.k[1].any(axis=0))
    assert cols.tolist() == list(range(3 * 128, 4 * 128))  # head 3's 128 values of a K row
    early = select(load_selector("EARLY"), st)  # b(1/4) of 4 layers: layer 0
    assert [bool(x.any()) for x in early.k] == [True, False, False, False]
    half = select(load_selector("L0"), st)
    assert half.selected_bytes == 2 * n * 1024 * 2  # layer 0, K and V
    every = select(load_selector("ALL"), st)
    assert every.selected_bytes == sum(a.nbytes for a in st.k) + sum(a.nbytes for a in st.v)


def test_diff_names_the_first_layer_and_position(arms, tmp_path):
    from statelab.api import diff as api_diff
    from statelab.api import difference_summary, open_capture

    (ca, _), (cr, _) = arms["A"], arms["R"]
    s = difference_summary(ca, cr)
    assert s["first_layer"] == compare(ca.state, cr.state).first_differing_layer
    ds = open_capture(ca)  # the head size from the model file: 128
    assert ds.kv.sizes["kv_head"] == 8 and ds.kv.sizes["head_dim"] == 128 and ds.layer.values.tolist() == [0, 1, 2, 3]
    k1 = ds.kv.sel(layer=1, component="K").values
    assert np.array_equal(k1.reshape(k1.shape[0], -1), ca.state.k[1])
    d = api_diff(ca, cr)
    by_layer = {(r["layer"], r["component"]): r["changed_values"] for r in compare(ca.state, cr.state).records()}
    assert {(int(L), c): int(d.changed_values.sel(layer=L, component=c)) for L in d.layer.values
            for c in ("K", "V")} == by_layer


def test_state_files_export_restore_and_import(ci, cfg, prompt, arms, tmp_path):
    from statelab.lab.interop import export_state_file, import_state_file
    from statelab.lab.intervene import config_of, import_and_continue
    from statelab.lab.receiver import continue_greedy
    from statelab.runtime import Context, statefile

    cap_a, nat_a = arms["A"]
    f = export_state_file(cap_a, tmp_path / "a.seq", "seq")
    with Context(ci, config_of(cap_a)) as ctx:  # the real library restores it and continues identically
        assert statefile.seq_load_file(ctx, f, 0).tolist() == cap_a.tokens.tolist()
        assert continue_greedy(ctx, cap_a.logits, cap_a.n_prompt, CAP).same(nat_a)
    cap_r, nat_r = arms["R"]
    g = export_state_file(cap_r, tmp_path / "r.whole", "whole")
    imp = import_state_file(g, ci, cfg, prompt=prompt, logits="recompute", source_backend="cpu")
    assert imp.blob == cap_r.blob and imp.logits.tobytes() == cap_r.logits.tobytes()
    assert import_and_continue(ci, cfg, imp.blob, imp.logits, imp.n_prompt, CAP).same(nat_r)


def test_qb_pq_gs_qualify_against_r(ci_ident, he):
    from statelab.experiments.spec_run import run_arms
    from statelab.speculative.transaction import SpecConfig

    refused = []
    results, _ = run_arms(ci_ident["path"], "self", he("HumanEval/2"), ["R", "M_QB", "M_PQ", "M_GS", "C_QB", "C_PQ"],
                          SpecConfig(k=3, cap=8, threads=1), refused=lambda a, why: refused.append((a, why)))
    got = {r.arm: r for r in results}
    assert not refused and set(got) == {"R", "M_QB", "M_PQ", "M_GS", "C_QB", "C_PQ"}
    for arm in ("M_QB", "M_PQ", "M_GS", "C_QB", "C_PQ"):
        assert got[arm].qualified and got[arm].first_diff is None, arm
    assert got["C_QB"].counters.verify_calls > 0 and got["C_QB"].counters.proposals > 0


def test_locator_names_the_first_differing_node(ci, cfg, prompt):
    from statelab.audit.locate import locate

    tokens = ci.tokenize(prompt.text)[:24]
    res = locate(ci, tokens, "ub1", "ub4", cfg, layers="0-1")
    assert res.diverged and res.first["layer"] == 0 and res.first["max_abs"] > 0
    assert not locate(ci, tokens, "ub4", "ub4", cfg, layers="0").diverged


def test_e1_and_replay_at_head_dim_128(ci, cfg, prompt):
    from statelab.audit.e1 import run_e1
    from statelab.audit.replay import replay_e1
    from statelab.runtime import layouts

    tokens = ci.tokenize(prompt.text)[:20]
    ds, detail = run_e1(ci, tokens, layers=[0], qs=(1, 4), base_config=cfg)
    assert (ds["observed"] == 1).all() and (ds["repeat_equal"] == 1).all()
    assert (ds["operands_identical"] == 1).all()
    cap = detail["runs"][("prefill", 4, "MQ")].captures[0]
    assert cap.operands["q"].ne[:3] == (128, 4, 32) and cap.operands["k"].ne[2] == 8
    assert cap.outputs["av"].shape == (32, 4, 128) and cap.head_map == [a // 4 for a in range(32)]
    assert cap.scale == pytest.approx(1 / np.sqrt(128))
    assert layouts.available()
    assert (ds["status"] == "compared").all() and (ds["bitwise_equal"].sel(pair="PQ-QB") == 1).all()
    rds = replay_e1(detail)
    assert (rds["own_path_equal"] == 1).all() and (rds["bitwise_equal"].sel(pair="PQ-QB") == 1).all()


def test_the_llama3_path_loads_and_runs(cfg, he):
    """ci-llama: the llama architecture with Llama 3's RoPE scaling as a rope_freqs tensor (which
    llama.cpp would refuse as an unused tensor if its llama loader did not take it), untied output."""
    from statelab.runtime import Model
    from statelab.models import gguf_reader
    from statelab.synth import llama3_rope_factors

    ident = synthesize("ci-llama", "q8_0", 0)
    f = llama3_rope_factors(get_shape("ci-llama"))
    assert f.shape == (32,) and f[0] == 1.0 and f[-1] == 32.0 and np.all(np.diff(f) >= 0)
    stored = {t.name: t for t in gguf_reader(ident["path"]).tensors}
    assert np.array_equal(np.asarray(stored["rope_freqs.weight"].data), f) and "output.weight" in stored
    m = Model(ident["path"], backend="cpu")
    try:
        assert m.info.architecture == "llama" and (m.info.n_head, m.info.n_head_kv, m.info.head_dim_k) == (32, 8, 64)
        c, nat = natural(m, he("HumanEval/2"), PRESETS["A"], cfg, CAP)
        assert np.isfinite(c.logits).all() and sham(m, c, CAP).same(nat)
    finally:
        m.close()
