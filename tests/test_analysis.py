"""Endpoint classes, lattices, separability, minimal selections and bootstrap intervals on
synthetic inputs with hand-computed answers."""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import xarray as xr

from statelab.analysis.classes import (
    Evaluation, bootstrap_ratio_interval, class_matrix_markdown, endpoint_class, first_difference,
    magnitude_separability, minimal_sufficient_selection, non_monotone_pairs, repeat_agreement,
    selector_lattice, trajectory_classes,
)

# --------------------------------------------------------------------------------------
# endpoints


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference(np.array([1, 2], np.int32), [1, 2, 3]) == 2
    assert first_difference([1, 2, 3], [1, 2]) == 2
    assert first_difference([1, 5, 3], [1, 2, 3]) == 1
    assert first_difference([], [4]) == 0
    assert first_difference([], []) is None


def ep(tokens, eog=True):
    return SimpleNamespace(tokens=np.array(tokens, dtype=np.int32), eog=eog, stop_reason="eog" if eog else "cap")


def test_endpoint_classes():
    donor, recipient = ep([1, 2, 3]), ep([1, 2, 4])
    assert endpoint_class(ep([1, 2, 3]), donor, recipient) == "B"
    assert endpoint_class(ep([1, 2, 4]), donor, recipient) == "D"
    assert endpoint_class(ep([1, 2, 5]), donor, recipient) == "C"
    # same tokens, different EOG flag: a third trajectory
    assert endpoint_class(ep([1, 2, 3], eog=False), donor, recipient) == "C"
    # donor and recipient coincide: a match keeps the recipient endpoint (D), not B
    assert endpoint_class(ep([1, 2, 4]), ep([1, 2, 4]), recipient) == "D"
    assert endpoint_class(ep([7]), ep([1, 2, 4]), recipient) == "C"
    # other accepted forms: (tokens, eog) tuples and mappings
    assert endpoint_class(([1, 2, 3], True), {"tokens": [1, 2, 3], "eog": True}, ([1, 2, 4], True)) == "B"


def test_trajectory_classes():
    endpoints = {"sweep_132+1": [1, 9], "C": np.array([1, 2, 3], np.int32), "B": [1, 2, 4], "A": [1, 2, 3]}
    assert trajectory_classes(endpoints) == [["A", "C"], ["B"], ["sweep_132+1"]]
    # identical state hashes
    assert trajectory_classes({"s3": "aa11", "s1": "bb22", "s2": "aa11"}) == [["s1"], ["s2", "s3"]]
    # the EOG flag is part of the endpoint
    assert trajectory_classes({"x": ep([5]), "y": ep([5], eog=False), "z": ep([5])}) == [["x", "z"], ["y"]]
    assert trajectory_classes({}) == []


# --------------------------------------------------------------------------------------
# repeat agreement and the class matrix


def class_dataset():
    klass = {
        ("/831", "L0_K"): [["B", "B"], ["D", "D"]],
        ("/831", "L0_V"): [["C", "C"], ["B", "C"]],
        ("/831", "ALL"): [["B", ""], ["", ""]],
        ("/1248", "L0_K"): [["", ""], ["", ""]],
        ("/1248", "L0_V"): [["D", "D"], ["B", "B"]],
        ("/1248", "ALL"): [["B", "B"], ["B", "B"]],
    }
    tasks, selectors = ["/831", "/1248"], ["L0_K", "L0_V", "ALL"]
    values = np.array([[klass[(t, s)] for s in selectors] for t in tasks], dtype="<U1")
    return xr.Dataset({"klass": (("task", "selector", "direction", "repeat"), values)},
                      coords={"task": tasks, "selector": selectors, "direction": ["A->B", "B->A"], "repeat": [0, 1]})


