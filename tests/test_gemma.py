"""The laboratory on a second model family: Gemma 3 270M Q4_K_M (an iSWA memory: a full KV
cache of 3 layers and a sliding-window cache of 15 layers, window 512) on CPU.

Kept short for CI: HumanEval/2 (86 prompt tokens), /18 (96) and /20 (173), caps of a few
tokens (a logit row is 262144 floats).  On CPU the A (ubatch 512) and R (ubatch 1) states
differ from layer 1 on and their natural endpoints differ at output 1 on HumanEval/18 (the
pinned x86-64-v3 build).
"""
import numpy as np
import pytest

from statelab.api import diff as api_diff
from statelab.api import difference_summary, open_capture
from statelab.errors import ConfigError, IdentityError
from statelab.lab.formation import PRESETS, form, parse_schedule
from statelab.lab.intervene import cross, natural, sham, subset_cross
from statelab.kvstate import GGML_BF16, GGML_F16, GGML_F32, GGML_Q8_0, KVFormatError, KVState, compare
from statelab.selection import SelectorError, load_selector, select

from conftest import REPO, one_line_error

pytestmark = [pytest.mark.model, pytest.mark.gemma]
CAP = 4
FULL_LAYERS = (5, 11, 17)
SWA_LAYERS = tuple(i for i in range(18) if i not in FULL_LAYERS)


@pytest.fixture(scope="module")
def arms(gemma, base_config, he):
    p = he("HumanEval/18")
    return {name: natural(gemma, p, PRESETS[name], base_config, CAP) for name in ("A", "R")}


@pytest.mark.parametrize("task, schedule, type_k, type_v, flash", [
    ("HumanEval/2", "A", "f16", "f16", False), ("HumanEval/2", "R", "f16", "f16", False),
    ("HumanEval/20", "B", "f16", "f16", False), ("HumanEval/20", "C", "f16", "f16", False),
    ("HumanEval/2", "40+rest@ub16", "f32", "f32", False), ("HumanEval/2", "A", "bf16", "bf16", False),
    ("HumanEval/2", "A", "q8_0", "f16", False), ("HumanEval/2", "A", "q8_0", "q8_0", True),
])
def test_codec_round_trip_of_every_part_on_real_states(gemma, base_config, he, task, schedule, type_k, type_v,
                                                       flash):
    p = he(task)
    n = len(gemma.tokenize(p.text))
    cfg = base_config.with_(type_k=type_k, type_v=type_v, flash_attn=flash)
    c = form(gemma, p, parse_schedule(schedule), cfg)
    st = KVState.parse(c.blob, gemma.memory_layout)
    assert st.to_bytes() == c.blob
    assert [(q.kind, q.n_layer) for q in st.parts] == [("full", 3), ("swa", 15)]
    assert st.layer_ids == FULL_LAYERS + SWA_LAYERS and st.parts[1].n_swa == 512
    assert all(q.positions.tolist() == list(range(n)) for q in st.parts)  # n < window: both hold every cell
    types = {"f32": GGML_F32, "f16": GGML_F16, "bf16": GGML_BF16, "q8_0": GGML_Q8_0}
    assert set(st.k_types) == {types[type_k]} and set(st.v_types) == {types[type_v]}
    assert st.n_embd_k_gqa == [256] * 18 and st.v_trans == (not flash)
    # without the layout the codec still reads both parts byte for byte
    assert KVState.parse(c.blob).to_bytes() == c.blob


def test_editing_one_value_of_each_part_changes_exactly_its_bytes(arms):
    c, _ = arms["A"]
    for il in (0, 3):  # stored layer 0 = model layer 5 (full cache); stored 3 = model layer 0 (swa cache)
        st = c.state.copy()
        st.k[il][10, 7] = np.float16(st.k[il][10, 7]) + np.float16(1.0)
        new = st.to_bytes()
        diff = np.flatnonzero(np.frombuffer(new, np.uint8) != np.frombuffer(c.blob, np.uint8))
        off, _ = st.component_offsets()[st.component_name(il, "K")]
        expect = off + (10 * st.k[il].shape[1] + 7) * 2
        assert len(diff) >= 1 and set(diff.tolist()) <= {expect, expect + 1}
        assert compare(c.state, st).first_differing_layer == st.layer_ids[il]


def test_shams_equal_natural(gemma, arms):
    for name in ("A", "R"):
        c, nat = arms[name]
        assert sham(gemma, c, CAP).same(nat), f"sham [{name}] differs from its natural endpoint"


