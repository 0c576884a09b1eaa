"""The paper's findings as tables with their denominators, over one or more study folders
(paper 6.2, S5.1-S5.3).  No model and no files: each study comes in as a :class:`RunData`
(its spec.json, controls, results dataset, cell records, the ``findings/*.jsonl`` records of
:mod:`statelab.experiments.findings_run` and its byte masks), read by
:mod:`statelab.experiments.findings_inputs`; the files are written by :mod:`statelab.report.findings`.

Tables (each states what it counts and out of what):

1. natural divergence per arm pair: inputs whose natural endpoints differ / inputs;
2. endpoint agreement without state equality: inputs with unequal KV states whose natural
   endpoints agree / inputs with unequal states (and the converse, which must be 0);
3. magnitude separability per arm pair over the inputs with unequal states: max |d|, L2 rel
   and first differing layer of the natural states against diverging / stable, the best
   single threshold (either orientation) and its error rate; undecided without both labels;
4. non-monotone sufficiency: (smaller, larger) selections on the inclusion lattice of the
   actual byte masks where the smaller reproduces the donor (B, all repeats) and the larger
   does not; each with the selected-value counts and mask hashes that prove inclusion
   (values of the smaller outside the larger: 0);
5. minimal sufficient selections of class-B cells: sizes (layers, positions, bytes, share);
6. frontier panels of class-B cells: t*, interaction I, the top-1 margin condition, share
   of panels with nonzero interaction.
"""
from __future__ import annotations

import itertools
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import networkx as nx
import numpy as np
import xarray as xr

from statelab.analysis.classes import endpoint_key, selector_lattice
from statelab.errors import ConfigError
from statelab.analysis.frontier import canonical_pair
from statelab.kvstate import KVState
from statelab.selection import flat_mask_sha256

WINDOW = 32  # outputs: the window reported beside full endpoints (the earlier studies' cap)
MAGNITUDES = (("max_abs", "max abs d"), ("l2_rel", "L2 rel"), ("first_differing_layer", "first differing layer"))


class FindingsInputError(ConfigError):
    """A folder the findings cannot be computed from, stated in one line."""


@dataclass
class RunData:
    root: Path
    name: str
    spec: dict
    controls: dict
    ds: xr.Dataset
    records: list
    minimal: list = field(default_factory=list)
    panels: list = field(default_factory=list)
    directions: dict = field(default_factory=dict)  # label -> (donor arm, recipient arm)
    masks_for: object = None  # task -> {selector name: flat byte mask} on the task's recipient state

    @property
    def arms(self) -> list[str]:
        return list(self.spec["normalized"]["arms"])

    @property
    def backend(self) -> str:
        return str(self.spec["normalized"]["backend"])


# ---------------------------------------------------------------------- folding


def arm_folds(run: RunData) -> dict[str, dict[str, str]]:
    """Per task: arm -> the arm it is folded into (itself when it is not).  An arm is folded
    into the first earlier arm (spec order) whose natural capture has the same K/V payload
    (sha256) and the same initial FP32 logits (sha256): its crosses then repeat that arm's
    crosses byte for byte and are not independent evidence."""
    out = {}
    for t, c in run.controls.items():
        arms = c.get("arms", {})
        rep: dict[str, str] = {}
        for a in run.arms:
            if a not in arms:
                continue
            known = arms[a].get("kv") and arms[a].get("logits")  # both hashes recorded, else nothing is proven
            rep[a] = next((b for b in rep if known and rep[b] == b and arms[b].get("kv") == arms[a]["kv"]
                           and arms[b].get("logits") == arms[a]["logits"]), a)
        out[t] = rep
    return out


def direction_folds(run: RunData, folds: dict | None = None) -> dict[str, dict[str, str | None]]:
    """Per task: direction -> the direction it is folded into (itself when independent; None
    when donor and recipient fold into one arm: a cross of a state into itself)."""
    folds = arm_folds(run) if folds is None else folds
    out = {}
    for t, rep in folds.items():
        seen: dict[tuple, str] = {}
        m: dict[str, str | None] = {}
        for d in run.spec["normalized"]["directions"]:
            donor, recipient = run.directions[d]
            key = (rep.get(donor, donor), rep.get(recipient, recipient))
            if key[0] == key[1]:
                m[d] = None
            else:
                m[d] = seen.setdefault(key, d)
        out[t] = m
    return out


def independent(run: RunData, task: str, direction: str, dfolds=None) -> bool:
    dfolds = direction_folds(run) if dfolds is None else dfolds
    return dfolds.get(task, {}).get(direction, direction) == direction


def fold_rows(run: RunData) -> list[dict]:
    """What was folded and why: one row per (arms folded, tasks), with the fold's evidence."""
    folds = arm_folds(run)
    by: dict[tuple, list] = {}
    for t, rep in folds.items():
        for a, b in rep.items():
            if a != b:
                by.setdefault((a, b), []).append(t)
    return [{"run": run.name, "arm": a, "into": b, "tasks": len(ts), "of": len(folds),
             "why": "equal K/V payload sha256 and equal initial-logits sha256 of the natural captures"}
            for (a, b), ts in sorted(by.items())]


