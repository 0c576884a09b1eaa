"""Layout oracles: integer address oracle, injected faults, FP64/F32 oracles, ULP distance."""
from __future__ import annotations

import numpy as np
import pytest

from statelab.audit import oracles as O
from statelab.audit.oracles import (
    FAULTS,
    OBLIGATIONS,
    Fixture,
    MQLayout,
    PQLayout,
    QBLayout,
    audit_markdown,
    check_qb_addressing,
    evaluate_layout,
    fixtures,
    make_data,
    reference_attention,
    run_layout_audit,
    ulp_distance,
)

QUICK = fixtures(quick=True)
LAYOUTS = (MQLayout(), PQLayout(), QBLayout())
FAULT_BY_NAME = {f.name: f for f in FAULTS}


# --------------------------------------------------------------------------- fixtures and descriptors


def test_fixture_product_covers_every_factor():
    full = fixtures()
    assert len(full) == 4 * 6 * 4 * 2 * 2 * 3 == 1152
    assert len({fx.name for fx in full}) == len(full)
    assert {fx.q for fx in full} == {1, 2, 3, 4}
    assert {fx.n_kv for fx in full} == {127, 128, 129, 255, 256, 257}
    assert {(fx.h_q, fx.h_kv) for fx in full} == {(8, 8), (8, 1), (32, 8), (9, 3)}
    assert {fx.d for fx in full} == {64, 128}
    assert {fx.q_storage for fx in full} == {"compact", "offset"}
    assert {fx.mask_kind for fx in full} == {"causal", "causal_padded", "sparse"}
    assert len(QUICK) == 96 and set(QUICK) <= set(full)


def test_ggml_permute_and_contiguity_semantics():
    t = O.TensorDesc("x", (2, 3, 5, 1), (4, 8, 24, 120), 0, 4)
    p = t.permute(0, 2, 1, 3)  # source axis 1 -> position 2, axis 2 -> position 1
    assert p.ne == (2, 5, 3, 1) and p.nb == (4, 24, 8, 120)
    assert t.is_contiguous() and not p.is_contiguous()
    # extent-1 axes are skipped, as in ggml_is_contiguous
    assert O.TensorDesc("m", (7, 1, 1, 3), (4, 999, 999, 28), 0, 4).is_contiguous()


@pytest.mark.parametrize("storage", ["compact", "offset"])
def test_qb_views_follow_the_paper(storage):
    fx = Fixture(3, 129, 32, 8, 128, storage, "causal_padded")
    nat = fx.native()
    # native q after build_attn_mha's permute: (d, q, h_Q, 1), column stride = Qcur row stride
    assert nat.q.ne == (128, 3, 32, 1)
    row = 4 * 128 * 32 if storage == "compact" else 4 * 128 * (32 + 2 * 8)
    assert nat.q.nb[:3] == (4, row, 4 * 128)
    assert (nat.q.offset == 0) == (storage == "compact")
    (call,) = QBLayout().calls(nat, fx)
    assert call.q.ne == (128, 1, 32, 3)
    assert call.q.nb[3] == nat.q.nb[1] and call.q.nb[2] == nat.q.nb[2] and call.q.offset == nat.q.offset
    # mask (n_kv, q_pad, 1, 1) -> (n_kv, 1, 1, q) with nb[3] = m1; still ggml-contiguous
    assert nat.mask.ne == (129, 8, 1, 1)
    assert call.mask.ne == (129, 1, 1, 3) and call.mask.nb[3] == nat.mask.nb[1] == 4 * 129
    assert call.mask.is_contiguous()
    # K/V shared: fourth extent 1, so ggml's r3 = q broadcasts them over the query batch
    assert call.k is nat.k and call.v is nat.v and call.k.ne[3] == 1


def test_ggml_broadcast_rule_gives_contiguous_groups_on_qb_shapes():
    fx = Fixture(4, 128, 9, 3, 64)
    (call,) = QBLayout().calls(fx.native(), fx)
    i02, i03 = O._kv_head_index(call, call.k, 9, 4)
    assert np.array_equal(np.broadcast_to(i02, (9, 4))[:, 0], [0, 0, 0, 1, 1, 1, 2, 2, 2])
    assert not np.broadcast_to(i03, (9, 4)).any()
    tiled = O._kv_head_index(FAULT_BY_NAME["gqa_modulo"].layout.calls(fx.native(), fx)[0], call.k, 9, 4)[0]
    assert np.array_equal(tiled[:, 0], [0, 1, 2, 0, 1, 2, 0, 1, 2])


