"""Synthetic tests of selectors (statelab.selection) against real storage strides."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statelab.kvstate import GGML_F16, GGML_F32, KVFormatError, KVState, make_state
from statelab.selection import (
    SelectorError,
    apply_subset,
    layer_fraction_bounds,
    list_selectors,
    load_selector,
    select,
)

FAST = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NAMED = ["ALL", "EARLY", "EMPTY", "K_ALL", "L0", "L0_K", "L0_V", "LATE", "MIDDLE", "PREFIX", "TAIL", "V_ALL"]


def sel(name, state):
    return select(load_selector(name), state)


def write(dirpath: Path, name: str, text: str) -> Path:
    p = dirpath / f"{name}.toml"
    p.write_text(text)
    return p


# ----------------------------------------------------------------------------- named selectors
def test_named_selectors_are_shipped_and_load():
    assert set(NAMED) <= set(list_selectors())
    for name in NAMED:
        s = load_selector(name)
        assert s.name == name and s.description
    assert load_selector("EMPTY").terms == ()
    l0 = load_selector("L0")
    assert [t.selector.name for t in l0.terms] == ["L0_K", "L0_V"]


def test_l0_k_is_one_sixty_fourth_of_a_32_layer_f16_state():
    s = make_state(7, 32, 12, 12, k_type=GGML_F16, v_type=GGML_F16, v_trans=True)
    x = sel("L0_K", s)
    assert x.selected_bytes == 7 * 12 * 2
    assert x.total_bytes == s.value_nbytes
    assert Fraction(x.selected_bytes, x.total_bytes) == Fraction(1, 64)
    assert x.share == 1 / 64
    lb = x.layer_bytes()
    assert lb.shape == (32, 2) and lb[0, 0] == x.selected_bytes and lb.sum() == x.selected_bytes


def test_shares_of_named_selectors_on_equal_widths():
    s = make_state(4, 32, 8, v_trans=True, positions=[0, 100, 128, 500])
    shares = {n: sel(n, s).share for n in NAMED}
    assert shares["ALL"] == 1.0 and shares["EMPTY"] == 0.0
    assert shares["K_ALL"] == shares["V_ALL"] == 0.5
    assert shares["L0"] == 2 / 64 and shares["L0_V"] == 1 / 64
    assert (shares["EARLY"], shares["MIDDLE"], shares["LATE"]) == (0.25, 0.5, 0.25)
    assert shares["PREFIX"] == shares["TAIL"] == 0.5


def layers_of(x):
    return [i for i, (kb, vb) in enumerate(x.layer_bytes()) if kb or vb]


def test_layer_groups_on_32_and_30_layers():
    s32 = make_state(2, 32, 2)
    assert layers_of(sel("EARLY", s32)) == list(range(0, 8))
    assert layers_of(sel("MIDDLE", s32)) == list(range(8, 24))
    assert layers_of(sel("LATE", s32)) == list(range(24, 32))
    s30 = make_state(2, 30, 2)  # SmolLM2-135M
    assert layers_of(sel("EARLY", s30)) == list(range(0, 8))
    assert layers_of(sel("MIDDLE", s30)) == list(range(8, 23))
    assert layers_of(sel("LATE", s30)) == list(range(23, 30))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 200))
def test_layer_groups_partition_any_layer_count(n_layer):
    masks = [load_selector(n).terms[0].layer_mask(n_layer) for n in ("EARLY", "MIDDLE", "LATE")]
    total = np.sum(masks, axis=0)
    assert np.all(total == 1)
    # contiguous and ordered
    idx = [np.flatnonzero(m) for m in masks]
    flat = np.concatenate(idx)
    assert flat.tolist() == list(range(n_layer))


def test_fraction_rounding_rule():
    assert layer_fraction_bounds(Fraction(1, 4), Fraction(3, 4), 30) == (8, 23)
    assert layer_fraction_bounds(Fraction(0), Fraction(1, 3), 30) == (0, 10)
    assert layer_fraction_bounds(Fraction(1, 4), Fraction(3, 4), 2) == (1, 2)


# ----------------------------------------------------------------------------- masks vs strides
def byte_owner(state: KVState, offsets: np.ndarray):
    """Map blob offsets to (component name, cell index) with independent stride arithmetic."""
    out = []
    for name, (start, size) in state.component_offsets().items():
        il, comp = int(name[1:name.index(".")]), name[-1]
        inside = offsets[(offsets >= start) & (offsets < start + size)] - start
        if comp == "K":
            cells = inside // state.k_row_sizes[il]
        elif state.v_trans:
            cells = (inside // state.v_element_sizes[il]) % state.n_cells
        else:
            cells = inside // state.v_row_sizes[il]
        out += [(name, int(c)) for c in cells]
    return out


@st.composite
def pair(draw, max_layers=4):
    n_cells = draw(st.integers(1, 8))
    n_layer = draw(st.integers(1, max_layers))
    kw = dict(
        n_cells=n_cells, n_layer=n_layer,
        n_embd_k=draw(st.lists(st.integers(1, 5), min_size=n_layer, max_size=n_layer)),
        n_embd_v=draw(st.lists(st.integers(1, 5), min_size=n_layer, max_size=n_layer)),
        k_type=draw(st.sampled_from([GGML_F16, GGML_F32])),
        v_type=draw(st.sampled_from([GGML_F16, GGML_F32])),
        v_trans=draw(st.booleans()),
        positions=draw(st.lists(st.integers(0, 300), min_size=n_cells, max_size=n_cells, unique=True)),
    )
    recipient = make_state(**kw, seed=1)
    donor = make_state(**kw, seed=2)
    # make every donor byte differ from the recipient's, so every copied byte is visible
    for a, b in zip(recipient.k + recipient.v, donor.k + donor.v):
        u = f"<u{a.dtype.itemsize}"
        b.view(u)[...] = ~a.view(u)
    return recipient, donor


def changed_offsets(a: KVState, b: KVState) -> np.ndarray:
    return np.flatnonzero(np.frombuffer(a.to_bytes(), np.uint8) != np.frombuffer(b.to_bytes(), np.uint8))


@FAST
@given(pair())
def test_l0_k_touches_only_layer0_k_bytes(p):
    recipient, donor = p
    before = recipient.to_bytes()
    x = sel("L0_K", recipient)
    out = apply_subset(recipient, donor, x)
    assert recipient.to_bytes() == before  # the recipient itself is untouched
    changed = changed_offsets(recipient, out)
    start, size = recipient.component_offsets()["L0.K"]
    assert changed.tolist() == list(range(start, start + size))
    assert len(changed) == x.selected_bytes
    assert out.k[0].tobytes() == donor.k[0].tobytes()


@FAST
@given(pair())
def test_prefix_touches_only_cells_below_128_in_k_rows_and_v_columns(p):
    recipient, donor = p
    x = sel("PREFIX", recipient)
    out = apply_subset(recipient, donor, x)
    changed = changed_offsets(recipient, out)
    owners = byte_owner(recipient, changed)
    prefix_cells = set(np.flatnonzero(recipient.positions < 128).tolist())
    assert {c for _, c in owners} == prefix_cells
    # every byte of every prefix cell, in every component, was imported
    expected = sum(
        len(prefix_cells) * (a.nbytes // recipient.n_cells) for a in recipient.k + recipient.v
    )
    assert len(changed) == expected == x.selected_bytes
    for il in range(recipient.n_layer):
        cm = recipient.positions < 128
        vm = x.v[il][:, 0] if not recipient.v_trans else x.v[il][0, :]
        assert np.array_equal(x.k[il][:, 0], cm) and np.array_equal(vm, cm)


@FAST
@given(pair())
def test_tail_is_the_complement_of_prefix(p):
    s, _ = p
    pre, tail, every, empty = (sel(n, s) for n in ("PREFIX", "TAIL", "ALL", "EMPTY"))
    assert (pre | tail).equals(every)
    assert (pre & tail).equals(empty)
    assert pre.selected_bytes + tail.selected_bytes == s.value_nbytes


@FAST
@given(pair())
def test_lattice_relations(p):
    s, _ = p
    x = {n: sel(n, s) for n in NAMED}
    assert x["EMPTY"].is_subset_of(x["L0_K"])
    assert x["L0_K"].is_subset_of(x["L0"]) and x["L0_V"].is_subset_of(x["L0"])
    assert (x["L0_K"] | x["L0_V"]).equals(x["L0"])
    assert x["L0"].is_subset_of(x["ALL"]) and not x["ALL"].is_subset_of(x["EMPTY"])
    assert (x["K_ALL"] | x["V_ALL"]).equals(x["ALL"])
    assert x["L0_K"].is_subset_of(x["K_ALL"]) and not x["L0_V"].is_subset_of(x["K_ALL"])
    flat = x["L0_K"].to_flat()
    assert flat.dtype == bool and flat.size == sum(a.size for a in s.k + s.v)
    assert int(flat.sum()) == s.n_cells * s.n_embd_k_gqa[0]
    recs = x["ALL"].records()
    assert len(recs) == 2 * s.n_layer
    assert sum(r["selected_bytes"] for r in recs) == sum(r["total_bytes"] for r in recs) == s.value_nbytes
    assert [(r["layer"], r["component"]) for r in x["L0_K"].records() if r["selected_bytes"]] == [(0, "K")]


def test_applying_all_and_empty():
    r = make_state(5, 3, 4, seed=1)
    d = make_state(5, 3, 4, seed=2)
    assert apply_subset(r, d, sel("ALL", r)).to_bytes() == d.to_bytes()
    assert apply_subset(r, d, sel("EMPTY", r)).to_bytes() == r.to_bytes()


# ----------------------------------------------------------------------------- schema features
def test_references_intersections_fractions_and_negative_layers(tmp_path):
    write(tmp_path, "EARLY_PREFIX", '[[term]]\nselector = "EARLY"\npositions = [0, 128]\n')
    write(tmp_path, "LAST_V", '[[term]]\nlayers = [-1]\ncomponent = "V"\n')
    write(tmp_path, "THIRD", '[[term]]\nlayer_fraction = [0, "1/3"]\ncomponent = "K"\n')
    write(tmp_path, "MIX", '[[term]]\nselector = "LAST_V"\n[[term]]\nselector = "THIRD"\npositions = [10]\n')
    dirs = [tmp_path, Path(__file__).resolve().parent.parent / "selectors"]
    s = make_state(6, 12, 4, positions=[0, 5, 10, 127, 128, 400])
    ep = select(load_selector("EARLY_PREFIX", dirs), s)
    assert ep.equals(sel("EARLY", s) & sel("PREFIX", s))
    lv = select(load_selector("LAST_V", dirs), s)
    assert layers_of(lv) == [11] and lv.k_bytes.sum() == 0
    th = select(load_selector("THIRD", dirs), s)
    assert layers_of(th) == [0, 1, 2, 3] and th.v_bytes.sum() == 0
    mix = select(load_selector("MIX", dirs), s)
    assert layers_of(mix) == [0, 1, 2, 3, 11]
    assert mix.k_bytes[0] == 4 * 4 * 2  # cells at positions 10, 127, 128, 400
    # loading by path resolves references next to the file
    assert load_selector(tmp_path / "MIX.toml").name == "MIX"


def test_env_search_path(tmp_path, monkeypatch):
    write(tmp_path, "MY_SEL", '[[term]]\nlayers = [1]\n')
    monkeypatch.setenv("STATELAB_SELECTORS", str(tmp_path))
    assert "MY_SEL" in list_selectors() and "ALL" in list_selectors()
    assert load_selector("MY_SEL").terms[0].layers == (1,)


def test_positions_open_end_forms(tmp_path):
    write(tmp_path, "A", "[[term]]\npositions = [128]\n")
    write(tmp_path, "B", "[[term]]\npositions = [128, inf]\n")
    a = load_selector("A", [tmp_path])
    b = load_selector("B", [tmp_path])
    assert a.terms == b.terms and a.terms[0].positions == (128, None)


def test_empty_state_gives_empty_selection():
    from statelab.kvstate import build_blob

    s = KVState.parse(build_blob(0, 3))
    x = sel("L0_K", s)
    assert x.selected_bytes == 0 and x.share == 0.0 and x.to_flat().size == 0
    assert apply_subset(s, s.copy(), x).to_bytes() == s.to_bytes()


# ----------------------------------------------------------------------------- errors
def test_unknown_name_lists_known_ones():
    with pytest.raises(SelectorError, match=r"unknown selector 'NOPE'; known: .*L0_K.*PREFIX"):
        load_selector("NOPE")


def test_layer_beyond_model_names_the_layer_count(tmp_path):
    write(tmp_path, "DEEP", "[[term]]\nlayers = [0, 30]\n")
    s = make_state(2, 30, 2)
    with pytest.raises(SelectorError, match="selects layer 30, but the model has 30 layers"):
        select(load_selector("DEEP", [tmp_path]), s)
    write(tmp_path, "REF", '[[term]]\nselector = "DEEP"\ncomponent = "K"\n')
    with pytest.raises(SelectorError, match="model has 30 layers"):
        load_selector("REF", [tmp_path]).validate(30)
    load_selector("REF", [tmp_path]).validate(31)


@pytest.mark.parametrize(
    "text,pattern",
    [
        ("[[term]]\npositions = [128, 128]\n", r"empty position range \[128, 128\)"),
        ("[[term]]\npositions = [200, 100]\n", r"empty position range"),
        ("[[term]]\npositions = [0, 1.5]\n", r"must be an integer or inf"),
        ("[[term]]\npositions = []\n", r"'positions' must be"),
        ("[[term]]\nlayer = [0]\n", r"term 1: unknown key\(s\) layer \(allowed: "),
        ("name = 'X'\n", r"unknown key\(s\) name"),
        ("[[term]]\ncomponent = 'Q'\n", r"unknown component 'Q' \(allowed: K, V, KV\)"),
        ("[[term]]\ncomponent = 'k'\n", r"unknown component 'k'"),
        ("[[term]]\nlayers = [0]\nlayer_fraction = [0, 1]\n", "not both"),
        ("[[term]]\nlayer_fraction = [0.5, 0.5]\n", "empty layer fraction range"),
        ("[[term]]\nlayer_fraction = [0, 2]\n", r"outside \[0, 1\]"),
        ("[[term]]\nlayers = []\n", "non-empty list"),
        ("[[term]]\nlayers = [true]\n", "list of integers"),
        ("[[term]]\nselector = 'GHOST'\n", "unknown selector 'GHOST'"),
        ("term = 3\n", "array of tables"),
        ("description = 3\n", "'description' must be a string"),
    ],
)
def test_schema_errors(tmp_path, text, pattern):
    p = write(tmp_path, "BAD", text)
    with pytest.raises(SelectorError, match=pattern) as err:
        load_selector("BAD", [tmp_path])
    if "GHOST" not in text:
        assert str(p) in str(err.value)


def test_malformed_toml_names_the_file(tmp_path):
    p = write(tmp_path, "BROKEN", "[[term]\nlayers = [0\n")
    with pytest.raises(SelectorError, match="malformed TOML") as err:
        load_selector("BROKEN", [tmp_path])
    assert str(p) in str(err.value)


def test_reference_cycle_is_refused(tmp_path):
    write(tmp_path, "A", '[[term]]\nselector = "B"\n')
    write(tmp_path, "B", '[[term]]\nselector = "A"\n')
    with pytest.raises(SelectorError, match="cycle: A -> B -> A"):
        load_selector("A", [tmp_path])


def test_apply_subset_refuses_mismatches():
    r = make_state(4, 2, 4, seed=1)
    with pytest.raises(KVFormatError, match="n_layer"):
        apply_subset(r, make_state(4, 3, 4), sel("ALL", r))
    with pytest.raises(KVFormatError, match="k_types"):
        apply_subset(r, make_state(4, 2, 4, k_type=GGML_F32, v_type=GGML_F16), sel("ALL", r))
    moved = make_state(4, 2, 4, positions=[0, 1, 2, 9])
    with pytest.raises(KVFormatError, match="different positions .* cell 3"):
        apply_subset(r, moved, sel("ALL", r))
    with pytest.raises(KVFormatError, match="does not match the state's geometry"):
        apply_subset(r, r.copy(), sel("ALL", make_state(5, 2, 4)))
    with pytest.raises(SelectorError, match="different geometry"):
        sel("ALL", r) | sel("ALL", make_state(5, 2, 4))


# ----------------------------------------------------------------------------- layer kinds and the window
def test_layer_kind_and_window_terms_on_an_iswa_state():
    from statelab.kvstate import make_iswa_state

    # 6 layers: full layers 2 and 5; 10 cells, window 4 -> the swa cache holds positions 6..9
    s = make_iswa_state(10, 6, swa_layers=[0, 1, 3, 4], n_swa=4)
    swa, full = sel("SWA", s), sel("FULL", s)
    ids = s.layer_ids
    assert [ids[i] for i in range(6) if swa.k[i].any()] == [0, 1, 3, 4]
    assert [ids[i] for i in range(6) if full.k[i].all()] == [2, 5]
    assert (swa | full).equals(sel("ALL", s))
    inside, outside = sel("WINDOW", s), sel("OUTSIDE_WINDOW", s)
    # full layers: positions 6..9 inside, 0..5 outside; swa layers hold only inside cells
    assert np.array_equal(inside.k[0][:, 0], s.parts[0].positions >= 6)
    assert np.array_equal(outside.k[0][:, 0], s.parts[0].positions < 6)
    assert all(inside.k[i].all() and not outside.k[i].any() for i in range(2, 6))
    assert (inside | outside).equals(sel("ALL", s))
    # named selectors keep their meaning in model layers: EARLY = b(1/4) = floor(2.0) -> layers 0, 1
    early = sel("EARLY", s)
    assert sorted(ids[i] for i in range(6) if early.k[i].any()) == [0, 1]
    l0 = sel("L0", s)
    assert [ids[i] for i in range(6) if l0.k[i].any()] == [0]


def test_layer_kind_and_window_on_a_model_without_a_window():
    s = make_state(6, 3, 4)
    assert sel("FULL", s).equals(sel("ALL", s)) and sel("WINDOW", s).equals(sel("ALL", s))
    assert sel("SWA", s).selected_bytes == 0 and sel("OUTSIDE_WINDOW", s).selected_bytes == 0


def test_multi_part_state_without_layer_map_is_refused(tmp_path):
    from statelab.kvstate import make_iswa_state

    bare = KVState.parse(make_iswa_state(4, 3, swa_layers=[0, 1], n_swa=2).to_bytes())
    with pytest.raises(SelectorError, match="no layer map"):
        sel("EARLY", bare)


@pytest.mark.parametrize("key,value,msg", [("layer_kind", "local", "unknown layer_kind"),
                                           ("window", "near", "unknown window")])
def test_bad_layer_kind_or_window_is_refused(tmp_path, key, value, msg):
    write(tmp_path, "bad", f'[[term]]\n{key} = "{value}"\n')
    with pytest.raises(SelectorError, match=msg):
        load_selector(tmp_path / "bad.toml")


def test_subset_cross_of_an_iswa_state_moves_only_the_selected_part():
    from statelab.kvstate import compare, make_iswa_state

    r = make_iswa_state(8, 6, swa_layers=[0, 1, 3, 4], n_swa=4, seed=1)
    d = make_iswa_state(8, 6, swa_layers=[0, 1, 3, 4], n_swa=4, seed=5)
    mixed = apply_subset(r, d, sel("SWA", r))
    diff = compare(r, mixed)
    changed = sorted({c.layer for c in diff.components.values() if c.changed_bytes})
    assert changed == [0, 1, 3, 4]
    assert KVState.parse(mixed.to_bytes()).to_bytes() == mixed.to_bytes()


def test_quantised_rows_are_selected_whole():
    from statelab.kvstate import GGML_Q8_0

    s = make_state(4, 2, 64, k_type=GGML_Q8_0, v_type=GGML_Q8_0, v_trans=False)
    m = sel("L0_K", s)
    assert m.k[0].shape == (4, 68) and m.k[0].all() and m.k_bytes[0] == 4 * 68


def test_heads_term_selects_head_features_and_refuses_part_of_a_quantised_row(tmp_path):
    from statelab.kvstate import GGML_Q8_0, MemoryLayout, PartLayout

    layout = MemoryLayout("kv", (PartLayout("kv", (0, 1)),), 2, "two-head", n_head_kv=2)
    s = KVState.parse(make_state(3, 2, 64, k_type=GGML_F16, v_trans=True).to_bytes(), layout)
    write(tmp_path, "H1", '[[term]]\nheads = [1]\nlayers = [0]\n')
    m = select(load_selector(tmp_path / "H1.toml"), s)
    assert m.k[0][:, 32:].all() and not m.k[0][:, :32].any()  # K row: features 32..63
    assert m.v[0][32:, :].all() and not m.v[0][:32, :].any()  # V^T: feature rows 32..63
    q = KVState.parse(make_state(3, 2, 64, k_type=GGML_Q8_0, v_type=GGML_Q8_0, v_trans=False).to_bytes(), layout)
    with pytest.raises(SelectorError, match="quantised rows are addressed whole"):
        select(load_selector(tmp_path / "H1.toml"), q)
    write(tmp_path, "H01", '[[term]]\nheads = [0, 1]\n')
    assert select(load_selector(tmp_path / "H01.toml"), q).equals(sel("ALL", q))
    write(tmp_path, "H5", '[[term]]\nheads = [5]\n')
    with pytest.raises(SelectorError, match="has 2 KV heads"):
        select(load_selector(tmp_path / "H5.toml"), s)
    with pytest.raises(SelectorError, match="head count is unknown"):
        select(load_selector(tmp_path / "H1.toml"), make_state(3, 2, 64))


def test_subset_cross_matches_cells_by_position_when_a_ring_cache_reorders_them():
    r = make_state(5, 2, 4, positions=[10, 11, 12, 13, 14], seed=1)
    d = make_state(5, 2, 4, positions=[13, 14, 10, 11, 12], seed=2)  # same cells, wrapped ring
    mixed = apply_subset(r, d, sel("ALL", r))
    assert np.array_equal(mixed.positions, r.positions)
    assert np.array_equal(mixed.k[1], d.k[1][[2, 3, 4, 0, 1]]) and np.array_equal(mixed.v[0], d.v[0][:, [2, 3, 4, 0, 1]])
    other = make_state(5, 2, 4, positions=[10, 11, 12, 13, 15])
    with pytest.raises(KVFormatError, match="different positions"):
        apply_subset(r, other, sel("ALL", r))