def folded_agreement(run: RunData) -> dict:
    """Cells of folded directions against their representative's: (coordinates compared, equal
    class in every repeat), and the coordinates of directions whose donor and recipient fold
    into one arm (``self``: a state crossed into itself, not evidence of anything)."""
    dfolds = direction_folds(run)
    k = run.ds["klass"].transpose("task", "selector", "direction", "repeat")
    dirs = [str(d) for d in k.direction.values]
    v = k.values.astype(str)
    n = same = own = 0
    for it, t in enumerate(k.task.values):
        for jd, d in enumerate(dirs):
            r = dfolds.get(str(t), {}).get(d, d)
            if r is None:
                own += int(v.shape[1])
                continue
            if r == d:
                continue
            a, b = v[it, :, jd, :], v[it, :, dirs.index(r), :]
            ok = (a != "") & (b != "")
            n += int(ok.all(axis=-1).sum())
            same += int(((a == b) & ok).all(axis=-1).sum())
    return {"cells": n, "same_class": same, "self": own}


# ---------------------------------------------------------------------- masks without captures


def skeleton_state(n_prompt: int, n_layer: int, total_value_bytes: int, itemsize: int = 2,
                   v_trans: bool = True) -> KVState:
    """A state of the recorded geometry without values (a kept run folder has no captures):
    positions 0..n-1, K rows token-major, V feature-major (no flash attention), equal K and V
    widths derived from the cells' ``total_value_bytes``.  Selectors only read the geometry;
    :func:`masks_from_records` checks every cell's selected bytes against it."""
    width, rem = divmod(int(total_value_bytes), 2 * n_prompt * n_layer * itemsize)
    if rem or width <= 0:
        raise FindingsInputError(f"total value bytes {total_value_bytes} do not fit {n_layer} layers x {n_prompt} "
                                 f"cells x K and V of {itemsize}-byte values")
    dt = np.dtype(f"u{itemsize}")
    k = [np.zeros((n_prompt, width), dt) for _ in range(n_layer)]
    v = [np.zeros((width, n_prompt) if v_trans else (n_prompt, width), dt) for _ in range(n_layer)]
    return KVState(positions=np.arange(n_prompt, dtype=np.int32),
                   seq_ids=tuple(np.zeros(1, np.int32) for _ in range(n_prompt)), v_trans=v_trans,
                   k=k, v=v, k_types=[1] * n_layer, v_types=[1] * n_layer)


# ---------------------------------------------------------------------- 1 and 2: natural pairs


def natural_pairs(run: RunData) -> list[dict]:
    """One row per (input, arm pair): natural endpoints equal?, KV states equal?, and
    ``folded``: the pair repeats another pair of the input (an arm folded into another,
    :func:`arm_folds`) or pairs an arm with the arm it is folded into."""
    rows = []
    folds = arm_folds(run)
    for p in run.spec["normalized"]["prompts"]:
        c = run.controls.get(p["id"])
        if c is None:
            continue
        arms = c["arms"]
        rep = folds.get(p["id"], {})
        seen = set()
        for a, b in itertools.combinations(run.arms, 2):
            if a not in arms or b not in arms:
                continue
            key = (rep.get(a, a), rep.get(b, b))
            folded = key[0] == key[1] or key in seen
            seen.add(key)
            ta, tb = arms[a]["natural"]["tokens"], arms[b]["natural"]["tokens"]
            rows.append({"run": run.name, "task": p["id"], "pair": f"{a}/{b}",
                         "endpoint_same": endpoint_key(arms[a]["natural"]) == endpoint_key(arms[b]["natural"]),
                         "window_same": list(ta[:WINDOW]) == list(tb[:WINDOW]),
                         "state_same": arms[a]["kv"] == arms[b]["kv"], "n_prompt": c.get("n_prompt"),
                         "folded": folded})
    return rows


def _by_run_pair(rows: list[dict]):
    """(run, pair) -> its rows, in sorted order."""
    key = lambda r: (r["run"], r["pair"])  # noqa: E731
    return [(k, list(g)) for k, g in itertools.groupby(sorted(rows, key=key), key=key)]


def divergence_table(rows: list[dict]) -> list[dict]:
    """Per (run, pair): inputs, diverging, share; equal/unequal states and agreement."""
    out = []
    for (run, pair), g in _by_run_pair([r for r in rows if not r.get("folded")]):
        same = np.array([r["endpoint_same"] for r in g])
        state = np.array([r["state_same"] for r in g])
        win = np.array([r.get("window_same", r["endpoint_same"]) for r in g])
        out.append({"run": run, "pair": pair, "inputs": len(g), "diverging": int((~same).sum()),
                    "diverging_window": int((~win).sum()),
                    "unequal_states": int((~state).sum()),
                    "agree_unequal_states": int((same & ~state).sum()),
                    "diverge_equal_states": int((~same & state).sum()),
                    "equal_states": int(state.sum())})
    return out


# ---------------------------------------------------------------------- 3: separability


def best_threshold(values, diverges) -> dict:
    """The single threshold on ``values`` that best separates diverging (True) from stable
    inputs, over both orientations ("diverging above": diverges iff value > t; "diverging
    below": diverges iff value < t).  Exhaustive over every cut between sorted values,
    vectorised.  Returns errors, error rate, orientation and threshold (midpoint of the cut)."""
    x = np.asarray(values, dtype=np.float64)
    y = np.asarray(diverges, dtype=bool)
    if x.shape != y.shape or x.ndim != 1 or x.size == 0:
        raise FindingsInputError("need equal-length, non-empty 1-D values and labels")
    if not np.all(np.isfinite(x)):
        raise FindingsInputError("values must be finite")
    order = np.argsort(x, kind="stable")
    xs, ys = x[order], y[order]
    # cut k (0..n) puts xs[:k] below and xs[k:] above; only cuts between distinct values are real
    cuts = np.concatenate([[0], np.flatnonzero(np.diff(xs) > 0) + 1, [xs.size]])
    div_below = np.concatenate([[0], np.cumsum(ys)])[cuts]
    stable_below = cuts - div_below
    n_div, n_stable = int(ys.sum()), int((~ys).sum())
    err_above = div_below + (n_stable - stable_below)  # diverging below the cut + stable above it
    err_below = stable_below + (n_div - div_below)
    best = []
    for name, err in (("diverging_above", err_above), ("diverging_below", err_below)):
        i = int(np.argmin(err))
        k = int(cuts[i])
        thr = (-np.inf if k == 0 else np.inf if k == xs.size else float((xs[k - 1] + xs[k]) / 2))
        best.append((int(err[i]), name, thr))
    errors, orientation, thr = min(best, key=lambda b: (b[0], b[1]))
    return {"n": int(x.size), "diverging": n_div, "stable": n_stable, "errors": errors,
            "errors_increasing": best[0][0],  # the paper's rule (S5.2): diverges iff value > t
            "error_rate": errors / x.size, "orientation": orientation, "threshold": thr,
            "separable": errors == 0, "both_labels": bool(n_div and n_stable)}