def test_a_and_r_differ_and_whole_cross_reproduces_the_donor(gemma, arms):
    (ca, ea), (cr, er) = arms["A"], arms["R"]
    d = compare(ca.state, cr.state)
    assert d.first_differing_layer == 1 and not ea.same(er)
    ep, acc = cross(gemma, ca, cr, logits_from="donor", cap=CAP)
    assert ep.same(ea) and acc.changed_bytes == d.changed_bytes


def test_difference_summary_names_model_layers(arms):
    """An iSWA blob stores its full-cache layers (5, 11, 17) first; the summary reports model layers."""
    (ca, _), (cr, _) = arms["A"], arms["R"]
    s = difference_summary(ca, cr)
    assert s["first_layer"] == compare(ca.state, cr.state).first_differing_layer == 1
    assert 0 <= s["earliest_layer"] < 18 and s["earliest_position"] <= s["first_position"]


def test_api_dataset_and_diff_are_in_model_layer_order(arms):
    """open_capture and api.diff put model layer L at layer=L, whatever the blob order."""
    (ca, _), (cr, _) = arms["A"], arms["R"]
    ds = open_capture(ca, head_dim=256)
    assert ds.layer.values.tolist() == list(range(18))
    assert [str(k) for k in ds.layer_kind.values] == ["full" if i in FULL_LAYERS else "swa" for i in range(18)]
    st = ca.state
    for stored, model_layer in enumerate(st.layer_ids):
        k = ds.kv.sel(layer=model_layer, component="K").values
        kept = ~np.isnan(k[:, 0, 0])
        assert np.array_equal(k[kept].reshape(int(kept.sum()), -1), st.k[stored])
    d = api_diff(ca, cr)
    by_layer = {(r["layer"], r["component"]): r["changed_values"] for r in compare(ca.state, cr.state).records()}
    assert {(int(L), c): int(d.changed_values.sel(layer=L, component=c)) for L in d.layer.values
            for c in ("K", "V")} == by_layer
    assert ((d.first_position.values >= 0) == (d.changed_values.values > 0)).all()


@pytest.mark.parametrize("selector, layers", [("FULL", FULL_LAYERS), ("SWA", SWA_LAYERS)])
def test_subset_cross_of_one_cache_kind(gemma, arms, selector, layers):
    (ca, _), (cr, _) = arms["A"], arms["R"]
    sel = select(load_selector(selector), cr.state)
    ep, acc = subset_cross(gemma, ca, cr, sel, CAP)
    assert acc.verified and acc.selected_bytes == sel.selected_bytes > 0
    from statelab.selection import apply_subset

    mixed = apply_subset(cr.state, ca.state, sel)
    changed = {c.layer for c in compare(cr.state, mixed).components.values() if c.changed_bytes}
    assert changed and changed <= set(layers)
    assert acc.changed_bytes == compare(cr.state, mixed).changed_bytes
    assert ep.length == CAP or ep.eog


def test_selector_named_layers_keep_their_meaning(arms):
    st = arms["A"][0].state
    early = select(load_selector("EARLY"), st)  # b(1/4) of 18 layers = 5: model layers 0..4
    assert sorted(st.layer_ids[i] for i in range(18) if early.k[i].any()) == [0, 1, 2, 3, 4]
    window = select(load_selector("WINDOW"), st)
    assert window.equals(select(load_selector("ALL"), st))  # 96 positions: all inside the 512 window


def test_quantised_rows_are_addressed_whole(gemma, base_config, he, tmp_path):
    c = form(gemma, he("HumanEval/2"), PRESETS["A"], base_config.with_(type_k="q8_0"))
    st = c.state
    assert st.k[0].shape == (c.n_prompt, 272)  # 256 values = 8 Q8_0 blocks of 34 bytes
    whole = select(load_selector("L0_K"), st)
    assert whole.k_bytes[st.layer_ids.index(0)] == c.n_prompt * 272
    (tmp_path / "H.toml").write_text("[[term]]\nheads = [0]\ncomponent = \"K\"\n")  # Gemma 3 270M: 1 KV head
    assert select(load_selector(tmp_path / "H.toml"), st).equals(select(load_selector("K_ALL"), st))
    with pytest.raises(ConfigError, match="flash attention"):
        base_config.with_(type_v="q8_0")
    # a subset cross of whole quantised rows restores and reads back byte for byte
    r = form(gemma, he("HumanEval/2"), PRESETS["R"], base_config.with_(type_k="q8_0"))
    sel = select(load_selector("FULL"), r.state)
    ep, acc = subset_cross(gemma, c, r, sel, 2)
    assert acc.verified and acc.selected_bytes == sel.selected_bytes and acc.changed_bytes > 0


