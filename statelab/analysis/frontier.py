"""Common-prefix frontiers and four-cell interaction scores of 2x2 panels (paper S5.2, S5.3).

A *panel* is one (task, recipient, panel name, direction) coordinate with four arms:

    EMPTY  neither component imported (the recipient's own path)
    C1     component 1 only   (L0: L0_K,   POSITION: PREFIX)
    C2     component 2 only   (L0: L0_V,   POSITION: TAIL)
    BOTH   both components

Each arm and repeat contributes an :class:`ArmTrace`: the natural output trajectory (token
ids) and, where it was archived, the full-logit trace (row ``t`` = the logits from which
output ``t`` was chosen; row 0 = the captured initial logits).  The library works on
archived traces and never needs a model.

Definitions (all per repeat):

* frontier ``t*``: the first output index at which the four trajectories cease to agree; the
  consumed prefix is identical there.  ``None`` / ``-1`` when all four are identical.  If one
  trajectory is a strict prefix of another, ``t*`` is the shorter length.
* frontier pair ``(a, b)``: the distinct tokens the arms chose at ``t*``.  When more than two
  tokens are chosen, the two most frequent are kept; ties in frequency are broken by the
  first arm (in the order EMPTY, C1, C2, BOTH) that chose the token, and ``pair_truncated``
  is set.  With exactly two tokens the same rule orders them (more frequent first, then
  the earlier arm's token first).
* fixed-pair score ``s = logit(a) - logit(b)``: the float64 difference of the two stored
  logits (exact for float32 inputs).  additive prediction ``s(C1) + s(C2) - s(EMPTY)``,
  joint ``s(BOTH)``, interaction ``I = joint - additive``; all float64.
* sufficient top-1 condition at a position: ``eps_inf`` = the largest absolute difference
  between any two arms' logits over the full vocabulary; the margin of an arm is its top-1
  minus top-2 logit; the condition holds when every arm's margin is strictly greater than
  ``2 * eps_inf``.  It needs all four vectors at that position and applies only there.
* canonicalisation: a pair ``(b, a)`` compared against reference ``(a, b)`` is flipped to
  ``(a, b)`` and every score (``score``, ``additive``, ``joint``, ``interaction``) changes
  sign; margins, ``eps_inf`` and the top-1 condition are pair-independent.  Pairs over a
  different token set cannot be canonicalised and stay ``canonical = False``.

Missing data stay missing: a contrast at output ``t`` uses exactly the four vectors at row
``t`` of that repeat; a vector archived for another position never fills the gap, and
contrasts are only defined on the shared prefix (``t <= t*``).

Results are :mod:`xarray` Datasets with dims ``(task, recipient, panel, direction, repeat,
arm, position)`` (see :data:`VARIABLES`), free of object dtypes, so they round-trip
through netCDF (:func:`save_results` / :func:`load_results`).
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xarray as xr

from statelab.errors import StatelabError
from statelab.analysis.results import load_results  # noqa: F401 (the one results reader, named here too)
from statelab.paths import atomic_write_netcdf

__all__ = [
    "ARMS", "PANEL_COMPONENTS", "VARIABLES", "FORMAT_VERSION",
    "FrontierError", "ArmTrace", "FrontierPair", "Top1Condition", "MissingVector",
    "frontier", "frontier_pair", "canonical_pair", "fixed_pair_scores", "four_cell",
    "top1_condition", "analyse_panel", "combine", "canonicalise", "score_repeat_agreement",
    "condition_accounting", "missing_vectors", "missing_summary", "contrast_table_markdown",
    "plot_scores", "save_results", "load_results", "frontier_rows",
]

FORMAT_VERSION = 1
ARMS: tuple[str, str, str, str] = ("EMPTY", "C1", "C2", "BOTH")
PANEL_COMPONENTS: dict[str, tuple[str, str]] = {"L0": ("L0_K", "L0_V"), "POSITION": ("PREFIX", "TAIL")}

PANEL_DIMS = ("task", "recipient", "panel", "direction")
CONTRAST_DIMS = PANEL_DIMS + ("repeat",)
ARM_DIMS = CONTRAST_DIMS + ("arm",)
POS_DIMS = CONTRAST_DIMS + ("position",)
ARM_POS_DIMS = CONTRAST_DIMS + ("arm", "position")
ALL_DIMS = ARM_POS_DIMS  # every dimension of a frontier dataset

_F8, _I4, _I1, _B, _S = np.float64, np.int32, np.int8, np.bool_, np.str_

# name -> (dims, dtype, fill value used where nothing was analysed, description)
VARIABLES: dict[str, tuple[tuple[str, ...], type, object, str]] = {
    "model_sha256": (PANEL_DIMS, _S, "", "model identity of every trace of the panel ('' = panel absent)"),
    "prompt_sha256": (PANEL_DIMS, _S, "", "prompt identity of every trace of the panel"),
    "n_vocab": (PANEL_DIMS, _I4, -1, "vocabulary size of the logit traces (-1: no logits)"),
    "t_star": (CONTRAST_DIMS, _I4, -1, "frontier: first output where the four trajectories differ (-1: none)"),
    "last_position": (CONTRAST_DIMS, _I4, -1, "last analysed output (t* or the last shared output)"),
    "token_a": (CONTRAST_DIMS, _I4, -1, "frontier pair token a (-1: undefined)"),
    "token_b": (CONTRAST_DIMS, _I4, -1, "frontier pair token b (-1: undefined)"),
    "n_distinct": (CONTRAST_DIMS, _I4, -1, "distinct tokens chosen at t*"),
    "pair_truncated": (CONTRAST_DIMS, _B, False, "more than two tokens at t*; the two most frequent were kept"),
    "pair_sign": (CONTRAST_DIMS, _I1, 0, "+1 raw pair order, -1 flipped by canonicalisation, 0 no pair"),
    "canonical": (CONTRAST_DIMS, _B, False, "pair aligned to a reference pair"),
    "trace_id": (ARM_DIMS, _S, "", "identity of the underlying run (shared arms share it)"),
    "n_tokens": (ARM_DIMS, _I4, -1, "trajectory length of the arm"),
    "token": (ARM_POS_DIMS, _I4, -1, "token chosen at the output (-1: beyond the trajectory)"),
    "available": (ARM_POS_DIMS, _B, False, "full-logit vector present for this arm/repeat/output"),
    "score": (ARM_POS_DIMS, _F8, np.nan, "fixed-pair score logit(token_a) - logit(token_b)"),
    "margin": (ARM_POS_DIMS, _F8, np.nan, "top-1 minus top-2 logit"),
    "argmax": (ARM_POS_DIMS, _I4, -1, "full-vocabulary argmax (first index on ties)"),
    "runner_up": (ARM_POS_DIMS, _I4, -1, "second-ranked token"),
    "pair_is_top2": (ARM_POS_DIMS, _B, False, "{token_a, token_b} are this arm's top two"),
    "requested": (POS_DIMS, _B, False, "a contrast was planned at this output"),
    "complete": (POS_DIMS, _B, False, "all four vectors are present at this output"),
    "eps_inf": (POS_DIMS, _F8, np.nan, "max |logit difference| between any two arms (full vocabulary)"),
    "top1_condition": (POS_DIMS, _B, False, "every arm's margin > 2 * eps_inf"),
    "additive": (POS_DIMS, _F8, np.nan, "s(C1) + s(C2) - s(EMPTY)"),
    "joint": (POS_DIMS, _F8, np.nan, "s(BOTH)"),
    "interaction": (POS_DIMS, _F8, np.nan, "s(BOTH) - additive"),
    "descriptive": (POS_DIMS, _B, False, "t < t* and the pair is not every arm's top two"),
    "component": (("panel", "arm"), _S, "", "component name of each arm of the panel"),
}
_SIGNED = ("score", "additive", "joint", "interaction")
_CHUNK_ELEMENTS = 1 << 22  # elements gathered at once (vocab x rows x arms)


class FrontierError(StatelabError, ValueError):
    """Inputs that cannot form a valid panel, or a request outside the defined contrasts."""


# --------------------------------------------------------------------------------------
# inputs


@dataclass(frozen=True)
class ArmTrace:
    """One arm of one repeat of a panel.

    ``arm`` is ``EMPTY``, ``C1``, ``C2``, ``BOTH`` or the panel's component name (``L0_K`` ...).
    ``logits`` has one row per archived output (``None`` when no full-logit trace exists);
    ``positions`` gives the output index of each row (default ``0..n_rows-1``), so sparse
    archives are represented exactly.  ``trace_id`` names the underlying run so that arms
    shared between panels are counted once in missing-vector accounting.
    """

    arm: str
    repeat: int
    tokens: np.ndarray
    logits: np.ndarray | None
    model_sha256: str
    prompt_sha256: str
    positions: np.ndarray | None = None
    trace_id: str = ""

    def __post_init__(self):
        tokens = np.asarray(self.tokens)
        if tokens.ndim != 1 or (tokens.size and not np.issubdtype(tokens.dtype, np.integer)):
            raise FrontierError(f"arm {self.arm!r} repeat {self.repeat}: tokens must be a 1-D integer array")
        object.__setattr__(self, "tokens", tokens.astype(np.int32, copy=False))
        object.__setattr__(self, "repeat", int(self.repeat))
        if self.logits is None:
            if self.positions is not None and len(self.positions):
                raise FrontierError(f"arm {self.arm!r} repeat {self.repeat}: positions given without logits")
            object.__setattr__(self, "positions", np.zeros(0, dtype=np.int64))
            return
        logits = np.asarray(self.logits)
        if logits.ndim != 2 or not np.issubdtype(logits.dtype, np.floating):
            raise FrontierError(f"arm {self.arm!r} repeat {self.repeat}: logits must be a 2-D float array "
                                f"(n_positions, n_vocab), got shape {logits.shape} dtype {logits.dtype}")
        if logits.shape[1] < 2:
            raise FrontierError(f"arm {self.arm!r} repeat {self.repeat}: need at least two vocabulary entries")
        object.__setattr__(self, "logits", logits)
        pos = np.arange(logits.shape[0]) if self.positions is None else np.asarray(self.positions)
        if pos.ndim != 1 or pos.shape[0] != logits.shape[0] or (pos.size and not np.issubdtype(pos.dtype, np.integer)):
            raise FrontierError(f"arm {self.arm!r} repeat {self.repeat}: positions must be one integer per logit row")
        if pos.size and (pos[0] < 0 or np.any(np.diff(pos) <= 0)):
            raise FrontierError(f"arm {self.arm!r} repeat {self.repeat}: positions must be non-negative and strictly increasing")
        object.__setattr__(self, "positions", pos.astype(np.int64, copy=False))


@dataclass(frozen=True)
class FrontierPair:
    """Tokens chosen at the frontier: ``pair`` is ``(a, b)`` or ``None`` when fewer than two
    distinct tokens were chosen; ``chosen`` maps each arm that has an output there to its token."""

    pair: tuple[int, int] | None
    chosen: dict
    n_distinct: int
    truncated: bool


@dataclass(frozen=True)
class Top1Condition:
    argmax: dict
    runner_up: dict
    margins: dict
    eps_inf: float
    holds: bool


@dataclass(frozen=True)
class MissingVector:
    task: str
    recipient: str
    panel: str
    direction: str
    repeat: int
    position: int
    arm: str
    trace_id: str


# --------------------------------------------------------------------------------------
# elementary definitions


def _stack_trajectories(trajectories: Mapping[str, Sequence[int]]) -> list[np.ndarray]:
    if not trajectories:
        raise FrontierError("no trajectories")
    return [np.asarray(v, dtype=np.int64).ravel() for v in trajectories.values()]


def frontier(trajectories: Mapping[str, Sequence[int]]) -> int | None:
    """First output index at which the trajectories cease to agree, or None if identical."""
    seqs = _stack_trajectories(trajectories)
    lengths = np.array([s.size for s in seqs])
    n = int(lengths.min())
    stacked = np.stack([s[:n] for s in seqs])
    differs = np.flatnonzero(np.any(stacked != stacked[0], axis=0))
    if differs.size:
        return int(differs[0])
    return n if np.any(lengths != n) else None


def frontier_pair(trajectories: Mapping[str, Sequence[int]], t: int) -> FrontierPair:
    """Distinct tokens chosen at output ``t``; order: frequency desc, then first arm in mapping order."""
    chosen = {}
    for arm, seq in trajectories.items():
        seq = np.asarray(seq).ravel()
        if t < seq.size:
            chosen[arm] = int(seq[t])
    toks = np.fromiter(chosen.values(), dtype=np.int64, count=len(chosen))
    uniq, first, counts = np.unique(toks, return_index=True, return_counts=True)
    order = np.lexsort((first, -counts))  # last key primary: count desc, then first appearance
    ranked = uniq[order]
    pair = (int(ranked[0]), int(ranked[1])) if ranked.size >= 2 else None
    return FrontierPair(pair=pair, chosen=chosen, n_distinct=int(uniq.size), truncated=bool(uniq.size > 2))


def canonical_pair(pair: tuple[int, int], reference_pair: tuple[int, int]) -> tuple[tuple[int, int], int]:
    """Return ``(reference_pair, sign)``: sign +1 if ``pair`` already has the reference order,
    -1 if it is the reversed pair (scores must then change sign)."""
    a, b = int(pair[0]), int(pair[1])
    ra, rb = int(reference_pair[0]), int(reference_pair[1])
    if (a, b) == (ra, rb):
        return (ra, rb), 1
    if (a, b) == (rb, ra):
        return (ra, rb), -1
    raise FrontierError(f"token pair {(a, b)} cannot be canonicalised against {(ra, rb)}: different tokens")


def fixed_pair_scores(logits_by_arm: Mapping[str, np.ndarray], pair: tuple[int, int]) -> dict:
    """``logit(a) - logit(b)`` (float64) for each arm's single logit vector."""
    a, b = int(pair[0]), int(pair[1])
    out = {}
    for arm, vec in logits_by_arm.items():
        vec = np.asarray(vec)
        _require_finite(vec, f"arm {arm!r}")
        out[arm] = float(np.float64(vec[a]) - np.float64(vec[b]))
    return out