def separability_rows(run: RunData) -> list[dict]:
    """Per input and reference arm pair of the controls: magnitudes and label (unequal states only)."""
    rows = []
    folds = arm_folds(run)
    for p in run.spec["normalized"]["prompts"]:
        c = run.controls.get(p["id"])
        if c is None:
            continue
        rep, seen = folds.get(p["id"], {}), set()
        for key, q in c.get("arm_pairs", {}).items():
            pair = tuple(rep.get(a, a) for a in (q["reference"], q["other"]))
            if q["kv_identical"] or pair in seen:  # equal states, or a pair folded into one already counted
                continue
            seen.add(pair)
            nat = [c["arms"][a]["natural"]["tokens"][:WINDOW] for a in (q["reference"], q["other"])]
            window = {"diverges_window": list(nat[0]) != list(nat[1])} if int(run.spec["normalized"]["cap"]) > WINDOW \
                else {}
            rows.append({"run": run.name, "task": p["id"], "pair": key, "diverges": not q["natural_same"], **window,
                         "max_abs": float(q["max_abs"]), "l2_rel": float(q["l2_rel"]),
                         "first_differing_layer": float(q["first_differing_layer"]),
                         "natural_first_diff": q["natural_first_diff"]})
    return rows


def separability_table(rows: list[dict]) -> list[dict]:
    out = []
    for (run, pair), g in _by_run_pair(rows):
        # labels of the full endpoints; where the cap is longer than the window, also those of
        # the first WINDOW outputs (reported beside, as "pair (32)")
        for suffix, key in (("", "diverges"), (f" ({WINDOW})", "diverges_window")):
            if key not in g[0]:
                continue
            y = [r[key] for r in g]
            for var, label in MAGNITUDES:
                res = best_threshold([r[var] for r in g], y)
                verdict = ("undecided (one label only)" if not res["both_labels"]
                           else "separable" if res["separable"] else "not separable")
                out.append({"run": run, "pair": pair + suffix, "magnitude": label, **res, "verdict": verdict})
    return out


# ---------------------------------------------------------------------- 4: non-monotone pairs


def agreed_classes(ds: xr.Dataset) -> xr.DataArray:
    """The class of each (task, selector, direction) whose repeats all agree, else ''."""
    k = ds["klass"].transpose("task", "selector", "direction", "repeat")
    v = k.values.astype(str)
    agree = np.all(v == v[..., :1], axis=-1) & (v[..., 0] != "")
    return xr.DataArray(np.where(agree, v[..., 0], ""), dims=("task", "selector", "direction"),
                        coords={d: k[d] for d in ("task", "selector", "direction")})


def non_monotone_in(masks: dict, outcomes: dict, lattice: nx.DiGraph | None = None) -> tuple[list[dict], int]:
    """Non-monotone pairs on the lattice of ``masks`` given ``outcomes`` (name -> class), each
    with its inclusion proof, and the denominator: (B selection, strict superset with an
    outcome) pairs examined. ``lattice``: ``selector_lattice(masks)`` when the caller has it."""
    lat = selector_lattice(masks) if lattice is None else lattice
    pairs, examined = [], 0
    for small in lat.nodes:
        if outcomes.get(small) != "B":
            continue
        for large in nx.descendants(lat, small):
            if large not in outcomes:
                continue
            examined += 1
            if outcomes[large] == "B":
                continue
            a, b = np.asarray(masks[small]).ravel(), np.asarray(masks[large]).ravel()
            pairs.append({"small": small, "large": large, "large_class": outcomes[large],
                          "small_values": int(a.sum()), "large_values": int(b.sum()),
                          "small_outside_large": int((a & ~b).sum()),
                          "small_mask_sha256": flat_mask_sha256(a), "large_mask_sha256": flat_mask_sha256(b)})
    return sorted(pairs, key=lambda p: (p["small"], p["large"])), examined


def non_monotone(run: RunData, masks_for=None) -> tuple[list[dict], list[dict]]:
    """All non-monotone pairs of a run (repeat-agreeing classes; byte masks on each task's
    recipient state) and one denominator row per (task, direction)."""
    agreed = agreed_classes(run.ds)
    dfolds = direction_folds(run)
    pairs, denominators = [], []
    for t in agreed.task.values:
        t = str(t)
        ctl = run.controls.get(t)
        if ctl is None or not ctl.get("passed"):
            continue
        masks = (masks_for or run.masks_for)(t)
        names = [str(s) for s in agreed.selector.values]
        task_masks = {s: masks[s] for s in names}
        lattice = None  # one inclusion lattice per task: every direction of it reads the same masks
        for d in agreed.direction.values:
            d = str(d)
            if not independent(run, t, d, dfolds):  # it repeats another direction byte for byte
                continue
            outcomes = {s: str(agreed.sel(task=t, selector=s, direction=d).item()) for s in names}
            outcomes = {s: k for s, k in outcomes.items() if k}
            if not outcomes:  # no repeat-agreeing result yet (pending or withheld): not a coordinate
                continue
            lattice = selector_lattice(task_masks) if lattice is None else lattice
            found, examined = non_monotone_in(task_masks, outcomes, lattice)
            pairs += [{"run": run.name, "task": t, "direction": d, **p} for p in found]
            denominators.append({"run": run.name, "task": t, "direction": d, "b_selections":
                                 sum(1 for k in outcomes.values() if k == "B"), "examined": examined,
                                 "non_monotone": len(found)})
    return pairs, denominators


