"""Frontier and four-cell scores on synthetic panels whose answers are computed by hand.

Every logit below is a small dyadic rational, so float32 storage and float64 arithmetic are
exact and the expected values can be compared with ``==``.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statelab.analysis.classes import first_difference
from statelab.analysis.frontier import (
    ARMS, ArmTrace, FrontierError, analyse_panel, canonical_pair, canonicalise, combine,
    condition_accounting, contrast_table_markdown, fixed_pair_scores, four_cell, frontier,
    frontier_pair, load_results, missing_summary, missing_vectors, plot_scores, save_results,
    score_repeat_agreement, top1_condition,
)

V = 8
L0_NAMES = {"EMPTY": "EMPTY", "C1": "L0_K", "C2": "L0_V", "BOTH": "BOTH"}


def row(values: dict[int, float], base: float = -4.0) -> np.ndarray:
    r = np.full(V, base, dtype=np.float32)
    for k, v in values.items():
        r[k] = v
    return r


# L0 panel, task T1, recipient A, direction B->A.  Shared prefix 1 2 7, frontier at output 3
# where C2 chooses 4 and the other arms choose 1: pair (1, 4).
L0_TOKENS = {"EMPTY": [1, 2, 7, 1, 0, 0], "C1": [1, 2, 7, 1, 0, 0],
             "C2": [1, 2, 7, 4, 0, 0], "BOTH": [1, 2, 7, 1, 0, 5]}
L0_ROWS = {
    # output 0: the recipient's initial logits, identical in every arm
    # output 1: token 2 chosen; runner-up 6; tokens 1 and 4 low
    # output 2: token 7 chosen; EMPTY margin exactly 2 * eps_inf
    # output 3: the frontier
    "EMPTY": [row({1: 2.0, 4: 1.5}), row({2: 3.0, 6: 1.0, 1: 0.5, 4: 0.25}),
              row({7: 1.0, 3: 0.5}), row({1: 2.5, 4: 1.0})],
    "C1": [row({1: 2.0, 4: 1.5}), row({2: 3.0, 6: 1.25, 1: 0.75, 4: 0.25}),
           row({7: 1.25, 3: 0.5}), row({1: 2.0, 4: 1.25})],
    "C2": [row({1: 2.0, 4: 1.5}), row({2: 3.0, 6: 1.0, 1: 0.5, 4: 0.25}),
           row({7: 1.0, 3: 0.5}), row({1: 1.0, 4: 3.0})],
    "BOTH": [row({1: 2.0, 4: 1.5}), row({2: 3.0, 6: 1.0, 1: 0.5, 4: 0.25}),
             row({7: 1.0, 3: 0.5}), row({1: 2.25, 4: 2.0})],
}


def l0_traces(repeats=(0, 1), model="m" * 64, prompt="p" * 64, rows=None, overrides=None):
    rows = rows or L0_ROWS
    overrides = overrides or {}
    out = []
    for r in repeats:
        for a in ARMS:
            kw = dict(arm=L0_NAMES[a], repeat=r, tokens=np.array(L0_TOKENS[a], dtype=np.int32),
                      logits=np.stack(rows[a]), model_sha256=model, prompt_sha256=prompt)
            kw.update(overrides.get((a, r), {}))
            out.append(ArmTrace(**kw))
    return out


def l0_panel():
    return analyse_panel("T1", "A", "L0", "B->A", l0_traces(), positions=[0, 1, 2])


def at(ds, var, **sel):
    base = dict(task="T1", recipient="A", panel="L0", direction="B->A")
    base.update(sel)
    return ds[var].sel({k: v for k, v in base.items() if k in ds[var].dims}).values


# --------------------------------------------------------------------------------------
# elementary definitions


def test_frontier_definitions():
    assert frontier({"a": [1, 2, 3], "b": [1, 2, 3]}) is None
    assert frontier({"a": [1, 2, 3], "b": [1, 2, 3, 4]}) == 3  # prefix: the shorter length
    assert frontier({"a": [1, 2, 3], "b": [1, 9, 3], "c": [1, 2, 8]}) == 1
    assert frontier(L0_TOKENS) == 3


def test_frontier_pair_tie_break_and_truncation():
    fp = frontier_pair(L0_TOKENS, 3)
    assert fp.pair == (1, 4) and fp.n_distinct == 2 and not fp.truncated
    assert fp.chosen == {"EMPTY": 1, "C1": 1, "C2": 4, "BOTH": 1}
    # 2-2 tie: the token of the earlier arm (EMPTY) comes first
    assert frontier_pair({"EMPTY": [9], "C1": [3], "C2": [3], "BOTH": [9]}, 0).pair == (9, 3)
    # three tokens: 6 is most frequent; 5 and 7 tie at one and 5's arm (EMPTY) is earlier
    fp3 = frontier_pair({"EMPTY": [5], "C1": [6], "C2": [6], "BOTH": [7]}, 0)
    assert fp3.pair == (6, 5) and fp3.n_distinct == 3 and fp3.truncated
    # an arm whose trajectory ended has no choice there
    fp_end = frontier_pair({"EMPTY": [1, 2], "C1": [1], "C2": [1, 2], "BOTH": [1, 3]}, 1)
    assert fp_end.pair == (2, 3) and fp_end.chosen == {"EMPTY": 2, "C2": 2, "BOTH": 3}


def test_canonical_pair():
    assert canonical_pair((3, 5), (3, 5)) == ((3, 5), 1)
    assert canonical_pair((5, 3), (3, 5)) == ((3, 5), -1)
    with pytest.raises(FrontierError, match="different tokens"):
        canonical_pair((5, 4), (3, 5))


def test_fixed_pair_scores_and_four_cell():
    vecs = {a: L0_ROWS[a][3] for a in ARMS}
    s = fixed_pair_scores(vecs, (1, 4))
    assert s == {"EMPTY": 1.5, "C1": 0.75, "C2": -2.0, "BOTH": 0.25}
    assert four_cell(s) == (-2.75, 0.25, 3.0)
    with pytest.raises(FrontierError, match="missing"):
        four_cell({"EMPTY": 1.0, "C1": 1.0, "BOTH": 1.0})


def test_top1_condition_both_sides_of_two_eps():
    base = row({2: 1.0, 5: 0.5})  # margin 0.5
    other = row({2: 1.0, 5: 0.5, 6: -3.75})  # token 6 differs by 0.25 -> eps_inf 0.25
    at_bound = top1_condition({"x": base, "y": other})
    assert at_bound.eps_inf == 0.25 and at_bound.margins == {"x": 0.5, "y": 0.5}
    assert at_bound.holds is False  # m = 2 * eps is not enough: the condition is strict
    above = top1_condition({"x": row({2: 1.0078125, 5: 0.5}), "y": row({2: 1.0078125, 5: 0.5, 6: -3.75})})
    assert above.margins == {"x": 0.5078125, "y": 0.5078125} and above.eps_inf == 0.25
    assert above.holds is True
    assert above.argmax == {"x": 2, "y": 2} and above.runner_up == {"x": 5, "y": 5}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=6), min_size=2, max_size=4))
def test_frontier_is_the_earliest_pairwise_difference(seqs):
    expected = [first_difference(a, b) for i, a in enumerate(seqs) for b in seqs[i + 1:]]
    expected = [e for e in expected if e is not None]
    got = frontier({i: s for i, s in enumerate(seqs)})
    assert got == (min(expected) if expected else None)


# --------------------------------------------------------------------------------------
# a complete panel


def test_panel_scores_additive_interaction_and_margins():
    ds = l0_panel()
    assert list(ds.sizes.items()) == [("task", 1), ("recipient", 1), ("panel", 1), ("direction", 1),
                                      ("repeat", 2), ("arm", 4), ("position", 4)]
    assert ds["component"].sel(panel="L0").values.tolist() == ["EMPTY", "L0_K", "L0_V", "BOTH"]
    for r in (0, 1):
        assert at(ds, "t_star", repeat=r) == 3
        assert (at(ds, "token_a", repeat=r), at(ds, "token_b", repeat=r)) == (1, 4)
        assert at(ds, "pair_sign", repeat=r) == 1 and not at(ds, "canonical", repeat=r)
        # scores per arm (rows) and output (columns)
        np.testing.assert_array_equal(at(ds, "score", repeat=r), [[0.5, 0.25, 0.0, 1.5], [0.5, 0.5, 0.0, 0.75],
                                                                   [0.5, 0.25, 0.0, -2.0], [0.5, 0.25, 0.0, 0.25]])
        np.testing.assert_array_equal(at(ds, "additive", repeat=r), [0.5, 0.5, 0.0, -2.75])
        np.testing.assert_array_equal(at(ds, "joint", repeat=r), [0.5, 0.25, 0.0, 0.25])
        np.testing.assert_array_equal(at(ds, "interaction", repeat=r), [0.0, -0.25, 0.0, 3.0])
        np.testing.assert_array_equal(at(ds, "eps_inf", repeat=r), [0.0, 0.25, 0.25, 2.0])
        np.testing.assert_array_equal(at(ds, "margin", repeat=r, position=3), [1.5, 0.75, 2.0, 0.25])
        np.testing.assert_array_equal(at(ds, "margin", repeat=r, position=2), [0.5, 0.75, 0.5, 0.5])
        # output 1: min margin 1.75 > 0.5 holds; output 2: EMPTY margin 0.5 == 2 * 0.25 fails
        np.testing.assert_array_equal(at(ds, "top1_condition", repeat=r), [True, True, False, False])
        np.testing.assert_array_equal(at(ds, "argmax", repeat=r, position=3), [1, 1, 4, 1])
        np.testing.assert_array_equal(at(ds, "runner_up", repeat=r, position=3), [4, 4, 1, 4])
        np.testing.assert_array_equal(at(ds, "argmax", repeat=r, position=1), [2, 2, 2, 2])
        # the pair (1, 4) is the top two at outputs 0 and 3 only; 1 and 2 are descriptive
        np.testing.assert_array_equal(at(ds, "descriptive", repeat=r), [False, True, True, False])
        np.testing.assert_array_equal(at(ds, "requested", repeat=r), [True] * 4)
        np.testing.assert_array_equal(at(ds, "complete", repeat=r), [True] * 4)
        np.testing.assert_array_equal(at(ds, "token", repeat=r, arm="C2"), [1, 2, 7, 4])
        np.testing.assert_array_equal(at(ds, "n_tokens", repeat=r), [6, 6, 6, 6])


def test_default_request_is_the_frontier_only():
    ds = analyse_panel("T1", "A", "L0", "B->A", l0_traces())
    np.testing.assert_array_equal(at(ds, "requested", repeat=0), [False, False, False, True])
    # values are still computed on the whole shared prefix
    assert at(ds, "interaction", repeat=0, position=1) == -0.25


def test_reference_pair_flips_signs():
    ds = analyse_panel("T1", "A", "L0", "B->A", l0_traces(), positions=[1], reference_pair=(4, 1))
    assert (at(ds, "token_a", repeat=0), at(ds, "token_b", repeat=0)) == (4, 1)
    assert at(ds, "pair_sign", repeat=0) == -1 and at(ds, "canonical", repeat=0)
    np.testing.assert_array_equal(at(ds, "score", repeat=0, position=3), [-1.5, -0.75, 2.0, -0.25])
    assert at(ds, "interaction", repeat=0, position=3) == -3.0
    assert at(ds, "additive", repeat=0, position=3) == 2.75
    np.testing.assert_array_equal(at(ds, "margin", repeat=0, position=3), [1.5, 0.75, 2.0, 0.25])


# POSITION panel of task T2 in both directions.  B->A arms: EMPTY = A state, PREFIX = B's
# prefix in A, TAIL = B's tail in A, BOTH = B state.  The mirror A->B has EMPTY = B,
# PREFIX = A's prefix in B (= B->A's TAIL state), TAIL = B->A's PREFIX state, BOTH = A.
STATE_TOKENS = {"A": [0, 6, 3, 3], "P": [0, 6, 3, 1], "Q": [0, 6, 5, 2], "B": [0, 6, 5, 5]}
STATE_ROWS = {"A": row({3: 2.0, 5: 1.0}), "P": row({3: 1.5, 5: 1.25}),
              "Q": row({3: 1.0, 5: 1.75}), "B": row({3: 0.5, 5: 2.5})}
MIRROR = {"B->A": {"EMPTY": "A", "PREFIX": "P", "TAIL": "Q", "BOTH": "B"},
          "A->B": {"EMPTY": "B", "PREFIX": "Q", "TAIL": "P", "BOTH": "A"}}


def position_panel(direction, repeats=(0, 1), task="T2"):
    traces = []
    for r in repeats:
        for arm, state in MIRROR[direction].items():
            rows = np.stack([row({0: 1.0}), row({6: 1.0}), STATE_ROWS[state]])
            traces.append(ArmTrace(arm, r, np.array(STATE_TOKENS[state]), rows, "m" * 64, "q" * 64,
                                   trace_id=f"{task}/{state}/r{r}"))
    recipient = direction[-1]
    return analyse_panel(task, recipient, "POSITION", direction, traces)


def test_direction_flip_agrees_only_after_canonicalisation():
    ds = combine([position_panel("B->A"), position_panel("A->B")])
    ba = dict(task="T2", panel="POSITION", recipient="A", direction="B->A", repeat=0, position=2)
    ab = dict(task="T2", panel="POSITION", recipient="B", direction="A->B", repeat=0, position=2)
    sel_ba = {k: v for k, v in ba.items() if k != "position"}
    sel_ab = {k: v for k, v in ab.items() if k != "position"}
    assert (int(ds["token_a"].sel(sel_ba)), int(ds["token_b"].sel(sel_ba))) == (3, 5)
    assert (int(ds["token_a"].sel(sel_ab)), int(ds["token_b"].sel(sel_ab))) == (5, 3)
    # raw: additive -1.5, joint -2, I -0.5 in B->A; the mirror has the reversed pair
    assert float(ds["interaction"].sel(ba)) == -0.5
    assert float(ds["interaction"].sel(ab)) == 0.5
    assert float(ds["interaction"].sel(ba)) != float(ds["interaction"].sel(ab))

    can = canonicalise(ds, reference_direction="B->A")
    assert float(can["interaction"].sel(ba)) == float(can["interaction"].sel(ab)) == -0.5
    assert float(can["additive"].sel(ab)) == 1.5 and float(can["joint"].sel(ab)) == 1.0
    np.testing.assert_array_equal(can["score"].sel(ab).values, [-2.0, -0.75, 0.25, 1.0])
    assert int(can["pair_sign"].sel(sel_ab)) == -1 and bool(can["canonical"].sel(sel_ab))
    assert (int(can["token_a"].sel(sel_ab)), int(can["token_b"].sel(sel_ab))) == (3, 5)
    assert int(can["pair_sign"].sel(sel_ba)) == 1 and bool(can["canonical"].sel(sel_ba))
    # margins and eps_inf are pair-independent; the input dataset is not modified
    assert can["margin"].equals(ds["margin"]) and can["eps_inf"].equals(ds["eps_inf"])
    assert float(ds["interaction"].sel(ab)) == 0.5
    # an empty (absent) recipient/direction combination stays unfilled
    assert int(can["pair_sign"].sel(task="T2", panel="POSITION", recipient="A", direction="A->B", repeat=0)) == 0


def test_condition_accounting_collapses_symmetric_directions():
    ds = combine([l0_panel(), position_panel("B->A"), position_panel("A->B")])
    acc = condition_accounting(ds)
    # L0: 4 outputs x 2 repeats, one orientation; POSITION: t* only, 2 directions x 2 repeats
    assert acc["L0"] == {"rows": 8, "oriented": 4, "conditions": 4, "inputs": 1}
    assert acc["POSITION"] == {"rows": 4, "oriented": 2, "conditions": 1, "inputs": 1}
    assert acc["total"] == {"rows": 12, "oriented": 6, "conditions": 5, "inputs": 2}


# --------------------------------------------------------------------------------------
# repeats


def test_repeat_agreement_bitwise_and_max_difference():
    agreement = score_repeat_agreement(l0_panel())
    assert agreement.attrs["n_compared"] == 4 and agreement.attrs["n_agree"] == 4
    np.testing.assert_array_equal(agreement["max_abs_diff"].values.ravel(), [0.0] * 4)

    rows = {a: list(v) for a, v in L0_ROWS.items()}
    rows["C1"] = rows["C1"][:3] + [row({1: 2.0 + 2.0 ** -10, 4: 1.25})]
    traces = l0_traces(repeats=(0,)) + l0_traces(repeats=(1,), rows=rows)
    ds = analyse_panel("T1", "A", "L0", "B->A", traces, positions=[0, 1, 2])
    agreement = score_repeat_agreement(ds)
    np.testing.assert_array_equal(agreement["agree"].values.ravel(), [True, True, True, False])
    np.testing.assert_array_equal(agreement["max_abs_diff"].values.ravel(), [0.0, 0.0, 0.0, 2.0 ** -10])
    assert agreement.attrs["n_compared"] == 4 and agreement.attrs["n_agree"] == 3


def test_single_repeat_is_not_an_agreeing_pair():
    agreement = score_repeat_agreement(analyse_panel("T1", "A", "L0", "B->A", l0_traces(repeats=(0,))))
    assert agreement.attrs["n_compared"] == 0 and agreement.attrs["n_agree"] == 0
    assert int(agreement["n_complete"].sel(position=3).squeeze()) == 1
    assert np.isnan(agreement["max_abs_diff"].values).all()


# --------------------------------------------------------------------------------------
# missing vectors


def missing_panel():
    c2_rows = np.stack(L0_ROWS["C2"][:3] + [L0_ROWS["C2"][3]])  # the output-3 row, archived as output 4
    overrides = {
        ("C2", 0): dict(logits=c2_rows, positions=np.array([0, 1, 2, 4])),
        ("BOTH", 1): dict(logits=np.stack(L0_ROWS["BOTH"][:2])),  # trace shorter than t*
        ("EMPTY", 1): dict(logits=None, trace_id="T1/A/natural/r1"),  # no trace at all
    }
    return analyse_panel("T1", "A", "L0", "B->A", l0_traces(overrides=overrides), positions=[0, 1, 2])


def test_missing_vectors_are_reported_and_never_filled():
    ds = missing_panel()
    # the output-4 row of C2 must not stand in for the missing output-3 row
    assert not at(ds, "available", repeat=0, arm="C2", position=3)
    assert np.isnan(at(ds, "score", repeat=0, arm="C2", position=3))
    np.testing.assert_array_equal(at(ds, "complete", repeat=0), [True, True, True, False])
    assert np.isnan(at(ds, "interaction", repeat=0, position=3)) and np.isnan(at(ds, "eps_inf", repeat=0, position=3))
    assert not at(ds, "top1_condition", repeat=0, position=3)
    # what exists is still reported: EMPTY's own score at the frontier
    assert at(ds, "score", repeat=0, arm="EMPTY", position=3) == 1.5
    np.testing.assert_array_equal(at(ds, "complete", repeat=1), [False] * 4)
    got = [(m.repeat, m.arm, m.position, m.trace_id) for m in missing_vectors(ds)]
    assert got == [(0, "C2", 3, "T1/A/L0/B->A/C2/r0"),
                   (1, "EMPTY", 0, "T1/A/natural/r1"), (1, "EMPTY", 1, "T1/A/natural/r1"),
                   (1, "EMPTY", 2, "T1/A/natural/r1"), (1, "EMPTY", 3, "T1/A/natural/r1"),
                   (1, "BOTH", 2, "T1/A/L0/B->A/BOTH/r1"), (1, "BOTH", 3, "T1/A/L0/B->A/BOTH/r1")]
    assert missing_summary(ds) == {"planned": 8, "complete": 3, "incomplete": 5, "missing_entries": 7,
                                   "distinct_missing_vectors": 7}
    # incomplete contrasts do not count as agreeing repeat pairs
    assert score_repeat_agreement(ds).attrs["n_compared"] == 0


def test_shared_arms_count_once_as_missing_vectors():
    # a POSITION panel for the same recipient shares the EMPTY run (same trace_id)
    names = {"EMPTY": "EMPTY", "C1": "PREFIX", "C2": "TAIL", "BOTH": "BOTH"}
    traces = [ArmTrace(names[a], 1, np.array(L0_TOKENS[a]), None if a == "EMPTY" else np.stack(L0_ROWS[a]),
                       "m" * 64, "p" * 64, trace_id="T1/A/natural/r1" if a == "EMPTY" else "")
              for a in ARMS]
    pos_panel = analyse_panel("T1", "A", "POSITION", "B->A", traces)
    ds = combine([missing_panel(), pos_panel])
    summary = missing_summary(ds)
    # POSITION requests output 3 only: one more missing entry, the EMPTY r1 output-3 vector already counted
    assert summary == {"planned": 9, "complete": 3, "incomplete": 6, "missing_entries": 8,
                       "distinct_missing_vectors": 7}


def test_missing_contrast_listed_in_table():
    table = contrast_table_markdown(missing_panel())
    assert "- T1/A/L0/B->A repeat 0 output 3: missing C2 (T1/A/L0/B->A/C2/r0)" in table
    assert ("- T1/A/L0/B->A repeat 1 output 3: missing EMPTY (T1/A/natural/r1), BOTH (T1/A/L0/B->A/BOTH/r1)"
            in table)
    assert "| T1 | A | L0 | B->A | 0 | 2 | 3 | 1/4 |" in table
    assert "| T1 | A | L0 | B->A | 0 | 3 |" not in table


def test_requested_output_after_the_frontier_is_refused():
    with pytest.raises(FrontierError, match=r"outside the shared prefix ending at the frontier t\*=3"):
        analyse_panel("T1", "A", "L0", "B->A", l0_traces(), positions=[4])


def test_identical_trajectories_have_no_pair_but_a_top1_condition():
    tokens = [1, 2]
    rows = np.stack([row({1: 2.0, 4: 1.0}), row({2: 1.0})])
    traces = [ArmTrace(a, 0, np.array(tokens), rows, "m" * 64, "p" * 64) for a in ARMS]
    ds = analyse_panel("T3", "A", "L0", "B->A", traces, positions=[0])
    cell = ds.isel(task=0, recipient=0, panel=0, direction=0, repeat=0)
    assert int(cell["t_star"]) == -1 and int(cell["token_a"]) == -1 and int(cell["pair_sign"]) == 0
    assert bool(cell["top1_condition"].sel(position=0)) and float(cell["eps_inf"].sel(position=0)) == 0.0
    assert np.isnan(cell["interaction"].values).all()
    np.testing.assert_array_equal(cell["requested"].values, [True, False])


# --------------------------------------------------------------------------------------
# bad input


def test_nan_logits_are_refused():
    bad = np.stack(L0_ROWS["C1"])
    bad[2, 5] = np.nan
    with pytest.raises(FrontierError, match=r"arm C1 repeat 0 logits .*non-finite logit \(nan\) at index \(2, 5\)"):
        analyse_panel("T1", "A", "L0", "B->A", l0_traces(overrides={("C1", 0): dict(logits=bad)}))


def test_mixed_models_and_prompts_are_refused():
    with pytest.raises(FrontierError, match="different models mixed in one panel"):
        analyse_panel("T1", "A", "L0", "B->A", l0_traces(overrides={("C2", 1): dict(model_sha256="x" * 64)}))
    with pytest.raises(FrontierError, match="different prompts mixed in one panel"):
        analyse_panel("T1", "A", "L0", "B->A", l0_traces(overrides={("BOTH", 0): dict(prompt_sha256="y" * 64)}))


def test_missing_or_duplicate_arm_is_refused():
    traces = [t for t in l0_traces() if not (t.arm == "L0_V" and t.repeat == 1)]
    with pytest.raises(FrontierError, match="repeat 1 lacks arm\\(s\\) C2"):
        analyse_panel("T1", "A", "L0", "B->A", traces)
    with pytest.raises(FrontierError, match="arm C1 repeat 0 given twice"):
        analyse_panel("T1", "A", "L0", "B->A", l0_traces() + l0_traces(repeats=(0,))[1:2])
    with pytest.raises(FrontierError, match="unknown arm 'PREFIX'"):
        analyse_panel("T1", "A", "L0", "B->A", l0_traces(overrides={("C1", 0): dict(arm="PREFIX")}))


def test_misaligned_trace_and_vocab_mismatch_are_refused():
    shifted = np.stack(L0_ROWS["EMPTY"][1:] + L0_ROWS["EMPTY"][:1])  # off by one row
    with pytest.raises(FrontierError, match="logit argmax 2 is not the chosen token 1"):
        analyse_panel("T1", "A", "L0", "B->A", l0_traces(overrides={("EMPTY", 0): dict(logits=shifted)}))
    wide = np.concatenate([np.stack(L0_ROWS["BOTH"]), np.full((4, 1), -4.0, np.float32)], axis=1)
    with pytest.raises(FrontierError, match="different vocabulary sizes"):
        analyse_panel("T1", "A", "L0", "B->A", l0_traces(overrides={("BOTH", 0): dict(logits=wide)}))
    with pytest.raises(FrontierError, match="strictly increasing"):
        ArmTrace("EMPTY", 0, np.array([1]), np.stack(L0_ROWS["EMPTY"][:2]), "m", "p", positions=np.array([1, 1]))


def test_combine_refuses_a_duplicate_panel():
    with pytest.raises(FrontierError, match="appears in datasets 0 and 1"):
        combine([l0_panel(), l0_panel()])


# --------------------------------------------------------------------------------------
# persistence and reporting


def test_netcdf_round_trip(tmp_path):
    ds = canonicalise(combine([l0_panel(), missing_panel().assign_coords(task=["T4"]),
                               position_panel("B->A"), position_panel("A->B")]))
    for name, var in ds.variables.items():
        assert var.dtype != object, name
    path = save_results(ds, tmp_path / "frontier.nc")
    assert sorted(os.listdir(tmp_path)) == ["frontier.nc"]  # no temporary left behind
    back = load_results(path)
    assert back.identical(ds)
    assert all(back[v].dtype == ds[v].dtype for v in ds.variables if ds[v].dtype.kind != "U")
    assert all(back[v].dtype.kind == "U" for v in ds.variables if ds[v].dtype.kind == "U")
    # overwriting is atomic and leaves one file
    save_results(back, path)
    assert sorted(os.listdir(tmp_path)) == ["frontier.nc"]
    assert missing_summary(load_results(path)) == missing_summary(ds)


def test_contrast_table_values():
    table = contrast_table_markdown(l0_panel())
    assert ("| T1 | A | L0 | B->A | 0 | 3 | 3 | 1/4 | 1.500000 | 0.750000 | -2.000000 | 0.250000 | -2.750000 | "
            "0.250000 | 3.000000 | 2.000000 | 1.500000/0.750000/2.000000/0.250000 | 1/1/4/1 | fails | frontier |"
            ) in table
    assert ("| T1 | A | L0 | B->A | 1 | 1 | 3 | 1/4 | 0.250000 | 0.500000 | 0.250000 | 0.250000 | 0.500000 | "
            "0.250000 | -0.250000 | 0.250000 | 2.000000/1.750000/2.000000/2.000000 | 2/2/2/2 | holds | descriptive |"
            ) in table
    assert table.count("\n| T1 |") == 8 and "Incomplete" not in table


def test_plot_scores_writes_png(tmp_path):
    path = plot_scores(l0_panel(), dict(task="T1", recipient="A", panel="L0", direction="B->A", repeat=1),
                       tmp_path / "scores.png", window=2)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    no_pair = analyse_panel("T3", "A", "L0", "B->A",
                            [ArmTrace(a, 0, np.array([1]), np.stack([row({1: 1.0})]), "m", "p") for a in ARMS])
    with pytest.raises(FrontierError, match="no frontier pair"):
        plot_scores(no_pair, dict(task="T3", recipient="A", panel="L0", direction="B->A", repeat=0),
                    tmp_path / "none.png")