def four_cell(scores: Mapping[str, float]) -> tuple[float, float, float]:
    """``(additive, joint, interaction)`` from the four arms' scores (keys EMPTY, C1, C2, BOTH)."""
    missing = [a for a in ARMS if a not in scores]
    if missing:
        raise FrontierError(f"four-cell contrast needs every arm; missing {missing}")
    additive = float(np.float64(scores["C1"]) + np.float64(scores["C2"]) - np.float64(scores["EMPTY"]))
    joint = float(scores["BOTH"])
    return additive, joint, joint - additive


def _top_two(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Along the last axis: (top-1 index, top-2 index, margin as float64). Ties: first index."""
    i1 = np.argmax(x, axis=-1)
    v1 = np.take_along_axis(x, i1[..., None], axis=-1)[..., 0]
    y = x.copy()
    np.put_along_axis(y, i1[..., None], -np.inf, axis=-1)
    i2 = np.argmax(y, axis=-1)
    v2 = np.take_along_axis(x, i2[..., None], axis=-1)[..., 0]
    return i1, i2, v1.astype(np.float64) - v2.astype(np.float64)


def _eps_inf(x: np.ndarray) -> np.ndarray:
    """x: (n_arms, ..., vocab) -> max over vocab of (max over arms - min over arms), float64."""
    return (x.max(axis=0).astype(np.float64) - x.min(axis=0).astype(np.float64)).max(axis=-1)


def _require_finite(x: np.ndarray, what: str) -> None:
    bad = ~np.isfinite(x)
    if bad.any():
        where = np.argwhere(bad)[0]
        raise FrontierError(f"{what}: non-finite logit ({x[tuple(where)]}) at index {tuple(int(i) for i in where)}")


def top1_condition(logits_by_arm: Mapping[str, np.ndarray]) -> Top1Condition:
    """Sufficient top-1 condition at one position from each arm's full logit vector."""
    names = list(logits_by_arm)
    if len(names) < 2:
        raise FrontierError("the top-1 condition compares at least two arms")
    vecs = [np.asarray(logits_by_arm[n]).ravel() for n in names]
    if len({v.size for v in vecs}) != 1:
        raise FrontierError(f"logit vectors of different sizes {[v.size for v in vecs]}")
    x = np.stack(vecs)
    _require_finite(x, "top-1 condition")
    i1, i2, m = _top_two(x)
    eps = float(_eps_inf(x))
    return Top1Condition(argmax={n: int(v) for n, v in zip(names, i1)},
                         runner_up={n: int(v) for n, v in zip(names, i2)},
                         margins={n: float(v) for n, v in zip(names, m)},
                         eps_inf=eps, holds=bool(np.all(m > 2.0 * eps)))


# --------------------------------------------------------------------------------------
# one panel


def _empty_dataset(coords: dict) -> dict[str, np.ndarray]:
    shape = {d: len(v) for d, v in coords.items()}
    return {name: np.full(tuple(shape[d] for d in dims), fill, dtype=object if dtype is _S else dtype)
            for name, (dims, dtype, fill, _) in VARIABLES.items()}


def _finish(arrays: dict[str, np.ndarray], coords: dict, attrs: dict | None = None) -> xr.Dataset:
    data = {}
    for name, (dims, dtype, _fill, desc) in VARIABLES.items():
        arr = arrays[name]
        if dtype is _S:
            arr = np.asarray(arr).astype(str)
        data[name] = xr.Variable(dims, arr, attrs={"description": desc})
    ds = xr.Dataset(data, coords=coords)
    ds.attrs.update(_dataset_attrs())
    if attrs:
        ds.attrs.update(attrs)
    return ds


def _dataset_attrs() -> dict:
    return {
        "statelab_frontier_format": FORMAT_VERSION,
        "arm_order": " ".join(ARMS),
        "score_definition": "logit(token_a) - logit(token_b), float64 difference of the stored logits",
        "additive_definition": "s(C1) + s(C2) - s(EMPTY)",
        "interaction_definition": "s(BOTH) - (s(C1) + s(C2) - s(EMPTY))",
        "top1_condition_definition": "every arm's top1-top2 margin > 2 * eps_inf; eps_inf = max over vocab "
                                     "of max |logit difference| between any two arms",
        "pair_rule": "distinct tokens at t*: frequency desc, ties by first arm in EMPTY,C1,C2,BOTH order; "
                     "pair_truncated marks more than two distinct tokens",
        "fill_values": "float NaN, int -1, bool False, string '', pair_sign 0",
    }


def _arm_code(arm: str, comps: tuple[str, str]) -> str:
    if arm in ARMS:
        return arm
    if arm == comps[0]:
        return "C1"
    if arm == comps[1]:
        return "C2"
    raise FrontierError(f"unknown arm {arm!r}; expected one of {ARMS} or components {comps}")


def analyse_panel(task: str, recipient: str, panel: str, direction: str, traces: Iterable[ArmTrace], *,
                  components: tuple[str, str] | None = None, positions: Iterable[int] | None = None,
                  reference_pair: tuple[int, int] | None = None, check_greedy: bool = True) -> xr.Dataset:
    """Analyse one 2x2 panel over all its repeats.

    ``positions``: outputs at which contrasts are requested in addition to each repeat's
    frontier ``t*`` (e.g. ``t* - 1`` or output 1 of a stable input); they must lie on the
    shared prefix.  Scores, margins and ``eps_inf`` are computed at every shared-prefix output
    where vectors exist, but only requested outputs count as contrasts (``requested``).
    ``reference_pair``: canonical token order for this coordinate (see :func:`canonical_pair`).
    ``check_greedy``: every available row's argmax must equal the token chosen there.
    """
    label = f"panel {task}/{recipient}/{panel}/{direction}"
    comps = tuple(components) if components is not None else PANEL_COMPONENTS.get(panel)
    if comps is None or len(comps) != 2:
        raise FrontierError(f"{label}: unknown panel; pass components=(name1, name2)")
    traces = list(traces)
    if not traces:
        raise FrontierError(f"{label}: no traces")

    for attr in ("model_sha256", "prompt_sha256"):
        values = {}
        for tr in traces:
            values.setdefault(str(getattr(tr, attr)), []).append(f"{tr.arm}/r{tr.repeat}")
        if len(values) != 1:
            detail = "; ".join(f"{v or '<empty>'}: {', '.join(a)}" for v, a in sorted(values.items()))
            raise FrontierError(f"{label}: traces of different {attr.split('_')[0]}s mixed in one panel ({detail})")
        if not next(iter(values)):
            raise FrontierError(f"{label}: empty {attr}")

    by_rep: dict[int, dict[str, ArmTrace]] = {}
    for tr in traces:
        code = _arm_code(tr.arm, comps)
        slot = by_rep.setdefault(tr.repeat, {})
        if code in slot:
            raise FrontierError(f"{label}: arm {code} repeat {tr.repeat} given twice")
        slot[code] = tr
    repeats = sorted(by_rep)
    for r in repeats:
        missing = [a for a in ARMS if a not in by_rep[r]]
        if missing:
            raise FrontierError(f"{label}: repeat {r} lacks arm(s) {', '.join(missing)}; "
                                "a panel needs EMPTY, C1, C2 and BOTH trajectories")

    vocab = {tr.logits.shape[1] for tr in traces if tr.logits is not None}
    if len(vocab) > 1:
        raise FrontierError(f"{label}: logit traces with different vocabulary sizes {sorted(vocab)}")
    n_vocab = vocab.pop() if vocab else -1
    for r in repeats:
        for a in ARMS:
            tr = by_rep[r][a]
            if tr.logits is not None:
                _require_finite(tr.logits, f"{label}: arm {a} repeat {r} logits (row, token)")

    extra = sorted({int(p) for p in positions}) if positions is not None else []
    info = []
    for r in repeats:
        traj = {a: by_rep[r][a].tokens for a in ARMS}
        t_star = frontier(traj)
        limit = t_star if t_star is not None else int(traj["EMPTY"].size) - 1
        fp = frontier_pair(traj, t_star) if t_star is not None else None
        req = sorted(set(extra) | ({t_star} if t_star is not None else set()))
        bad = [p for p in req if p < 0 or p > limit]
        if bad:
            where = f"the frontier t*={t_star}" if t_star is not None else f"the last shared output {limit}"
            raise FrontierError(f"{label}: requested output(s) {bad} of repeat {r} lie outside the shared prefix "
                                f"ending at {where}; later natural prefixes differ and are not comparable")
        info.append((t_star, limit, fp, req))

    n_pos = max(limit for _, limit, _, _ in info) + 1
    coords = {"task": np.array([task]), "recipient": np.array([recipient]), "panel": np.array([panel]),
              "direction": np.array([direction]), "repeat": np.array(repeats, dtype=np.int64),
              "arm": np.array(ARMS), "position": np.arange(n_pos, dtype=np.int64)}
    arr = _empty_dataset(coords)
    idx0 = (0, 0, 0, 0)
    first = by_rep[repeats[0]]["EMPTY"]
    arr["model_sha256"] = np.full((1, 1, 1, 1), first.model_sha256, dtype=object)
    arr["prompt_sha256"] = np.full((1, 1, 1, 1), first.prompt_sha256, dtype=object)
    arr["n_vocab"][idx0] = n_vocab
    arr["component"] = np.array([["EMPTY", comps[0], comps[1], "BOTH"]], dtype=object)

    for ri, (r, (t_star, limit, fp, req)) in enumerate(zip(repeats, info)):
        c = idx0 + (ri,)
        arr["t_star"][c] = -1 if t_star is None else t_star
        arr["last_position"][c] = limit
        pair = None
        if fp is not None:
            arr["n_distinct"][c] = fp.n_distinct
            arr["pair_truncated"][c] = fp.truncated
            pair = fp.pair
        if pair is not None:
            sign = 1
            if reference_pair is not None:
                pair, sign = canonical_pair(pair, reference_pair)
                arr["canonical"][c] = True
            arr["token_a"][c], arr["token_b"][c] = pair
            arr["pair_sign"][c] = sign
        arr["requested"][c][req] = True

        rows = np.full((len(ARMS), n_pos), -1, dtype=np.int64)
        for k, a in enumerate(ARMS):
            tr = by_rep[r][a]
            ck = c + (k,)
            arr["trace_id"][ck] = tr.trace_id or f"{task}/{recipient}/{panel}/{direction}/{a}/r{r}"
            arr["n_tokens"][ck] = tr.tokens.size
            m = min(n_pos, tr.tokens.size)
            arr["token"][ck][:m] = tr.tokens[:m]
            if tr.logits is None:
                continue
            sel = np.flatnonzero(tr.positions <= limit)
            pos = tr.positions[sel]
            rows[k, pos] = sel
            arr["available"][ck][pos] = True
            step = max(1, _CHUNK_ELEMENTS // tr.logits.shape[1])
            for s0 in range(0, sel.size, step):
                rs, ps = sel[s0:s0 + step], pos[s0:s0 + step]
                x = tr.logits[rs]
                i1, i2, m_ = _top_two(x)
                arr["argmax"][ck][ps], arr["runner_up"][ck][ps], arr["margin"][ck][ps] = i1, i2, m_
                if check_greedy:
                    has_tok = np.flatnonzero(ps < tr.tokens.size)
                    wrong = has_tok[i1[has_tok] != tr.tokens[ps[has_tok]]]
                    if wrong.size:
                        w = int(wrong[0])
                        raise FrontierError(
                            f"{label}: arm {a} repeat {r} output {int(ps[w])}: logit argmax {int(i1[w])} is not "
                            f"the chosen token {int(tr.tokens[ps[w]])}; is the trace aligned (row t = logits "
                            "that chose output t)?")
                if pair is not None:
                    pa, pb = pair
                    arr["score"][ck][ps] = x[:, pa].astype(np.float64) - x[:, pb].astype(np.float64)
                    arr["pair_is_top2"][ck][ps] = ((i1 == pa) & (i2 == pb)) | ((i1 == pb) & (i2 == pa))

        full = np.flatnonzero(np.all(rows >= 0, axis=0))
        arr["complete"][c][full] = True
        if full.size:
            logits = [by_rep[r][a].logits for a in ARMS]
            step = max(1, _CHUNK_ELEMENTS // (len(ARMS) * n_vocab))
            for s0 in range(0, full.size, step):
                ps = full[s0:s0 + step]
                x = np.stack([lg[rows[k, ps]] for k, lg in enumerate(logits)])
                arr["eps_inf"][c][ps] = _eps_inf(x)
            eps = arr["eps_inf"][c][full]
            margins = arr["margin"][c][:, full]
            arr["top1_condition"][c][full] = np.all(margins > 2.0 * eps, axis=0)
            if pair is not None:
                s = arr["score"][c][:, full]
                additive = s[1] + s[2] - s[0]
                arr["additive"][c][full] = additive
                arr["joint"][c][full] = s[3]
                arr["interaction"][c][full] = s[3] - additive
                not_top2 = ~np.all(arr["pair_is_top2"][c][:, full], axis=0)
                arr["descriptive"][c][full] = not_top2 & (full != t_star)
    return _finish(arr, coords)


# --------------------------------------------------------------------------------------
# many panels


def _populated(ds: xr.Dataset) -> list[tuple[str, str, str, str]]:
    present = np.argwhere(ds["model_sha256"].transpose(*PANEL_DIMS).values != "")
    return [tuple(str(ds[d].values[i]) for d, i in zip(PANEL_DIMS, row)) for row in present]


def _union(values: Iterable[np.ndarray], sort: bool) -> np.ndarray:
    seen: dict = {}
    for v in values:
        for x in np.asarray(v).tolist():
            seen.setdefault(x, None)
    out = list(seen)
    return np.array(sorted(out) if sort else out)


def combine(datasets: Iterable[xr.Dataset]) -> xr.Dataset:
    """Outer-combine panel datasets (from :func:`analyse_panel` or earlier :func:`combine`).

    Labels keep first-appearance order (repeat and position are sorted); cells no dataset
    supplies hold the fill values of :data:`VARIABLES`.  The same panel coordinate in two
    datasets, or one panel name with two different component naming, raises FrontierError.
    """
    datasets = list(datasets)
    if not datasets:
        raise FrontierError("nothing to combine")
    coords = {d: _union((ds[d].values for ds in datasets), sort=d in ("repeat", "position")) for d in ALL_DIMS}
    coords["arm"] = np.array(ARMS)
    for d in ("repeat", "position"):
        coords[d] = coords[d].astype(np.int64)
    arr = _empty_dataset(coords)
    index = {d: {v: i for i, v in enumerate(coords[d].tolist())} for d in ALL_DIMS}
    owner: dict[tuple, int] = {}
    comp_seen: dict[str, tuple] = {}
    for n, ds in enumerate(datasets):
        missing = [v for v in VARIABLES if v not in ds]
        if missing:
            raise FrontierError(f"dataset {n} is not a frontier dataset (missing {missing})")
        for p in ds["panel"].values.tolist():
            names = tuple(ds["component"].sel(panel=p).values.tolist())
            if not any(names):
                continue
            if comp_seen.setdefault(p, names) != names:
                raise FrontierError(f"panel {p!r} has components {comp_seen[p]} and {names}")
            arr["component"][index["panel"][p]] = names
        for key in _populated(ds):
            if key in owner:
                raise FrontierError(f"panel {'/'.join(key)} appears in datasets {owner[key]} and {n}")
            owner[key] = n
            sub = ds.sel(dict(zip(PANEL_DIMS, key)))
            for name, (dims, _dtype, _fill, _) in VARIABLES.items():
                if name == "component":
                    continue
                idx = []
                for d in dims:
                    if d in PANEL_DIMS:
                        idx.append(np.array([index[d][key[PANEL_DIMS.index(d)]]]))
                    else:
                        idx.append(np.array([index[d][v] for v in sub[d].values.tolist()]))
                values = sub[name].transpose(*[d for d in dims if d not in PANEL_DIMS]).values
                values = values.reshape(tuple(len(i) for i in idx))
                arr[name][np.ix_(*idx)] = values
    return _finish(arr, coords)


def canonicalise(ds: xr.Dataset, reference_direction: str | None = None,
                 reference_pairs: Mapping[tuple[str, str], tuple[int, int]] | None = None) -> xr.Dataset:
    """Align every coordinate's token pair to one reference order per (task, panel).

    The reference is ``reference_pairs[(task, panel)]`` if given, otherwise the pair of the
    first repeat (in recipient, repeat order) of ``reference_direction`` (default: the first
    direction, in dataset order, that has a pair).  Reversed pairs are flipped and their
    signed variables negated (``0.0 - x``, so zeros stay +0.0); ``pair_sign`` records the
    orientation.  Pairs over other tokens keep ``canonical = False``.
    """
    out = ds.copy(deep=True)
    ta = out["token_a"].transpose(*CONTRAST_DIMS).values
    tb = out["token_b"].transpose(*CONTRAST_DIMS).values
    directions = out["direction"].values.tolist()
    if reference_direction is not None and reference_direction not in directions:
        raise FrontierError(f"reference direction {reference_direction!r} not in {directions}")
    order = [directions.index(reference_direction)] if reference_direction else range(len(directions))
    ref = np.full((out.sizes["task"], out.sizes["panel"], 2), -1, dtype=np.int64)
    for i, task in enumerate(out["task"].values.tolist()):
        for j, panel in enumerate(out["panel"].values.tolist()):
            if reference_pairs is not None and (task, panel) in reference_pairs:
                ref[i, j] = reference_pairs[(task, panel)]
                continue
            for d in order:
                hits = np.argwhere((ta[i, :, j, d, :] >= 0) & (tb[i, :, j, d, :] >= 0))
                if hits.size:
                    rec, rep = hits[0]
                    ref[i, j] = ta[i, rec, j, d, rep], tb[i, rec, j, d, rep]
                    break
    ra = xr.DataArray(ref[..., 0], dims=("task", "panel"), coords={"task": out["task"], "panel": out["panel"]})
    rb = xr.DataArray(ref[..., 1], dims=("task", "panel"), coords={"task": out["task"], "panel": out["panel"]})
    has = (ra >= 0) & (out["token_a"] >= 0)
    same = has & (out["token_a"] == ra) & (out["token_b"] == rb)
    flip = has & (out["token_a"] == rb) & (out["token_b"] == ra)
    for name in _SIGNED:
        out[name] = xr.where(flip, 0.0 - out[name], out[name]).transpose(*VARIABLES[name][0])
    new_a = xr.where(flip, out["token_b"], out["token_a"])
    new_b = xr.where(flip, out["token_a"], out["token_b"])
    out["token_a"] = new_a.astype(np.int32).transpose(*CONTRAST_DIMS)
    out["token_b"] = new_b.astype(np.int32).transpose(*CONTRAST_DIMS)
    out["pair_sign"] = xr.where(flip, -out["pair_sign"], out["pair_sign"]).astype(np.int8).transpose(*CONTRAST_DIMS)
    out["canonical"] = (same | flip).transpose(*CONTRAST_DIMS)
    for name in ("token_a", "token_b", "pair_sign", "canonical", *_SIGNED):
        out[name].attrs = ds[name].attrs
    return out


def _contrast_mask(ds: xr.Dataset) -> xr.DataArray:
    return (ds["requested"] & ds["complete"]).transpose(*POS_DIMS)


def score_repeat_agreement(ds: xr.Dataset) -> xr.Dataset:
    """Compare repeats of every requested, complete contrast.

    Returns dims (task, recipient, panel, direction, position): ``n_complete`` (repeats with
    the contrast), ``agree`` (True when at least two repeats exist and token pair, t*, every
    arm's score/margin/argmax, eps_inf, additive, joint and interaction are bitwise equal),
    ``max_abs_diff`` (largest absolute difference over those float quantities, NaN when fewer
    than two repeats).  attrs: ``n_compared``, ``n_agree``.
    """
    mask = _contrast_mask(ds)
    n = mask.sum("repeat").astype(np.int32)
    equal = xr.ones_like(n, dtype=bool)
    diff = xr.full_like(n, np.nan, dtype=np.float64)
    lo_fill, hi_fill = np.iinfo(np.int64).max, np.iinfo(np.int64).min
    names = ("score", "margin", "argmax", "eps_inf", "additive", "joint", "interaction",
             "t_star", "token_a", "token_b")
    for name in names:
        da = ds[name]
        if np.issubdtype(da.dtype, np.floating):
            vals = np.where(np.isnan(da.values), np.nan, da.values.astype(np.float64))
            bits = xr.DataArray(vals.view(np.int64), dims=da.dims, coords=da.coords)
            f = da.astype(np.float64).where(mask)
            spread = f.max("repeat") - f.min("repeat")
            if "arm" in spread.dims:
                spread = spread.max("arm")
            diff = np.fmax(diff, spread.transpose(*n.dims))
        else:
            bits = da.astype(np.int64)
        hi = bits.where(mask, hi_fill).max("repeat")
        lo = bits.where(mask, lo_fill).min("repeat")
        eq = (hi == lo) | (n < 1)
        if "arm" in eq.dims:
            eq = eq.all("arm")
        equal = equal & eq.broadcast_like(n).transpose(*n.dims)
    agree = (n >= 2) & equal
    diff = diff.where(n >= 2)
    out = xr.Dataset({"n_complete": n, "agree": agree, "max_abs_diff": diff})
    out.attrs.update(n_compared=int((n >= 2).sum()), n_agree=int(agree.sum()))
    return out


def condition_accounting(ds: xr.Dataset, symmetric_panels: Sequence[str] = ("POSITION",)) -> dict:
    """Direction-symmetry accounting (paper S5.3) of requested, complete contrasts.

    Per panel name and in total: ``rows`` (oriented repeat-level contrasts), ``oriented``
    (distinct task/recipient/direction/output, repeats collapsed), ``conditions`` (for
    ``symmetric_panels`` the two directions are one condition: distinct task/output;
    other panels keep their orientation) and ``inputs`` (distinct tasks).
    """
    mask = _contrast_mask(ds).values
    hits = np.argwhere(mask)
    result = {}
    panels = ds["panel"].values.tolist()
    for p_i, p in enumerate(panels + ["total"]):
        sel = hits if p == "total" else hits[hits[:, 2] == p_i]
        rows = len(sel)
        oriented = {(h[0], h[1], h[2], h[3], h[5]) for h in sel}
        conditions = {(h[0], h[2], h[5]) if panels[h[2]] in symmetric_panels else (h[0], h[1], h[2], h[3], h[5])
                      for h in sel}
        inputs = {h[0] for h in sel}
        result[p] = {"rows": rows, "oriented": len(oriented), "conditions": len(conditions), "inputs": len(inputs)}
    return result


def missing_vectors(ds: xr.Dataset) -> list[MissingVector]:
    """Every absent (arm, repeat, output) vector of a requested contrast, in coordinate order."""
    req = ds["requested"].transpose(*POS_DIMS).values
    avail = ds["available"].transpose(*ARM_POS_DIMS).values
    ids = ds["trace_id"].transpose(*ARM_DIMS).values
    hits = np.argwhere(req[:, :, :, :, :, None, :] & ~avail)
    out = []
    for h in hits:
        t, rc, p, d, r, a, pos = (int(i) for i in h)
        out.append(MissingVector(task=str(ds["task"].values[t]), recipient=str(ds["recipient"].values[rc]),
                                 panel=str(ds["panel"].values[p]), direction=str(ds["direction"].values[d]),
                                 repeat=int(ds["repeat"].values[r]), position=int(ds["position"].values[pos]),
                                 arm=ARMS[a], trace_id=str(ids[t, rc, p, d, r, a])))
    return out


def missing_summary(ds: xr.Dataset) -> dict:
    """Counts: planned / complete / incomplete contrasts, missing panel entries and distinct
    missing vectors (distinct trace_id and output: arms shared between panels count once)."""
    req = ds["requested"].values
    comp = (ds["requested"] & ds["complete"]).values
    miss = missing_vectors(ds)
    return {"planned": int(req.sum()), "complete": int(comp.sum()), "incomplete": int(req.sum() - comp.sum()),
            "missing_entries": len(miss), "distinct_missing_vectors": len({(m.trace_id, m.position) for m in miss})}


# --------------------------------------------------------------------------------------
# reporting


def _fmt(x: float) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.6f}"


def contrast_table_markdown(ds: xr.Dataset) -> str:
    """Every requested contrast: complete ones as a table (six decimals), incomplete ones
    listed with exactly the vectors they lack."""
    req = ds["requested"].transpose(*POS_DIMS).values
    comp = ds["complete"].transpose(*POS_DIMS).values
    head = ("| task | recipient | panel | direction | repeat | output | t* | pair a/b | "
            "s(EMPTY) | s(C1) | s(C2) | s(BOTH) | additive | joint | I | eps_inf | margins | argmax | top-1 | notes |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    incomplete = []
    for h in np.argwhere(req):
        t, rc, p, d, r, pos = (int(i) for i in h)
        sel = dict(task=t, recipient=rc, panel=p, direction=d, repeat=r, position=pos)
        cell = ds.isel(sel)
        names = [str(cell[k].values) for k in PANEL_DIMS]
        rep, out = int(cell["repeat"]), int(cell["position"])
        if not comp[tuple(h)]:
            incomplete.append((names, rep, out))
            continue
        ts, a, b = int(cell["t_star"]), int(cell["token_a"]), int(cell["token_b"])
        scores = cell["score"].values
        notes = []
        if out == ts:
            notes.append("frontier")
        if bool(cell["descriptive"]):
            notes.append("descriptive")
        if bool(cell["canonical"]):
            notes.append("canonical" + (" (flipped)" if int(cell["pair_sign"]) < 0 else ""))
        if bool(cell["pair_truncated"]):
            notes.append(f"{int(cell['n_distinct'])} tokens at t*")
        lines.append("| " + " | ".join([
            *names, str(rep), str(out), str(ts) if ts >= 0 else "—", f"{a}/{b}" if a >= 0 else "—",
            *(_fmt(float(s)) for s in scores), _fmt(float(cell["additive"])), _fmt(float(cell["joint"])),
            _fmt(float(cell["interaction"])), _fmt(float(cell["eps_inf"])),
            "/".join(_fmt(float(m)) for m in cell["margin"].values),
            "/".join(str(int(x)) for x in cell["argmax"].values),
            "holds" if bool(cell["top1_condition"]) else "fails", ", ".join(notes)]) + " |")
    parts = ["\n".join(lines)]
    if incomplete:
        by_key: dict = {}
        for m in missing_vectors(ds):
            by_key.setdefault(((m.task, m.recipient, m.panel, m.direction), m.repeat, m.position), []).append(m)
        items = []
        for names, rep, out in incomplete:
            lack = by_key[(tuple(names), rep, out)]
            what = ", ".join(f"{m.arm} ({m.trace_id})" for m in lack)
            items.append(f"- {'/'.join(names)} repeat {rep} output {out}: missing {what}")
        parts.append("Incomplete contrasts (missing full-logit vectors; no substitute is used):\n" + "\n".join(items))
    return "\n\n".join(parts) + "\n"


def plot_scores(ds: xr.Dataset, coordinate: Mapping[str, object], path: str | os.PathLike, window: int = 8) -> Path:
    """Plot the four arms' fixed-pair scores over outputs ``t* - window .. t*`` for one
    (task, recipient, panel, direction, repeat) coordinate, with the additive prediction."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    keys = [k for k in CONTRAST_DIMS if k not in coordinate]
    if keys:
        raise FrontierError(f"coordinate lacks {keys}")
    cell = ds.sel({k: coordinate[k] for k in CONTRAST_DIMS})
    ts = int(cell["t_star"])
    if ts < 0 or int(cell["token_a"]) < 0:
        raise FrontierError(f"coordinate {dict(coordinate)} has no frontier pair to plot")
    lo = max(0, ts - int(window))
    pos = np.arange(lo, ts + 1)
    part = cell.sel(position=pos)
    comps = [str(c) for c in ds["component"].sel(panel=coordinate["panel"]).values]
    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for k, arm in enumerate(ARMS):
        ax.plot(pos, part["score"].sel(arm=arm).values, marker="o", label=f"{arm} ({comps[k]})" if comps[k] != arm else arm)
    ax.plot(pos, part["additive"].values, linestyle="--", color="black", label="additive prediction")
    ax.axvline(ts, color="grey", linewidth=0.8)
    ax.axhline(0.0, color="grey", linewidth=0.5)
    ax.set_xlabel("output index")
    ax.set_ylabel(f"logit({int(cell['token_a'])}) - logit({int(cell['token_b'])})")
    ax.set_title(" / ".join(str(coordinate[k]) for k in CONTRAST_DIMS) + f"   t* = {ts}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    return path


# --------------------------------------------------------------------------------------
# persistence


def save_results(ds: xr.Dataset, path: str | os.PathLike) -> Path:
    """Write ``ds`` as netCDF atomically (temporary file in the same folder, then os.replace)."""
    path = Path(path)
    for name, var in ds.variables.items():
        if var.dtype == object:
            raise FrontierError(f"variable {name!r} has object dtype; not netCDF-safe")
    return atomic_write_netcdf(path, ds)


def frontier_rows(ds, agreement=None) -> list[dict]:
    """One row per populated (task, recipient, panel, direction, repeat): t*, pair, the
    four arms' tokens and scores at t*, additive/joint/interaction, top-1 condition."""
    rows = []
    present = ds["model_sha256"].transpose("task", "recipient", "panel", "direction").values != ""
    for ti, ri, pi, di in np.argwhere(present):
        for k in range(ds.sizes["repeat"]):
            c = ds.isel(task=ti, recipient=ri, panel=pi, direction=di, repeat=k)
            if int(c["n_tokens"].values.max()) < 0:
                continue
            ts = int(c["t_star"])
            row = {"task": str(c["task"].values), "recipient": str(c["recipient"].values),
                   "panel": str(c["panel"].values), "direction": str(c["direction"].values),
                   "repeat": int(c["repeat"]), "t_star": ts, "last": int(c["last_position"])}
            if ts >= 0 and int(c["token_a"]) >= 0:
                at = c.sel(position=ts)
                row.update(token_a=int(c["token_a"]), token_b=int(c["token_b"]),
                           flipped=int(c["pair_sign"]) < 0, tokens=[int(x) for x in at["token"].values],
                           scores=[float(x) for x in at["score"].values], additive=float(at["additive"]),
                           joint=float(at["joint"]), interaction=float(at["interaction"]),
                           eps_inf=float(at["eps_inf"]), top1=bool(at["top1_condition"]))
            if agreement is not None and ts >= 0:
                a = agreement.isel(task=ti, recipient=ri, panel=pi, direction=di).sel(position=ts)
                row["agree"] = bool(a["agree"])
            rows.append(row)
    return rows