# ---------------------------------------------------------------------- 5 and 6: minimal, panels


def class_b_count(run: RunData, folded: bool = False) -> int:
    """Class-B cells (B in every repeat) of independent directions (``folded``: of all directions)."""
    a = agreed_classes(run.ds)
    b = a.values == "B"
    if not folded:
        dfolds = direction_folds(run)
        keep = np.array([[independent(run, str(t), str(d), dfolds) for d in a.direction.values]
                         for t in a.task.values])
        b = b & keep[:, None, :]
    return int(b.sum())


def independent_records(run: RunData, recs: list[dict]) -> list[dict]:
    """Records of independent directions, first process repeat (later panel repeats are
    compared with it in :func:`repeat_agreement`, not counted again)."""
    dfolds = direction_folds(run)
    return [r for r in recs if independent(run, r["task"], r["direction"], dfolds) and r.get("repeat", 0) == 0]


def repeat_agreement(runs: list[RunData]) -> dict:
    """Repeat-level frontier contrasts: panels of independent directions recorded by a second
    process repeat, and how many equal the first repeat bit for bit (t*, tokens, pair, scores)."""
    n = same = 0
    for run in runs:
        dfolds = direction_folds(run)
        first = {(r["task"], r["selector"], r["direction"]): r for r in run.panels
                 if r.get("status") == "ok" and r.get("repeat", 0) == 0}
        for r in run.panels:
            k = (r["task"], r["selector"], r["direction"])
            if r.get("status") != "ok" or r.get("repeat", 0) == 0 or k not in first \
                    or not independent(run, r["task"], r["direction"], dfolds):
                continue
            n += 1
            same += all(r.get(f) == first[k].get(f) for f in _PANEL_FIELDS)
    return {"compared": n, "agree": same}


def minimal_summary(runs: list[RunData]) -> dict:
    recs = [r for run in runs for r in independent_records(run, run.minimal)]
    ok = [r for r in recs if r.get("status") == "ok" and r.get("found")]
    b = sum(class_b_count(run) for run in runs)
    sizes = np.array([r["n_layers"] for r in ok]) if ok else np.zeros(0, int)
    return {"class_b_cells": b, "class_b_cells_all_directions": sum(class_b_count(run, True) for run in runs),
            "records_all_directions": sum(len(run.minimal) for run in runs),
            "searched": sum(1 for r in recs if r.get("status") == "ok"), "found": len(ok),
            "skipped": sum(1 for r in recs if r.get("status") == "skipped"),
            "failed": sum(1 for r in recs if r.get("status") == "failed"),
            "layers_hist": dict(sorted(Counter(int(x) for x in sizes).items())),
            "single_position": sum(1 for r in ok if r["n_positions"] == 1),
            "median_bytes": float(np.median([r["selected_bytes"] for r in ok])) if ok else None,
            "median_share": float(np.median([r["share"] for r in ok])) if ok else None,
            "median_evaluations": float(np.median([r["evaluations"] for r in ok])) if ok else None}


def panel_class(r: dict) -> str:
    """``active``: both components move the score at t* (s(C1) and s(C2) both differ from
    s(EMPTY)); ``degenerate``: one component leaves it bit for bit at its EMPTY value (then
    I = s(BOTH) - s(other component), 0 whenever BOTH and that component give the same
    score, which is the rule, not a finding)."""
    s0, s1, s2, _ = r["scores"]
    return "active" if (s1 != s0 and s2 != s0) else "degenerate"


def _ok_panels(run: RunData) -> list[dict]:
    return [r for r in independent_records(run, run.panels) if r.get("status") == "ok"
            and r.get("t_star", -1) >= 0 and "interaction" in r]


def margin_summary(recs: list[dict]) -> dict:
    """The paper's sufficient top-1 condition (every arm's margin m > 2 eps_inf) at every
    recorded output before t*: steps and panels where it holds; output 0 separately (every arm
    starts from the recipient's initial logits there, so eps_inf = 0 there by construction)."""
    with_steps = [r for r in recs if "steps" in r]
    steps = steps1 = holds = holds1 = panels_all = panels_all1 = complete = nonempty = 0
    for r in with_steps:
        st = r["steps"]
        pos = np.asarray(st["positions"], dtype=np.int64)
        if pos.size == 0:  # t* = 0: no output before the frontier
            continue
        nonempty += 1
        complete += int(pos.size == st["before"])
        h = np.all(np.asarray(st["margin"], dtype=np.float64) > 2.0 * np.asarray(st["eps_inf"])[None, :], axis=0)
        steps += int(pos.size)
        holds += int(h.sum())
        panels_all += int(h.all())
        later = pos >= 1
        steps1 += int(later.sum())
        holds1 += int(h[later].sum())
        panels_all1 += int(h[later].all()) if later.any() else 0
    return {"panels": len(recs), "panels_with_steps": len(with_steps), "panels_with_a_step": nonempty,
            "panels_all_steps_recorded": complete, "steps": steps, "steps_holding": holds,
            "panels_holding_everywhere": panels_all, "steps_from_1": steps1, "steps_from_1_holding": holds1,
            "panels_from_1": sum(1 for r in with_steps if any(p >= 1 for p in r["steps"]["positions"])),
            "panels_holding_everywhere_from_1": panels_all1}