def test_repeat_agreement():
    res = repeat_agreement(class_dataset())
    assert res.agree.dims == ("task", "selector", "direction")
    np.testing.assert_array_equal(res.agree.sel(task="/831").values,
                                  [[True, True], [True, False], [False, False]])
    assert (res.n_coordinates, res.n_agree, res.n_disagree, res.n_incomplete) == (9, 7, 1, 1)
    assert res.disagreements == (
        {"task": "/831", "selector": "L0_V", "direction": "B->A", "classes": ("B", "C")},
        {"task": "/831", "selector": "ALL", "direction": "A->B", "classes": ("B", "")},
    )


def test_class_matrix_markdown():
    expected = (
        "| task | selector | A->B | B->A |\n"
        "|---|---|---|---|\n"
        "| /831 | L0_K | B | D |\n"
        "| /831 | L0_V | C | B/C |\n"
        "| /831 | ALL | B/? | — |\n"
        "| /1248 | L0_V | D | B |\n"
        "| /1248 | ALL | B | B |\n"
        "\n"
        "Requests: B 10, C 3, D 4. Repeats agree at 7 of 9 coordinates; disagree at 1; incomplete at 1.\n"
    )
    assert class_matrix_markdown(class_dataset()) == expected


# --------------------------------------------------------------------------------------
# selector lattice


def lattice_masks(layers=4, positions=6):
    shape = (layers, 2, positions)  # layer, component (K, V), position

    def mask(fn):
        m = np.zeros(shape, dtype=bool)
        fn(m)
        return m.ravel()

    return {
        "EMPTY": mask(lambda m: None),
        "L0_K": mask(lambda m: m.__setitem__((0, 0), True)),
        "L0_V": mask(lambda m: m.__setitem__((0, 1), True)),
        "L0_V_PREFIX": mask(lambda m: m.__setitem__((0, 1, slice(0, 3)), True)),
        "L0": mask(lambda m: m.__setitem__(0, True)),
        "V_ALL": mask(lambda m: m.__setitem__((slice(None), 1), True)),
        "PREFIX": mask(lambda m: m.__setitem__((slice(None), slice(None), slice(0, 3)), True)),
        "ALL": mask(lambda m: m.fill(True)),
    }


def test_selector_lattice_is_the_covering_dag():
    g = selector_lattice(lattice_masks())
    assert sorted(g.edges) == sorted([
        ("EMPTY", "L0_K"), ("EMPTY", "L0_V_PREFIX"), ("L0_V_PREFIX", "L0_V"), ("L0_V_PREFIX", "PREFIX"),
        ("L0_K", "L0"), ("L0_V", "L0"), ("L0_V", "V_ALL"), ("L0", "ALL"), ("V_ALL", "ALL"), ("PREFIX", "ALL"),
    ])
    assert g.nodes["L0_V"]["n_selected"] == 6 and g.nodes["ALL"]["n_selected"] == 48
    assert g.nodes["PREFIX"]["n_selected"] == 24 and g.graph["equal"] == []


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 9), st.integers(0, 70), st.data())
def test_lattice_inclusion_is_the_elementwise_definition(n, size, data):
    """The packed-column inclusion test equals 'every selected byte of i is selected in j'
    on masks of runs and of scattered bytes (equal masks, empty ones and sizes not a multiple
    of 8 included)."""
    from statelab.analysis.classes import _subsets

    masks = []
    for _ in range(n):
        if data.draw(st.booleans()):  # a run, as selectors make
            a = data.draw(st.integers(0, size))
            b = data.draw(st.integers(a, size))
            m = np.zeros(size, bool)
            m[a:b] = True
        else:
            m = np.array(data.draw(st.lists(st.booleans(), min_size=size, max_size=size)), bool)
        masks.append(m)
    if data.draw(st.booleans()) and n > 1:
        masks[-1] = masks[0].copy()
    want = np.array([[not np.any(x & ~y) for y in masks] for x in masks])
    packed = np.stack([np.packbits(m) for m in masks])
    assert (_subsets(packed) == want).all()


