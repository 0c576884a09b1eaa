"""Endpoint classes, trajectory equivalence, selector lattices, magnitude separability,
minimal sufficient selections and bootstrap intervals (paper 6.2, S3.1, S5.1-S5.3).

Endpoints compare as (full token sequence, EOG flag).  Accepted endpoint forms: an object
with ``tokens`` and ``eog`` attributes (the lead's ``Endpoint``), a mapping with those keys,
a ``(tokens, eog)`` tuple whose second item is a bool, or a bare token sequence (its EOG
flag is then unknown, ``None``, and equals only another unknown flag).  For hashes, pass
``str``/``bytes`` values: they compare as themselves.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import networkx as nx
import numpy as np
import xarray as xr

__all__ = [
    "CLASSES", "first_difference", "endpoint_key", "endpoint_class", "trajectory_classes",
    "RepeatAgreement", "repeat_agreement", "class_matrix_markdown",
    "selector_lattice", "non_monotone_pairs",
    "OrientationResult", "SeparabilityResult", "magnitude_separability",
    "Evaluation", "MinimalSelection", "minimal_sufficient_selection",
    "BootstrapInterval", "bootstrap_ratio_interval", "kv_profile_dataset",
]

CLASSES = ("B", "C", "D")


# --------------------------------------------------------------------------------------
# endpoints


def _tokens(x) -> np.ndarray:
    arr = np.asarray(x)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"token sequence must be 1-D integers, got shape {arr.shape} dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def first_difference(a_tokens: Sequence[int], b_tokens: Sequence[int]) -> int | None:
    """Index of the first differing output; the shorter length if one is a prefix of the
    other; None if equal."""
    a, b = _tokens(a_tokens), _tokens(b_tokens)
    n = min(a.size, b.size)
    differs = np.flatnonzero(a[:n] != b[:n])
    if differs.size:
        return int(differs[0])
    return None if a.size == b.size else n


def endpoint_key(endpoint) -> Hashable:
    """Hashable identity of an endpoint (tokens + EOG flag) or of a str/bytes hash."""
    if isinstance(endpoint, (str, bytes)):
        return ("hash", endpoint)
    if hasattr(endpoint, "tokens"):
        tokens, eog = endpoint.tokens, getattr(endpoint, "eog", None)
    elif isinstance(endpoint, Mapping):
        tokens, eog = endpoint["tokens"], endpoint.get("eog")
    elif (isinstance(endpoint, tuple) and len(endpoint) == 2
          and isinstance(endpoint[1], (bool, np.bool_))):
        tokens, eog = endpoint
    else:
        tokens, eog = endpoint, None
    t = _tokens(tokens)
    return ("endpoint", t.size, t.tobytes(), None if eog is None else bool(eog))


def endpoint_class(result, donor, recipient) -> str:
    """B: reproduces a distinguishable donor endpoint; C: a third trajectory; D: keeps the
    recipient endpoint (also when donor and recipient coincide and the result matches)."""
    r, d, c = endpoint_key(result), endpoint_key(donor), endpoint_key(recipient)
    if r == c:
        return "D"
    if r == d:
        return "B"
    return "C"


def _ordered(names: list) -> list:
    try:
        return sorted(names)
    except TypeError:
        return sorted(names, key=repr)


def trajectory_classes(endpoints: Mapping[Hashable, object]) -> list[list[Hashable]]:
    """Equivalence classes of identical endpoints (or identical hashes).

    Members are sorted; classes are ordered by their first (smallest) member.
    """
    groups: dict[Hashable, list] = {}
    for name, ep in endpoints.items():
        groups.setdefault(endpoint_key(ep), []).append(name)
    by_first = {members[0]: members for members in (_ordered(m) for m in groups.values())}
    return [by_first[first] for first in _ordered(list(by_first))]


# --------------------------------------------------------------------------------------
# repeat agreement and the class matrix


@dataclass(frozen=True)
class RepeatAgreement:
    """``agree``: per coordinate (all dims except repeat), True when every repeat is present
    and all carry the same class.  Coordinates with no repeat present are not planned and are
    excluded from the counts; ``incomplete`` counts those with only some repeats present."""

    agree: xr.DataArray
    n_coordinates: int
    n_agree: int
    n_disagree: int
    n_incomplete: int
    disagreements: tuple[dict, ...]


def repeat_agreement(ds: xr.Dataset, variable: str = "klass", repeat_dim: str = "repeat",
                     missing: str = "") -> RepeatAgreement:
    """Repeat agreement of a string class variable (``missing`` marks an absent repeat)."""
    da = ds[variable]
    if repeat_dim not in da.dims:
        raise ValueError(f"{variable!r} has no {repeat_dim!r} dimension")
    da = da.transpose(*[d for d in da.dims if d != repeat_dim], repeat_dim)
    vals = da.values.astype(str)
    present = vals != missing
    n_present = present.sum(axis=-1)
    all_same = np.all(vals == vals[..., :1], axis=-1)
    full = n_present == vals.shape[-1]
    agree_np = full & all_same
    planned = n_present > 0
    incomplete = planned & ~full
    disagree = full & ~all_same
    dims = da.dims[:-1]
    agree = xr.DataArray(agree_np, dims=dims, coords={d: da[d] for d in dims if d in da.coords})
    rows = []
    for idx in np.argwhere(disagree | incomplete):
        coord = {d: da[d].values[i].item() if d in da.coords else int(i) for d, i in zip(dims, idx)}
        coord["classes"] = tuple(vals[tuple(idx)].tolist())
        rows.append(coord)
    return RepeatAgreement(agree=agree, n_coordinates=int(planned.sum()), n_agree=int(agree_np.sum()),
                           n_disagree=int(disagree.sum()), n_incomplete=int(incomplete.sum()),
                           disagreements=tuple(rows))


def _cell(values: Sequence[str], missing: str) -> str:
    if all(v == missing for v in values):
        return "—"
    seen: list[str] = []
    for v in values:
        v = "?" if v == missing else v
        if v not in seen:
            seen.append(v)
    return "/".join(seen)


def class_matrix_markdown(ds: xr.Dataset, variable: str = "klass", row_dims: tuple[str, str] = ("task", "selector"),
                          column_dim: str = "direction", repeat_dim: str = "repeat", missing: str = "") -> str:
    """Markdown matrix like paper Table S11: one row per task x selector, one column per
    direction.  A cell shows the class letter when all repeats agree, the distinct letters in
    repeat order (``B/C``) when they disagree, ``?`` for an absent repeat, ``—`` when the
    coordinate has no result.  A summary line counts requests per class and agreement."""
    da = ds[variable].transpose(*row_dims, column_dim, repeat_dim)
    vals = da.values.astype(str)
    cols = [str(c) for c in da[column_dim].values]
    lines = ["| " + " | ".join([*row_dims, *cols]) + " |", "|" + "---|" * (len(row_dims) + len(cols))]
    for i, r0 in enumerate(da[row_dims[0]].values):
        for j, r1 in enumerate(da[row_dims[1]].values):
            cells = [_cell(vals[i, j, k].tolist(), missing) for k in range(len(cols))]
            if all(c == "—" for c in cells):
                continue
            lines.append("| " + " | ".join([str(r0), str(r1), *cells]) + " |")
    counts = {c: int((vals == c).sum()) for c in CLASSES}
    other = int(((vals != missing) & ~np.isin(vals, CLASSES)).sum())
    agreement = repeat_agreement(ds, variable, repeat_dim, missing)
    summary = (f"Requests: {', '.join(f'{c} {n}' for c, n in counts.items())}"
               + (f", other {other}" if other else "")
               + f". Repeats agree at {agreement.n_agree} of {agreement.n_coordinates} coordinates"
               + (f"; disagree at {agreement.n_disagree}" if agreement.n_disagree else "")
               + (f"; incomplete at {agreement.n_incomplete}" if agreement.n_incomplete else "") + ".")
    return "\n".join(lines) + "\n\n" + summary + "\n"


# --------------------------------------------------------------------------------------
# selector lattice


def _subsets(packed: np.ndarray) -> np.ndarray:
    """subset[i, j]: mask i (row i of the bit-packed masks) is contained in mask j.

    Only the distinct columns of ``packed`` matter (a byte of eight mask bits per mask), and
    selector masks are runs: the columns are read where any mask changes, deduplicated, and
    unpacked to bits; i is in j when no bit is set in i and clear in j, counted for all pairs
    at once by one matrix product (exact in float64: at most 8 x columns per count)."""
    if packed.shape[1] == 0:
        return np.ones((len(packed), len(packed)), bool)
    change = np.flatnonzero(np.any(packed[:, 1:] != packed[:, :-1], axis=0)) + 1
    cols = np.ascontiguousarray(packed[:, np.concatenate([[0], change])].T)  # one row per column
    cols = np.unique(cols.view(np.dtype((np.void, cols.shape[1]))).ravel()).view(np.uint8).reshape(-1, len(packed))
    bits = np.unpackbits(cols, axis=0).astype(np.float64)  # (8 x distinct columns, masks)
    return (bits.T @ (1.0 - bits)) == 0


def selector_lattice(masks: Mapping[Hashable, np.ndarray]) -> nx.DiGraph:
    """Inclusion DAG of selections from their actual flat byte masks.

    An edge ``small -> large`` means ``small`` is a strict subset of ``large``; the graph is
    the transitive reduction (covering relations).  Node attribute ``n_selected`` counts the
    selected bytes; selections with identical masks get no edge and are listed in
    ``graph.graph['equal']`` as sorted name pairs.
    """
    names = list(masks)
    flat = [np.asarray(masks[n]).ravel() for n in names]
    sizes = {f.size for f in flat}
    if len(sizes) > 1:
        raise ValueError(f"masks cover different storage sizes {sorted(sizes)}")
    for n, f in zip(names, flat):
        if f.dtype != np.bool_:
            raise TypeError(f"mask {n!r} must be boolean, got {f.dtype}")
    counts = np.array([int(np.count_nonzero(f)) for f in flat])
    subset = _subsets(np.stack([np.packbits(f) for f in flat])) if flat else np.zeros((0, 0), bool)
    full = nx.DiGraph()
    for n, c in zip(names, counts):
        full.add_node(n, n_selected=int(c))
    equal = []
    for i, j in np.argwhere(subset):
        if i == j:
            continue
        if subset[j, i]:
            if i < j:
                equal.append(tuple(_ordered([names[i], names[j]])))
            continue
        full.add_edge(names[i], names[j])
    graph = nx.transitive_reduction(full)
    graph.add_nodes_from(full.nodes(data=True))
    graph.graph["equal"] = sorted(equal, key=repr)
    graph.graph["storage_size"] = sizes.pop() if sizes else 0
    return graph


def non_monotone_pairs(lattice: nx.DiGraph, outcomes: Mapping[Hashable, str],
                       reproduces: str = "B") -> list[tuple[Hashable, Hashable]]:
    """Every (small, large) with large any strict superset of small (a descendant in the
    lattice, not only a covering edge), where small reproduces the donor and large does not.
    Selections without an outcome are skipped.  Sorted by (small, large)."""
    pairs = []
    for small in lattice.nodes:
        if outcomes.get(small) != reproduces:
            continue
        for large in nx.descendants(lattice, small):
            if large in outcomes and outcomes[large] != reproduces:
                pairs.append((small, large))
    return _ordered(pairs)


# --------------------------------------------------------------------------------------
# magnitude separability


@dataclass(frozen=True)
class OrientationResult:
    """One threshold orientation.

    ``diverging_above``: rule "diverges iff magnitude > threshold" (the paper's increasing
    rule); separable iff every stable magnitude is strictly below every diverging one, and
    then ``threshold`` is the largest stable magnitude (``-inf`` with no stable input).
    ``diverging_below``: "diverges iff magnitude < threshold"; ``threshold`` is the smallest
    stable magnitude (``+inf`` with none).  ``violations``: every (stable, diverging) pair
    ordered against the rule (ties included); ``counterexample``: the most extreme one.
    """

    orientation: str
    separable: bool
    threshold: float | None
    counterexample: tuple[Hashable, Hashable] | None
    violations: tuple[tuple[Hashable, Hashable], ...]


@dataclass(frozen=True)
class SeparabilityResult:
    separable: bool  # any tested orientation separates
    orientations: dict

    def __getitem__(self, orientation: str) -> OrientationResult:
        return self.orientations[orientation]


_ORIENTATIONS = ("diverging_above", "diverging_below")


def magnitude_separability(magnitudes: Mapping[Hashable, float], diverges: Mapping[Hashable, bool],
                           orientations: Sequence[str] = ("diverging_above",)) -> SeparabilityResult:
    """Does one threshold on the magnitude separate diverging from stable inputs?

    By default only the increasing rule ("diverging above", as in paper S5.2) is tested;
    pass ``orientations=("diverging_above", "diverging_below")`` for both.
    """
    if set(magnitudes) != set(diverges):
        raise ValueError(f"inputs differ: {sorted(map(repr, set(magnitudes) ^ set(diverges)))}")
    bad = [o for o in orientations if o not in _ORIENTATIONS]
    if bad or not orientations:
        raise ValueError(f"orientations must be drawn from {_ORIENTATIONS}, got {list(orientations)}")
    names = _ordered(list(magnitudes))
    mag = np.array([float(magnitudes[n]) for n in names], dtype=np.float64)
    if not np.all(np.isfinite(mag)):
        raise ValueError("magnitudes must be finite")
    div = np.array([bool(diverges[n]) for n in names])
    si, di = np.flatnonzero(~div), np.flatnonzero(div)
    results = {}
    for o in orientations:
        if o == "diverging_above":
            bad_pairs = mag[si][:, None] >= mag[di][None, :]
            threshold = float(mag[si].max()) if si.size else -math.inf
            extreme = (si[np.argmax(mag[si])], di[np.argmin(mag[di])]) if si.size and di.size else None
        else:
            bad_pairs = mag[si][:, None] <= mag[di][None, :]
            threshold = float(mag[si].min()) if si.size else math.inf
            extreme = (si[np.argmin(mag[si])], di[np.argmax(mag[di])]) if si.size and di.size else None
        viol = tuple((names[si[a]], names[di[b]]) for a, b in np.argwhere(bad_pairs))
        separable = not viol
        results[o] = OrientationResult(
            orientation=o, separable=separable, threshold=threshold if separable else None,
            counterexample=None if separable else (names[extreme[0]], names[extreme[1]]), violations=viol)
    return SeparabilityResult(separable=any(r.separable for r in results.values()), orientations=results)


# --------------------------------------------------------------------------------------
# minimal sufficient selection


@dataclass(frozen=True)
class Evaluation:
    phase: str  # "full", "layers", "positions"
    layers: tuple[int, ...]
    positions: tuple[int, int]
    reproduces: bool


@dataclass(frozen=True)
class MinimalSelection:
    """``found``: the full selection reproduces; then ``layers`` / ``positions`` is the
    smallest selection found, which was itself evaluated True.  ``path`` lists every call
    of ``evaluate`` in order (results are cached: no selection is evaluated twice)."""

    found: bool
    layers: tuple[int, ...]
    positions: tuple[int, int]
    path: tuple[Evaluation, ...] = field(repr=False)

    @property
    def n_evaluations(self) -> int:
        return len(self.path)


def minimal_sufficient_selection(evaluate: Callable[[tuple[int, ...], tuple[int, int]], bool], layers: int,
                                 positions: tuple[int, int], refine: bool = True) -> MinimalSelection:
    """Search a small selection that still reproduces the donor.

    ``evaluate(layer_set, (lo, hi))`` -> True when importing those layers (sorted tuple) over
    positions ``[lo, hi)`` reproduces the donor.  Phase 1 works on layers over the full
    position range: bisection (keep the first half that reproduces, else the second); with
    ``refine`` it continues as delta debugging (ddmin: finer chunks and their complements)
    until no single chunk can be removed, so the layer set is 1-minimal with respect to the
    evaluations.  Phase 2 fixes those layers and bisects the position range the same way;
    with ``refine`` it then trims each end by binary search.  Sufficiency need not be
    monotone, so the result is a small sufficient selection, not a global minimum.
    Deterministic: the same oracle gives the same path.
    """
    lo0, hi0 = int(positions[0]), int(positions[1])
    if layers < 1 or hi0 <= lo0:
        raise ValueError("need at least one layer and a non-empty position range")
    cache: dict[tuple, bool] = {}
    path: list[Evaluation] = []

    def ev(phase: str, ls, pr) -> bool:
        key = (tuple(sorted(int(x) for x in ls)), (int(pr[0]), int(pr[1])))
        if key not in cache:
            out = evaluate(*key)
            if not isinstance(out, (bool, np.bool_)):
                raise TypeError(f"evaluate must return a bool, got {type(out).__name__}")
            cache[key] = bool(out)
            path.append(Evaluation(phase, key[0], key[1], bool(out)))
        return cache[key]

    current = list(range(layers))
    if not ev("full", current, (lo0, hi0)):
        return MinimalSelection(False, tuple(current), (lo0, hi0), tuple(path))

    # phase 1: layers
    n = 2
    while len(current) >= 2:
        chunks = [[int(x) for x in c] for c in np.array_split(np.array(current), min(n, len(current)))]
        chosen = next((c for c in chunks if ev("layers", c, (lo0, hi0))), None)
        if chosen is not None:
            current, n = chosen, 2
            continue
        if not refine:
            break
        if len(chunks) > 2:
            complement = None
            for c in chunks:
                rest = [x for x in current if x not in c]
                if ev("layers", rest, (lo0, hi0)):
                    complement = rest
                    break
            if complement is not None:
                current, n = complement, max(n - 1, 2)
                continue
        if n >= len(current):
            break
        n = min(len(current), 2 * n)

    # phase 2: positions
    lo, hi = lo0, hi0
    while hi - lo >= 2:
        mid = lo + (hi - lo) // 2
        if ev("positions", current, (lo, mid)):
            hi = mid
        elif ev("positions", current, (mid, hi)):
            lo = mid
        else:
            break
    if refine and hi - lo >= 2:
        a, b = lo, hi - 1  # largest lo' with [lo', hi) reproducing; [lo, hi) is known to
        while a < b:
            m = (a + b + 1) // 2
            if ev("positions", current, (m, hi)):
                a = m
            else:
                b = m - 1
        lo = a
        a, b = lo + 1, hi  # smallest hi' with [lo, hi') reproducing; [lo, hi) is known to
        while a < b:
            m = (a + b) // 2
            if ev("positions", current, (lo, m)):
                b = m
            else:
                a = m + 1
        hi = b
    return MinimalSelection(True, tuple(current), (lo, hi), tuple(path))


# --------------------------------------------------------------------------------------
# bootstrap


@dataclass(frozen=True)
class BootstrapInterval:
    """Percentile bootstrap of the mean session log contrast, reported as a ratio.

    Iterating yields ``(ratio, lower, upper)`` so it unpacks like a tuple.
    """

    ratio: float
    lower: float
    upper: float
    mean_log: float
    n_sessions: int
    n_resamples: int
    seed: int
    level: float
    method: str = "percentile bootstrap of the mean; numpy default_rng(seed).integers; linear percentiles"

    def __iter__(self):
        return iter((self.ratio, self.lower, self.upper))


def bootstrap_ratio_interval(session_log_contrasts: Sequence[float], n_resamples: int = 10000,
                             seed: int = 20261014, level: float = 0.95) -> BootstrapInterval:
    """Resample sessions with replacement ``n_resamples`` times (``np.random.default_rng(seed)
    .integers(0, n, (n_resamples, n))``), take each resample's mean, and report
    ``exp(mean)`` with ``exp`` of the linearly interpolated ``(1-level)/2`` and ``(1+level)/2``
    percentiles of the resampled means (paper S3.1: seed 20261014, 10,000 draws)."""
    x = np.asarray(session_log_contrasts, dtype=np.float64).ravel()
    if x.size == 0 or not np.all(np.isfinite(x)):
        raise ValueError("need at least one finite session log contrast")
    if not 0.0 < level < 1.0 or n_resamples < 1:
        raise ValueError("level must lie in (0, 1) and n_resamples >= 1")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(int(n_resamples), x.size))
    means = x[idx].mean(axis=1)
    q = np.array([(1.0 - level) / 2.0, (1.0 + level) / 2.0]) * 100.0
    lo, hi = np.percentile(means, q, method="linear")
    mean = float(x.mean())
    return BootstrapInterval(ratio=math.exp(mean), lower=math.exp(float(lo)), upper=math.exp(float(hi)),
                             mean_log=mean, n_sessions=int(x.size), n_resamples=int(n_resamples),
                             seed=int(seed), level=float(level))


# --------------------------------------------------------------------------------------
# per-layer K/V profiles


def kv_profile_dataset(records: Sequence[dict]) -> xr.Dataset:
    """``kvstate.StateDiff.records()`` as a (layer, component) Dataset."""
    layers = sorted({int(r["layer"]) for r in records})
    comps = sorted({str(r["component"]) for r in records})
    shape = (len(layers), len(comps))
    data = {v: np.zeros(shape, np.float64) for v in ("changed_bytes", "max_abs", "l2", "l2_rel")}
    for r in records:
        i, j = layers.index(int(r["layer"])), comps.index(str(r["component"]))
        for v in data:
            data[v][i, j] = float(r[v])
    return xr.Dataset({v: (("layer", "component"), a) for v, a in data.items()},
                      coords={"layer": layers, "component": comps})