def panel_summary(runs: list[RunData], tol: float = 0.0) -> dict:
    recs = [r for run in runs for r in independent_records(run, run.panels)]
    ok = [r for r in recs if r.get("status") == "ok"]
    with_f = [r for run in runs for r in _ok_panels(run)]
    inter = np.array([r["interaction"] for r in with_f])
    cls = np.array([panel_class(r) for r in with_f])
    nz = np.abs(inter) > tol
    act = cls == "active"
    return {"class_b_cells": sum(class_b_count(run) for run in runs),
            "class_b_cells_all_directions": sum(class_b_count(run, True) for run in runs),
            "records_all_directions": sum(len(run.panels) for run in runs),
            "folded_equal": sum(folded_panels_equal(run)[1] for run in runs),
            "folded": sum(folded_panels_equal(run)[0] for run in runs),
            "panels": len(ok),
            "skipped": sum(1 for r in recs if r.get("status") == "skipped"),
            "failed": sum(1 for r in recs if r.get("status") == "failed"),
            "with_frontier": len(with_f),
            "nonzero_interaction": int(nz.sum()),
            "active": int(act.sum()), "degenerate": int((~act).sum()),
            "active_nonzero": int((nz & act).sum()), "degenerate_zero": int((~nz & ~act).sum()),
            "zero_interaction": int((~nz).sum()),
            "top1_condition": sum(1 for r in with_f if r.get("top1")),
            "median_abs_interaction": float(np.median(np.abs(inter))) if inter.size else None,
            "median_abs_interaction_active": float(np.median(np.abs(inter[act]))) if act.any() else None,
            "median_t_star": float(np.median([r["t_star"] for r in with_f])) if with_f else None,
            "margin": margin_summary(with_f), "repeats": repeat_agreement(runs)}


_PANEL_FIELDS = ("t_star", "tokens", "scores", "interaction", "token_a", "token_b")


def folded_panels_equal(run: RunData) -> tuple[int, int]:
    """Panels of folded directions that have their representative's panel: (how many, how
    many equal it in t*, tokens, pair and scores bit for bit)."""
    dfolds = direction_folds(run)
    by = {(r["task"], r["selector"], r["direction"]): r for r in run.panels
          if r.get("status") == "ok" and r.get("repeat", 0) == 0}
    n = same = 0
    for (t, sel, d), r in by.items():
        rep = dfolds.get(t, {}).get(d, d)
        if rep is None or rep == d or (t, sel, rep) not in by:
            continue
        n += 1
        q = by[(t, sel, rep)]
        same += all(r.get(k) == q.get(k) for k in _PANEL_FIELDS)
    return n, same


def contrast_rows(runs: list[RunData]) -> list[dict]:
    """The canonical per-panel contrast table (paper S5.2, Table S13): one row per independent
    panel with a frontier; the token pair in canonical order (smaller token id first), every
    score, the additive prediction, the joint and I multiplied by the sign that canonical order
    needs (direction-dependent pairs reversed), so that signs compare across panels."""
    out = []
    for run in runs:
        for r in sorted(_ok_panels(run), key=lambda r: (r["task"], r["direction"], r["selector"])):
            pair = (int(r["token_a"]), int(r["token_b"]))
            cpair, sign = canonical_pair(pair, tuple(sorted(pair)))
            sc = [sign * float(x) for x in r["scores"]]
            out.append({"run": run.name, "task": r["task"], "selector": r["selector"], "direction": r["direction"],
                        "components": "/".join(r.get("components", ["C1", "C2"])), "t_star": int(r["t_star"]),
                        "pair": f"{cpair[0]}/{cpair[1]}", "sign": sign, "tokens": "/".join(str(x) for x in r["tokens"]),
                        "s_empty": sc[0], "s_c1": sc[1], "s_c2": sc[2], "s_both": sc[3],
                        "additive": sign * float(r["additive"]), "joint": sign * float(r["joint"]),
                        "interaction": sign * float(r["interaction"]), "eps_inf": float(r["eps_inf"]),
                        "class": panel_class(r)})
    return out


def magnitude_rows(f_sep_inputs: list[dict]) -> list[dict]:
    """Magnitude against label per input (paper S5.2, Table S12)."""
    return sorted(f_sep_inputs, key=lambda r: (r["run"], r["pair"], r["l2_rel"]))


# ---------------------------------------------------------------------- Markdown


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return "inf" if v == np.inf else "-inf" if v == -np.inf else f"{v:.4g}"
    return "" if v is None else str(v)


def md_table(cols: list[tuple[str, str]], rows: list[dict]) -> str:
    if not rows:
        return "(none)\n"
    out = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(_fmt(r.get(k)) for k, _ in cols) + " |" for r in rows]
    return "\n".join(out) + "\n"


def _share(n: int, d: int) -> str:
    return f"{n} / {d}" + (f" ({100.0 * n / d:.1f} %)" if d else "")