def test_a_capture_of_another_model_is_refused(gemma, model, base_config, he, arms):
    smol = form(model, he("HumanEval/2"), PRESETS["A"], base_config)
    with pytest.raises(IdentityError, match="formed with model"):
        sham(gemma, smol, CAP)
    with pytest.raises(IdentityError, match="does not cross models"):
        cross(gemma, smol, arms["R"][0], cap=CAP)
    with pytest.raises(KVFormatError, match="the blob holds 1 KV cache part"):
        KVState.parse(smol.blob, gemma.memory_layout)
    with pytest.raises(KVFormatError, match="trailing bytes"):
        KVState.parse(arms["A"][0].blob, model.memory_layout)
    with pytest.raises(SelectorError, match="no layer map"):
        select(load_selector("EARLY"), KVState.parse(arms["A"][0].blob))


def test_cli_capture_sham_cross_diff_and_refusals(cli, tmp_path):
    a, r, s = tmp_path / "a", tmp_path / "r", tmp_path / "s"
    for out, sched in ((a, "A"), (r, "R")):
        res = cli("capture", out, "-H", "2", "-s", sched, "--model", "gemma3")
        assert res.returncode == 0, res.stderr
    assert cli("sham", r, "--cap", "3", "--model", "gemma3").returncode == 0
    x = cli("cross", a, r, "--cap", "3", "--model", "gemma3", "--json")
    assert x.returncode == 0, x.stderr
    d = cli("diff", a, r)
    assert d.returncode == 0 and "first differing layer: 1" in d.stdout and "swa" in d.stdout
    assert cli("capture", s, "-H", "2", "-s", "A").returncode == 0  # the embedded SmolLM2
    one_line_error(cli("continue", s, "--model", "gemma3", "--cap", "2"), "formed with model")
    one_line_error(cli("capture", tmp_path / "q", "-H", "2", "--model", "gemma3", "--cache-type-v", "q8_0"),
                   "flash attention")
    assert not (tmp_path / "q").exists()


def test_cli_sweep(cli, tmp_path):
    r = cli("sweep", "-H", "2", "--model", "gemma3", "--schedules", "A,C,R", "--cap", "3", "--out", tmp_path / "run")
    assert r.returncode == 0, r.stderr
    assert "state classes:    A, C | R" in r.stdout


def test_cli_doctor_names_the_capabilities(cli):
    r = cli("doctor", "--model", "gemma3")
    assert r.returncode == 0, r.stderr
    for needle in ("iswa", "codec parts", "sliding window (15 layers, window 512)", "layer kinds", "QB admission"):
        assert needle in r.stdout, needle


@pytest.fixture(scope="module")
def small_study(tmp_path_factory):
    spec = tmp_path_factory.mktemp("gemma-study") / "gemma-small.toml"
    spec.write_text((REPO / "studies" / "gemma-ci.toml").read_text()
                    .replace('prompts = ["HumanEval/18", "HumanEval/1"]', 'prompts = ["HumanEval/18"]')
                    .replace('selectors = ["EMPTY", "ALL", "SWA", "FULL"]', 'selectors = ["SWA", "FULL"]')
                    .replace('directions = ["A->R", "R->A"]', 'directions = ["A->R"]')
                    .replace("cap = 8", "cap = 4"))
    return spec, spec.parent / "run"


def test_study_run_and_minimal_on_gemma(cli, small_study):
    spec, out = small_study
    r = cli("study", "run", spec, "-o", out)
    assert r.returncode == 0, r.stderr
    report = (out / "report.md").read_text()
    assert "| HumanEval/18 | 96 |" in report and "| pass |" in report  # controls passed
    assert "| HumanEval/18 | SWA |" in report and "| HumanEval/18 | FULL |" in report
    m = cli("study", "minimal", spec, "-p", "HumanEval/18", "-d", "A->R", "-o", out)
    assert m.returncode == 0, m.stderr
    assert "reproduce the donor" in m.stdout


def test_frontier_panel_on_gemma(cli, tmp_path):
    out = tmp_path / "frontier"
    r = cli("frontier", "run", REPO / "studies" / "frontier-gemma-ci.toml", "-o", out)
    assert r.returncode == 0, r.stderr
    assert "2 panel repeat(s) with a frontier; repeats agree on 2 of 2" in r.stdout
    report = (out / "report.md").read_text()
    assert "| HumanEval/20 | A->R | KIND | C1 | FULL |" in report and "passed in 2 of 2 repeats" in report