def test_non_monotone_sufficiency_like_the_paper():
    # /1248 style: V-only layer 0 reproduces the donor, K+V at layer 0 does not, and V at
    # every layer does not either; the complete ALL import does.
    outcomes = {"EMPTY": "D", "L0_K": "D", "L0_V": "B", "L0_V_PREFIX": "B", "L0": "D", "V_ALL": "C",
                "PREFIX": "D", "ALL": "B"}
    pairs = non_monotone_pairs(selector_lattice(lattice_masks()), outcomes)
    assert pairs == [("L0_V", "L0"), ("L0_V", "V_ALL"),
                     ("L0_V_PREFIX", "L0"),  # not a covering edge: any strict superset counts
                     ("L0_V_PREFIX", "PREFIX"), ("L0_V_PREFIX", "V_ALL")]
    # monotone outcomes give no pair; selections without an outcome are skipped
    assert non_monotone_pairs(selector_lattice(lattice_masks()), {"L0_V": "B", "ALL": "B"}) == []


def test_lattice_equal_masks_and_bad_masks():
    masks = lattice_masks()
    masks["LAYER0"] = masks["L0"].copy()
    g = selector_lattice(masks)
    assert g.graph["equal"] == [("L0", "LAYER0")]
    assert not g.has_edge("L0", "LAYER0") and not g.has_edge("LAYER0", "L0")
    assert g.has_edge("LAYER0", "ALL") and g.has_edge("L0_K", "LAYER0")
    with pytest.raises(ValueError, match="different storage sizes"):
        selector_lattice({"a": np.zeros(4, bool), "b": np.zeros(5, bool)})
    with pytest.raises(TypeError, match="must be boolean"):
        selector_lattice({"a": np.zeros(4, np.uint8)})


# --------------------------------------------------------------------------------------
# magnitude separability


def test_magnitude_counterexample_like_table_s12():
    magnitudes = {"/831": 0.25, "/1248": 1.5, "/1011": 0.5, "/1249": 0.125}
    diverges = {"/831": True, "/1248": True, "/1011": False, "/1249": False}
    res = magnitude_separability(magnitudes, diverges, orientations=("diverging_above", "diverging_below"))
    assert not res.separable
    above = res["diverging_above"]
    assert not above.separable and above.threshold is None
    assert above.counterexample == ("/1011", "/831")  # stable 0.5 above diverging 0.25
    assert above.violations == (("/1011", "/831"),)
    below = res["diverging_below"]
    assert below.counterexample == ("/1249", "/1248")
    assert below.violations == (("/1011", "/1248"), ("/1249", "/1248"), ("/1249", "/831"))
    # default: only the paper's increasing rule is tested
    assert list(magnitude_separability(magnitudes, diverges).orientations) == ["diverging_above"]


def test_magnitude_separable():
    mags = {"a": 0.1, "b": 0.2, "c": 0.5, "d": 0.75}
    div = {"a": False, "b": False, "c": True, "d": True}
    res = magnitude_separability(mags, div, orientations=("diverging_above", "diverging_below"))
    assert res.separable
    assert res["diverging_above"].separable and res["diverging_above"].threshold == 0.2
    assert res["diverging_above"].counterexample is None and res["diverging_above"].violations == ()
    assert not res["diverging_below"].separable and res["diverging_below"].counterexample == ("a", "d")
    # a tie cannot be split by one threshold
    tie = magnitude_separability({"s": 0.5, "d": 0.5}, {"s": False, "d": True})
    assert not tie.separable and tie["diverging_above"].counterexample == ("s", "d")
    everything_stable = magnitude_separability({"s": 0.5}, {"s": False})
    assert everything_stable.separable and everything_stable["diverging_above"].threshold == 0.5
    with pytest.raises(ValueError, match="inputs differ"):
        magnitude_separability({"a": 1.0}, {"b": True})


# --------------------------------------------------------------------------------------
# minimal sufficient selection