@dataclass
class Findings:
    runs: list
    divergence: list
    natural: list
    separability: list
    separability_inputs: list
    nonmono_pairs: list
    nonmono_denominators: list
    minimal: dict
    panels: dict
    same_cross_cells: int = 0
    folds: list = field(default_factory=list)
    folded_cells: dict = field(default_factory=dict)
    contrasts: list = field(default_factory=list)

    def as_dict(self, out=None) -> dict:
        """Everything as JSON; run folders relative to ``out`` (the folder the tables go to),
        never a machine-local absolute path."""
        def where(root: Path) -> str:  # relative to the tables when inside their folder, else its name
            r, o = Path(root).resolve(), Path(out).resolve() if out else None
            return Path(os.path.relpath(r, o)).as_posix() if o is not None and o in r.parents else r.name

        return {"runs": [{"name": r.name, "folder": where(r.root), "spec_hash": r.spec["spec_hash"],
                          "backend": r.backend, "arms": r.arms} for r in self.runs],
                "divergence": self.divergence, "natural": self.natural, "separability": self.separability,
                "separability_inputs": self.separability_inputs, "non_monotone_pairs": self.nonmono_pairs,
                "non_monotone_denominators": self.nonmono_denominators, "minimal": self.minimal,
                "panels": self.panels, "same_cross_cells": self.same_cross_cells, "folds": self.folds,
                "folded_cells": self.folded_cells, "contrasts": self.contrasts}


def compute(runs: list[RunData]) -> Findings:
    natural = [r for run in runs for r in natural_pairs(run)]
    sep_in = [r for run in runs for r in separability_rows(run)]
    pairs, dens = [], []
    for run in runs:
        p, d = non_monotone(run)
        pairs += p
        dens += d
    # same_mask_as: the field's name in run folders of an earlier statelab
    same = sum(1 for run in runs for r in run.records
               if (r.get("same_cross_as") or r.get("same_mask_as")) and r.get("status") == "ok")
    folded = [folded_agreement(run) for run in runs]
    return Findings(runs, divergence_table(natural), natural, separability_table(sep_in), sep_in, pairs, dens,
                    minimal_summary(runs), panel_summary(runs), same,
                    [row for run in runs for row in fold_rows(run)],
                    {k: sum(x[k] for x in folded) for k in ("cells", "same_class", "self")},
                    contrast_rows(runs))


