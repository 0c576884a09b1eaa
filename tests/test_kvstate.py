"""Synthetic tests of the sequence-state codec (statelab.kvstate)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statelab.kvstate import (
    GGML_F16,
    GGML_F32,
    SEQ_STATE_MAGIC,
    KVFormatError,
    KVState,
    build_blob,
    compare,
    make_state,
)

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SIZE = {GGML_F32: 4, GGML_F16: 2}
DT = {GGML_F32: "<f4", GGML_F16: "<f2"}


# ----------------------------------------------------------------------------- an independent writer
def manual_blob(positions, k, v, k_types, v_types, v_trans, seq_id=0, seq_lists=None, ext=False,
                n_stream=1, v_el_size=None, k_row_size=None):
    """Field-by-field writer following llama.cpp's state_write, independent of kvstate.

    k[l]: (n_cells, wk) arrays; v[l]: (n_cells, wv) arrays in *logical* cell-major order;
    the writer itself transposes V when v_trans (feature-major runs of cell values).
    """
    out = bytearray(struct.pack("<Ii", SEQ_STATE_MAGIC, seq_id))
    out += struct.pack("<I", n_stream)
    n = len(positions)
    out += struct.pack("<I", n)
    if n == 0:
        return bytes(out)
    for i, p in enumerate(positions):
        ids = [seq_id] if seq_lists is None else seq_lists[i]
        out += struct.pack("<iI", p, len(ids))
        if ext:
            out += struct.pack("<iii", 0, 0, 100 + i)
        for s in ids:
            out += struct.pack("<i", s)
    out += struct.pack("<II", int(v_trans), len(k))
    for il, (a, t) in enumerate(zip(k, k_types)):
        row = a.shape[1] * SIZE[t] if k_row_size is None else k_row_size
        out += struct.pack("<iQ", t, row)
        for c in range(n):
            for j in range(a.shape[1]):
                out += np.array(a[c, j], dtype=DT[t]).tobytes()
    for il, (a, t) in enumerate(zip(v, v_types)):
        if v_trans:
            el = SIZE[t] if v_el_size is None else v_el_size
            out += struct.pack("<iII", t, el, a.shape[1])
            for j in range(a.shape[1]):
                for c in range(n):
                    out += np.array(a[c, j], dtype=DT[t]).tobytes()
        else:
            out += struct.pack("<iQ", t, a.shape[1] * SIZE[t])
            for c in range(n):
                for j in range(a.shape[1]):
                    out += np.array(a[c, j], dtype=DT[t]).tobytes()
    return bytes(out)


def small_manual(v_trans=True, k_types=(GGML_F16, GGML_F32), v_types=(GGML_F32, GGML_F16), **kw):
    rng = np.random.default_rng(7)
    n = 3
    k = [rng.standard_normal((n, w)).astype(DT[t]) for w, t in zip((2, 3), k_types)]
    v = [rng.standard_normal((n, w)).astype(DT[t]) for w, t in zip((4, 1), v_types)]
    pos = [5, 9, 130]
    return manual_blob(pos, k, v, list(k_types), list(v_types), v_trans, **kw), pos, k, v


# ----------------------------------------------------------------------------- layout
@pytest.mark.parametrize("v_trans", [False, True])
def test_parse_matches_independent_writer(v_trans):
    blob, pos, k, v = small_manual(v_trans)
    s = KVState.parse(blob)
    assert s.v_trans is v_trans and s.n_cells == 3 and s.n_layer == 2 and s.seq_id == 0
    assert s.positions.tolist() == pos
    assert [x.tolist() for x in s.seq_ids] == [[0]] * 3
    assert s.k_types == [GGML_F16, GGML_F32] and s.v_types == [GGML_F32, GGML_F16]
    for il in range(2):
        assert s.k[il].dtype == np.dtype(DT[s.k_types[il]])
        np.testing.assert_array_equal(s.k[il], k[il])
        # V arrays are stored as in the blob: feature-major when transposed
        np.testing.assert_array_equal(s.v[il], v[il].T if v_trans else v[il])
    assert s.n_embd_k_gqa == [2, 3] and s.n_embd_v_gqa == [4, 1]
    assert s.k_row_sizes == [4, 12] and s.v_element_sizes == [4, 2]
    assert s.value_nbytes == sum(a.nbytes for a in k) + sum(a.nbytes for a in v)
    assert s.to_bytes() == blob


def test_component_offsets_locate_value_blocks():
    blob, _, k, v = small_manual(True)
    s = KVState.parse(blob)
    offs = s.component_offsets()
    assert list(offs) == ["L0.K", "L1.K", "L0.V", "L1.V"]
    # header 16 + 3 cells * 12 + v_trans/n_layer 8 + K type/row 12
    assert offs["L0.K"] == (16 + 36 + 8 + 12, 3 * 2 * 2)
    for name, (off, size) in offs.items():
        il, comp = int(name[1]), name[-1]
        arr = s.k[il] if comp == "K" else s.v[il]
        assert blob[off:off + size] == arr.tobytes()


# ----------------------------------------------------------------------------- round trip
@st.composite
def states(draw, max_cells=6, max_layers=4):
    n_cells = draw(st.integers(0, max_cells))
    n_layer = draw(st.integers(1, max_layers))
    widths_k = draw(st.lists(st.integers(1, 6), min_size=n_layer, max_size=n_layer))
    widths_v = draw(st.lists(st.integers(1, 6), min_size=n_layer, max_size=n_layer))
    types = st.sampled_from([GGML_F16, GGML_F32])
    k_types = draw(st.lists(types, min_size=n_layer, max_size=n_layer))
    v_types = draw(st.lists(types, min_size=n_layer, max_size=n_layer))
    positions = draw(st.lists(st.integers(0, 400), min_size=n_cells, max_size=n_cells))
    return make_state(
        n_cells, n_layer, widths_k, widths_v, k_type=k_types, v_type=v_types,
        v_trans=draw(st.booleans()), positions=positions, seq_id=draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 2**16)),
    )


def expected_size(s: KVState) -> int:
    if s.n_cells == 0:
        return 16
    n = s.n_cells
    body = sum(12 + a.nbytes for a in s.k) + sum(12 + a.nbytes for a in s.v)
    return 16 + 12 * n + 8 + body


@FAST
@given(states())
def test_round_trip(s):
    blob = s.to_bytes()
    assert len(blob) == expected_size(s)
    p = KVState.parse(blob)
    assert p.to_bytes() == blob
    assert p.sha256() == s.sha256()
    assert p.n_cells == s.n_cells and p.n_layer == s.n_layer
    if s.n_cells:
        assert p.v_trans == s.v_trans and p.k_types == s.k_types and p.v_types == s.v_types
        for a, b in zip(p.k + p.v, s.k + s.v):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert a.tobytes() == b.tobytes()
        np.testing.assert_array_equal(p.positions, s.positions)
    # parsing accepts bytearray and memoryview as well
    assert KVState.parse(bytearray(blob)).to_bytes() == blob
    assert KVState.parse(memoryview(blob)).to_bytes() == blob


def test_empty_state_round_trips():
    blob = build_blob(0, 3)
    assert blob == struct.pack("<IiII", SEQ_STATE_MAGIC, 0, 1, 0)
    s = KVState.parse(blob)
    assert s.n_cells == 0 and s.n_layer == 0 and s.value_nbytes == 0
    assert s.to_bytes() == blob and s.copy().to_bytes() == blob
    d = compare(s, s.copy())
    assert d.identical and d.first_differing_layer is None and d.records() == []


def test_single_cell_round_trips():
    for v_trans in (False, True):
        blob = build_blob(1, 2, [3, 5], [4, 2], k_type=GGML_F32, v_type=GGML_F16, v_trans=v_trans, seed=3)
        s = KVState.parse(blob)
        assert s.n_cells == 1 and s.to_bytes() == blob
        assert s.v[1].shape == ((2, 1) if v_trans else (1, 2))


def test_whole_memory_blob_with_multi_sequence_cells_round_trips():
    # seq_id == -1 (all sequences): a cell may belong to several sequences
    rng = np.random.default_rng(0)
    k = [rng.standard_normal((3, 2)).astype("<f2")]
    v = [rng.standard_normal((3, 2)).astype("<f2")]
    blob = manual_blob([0, 1, 2], k, v, [1], [1], True, seq_id=-1, seq_lists=[[0], [0, 1], [2]])
    s = KVState.parse(blob)
    assert [x.tolist() for x in s.seq_ids] == [[0], [0, 1], [2]]
    assert s.to_bytes() == blob


# ----------------------------------------------------------------------------- edits
@FAST
@given(states(max_cells=5, max_layers=3).filter(lambda s: s.n_cells > 0), st.data())
def test_editing_one_value_changes_exactly_its_bytes(s, data):
    blob = s.to_bytes()
    comp = data.draw(st.sampled_from(["K", "V"]))
    il = data.draw(st.integers(0, s.n_layer - 1))
    arr = s.k[il] if comp == "K" else s.v[il]
    i = data.draw(st.integers(0, arr.shape[0] - 1))
    j = data.draw(st.integers(0, arr.shape[1] - 1))
    size = arr.dtype.itemsize
    # a value whose every byte differs from the stored one
    old = arr[i:i + 1, j].view(f"<u{size}")[0]
    new = np.array([old ^ ((1 << (8 * size)) - 1)], dtype=f"<u{size}").view(arr.dtype)[0]
    arr[i, j] = new
    out = s.to_bytes()
    assert len(out) == len(blob)
    diff = np.flatnonzero(np.frombuffer(out, np.uint8) != np.frombuffer(blob, np.uint8))
    # independent stride arithmetic: where this element lies in the blob
    block, _ = s.component_offsets()[f"L{il}.{comp}"]
    if comp == "K":
        cell, feat, width = i, j, s.n_embd_k_gqa[il]
        rel = (cell * width + feat) * size
    elif s.v_trans:
        feat, cell = i, j
        rel = (feat * s.n_cells + cell) * size
    else:
        cell, feat, width = i, j, s.n_embd_v_gqa[il]
        rel = (cell * width + feat) * size
    assert diff.tolist() == list(range(block + rel, block + rel + size))


def test_f16_edit_example_from_the_brief():
    s = make_state(6, 2, 8, v_trans=True, seed=1)
    blob = s.to_bytes()
    s.k[0][3, 5] = np.float16(1234.0) if s.k[0][3, 5] != 1234.0 else np.float16(-1.0)
    out = s.to_bytes()
    diff = np.flatnonzero(np.frombuffer(out, np.uint8) != np.frombuffer(blob, np.uint8))
    off = s.component_offsets()["L0.K"][0] + (3 * 8 + 5) * 2
    assert set(diff.tolist()) <= {off, off + 1} and len(diff) >= 1
    assert out[off:off + 2] == np.float16(s.k[0][3, 5]).tobytes()


def test_copy_is_deep_and_writable():
    s = make_state(4, 2, 4, seed=2)
    c = s.copy()
    c.k[0][0, 0] += 1
    c.v[1][0, 0] += 1
    c.positions[0] = 99
    c.seq_ids[0][0] = 5
    assert s.k[0][0, 0] != c.k[0][0, 0] and s.v[1][0, 0] != c.v[1][0, 0]
    assert s.positions[0] == 0 and s.seq_ids[0][0] == 0
    parsed = KVState.parse(s.to_bytes())
    for a in parsed.k + parsed.v:
        assert a.flags.writeable


def test_component_hashes_isolate_changes():
    s = make_state(5, 3, 4, seed=4)
    h0 = s.component_hashes()
    assert set(h0) == {f"L{i}.{c}" for i in range(3) for c in "KV"} | {"meta"}
    s.v[2][1, 1] = s.v[2][1, 1] + np.float16(1)
    h1 = s.component_hashes()
    assert [k for k in h0 if h0[k] != h1[k]] == ["L2.V"]
    s.positions[0] = 77
    h2 = s.component_hashes()
    assert [k for k in h1 if h1[k] != h2[k]] == ["meta"]
    assert len(s.sha256()) == 64


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("v_trans", [False, True])
def test_every_truncation_is_refused_with_offset(v_trans):
    blob, *_ = small_manual(v_trans)
    for cut in range(len(blob)):
        with pytest.raises(KVFormatError, match=r"truncated blob: .* at offset \d+"):
            KVState.parse(blob[:cut])


@FAST
@given(states(max_cells=5).filter(lambda s: s.n_cells > 0), st.data())
def test_random_truncation_is_refused(s, data):
    blob = s.to_bytes()
    cut = data.draw(st.integers(0, len(blob) - 1))
    with pytest.raises(KVFormatError, match="truncated"):
        KVState.parse(blob[:cut])


def test_truncation_names_the_field():
    blob, *_ = small_manual(True)
    with pytest.raises(KVFormatError, match=r"L1\.V values .* at offset \d+"):
        KVState.parse(blob[:-1])
    with pytest.raises(KVFormatError, match=r"n_stream needs 4 bytes at offset 8"):
        KVState.parse(blob[:9])


def test_trailing_bytes_are_refused():
    blob, *_ = small_manual(True)
    with pytest.raises(KVFormatError, match=rf"trailing bytes: 3 bytes .* at offset {len(blob)}"):
        KVState.parse(blob + b"\0\0\0")
    with pytest.raises(KVFormatError, match="trailing bytes"):
        KVState.parse(build_blob(0, 1) + b"\1")


def test_second_memory_part_is_an_iswa_cache_and_a_third_is_refused():
    # an iSWA cache writes two KV parts back to back: full cache, then sliding-window cache
    blob = build_blob(3, 1, 4)
    two = blob + blob[8:]
    st = KVState.parse(two)
    assert [p.kind for p in st.parts] == ["full", "swa"] and st.n_layer == 2
    assert st.to_bytes() == two
    with pytest.raises(KVFormatError, match="trailing bytes"):
        KVState.parse(two + blob[8:])


def test_wrong_magic_is_refused():
    blob = bytearray(build_blob(2, 1, 4))
    blob[0] ^= 0xFF
    with pytest.raises(KVFormatError, match="magic"):
        KVState.parse(bytes(blob))


@pytest.mark.parametrize("n_stream", [0, 2])
def test_stream_count_other_than_one_is_refused(n_stream):
    blob, *_ = small_manual(True, n_stream=n_stream)
    with pytest.raises(KVFormatError, match=f"n_stream = {n_stream} at offset 8"):
        KVState.parse(blob)


@pytest.mark.parametrize("t,name", [(2, "Q4_0"), (12, "Q4_K"), (99, "unknown")])
def test_unsupported_types_are_refused(t, name):
    s = make_state(2, 2, 4)
    blob = bytearray(s.to_bytes())
    off = s.component_offsets()["L1.K"][0] - 12
    struct.pack_into("<i", blob, off, t)
    with pytest.raises(KVFormatError, match=rf"L1\.K: ggml type {t} \({name}\) at offset {off}"):
        KVState.parse(bytes(blob))
    blob = bytearray(s.to_bytes())
    off = s.component_offsets()["L0.V"][0] - 12
    struct.pack_into("<i", blob, off, t)
    with pytest.raises(KVFormatError, match=r"L0\.V: ggml type"):
        KVState.parse(bytes(blob))


def test_inconsistent_row_size_is_refused():
    rng = np.random.default_rng(0)
    k = [rng.standard_normal((2, 3)).astype("<f2")]
    v = [rng.standard_normal((2, 3)).astype("<f2")]
    with pytest.raises(KVFormatError, match=r"L0\.K row size 5 at offset \d+ is not a positive multiple"):
        KVState.parse(manual_blob([0, 1], k, v, [1], [1], True, k_row_size=5))
    with pytest.raises(KVFormatError, match=r"L0\.K row size 0"):
        KVState.parse(manual_blob([0, 1], k, v, [1], [1], True, k_row_size=0))
    with pytest.raises(KVFormatError, match=r"L0\.V element size 4 .* does not match type F16"):
        KVState.parse(manual_blob([0, 1], k, v, [1], [1], True, v_el_size=4))
    # a row size that disagrees with the data that follows: the stream no longer ends where it should
    with pytest.raises(KVFormatError):
        KVState.parse(manual_blob([0, 1], k, v, [1], [1], True, k_row_size=8))


def test_bad_v_trans_and_layer_count_are_refused():
    s = make_state(2, 1, 4)
    blob = bytearray(s.to_bytes())
    off = 16 + 2 * 12
    struct.pack_into("<I", blob, off, 2)
    with pytest.raises(KVFormatError, match=f"v_trans = 2 at offset {off}"):
        KVState.parse(bytes(blob))
    struct.pack_into("<II", blob, off, 1, 10**6)
    with pytest.raises(KVFormatError, match=r"truncated blob: n_layer 1000000"):
        KVState.parse(bytes(blob))


def test_cell_extension_records_are_refused():
    rng = np.random.default_rng(0)
    k = [rng.standard_normal((2, 4)).astype("<f2")]
    v = [rng.standard_normal((2, 4)).astype("<f2")]
    with pytest.raises(KVFormatError, match="extension records"):
        KVState.parse(manual_blob([0, 1], k, v, [1], [1], True, ext=True))


def test_foreign_or_multiple_sequence_ids_in_a_sequence_blob_are_refused():
    rng = np.random.default_rng(0)
    k = [rng.standard_normal((2, 2)).astype("<f2")]
    v = [rng.standard_normal((2, 2)).astype("<f2")]
    with pytest.raises(KVFormatError, match="cell 1 lists sequence id 3, but the blob header is for sequence 0"):
        KVState.parse(manual_blob([0, 1], k, v, [1], [1], True, seq_id=0, seq_lists=[[0], [3]]))
    with pytest.raises(KVFormatError, match="n_seq_id 2"):
        KVState.parse(manual_blob([0, 1], k, v, [1], [1], True, seq_id=0, seq_lists=[[0], [0, 1]]))
    with pytest.raises(KVFormatError, match="0 sequence ids"):
        KVState.parse(manual_blob([0, 1], k, v, [1], [1], True, seq_id=-1, seq_lists=[[0], []]))


def test_huge_cell_count_is_refused_before_allocating():
    blob = struct.pack("<IiII", SEQ_STATE_MAGIC, 0, 1, 2**31) + b"\0" * 40
    with pytest.raises(KVFormatError, match=r"truncated blob: cell_count 2147483648 at offset 12"):
        KVState.parse(blob)


def test_to_bytes_refuses_inconsistent_arrays():
    s = make_state(3, 2, 4)
    s.k[1] = s.k[1].astype(np.float32)  # type says F16
    with pytest.raises(KVFormatError, match=r"L1\.K: array float32"):
        s.to_bytes()
    s = make_state(3, 2, 4, v_trans=True)
    s.v[0] = s.v[0].T.copy()  # cell-major, but the state is transposed
    with pytest.raises(KVFormatError, match=r"L0\.V"):
        s.to_bytes()


# ----------------------------------------------------------------------------- compare
def test_compare_identical_states():
    s = make_state(5, 3, 4, seed=5)
    d = compare(s, s.copy())
    assert d.identical and d.values_identical and d.positions_equal
    assert d.first_differing_layer is None
    assert d.changed_bytes == 0 and d.max_abs == 0.0 and d.l2 == 0.0 and d.l2_rel == 0.0
    assert len(d.records()) == 6
    assert [(r["layer"], r["component"]) for r in d.records()][:3] == [(0, "K"), (0, "V"), (1, "K")]


def test_compare_one_changed_value():
    a = make_state(5, 3, 4, k_type=GGML_F32, v_type=GGML_F16, seed=6)
    b = a.copy()
    b.v[2][1, 3] = np.float16(a.v[2][1, 3]) + np.float16(0.5)
    b.k[1][0, 0] = np.float32(a.k[1][0, 0]) - np.float32(0.25)
    d = compare(a, b)
    assert not d.identical and not d.values_identical and d.positions_equal
    assert d.first_differing_layer == 1
    v = d["L2.V"]
    dv = float(np.float64(a.v[2][1, 3]) - np.float64(b.v[2][1, 3]))
    assert v.changed_values == 1 and 1 <= v.changed_bytes <= 2
    assert v.max_abs == abs(dv) and v.l2 == abs(dv)
    ref = np.sqrt(np.sum(a.v[2].astype(np.float64) ** 2))
    assert v.ref_l2 == pytest.approx(ref, rel=1e-12) and v.l2_rel == pytest.approx(abs(dv) / ref, rel=1e-12)
    k = d["L1.K"]
    dk = float(np.float64(a.k[1][0, 0]) - np.float64(b.k[1][0, 0]))
    assert k.changed_values == 1 and k.max_abs == abs(dk)
    assert d["L0.K"].changed_bytes == 0 and d["L0.V"].changed_bytes == 0
    assert d.changed_values == 2
    assert d.max_abs == max(abs(dv), abs(dk))
    assert d.l2 == pytest.approx(np.hypot(dv, dk), rel=1e-12)
    whole = np.sqrt(sum(np.sum(x.astype(np.float64) ** 2) for x in a.k + a.v))
    assert d.l2_rel == pytest.approx(np.hypot(dv, dk) / whole, rel=1e-12)


def test_compare_reference_and_positions():
    a = make_state(4, 2, 4, seed=8)
    b = a.copy()
    b.k[0] *= np.float16(2)
    ref = make_state(4, 2, 4, fill="zeros")
    d = compare(a, b, reference=ref)
    assert d["L0.K"].ref_l2 == 0.0 and d["L0.K"].l2_rel == float("inf")
    assert d["L1.K"].l2_rel == 0.0
    c = a.copy()
    c.positions[2] = 50
    d = compare(a, c)
    assert d.values_identical and not d.positions_equal and not d.identical


def test_compare_counts_bit_changes_not_numeric_ones():
    a = make_state(2, 1, 2, fill="zeros")
    b = a.copy()
    b.k[0][0, 0] = -0.0
    d = compare(a, b)
    assert d["L0.K"].changed_values == 1 and d["L0.K"].changed_bytes == 1 and d.max_abs == 0.0


@pytest.mark.parametrize(
    "other,field",
    [
        (dict(n_cells=5, n_layer=2), "n_cells"),
        (dict(n_cells=4, n_layer=3), "n_layer"),
        (dict(n_cells=4, n_layer=2, v_trans=False), "v_trans"),
        (dict(n_cells=4, n_layer=2, k_type=GGML_F32), "k_types"),
        (dict(n_cells=4, n_layer=2, n_embd_k=[4, 6]), "n_embd_k_gqa"),
    ],
)
def test_compare_refuses_different_geometry(other, field):
    a = make_state(4, 2, 4, v_trans=True)
    kw = dict(n_embd_k=4, v_trans=True) | other
    b = make_state(**kw)
    with pytest.raises(KVFormatError, match=field):
        compare(a, b)
    with pytest.raises(KVFormatError, match=field):
        compare(a, a, reference=b)


# ----------------------------------------------------------------------------- KV types and iSWA parts
from statelab.kvstate import (  # noqa: E402
    GGML_BF16,
    GGML_Q8_0,
    MemoryLayout,
    PartLayout,
    make_iswa_state,
    values_f64,
)


@pytest.mark.parametrize("k_type,v_type,v_trans", [(GGML_BF16, GGML_BF16, True), (GGML_Q8_0, GGML_F16, True),
                                                   (GGML_Q8_0, GGML_Q8_0, False), (GGML_F32, GGML_BF16, False)])
def test_bf16_and_q8_0_rows_round_trip(k_type, v_type, v_trans):
    s = make_state(5, 2, 64, k_type=k_type, v_type=v_type, v_trans=v_trans, seed=3)
    blob = s.to_bytes()
    back = KVState.parse(blob)
    assert back.to_bytes() == blob
    assert back.k_types == [k_type] * 2 and back.v_types == [v_type] * 2
    assert back.n_embd_k_gqa == [64, 64] and back.n_embd_v_gqa == [64, 64]
    if k_type == GGML_Q8_0:  # a quantised row is stored whole: 2 blocks of 34 bytes per cell
        assert back.k[0].shape == (5, 68) and back.k_row_sizes == [68, 68]


def test_q8_0_values_dequantise_and_compare_counts_block_values():
    s = make_state(3, 1, 64, k_type=GGML_Q8_0, v_type=GGML_F16, seed=1)
    vals = values_f64(s.k[0], GGML_Q8_0)
    assert vals.shape == (3, 64)
    t = s.copy()
    t.k[0][1, 2] ^= 1  # one quant of cell 1, block 0
    d = compare(s, t)
    assert d["L0.K"].changed_bytes == 1 and d["L0.K"].changed_values == 1
    t.k[0][2, 0] ^= 0x40  # a block scale: every nonzero value of that block changes
    nonzero = int(np.count_nonzero(s.k[0][2, 2:34].view(np.int8)))
    assert compare(s, t)["L0.K"].changed_values == 1 + nonzero and nonzero > 20


def test_bf16_values_widen_exactly():
    s = make_state(2, 1, 4, k_type=GGML_BF16, fill="index")
    assert np.array_equal(values_f64(s.k[0], GGML_BF16), np.arange(8).reshape(2, 4))


def test_quantised_transposed_v_is_refused():
    s = make_state(2, 1, 32, k_type=GGML_F16, v_type=GGML_F16, v_trans=True)
    blob = bytearray(s.to_bytes())
    off = s.component_offsets()["L0.V"][0] - 12
    struct.pack_into("<i", blob, off, GGML_Q8_0)
    with pytest.raises(KVFormatError, match="transposed V of quantised type Q8_0"):
        KVState.parse(bytes(blob))


def test_iswa_state_parts_layers_and_round_trip():
    s = make_iswa_state(10, 6, swa_layers=[0, 1, 3, 4], n_swa=4, n_embd=8)
    assert [p.kind for p in s.parts] == ["full", "swa"]
    assert s.parts[0].n_cells == 10 and list(s.parts[1].positions) == [6, 7, 8, 9]
    assert s.layer_ids == (2, 5, 0, 1, 3, 4) and s.layer_kinds == ["full"] * 2 + ["swa"] * 4
    assert s.parts[1].n_swa == 4
    blob = s.to_bytes()
    assert KVState.parse(blob).to_bytes() == blob
    names = list(s.component_offsets())
    assert names[:2] == ["L2.K", "L5.K"] and "L0.K" in names
    # without the layout the layers are named by part and index
    bare = KVState.parse(blob)
    assert bare.layer_ids is None and bare.component_name(2, "V") == "swa.L0.V"
    # the layout is checked against the blob
    wrong = MemoryLayout("iswa", (PartLayout("full", (2,)), PartLayout("swa", (0, 1, 3, 4, 5), 4, 1)), 6, "other")
    with pytest.raises(KVFormatError, match="stores 2 layers, but model other has 1 full layers"):
        KVState.parse(blob, wrong)
    one = MemoryLayout("kv", (PartLayout("kv", tuple(range(6))),), 6, "smol")
    with pytest.raises(KVFormatError, match="trailing bytes"):
        KVState.parse(blob, one)


def test_iswa_edit_changes_only_its_part_and_compare_names_model_layers():
    s = make_iswa_state(6, 6, swa_layers=[0, 1, 2, 3, 4], n_swa=3)
    t = s.copy()
    t.k[1][0, 0] += 1  # stored layer 1 = model layer 0 (first sliding-window layer)
    d = compare(s, t)
    assert d.first_differing_layer == 0 and d["L0.K"].changed_values == 1
    assert sum(c.changed_values for c in d.components.values()) == 1
    assert KVState.parse(t.to_bytes()).to_bytes() == t.to_bytes()


@pytest.mark.parametrize("kind", ["recurrent", "hybrid"])
def test_recurrent_and_hybrid_memories_are_refused_by_name(kind):
    layout = MemoryLayout(kind, (), 4, "Mamba Test")
    with pytest.raises(KVFormatError, match=f"model Mamba Test keeps a {kind} memory"):
        KVState.parse(build_blob(2, 1, 4), layout)


def test_second_part_that_is_not_a_kv_cache_is_trailing_bytes():
    blob = build_blob(2, 1, 4)
    # a recurrent part writes n_seq_id 0 per cell (after a cell count of its own)
    rec = struct.pack("<II", 1, 2) + struct.pack("<iI", 0, 0) * 2
    with pytest.raises(KVFormatError, match="not a second \\(sliding-window\\) KV cache"):
        KVState.parse(blob + rec)