def test_minimal_selection_bisection_path():
    def oracle(layer_set, pos_range):
        return 2 in layer_set and pos_range[0] <= 5 and pos_range[1] >= 8

    res = minimal_sufficient_selection(oracle, layers=8, positions=(0, 16))
    assert res.found and res.layers == (2,) and res.positions == (5, 8)
    assert [(e.phase, e.layers, e.positions, e.reproduces) for e in res.path] == [
        ("full", (0, 1, 2, 3, 4, 5, 6, 7), (0, 16), True),
        ("layers", (0, 1, 2, 3), (0, 16), True),
        ("layers", (0, 1), (0, 16), False),
        ("layers", (2, 3), (0, 16), True),
        ("layers", (2,), (0, 16), True),
        ("positions", (2,), (0, 8), True),
        ("positions", (2,), (0, 4), False),
        ("positions", (2,), (4, 8), True),
        ("positions", (2,), (4, 6), False),
        ("positions", (2,), (6, 8), False),
        ("positions", (2,), (5, 8), True),
        ("positions", (2,), (5, 7), False),
    ]
    assert res.n_evaluations == 12
    assert minimal_sufficient_selection(oracle, 8, (0, 16)) == res  # deterministic


def test_minimal_selection_needs_layers_from_both_halves():
    calls = []

    def needs(layer_set, pos_range):
        return {1, 6} <= set(layer_set) and pos_range[0] <= 3 < pos_range[1]

    def oracle(layer_set, pos_range):
        calls.append((layer_set, pos_range))
        return needs(layer_set, pos_range)

    res = minimal_sufficient_selection(oracle, layers=8, positions=(0, 16))
    assert res.found and res.layers == (1, 6) and res.positions == (3, 4)
    assert len(calls) == len(res.path) == len(set(calls))  # every call recorded, none repeated
    assert all(e.reproduces == needs(e.layers, e.positions) for e in res.path)
    assert Evaluation("layers", (1, 6), (0, 16), True) in res.path
    # plain bisection stops when neither half suffices
    plain = minimal_sufficient_selection(oracle, layers=8, positions=(0, 16), refine=False)
    assert plain.layers == tuple(range(8)) and plain.positions == (3, 4)


def test_minimal_selection_not_found_and_bad_oracle():
    res = minimal_sufficient_selection(lambda ls, pr: False, layers=4, positions=(0, 10))
    assert not res.found and res.n_evaluations == 1 and res.layers == (0, 1, 2, 3) and res.positions == (0, 10)
    with pytest.raises(TypeError, match="must return a bool"):
        minimal_sufficient_selection(lambda ls, pr: 1, layers=4, positions=(0, 10))


# --------------------------------------------------------------------------------------
# bootstrap


def reference_percentile(sorted_values, p):
    h = (len(sorted_values) - 1) * p
    lo = math.floor(h)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (h - lo) * (sorted_values[hi] - sorted_values[lo])


def test_bootstrap_reproducible_with_seed():
    x = [0.12, -0.03, 0.08, 0.21, 0.05, 0.10]
    res = bootstrap_ratio_interval(x)
    assert res.seed == 20261014 and res.n_resamples == 10000 and res.level == 0.95 and res.n_sessions == 6
    assert res == bootstrap_ratio_interval(x)
    ratio, lower, upper = res
    assert ratio == math.exp(np.mean(x)) and lower < ratio < upper
    # the documented algorithm, with an independent linear-interpolation percentile
    idx = np.random.default_rng(20261014).integers(0, 6, size=(10000, 6))
    means = np.sort(np.asarray(x)[idx].mean(axis=1))
    assert lower == pytest.approx(math.exp(reference_percentile(means, 0.025)), rel=1e-14)
    assert upper == pytest.approx(math.exp(reference_percentile(means, 0.975)), rel=1e-14)
    other = bootstrap_ratio_interval(x, seed=1)
    assert other.seed == 1 and (other.lower, other.upper) != (lower, upper)


def test_bootstrap_degenerate_and_bad_input():
    res = bootstrap_ratio_interval([0.25] * 6, n_resamples=100)
    assert tuple(res) == (math.exp(0.25), math.exp(0.25), math.exp(0.25))
    with pytest.raises(ValueError):
        bootstrap_ratio_interval([])
    with pytest.raises(ValueError):
        bootstrap_ratio_interval([0.1, float("nan")])