def markdown(f: Findings) -> str:
    out = ["# Findings tables", ""]
    for run in f.runs:
        n = run.spec["normalized"]
        st = run.ds.status.values
        out.append(f"- `{run.name}` ({run.backend}, arms {', '.join(run.arms)}, cap {n['cap']}, "
                   f"{len(n['prompts'])} prompts x {len(n['selectors'])} selectors x {len(n['directions'])} "
                   f"directions x {n['repeats']} repeats = {st.size} cells; {int((st == 'ok').sum())} done, "
                   f"{int((st == 'withheld').sum())} withheld, {int((st == 'failed').sum())} failed, "
                   f"{int((st == 'pending').sum())} pending; spec {run.spec['spec_hash'][:12]})")
    out.append(f"\nCells whose cross had byte-identical inputs to one already run in the same process (the same "
               f"imported bytes, logits and recipient configuration) were run once and recorded "
               f"under every name: {f.same_cross_cells} cells.\n")
    out.append("## 0. Independent evidence: folded arms\n")
    if f.folds:
        out.append("An arm whose natural capture has the same K/V payload and the same initial logits (sha256 of "
                   "each) as an earlier arm of the same input forms the same state: every cross from or into it "
                   "repeats the earlier arm's cross byte for byte. Such arms are folded into the earlier one before "
                   "anything is counted: their arm pairs, their directions (a direction whose donor and recipient "
                   "fold to an already counted direction, or into one arm), their cells, panels and searches are "
                   "left out of every denominator below.\n")
        out.append(md_table([("run", "run"), ("arm", "arm"), ("into", "folded into"), ("n", "inputs"),
                             ("why", "why")], [{**r, "n": f"{r['tasks']} / {r['of']}"} for r in f.folds]))
        fc = f.folded_cells
        out.append(f"\nCells of folded directions left out: {fc['cells']} (task, selector, direction) coordinates "
                   f"repeat a counted direction, and their repeat-agreeing class equals that of the direction they "
                   f"repeat at {_share(fc['same_class'], fc['cells'])}; {fc['self']} coordinates cross a state into "
                   f"itself (donor and recipient fold into one arm).\n")
    else:
        out.append("No arm was folded: on every input the arms' natural captures differ in K/V payload or "
                   "initial logits, so every arm pair and direction is counted.\n")
    out.append("\n## 1. Natural endpoints per arm pair\n")
    out.append("Inputs whose natural endpoints (greedy, within the cap) differ, out of all inputs with controls "
               "(independent arm pairs only).\n")
    caps = ", ".join(sorted({str(run.spec["normalized"]["cap"]) for run in f.runs}))
    out.append(f"Full endpoints: EOS or the cap ({caps} outputs); beside them, the first {WINDOW} outputs only.\n")
    out.append(md_table([("run", "run"), ("pair", "arm pair"), ("inputs", "inputs"), ("diverging", "diverging"),
                         ("share", "share"), ("win", f"diverging within {WINDOW} outputs")],
                        [{**r, "share": _share(r["diverging"], r["inputs"]),
                          "win": _share(r["diverging_window"], r["inputs"])} for r in f.divergence]))
    out.append("\n## 2. Endpoint agreement without state equality\n")
    out.append("Among inputs whose two natural KV states differ (sha256 of the K/V payload), how many still "
               "reach the same natural endpoint; and inputs with equal states whose endpoints differ (must be 0).\n")
    out.append(md_table([("run", "run"), ("pair", "arm pair"), ("unequal_states", "unequal states"),
                         ("agree", "same endpoint despite unequal states"), ("equal_states", "equal states"),
                         ("diverge_equal_states", "diverging with equal states")],
                        [{**r, "agree": _share(r["agree_unequal_states"], r["unequal_states"])}
                         for r in f.divergence]))
    out.append("\n## 3. Magnitude separability\n")
    out.append("Over the inputs whose natural states differ: does one threshold on the magnitude of the natural "
               "state difference (relative to the reference arm's state) separate diverging from stable inputs? "
               "Best single threshold over both orientations and every cut; its errors out of all inputs; and the "
               "errors of the best increasing rule alone (diverges iff magnitude > t, the rule of paper S5.2).\n")
    out.append(md_table([("run", "run"), ("pair", "pair"), ("magnitude", "magnitude"), ("n", "inputs"),
                         ("diverging", "diverging"), ("stable", "stable"), ("orientation", "best rule"),
                         ("threshold", "threshold"), ("err", "errors"), ("inc", "errors of the best increasing rule"),
                         ("verdict", "verdict")],
                        [{**r, "err": _share(r["errors"], r["n"]), "inc": _share(r["errors_increasing"], r["n"])}
                         for r in f.separability]))
    if f.separability_inputs:
        out.append("\nMagnitude against label, per input (paper S5.2, Table S12), sorted by L2 rel; the label is "
                   "that of the natural endpoints within the cap:\n")
        out.append(md_table([("run", "run"), ("pair", "pair"), ("task", "task"), ("max_abs", "max abs d"),
                             ("l2_rel", "L2 rel"), ("first_differing_layer", "first differing layer"),
                             ("label", "label"), ("natural_first_diff", "first output difference")],
                            [{**r, "label": "diverging" if r["diverges"] else "stable",
                              "first_differing_layer": int(r["first_differing_layer"])}
                             for r in magnitude_rows(f.separability_inputs)]))
    out.append("\n## 4. Non-monotone sufficiency\n")
    tot_ex = sum(d["examined"] for d in f.nonmono_denominators)
    coords = sum(1 for d in f.nonmono_denominators if d["non_monotone"])
    distinct = len({(p["run"], p["task"], p["direction"], p["small_mask_sha256"], p["large_mask_sha256"])
                    for p in f.nonmono_pairs})
    out.append(f"Pairs (smaller, strict superset) on the inclusion lattice of the actual byte masks, where the "
               f"smaller selection reproduces the donor (B in every repeat) and the superset does not (C or D in "
               f"every repeat). Found {_share(len(f.nonmono_pairs), tot_ex)} of the (B selection, superset) pairs "
               f"examined, at {coords} of {len(f.nonmono_denominators)} independent (task, direction) coordinates "
               f"with results; "
               f"{distinct} of them are distinct (smaller mask, larger mask) pairs (selectors with identical masks, "
               f"e.g. PREFIX_V and V_ALL on a prompt of at most 128 tokens, count once there). Proof of "
               "inclusion per pair: the smaller mask's values outside the larger one (0) and both masks' sha256 "
               "(packed bits over the recipient state's K then V arrays) in `findings.json`.\n")
    by_cls = Counter(p["large_class"] for p in f.nonmono_pairs)
    if f.nonmono_pairs:
        out.append(f"Superset classes: {', '.join(f'{k} {v}' for k, v in sorted(by_cls.items()))}.\n")
        kinds = Counter((p["small"], p["large"]) for p in f.nonmono_pairs)
        top = [{"small": s, "large": lg, "n": n} for (s, lg), n in kinds.most_common(15)]
        out.append("Most frequent pairs (over tasks and directions):\n")
        out.append(md_table([("small", "sufficient (B)"), ("large", "superset (not B)"), ("n", "coordinates")], top))
        out.append("\nExamples with their proof (first per task):\n")
        seen, ex = set(), []
        for p in f.nonmono_pairs:
            if (p["run"], p["task"]) not in seen:
                seen.add((p["run"], p["task"]))
                ex.append({**p, "small_sha": p["small_mask_sha256"][:12], "large_sha": p["large_mask_sha256"][:12]})
        out.append(md_table([("run", "run"), ("task", "task"), ("direction", "direction"), ("small", "small (B)"),
                             ("large", "large"), ("large_class", "class"), ("small_values", "small values"),
                             ("large_values", "large values"), ("small_outside_large", "small outside large"),
                             ("small_sha", "small mask sha256"), ("large_sha", "large mask sha256")], ex))
    m = f.minimal
    out.append("\n## 5. Minimal sufficient selections of class-B cells\n")
    out.append(f"Class-B cells (B in every repeat) of independent directions: {m['class_b_cells']} (of "
               f"{m['class_b_cells_all_directions']} over all directions; {m['records_all_directions']} search "
               f"records over all directions). Searched (inside each cell's own box: its "
               f"layers, component and positions; one process repeat): {_share(m['searched'], m['class_b_cells'])}; "
               f"a sufficient selection found: {m['found']}; skipped {m['skipped']}, failed {m['failed']}.\n")
    if m["found"]:
        out.append(f"Layers in the minimal selection: "
                   f"{', '.join(f'{k}: {v}' for k, v in m['layers_hist'].items())} (layers: searches). "
                   f"A single position suffices in {_share(m['single_position'], m['found'])}. Median "
                   f"{m['median_bytes']:.0f} bytes ({100 * m['median_share']:.3g} % of the K/V values), median "
                   f"{m['median_evaluations']:.0f} evaluations per search.\n")
    p = f.panels
    out.append("\n## 6. Frontier panels of class-B cells\n")
    out.append(f"One 2x2 panel per class-B cell of an independent direction (BOTH = the cell's selection; C1/C2 = "
               f"its K and V parts, or the two halves of its position range for one-component cells; counted on the first process "
               f"repeat): {_share(p['panels'], p['class_b_cells'])} run, {p['skipped']} without a split, "
               f"{p['failed']} failed ({p['records_all_directions']} panel records over all directions and process repeats; "
               f"{p['folded']} of them belong to folded directions and {p['folded_equal']} of those equal the panel "
               f"they repeat in t*, tokens, pair and scores bit for bit). With a frontier t*: {p['with_frontier']}.\n")
    if p["with_frontier"]:
        out.append("Panels are **active** when both components move the score at t* (s(C1) and s(C2) both differ "
                   "from s(EMPTY)) and **degenerate** when one component leaves it bit for bit at its EMPTY value "
                   "(then I = s(BOTH) - s(other component), zero whenever BOTH scores as that component alone: "
                   "I = 0 there says nothing about interaction).\n")
        out.append(md_table([("k", "panels"), ("n", "with a frontier"), ("nz", "I != 0 at t*"), ("z", "I = 0 at t*")], [
            {"k": "active", "n": p["active"], "nz": _share(p["active_nonzero"], p["active"]),
             "z": p["active"] - p["active_nonzero"]},
            {"k": "degenerate", "n": p["degenerate"], "nz": p["degenerate"] - p["degenerate_zero"],
             "z": _share(p["degenerate_zero"], p["degenerate"])},
            {"k": "all", "n": p["with_frontier"], "nz": _share(p["nonzero_interaction"], p["with_frontier"]),
             "z": p["zero_interaction"]}]))
        out.append(f"\nInteraction I at t* is nonzero in {_share(p['active_nonzero'], p['active'])} of the active "
                   f"panels (median |I| there {_fmt(p['median_abs_interaction_active'])}); over all panels, "
                   f"{_share(p['nonzero_interaction'], p['with_frontier'])}. Median t* {p['median_t_star']:.0f}. "
                   f"Every panel with its canonical contrast: `contrasts.md`.\n")
    rp = p.get("repeats", {"compared": 0})
    out.append("\nRepeat-level contrasts (each panel again in another process, `study findings-run --kind panels "
               "--repeats 2`): " + (f"{rp['compared']} panels have a second repeat; it equals the first in t*, tokens, "
                                     f"pair and scores bit for bit in {_share(rp['agree'], rp['compared'])}.\n"
                                     if rp["compared"] else "none recorded (one process repeat per panel).\n"))
    mg = p["margin"]
    out.append("\n### The sufficient top-1 condition before the frontier\n")
    out.append(f"At t* the four arms choose different tokens, so the condition (every arm's top-1 minus top-2 logit "
               f"m > 2 eps_inf, eps_inf = the largest absolute logit difference between any two of the four arms "
               f"over the full vocabulary) cannot hold there: {_share(p['top1_condition'], p['with_frontier'])} at "
               f"t*. The paper's claim is that it holds before divergence, at outputs 0..t*-1.\n")
    if mg["panels_with_steps"]:
        out.append(md_table([("what", "outputs before t*"), ("steps", "steps where m > 2 eps_inf in every arm"),
                             ("panels", "panels where it holds at every such step")], [
            {"what": "0 .. t*-1", "steps": _share(mg["steps_holding"], mg["steps"]),
             "panels": _share(mg["panels_holding_everywhere"], mg["panels_with_a_step"])},
            {"what": "1 .. t*-1 (output 0: all arms share the recipient's initial logits, eps_inf = 0)",
             "steps": _share(mg["steps_from_1_holding"], mg["steps_from_1"]),
             "panels": _share(mg["panels_holding_everywhere_from_1"], mg["panels_from_1"])}]))
        out.append(f"\nPanels that record the per-output margins: {_share(mg['panels_with_steps'], mg['panels'])}; "
                   f"with an output before t* (t* > 0): {mg['panels_with_a_step']}; with all four vectors at every "
                   f"output before t*: {mg['panels_all_steps_recorded']}.\n")
    else:
        out.append(f"Not measured: none of the {mg['panels']} panel records holds the per-output margins and eps_inf "
                   f"before t* (they were recorded at t* only; `study findings-run --kind panels` now records them "
                   f"as `steps`, so a new panel run measures it).\n")
    return "\n".join(out) + "\n"