# --------------------------------------------------------------------------- address oracle


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.name)
def test_address_oracle_passes_on_quick_fixtures(layout):
    for fx in QUICK:
        rep = check_qb_addressing(fx, layout)
        assert rep.passed, str(rep)
        assert rep.checked == OBLIGATIONS


def test_qb_address_oracle_passes_on_the_full_product():
    failures = [str(r) for r in (check_qb_addressing(fx) for fx in fixtures()) if not r.passed]
    assert failures == []


def _fires(fault_name, fx):
    return FAULT_BY_NAME[fault_name].obligation in check_qb_addressing(fx, FAULT_BY_NAME[fault_name].layout).violated


@pytest.mark.parametrize(
    "fault_name, observable",
    [
        ("fourth_axis_stride_nb2", lambda fx: fx.q > 1),
        ("shared_mask_column", lambda fx: fx.q > 1),
        ("permuted_output", lambda fx: fx.q > 1),
        ("kv_not_shared", lambda fx: fx.q > 1),
        # a % h_KV == a // group for every a only when h_KV == h_Q or h_KV == 1
        ("gqa_modulo", lambda fx: fx.h_kv not in (1, fx.h_q)),
        ("q_offset_plus_one_element", lambda fx: True),
        ("misaligned_q_offset", lambda fx: True),
    ],
)
def test_each_fault_fires_its_obligation_exactly_where_observable(fault_name, observable):
    fired = {fx.name for fx in QUICK if _fires(fault_name, fx)}
    expected = {fx.name for fx in QUICK if observable(fx)}
    assert fired == expected and fired


def test_fault_reports_name_first_offending_coordinate():
    fx = Fixture(3, 129, 32, 8, 128, "offset", "sparse")
    nat = fx.native()
    rep = check_qb_addressing(fx, FAULT_BY_NAME["shared_mask_column"].layout)
    v = next(v for v in rep.violations if v.obligation == "mask_address")
    assert (v.coordinate["t"], v.coordinate["j"]) == (0, 1)  # query 1 reads query 0's column
    assert str(nat.mask.nb[1]) in v.detail
    rep = check_qb_addressing(fx, FAULT_BY_NAME["fourth_axis_stride_nb2"].layout)
    v = next(v for v in rep.violations if v.obligation == "q_address")
    assert (v.coordinate["c"], v.coordinate["j"], v.coordinate["a"]) == (0, 1, 0)
    assert {"q_address", "q_injective"} <= rep.violated  # query 1 aliases head 1 of query 0
    rep = check_qb_addressing(fx, FAULT_BY_NAME["gqa_modulo"].layout)
    v = next(v for v in rep.violations if v.obligation == "gqa_head_map")
    assert v.coordinate["a"] == 1 and v.detail.endswith("reads KV head 1, expected 0")
    rep = check_qb_addressing(fx, FAULT_BY_NAME["permuted_output"].layout)
    assert rep.violated == {"output_order"}
    # an off-by-one offset of compact Q also leaves the allocated span
    rep = check_qb_addressing(Fixture(2, 128, 8, 8, 64, "compact"), FAULT_BY_NAME["q_offset_plus_one_element"].layout)
    assert {"q_address", "view_bounds"} <= rep.violated


def test_pq_and_mq_faults_are_also_caught():
    fx = Fixture(2, 127, 32, 8, 64)
    assert "gqa_head_map" in check_qb_addressing(fx, PQLayout(kv_head_map="repeat")).violated
    assert "output_order" in check_qb_addressing(fx, MQLayout(out_perm=(0, 1, 2, 3))).violated


# --------------------------------------------------------------------------- numeric oracles


SAMPLE = [Fixture(3, 129, 32, 8, 128, "offset", "sparse"), Fixture(4, 257, 9, 3, 64, "compact", "causal_padded"),
          Fixture(2, 127, 8, 1, 64, "offset", "causal"), Fixture(1, 256, 8, 8, 128, "compact", "sparse")]


@pytest.mark.parametrize("fx", SAMPLE, ids=lambda fx: fx.name)
def test_fp64_oracle_reads_identical_values_through_every_layout(fx):
    for pattern in ("random", "dyadic"):
        data = make_data(fx, pattern)
        ref = reference_attention(data)
        for lay in LAYOUTS:
            out = evaluate_layout(data, lay)
            for stage in O.STAGES:
                assert np.array_equal(out["fp64"][stage], ref[stage]), (lay.name, stage)
                assert np.isfinite(out["f32"][stage]).all()


def test_reference_matches_an_independent_per_head_loop():
    fx = Fixture(2, 129, 9, 3, 64, "offset", "sparse")
    data = make_data(fx, "random")
    ref = reference_attention(data)
    scale = np.float64(np.float32(data.scale))
    for j in range(fx.q):
        for a in range(fx.h_q):
            h = a // fx.group
            k = data.k[:, :, h].astype(np.float64)  # (d, n)
            s = k.T @ data.q[:, j, a].astype(np.float64)
            w = s * scale + data.mask[:, j]
            p = np.exp(w - w.max())
            p /= p.sum()
            o = data.v[:, :, h].astype(np.float64).T @ p
            np.testing.assert_allclose(ref["qk"][:, j, a], s, rtol=0, atol=1e-12)
            np.testing.assert_allclose(ref["softmax"][:, j, a], p, rtol=0, atol=1e-15)
            np.testing.assert_allclose(ref["output"][(j * fx.h_q + a) * fx.d_v:][: fx.d_v], o, rtol=0, atol=1e-12)


@pytest.mark.parametrize("fx", QUICK[::7], ids=lambda fx: fx.name)
def test_structured_cases_meet_exact_expectations(fx):
    for pattern in ("onehot", "single_key"):
        data = make_data(fx, pattern)
        assert set(data.expected) >= {"softmax", "av", "output"}
        for lay in LAYOUTS:
            out = evaluate_layout(data, lay)
            for prec in O.PRECISIONS:
                for stage, exp in data.expected.items():
                    assert np.array_equal(out[prec][stage], exp), (pattern, lay.name, prec, stage)