def contrasts_markdown(f: Findings) -> str:
    """Every independent panel's canonical contrast (paper Table S13)."""
    head = ("# Frontier contrasts, one per panel\n\nCanonical token order (smaller id first); s = logit(a) - "
            "logit(b) at t* in each arm; additive = s(C1) + s(C2) - s(EMPTY); I = s(BOTH) - additive; sign -1: the "
            "frontier pair was reversed to canonical order and every score changed sign. class: active (both "
            "components move the score) or degenerate (one leaves it at its EMPTY value). Values as recorded "
            "(float64 of the FP32 logits).\n\n")
    return head + md_table([("run", "run"), ("task", "task"), ("selector", "selector"), ("direction", "direction"),
                            ("components", "C1/C2"), ("t_star", "t*"), ("pair", "pair a/b"), ("sign", "sign"),
                            ("tokens", "tokens EMPTY/C1/C2/BOTH"), ("s_empty", "s(EMPTY)"), ("s_c1", "s(C1)"),
                            ("s_c2", "s(C2)"), ("s_both", "s(BOTH)"), ("additive", "additive"), ("joint", "joint"),
                            ("interaction", "I"), ("eps_inf", "eps_inf"), ("class", "class")],
                           [{k: (f"{v:+.6f}" if isinstance(v, float) else v) for k, v in r.items()}
                            for r in f.contrasts])