def test_exact_expectations_are_stated_independently():
    fx = Fixture(3, 128, 32, 8, 64, "compact", "causal")
    data = make_data(fx, "single_key")
    keys = [5, 34, 63]
    for j, s in enumerate(keys):
        assert np.flatnonzero(np.isfinite(data.mask[:, j])).tolist() == [s]
        for a in (0, 3, 4, 31):
            np.testing.assert_array_equal(data.expected["av"][:, j, a], data.v[s, :, a // 4].astype(np.float64))
            start = (j * fx.h_q + a) * fx.d_v
            np.testing.assert_array_equal(data.expected["output"][start:start + fx.d_v], data.v[s, :, a // 4])
    data = make_data(fx, "onehot")
    for j in range(fx.q):
        for a in (0, 5, 31):
            c = (j * fx.h_q + a) % fx.d
            assert np.flatnonzero(data.q[:, j, a]).tolist() == [c]
            t = int(np.argmax(data.expected["softmax"][:, j, a]))
            assert data.k[c, t, a // 4] == O.ONEHOT_KEY_VALUE and data.expected["softmax"][:, j, a].sum() == 1.0
            np.testing.assert_array_equal(data.expected["av"][:, j, a], data.v[t, :, a // 4])


def test_faults_break_the_exact_cases():
    fx = Fixture(3, 129, 32, 8, 64, "offset", "sparse")
    single = make_data(fx, "single_key")
    onehot = make_data(fx, "onehot")

    def exact(data, lay):
        out = evaluate_layout(data, lay)["fp64"]
        return all(np.array_equal(out[s], e) for s, e in data.expected.items())

    assert not exact(single, FAULT_BY_NAME["shared_mask_column"].layout)
    assert not exact(onehot, FAULT_BY_NAME["gqa_modulo"].layout)
    assert not exact(onehot, FAULT_BY_NAME["fourth_axis_stride_nb2"].layout)
    assert not exact(onehot, FAULT_BY_NAME["permuted_output"].layout)
    # reading the spare NaN cache cells is visible as a non-finite result
    out = evaluate_layout(single, FAULT_BY_NAME["kv_not_shared"].layout)
    assert not np.isfinite(out["fp64"]["qk"]).all()


def test_dyadic_qk_is_exact_in_float32():
    fx = Fixture(4, 257, 32, 8, 128, "offset", "causal")
    data = make_data(fx, "dyadic")
    ref = reference_attention(data)
    for lay in LAYOUTS:
        assert np.array_equal(evaluate_layout(data, lay)["f32"]["qk"], ref["qk"])


# --------------------------------------------------------------------------- audit dataset


def test_quick_audit_dataset_and_markdown():
    ds, passed = run_layout_audit(quick=True)
    assert passed and ds.attrs["passed"] == 1 and ds.attrs["quick"] == 1
    assert ds.sizes["fixture"] == 96 and ds.sizes["obligation"] == len(OBLIGATIONS)
    assert list(ds["layout"].values) == ["MQ", "PQ", "QB"]
    assert list(ds["pattern"].values) == list(O.PATTERNS) and list(ds["stage"].values) == list(O.STAGES)
    assert bool(ds["obligation_ok"].all())
    detected = ds["fault_expected_fired"].sum("fixture")
    assert bool((detected > 0).all())
    q_dependent = int((ds["q"] > 1).sum())
    assert int(detected.sel(fault="shared_mask_column")) == q_dependent == 48
    assert int(detected.sel(fault="misaligned_q_offset")) == 96
    assert bool(ds["exact_ok"].all()) and bool(ds["finite"].all())
    fp64 = ds["maxdiff_vs_reference"].sel(precision="fp64")
    assert float(fp64.max()) == 0.0  # identical values read through every layout
    assert float(ds["maxdiff_vs_reference"].sel(precision="f32", pattern="dyadic", stage="qk").max()) == 0.0
    f32 = ds["maxdiff_vs_reference"].sel(precision="f32", pattern="random", stage="av")
    assert float(f32.max()) > 0.0  # reported, not thresholded
    md = audit_markdown(ds)
    assert "Fixtures checked: **96**" in md and "**PASS**" in md
    for f in FAULTS:
        assert f"| {f.name} | {f.obligation} |" in md


def test_audit_fails_when_a_fault_is_passed_off_as_a_layout():
    ds, passed = run_layout_audit(fixture_list=[Fixture(2, 128, 32, 8, 64)], patterns=("single_key",),
                                  layouts=(MQLayout(), QBLayout(mask_columns="shared")))
    assert not passed
    assert not bool(ds["obligation_ok"].sel(layout="QB[mask_columns=shared]", obligation="mask_address"))
    assert not bool(ds["exact_ok"].sel(layout="QB[mask_columns=shared]").any())


# --------------------------------------------------------------------------- ULP distance


@pytest.mark.parametrize("dt", [np.float32, np.float16])
def test_ulp_adjacent_zero_and_sign_crossing(dt):
    one = dt(1.0)
    assert ulp_distance(one, np.nextafter(one, dt(2))) == 1
    assert ulp_distance(np.nextafter(one, dt(0)), one) == 1
    assert ulp_distance(dt(0.0), dt(-0.0)) == 0
    tiny = np.nextafter(dt(0), dt(1))  # smallest positive subnormal
    assert ulp_distance(tiny, -tiny) == 2  # through +-0, counted once
    assert ulp_distance(-tiny, dt(0.0)) == 1
    bits = int(np.array(one).view(np.int32 if dt is np.float32 else np.int16))
    assert ulp_distance(-one, one) == 2 * bits
    big = np.finfo(dt).max
    assert ulp_distance(big, dt(np.inf)) == 1


def test_ulp_arrays_broadcast_and_symmetric():
    a = np.array([1.0, -2.0, 3.5], dtype=np.float32)
    b = np.nextafter(a, np.float32(np.inf))
    d = ulp_distance(a, b)
    assert d.dtype == np.int64 and d.tolist() == [1, 1, 1]
    assert ulp_distance(b, a).tolist() == [1, 1, 1]
    assert ulp_distance(a, np.float32(1.0)).shape == (3,)
    step = np.nextafter(np.float32(2.0), np.float32(3.0)) - np.float32(2.0)
    assert ulp_distance(np.float32(2.0), np.float32(2.0) + 5 * step) == 5


def test_ulp_nan_and_dtype_handling():
    a = np.array([1.0, np.nan], dtype=np.float32)
    with pytest.raises(ValueError):
        ulp_distance(a, a)
    assert ulp_distance(a, a, nan="sentinel").tolist() == [0, O.ULP_NAN]
    with pytest.raises(TypeError):
        ulp_distance(np.float32(1), np.float16(1))
    with pytest.raises(TypeError):
        ulp_distance(np.float64(1), np.float64(1))
