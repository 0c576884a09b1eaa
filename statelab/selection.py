"""KV selectors: TOML data files turned into element masks over a parsed :class:`KVState`.

A selector names a set of stored K/V *values* by (layer, component, cell position). It is
a data file ``selectors/<NAME>.toml`` (the file stem is the name). Schema::

    description = "free text"          # optional string

    [[term]]                           # zero or more terms; the selector is their UNION
    selector       = "NAME"            # optional: start from another selector (by name)
    layers         = [0, 1, -1]        # optional: explicit layer indices (negative = from the end)
    layer_fraction = [0.25, 0.75]      # optional: half-open range of layer fractions (see below)
    component      = "K"               # optional: "K", "V" or "KV" (default "KV")
    positions      = [0, 128]          # optional: half-open [start, end) of stored positions;
                                       #           [128] or [128, inf] = open end

Each term is the INTERSECTION of its constraints; an absent constraint does not restrict
(so an empty ``[[term]]`` selects everything, and a file without terms selects nothing).
``selector = "NAME"`` intersects the named selector with the term's other constraints, so
``{selector = "EARLY", positions = [0, 128]}`` is "early layers, prefix positions" and a
union of named selectors is a list of terms that each name one. References are resolved
when the selector is loaded (unknown names and cycles fail then). A term may give
``layers`` or ``layer_fraction``, not both.

``layer_fraction = [lo, hi]`` (0 <= lo < hi <= 1; numbers or exact strings like "1/3")
selects layers ``b(lo) <= i < b(hi)`` with ``b(f) = floor(f * n_layer + 1/2)`` computed in
exact rational arithmetic (round half up). Adjacent ranges therefore partition the
layers with no gap or overlap. With 32 layers the quarters give 8/16/8 (the paper's
early/middle/late); with SmolLM2-135M's 30 layers, b(1/4) = floor(8.0) = 8 and
b(3/4) = floor(23.0) = 23, so EARLY = 0..7 (8), MIDDLE = 8..22 (15), LATE = 23..29 (7).

Positions are the cells' stored logical positions (``state.positions``), not cell indices.
Masks honour the real storage strides: K is ``(n_cells, n_embd_k_gqa)`` (a cell is a row)
and V is ``(n_embd_v_gqa, n_cells)`` when ``v_trans`` (a cell is a column).

Errors (:class:`SelectorError`, raised by :func:`load_selector` or, for the layer count,
by :meth:`Selector.validate` / :func:`select` before any mask is built): unknown selector
name (the known ones are listed), malformed TOML (the file is named), unknown keys,
unknown component, empty position or layer-fraction range, layer index beyond the model
(the layer count is given), reference cycles.

Search path for names: ``search_dirs`` if given, else every directory of the
``STATELAB_SELECTORS`` environment variable (``os.pathsep``-separated) and then the
repository's ``selectors/`` directory; the first match wins.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import numpy as np

from .errors import StatelabError
from .kvstate import KVFormatError, KVState, check_same_geometry

__all__ = [
    "Selection",
    "Selector",
    "SelectorError",
    "Term",
    "apply_subset",
    "default_search_dirs",
    "layer_fraction_bounds",
    "list_selectors",
    "load_selector",
    "select",
]

COMPONENTS = ("K", "V", "KV")
_TOP_KEYS = ("description", "term")
_TERM_KEYS = ("selector", "layers", "layer_fraction", "component", "positions")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_REPO_SELECTORS = Path(__file__).resolve().parent.parent / "selectors"


class SelectorError(StatelabError, ValueError):
    """A selector that cannot be loaded or does not fit the model."""


# --------------------------------------------------------------------------- schema


def layer_fraction_bounds(lo: Fraction, hi: Fraction, n_layer: int) -> tuple[int, int]:
    """Half-open layer range ``[b(lo), b(hi))`` with ``b(f) = floor(f * n_layer + 1/2)``."""
    half = Fraction(1, 2)
    return math.floor(lo * n_layer + half), math.floor(hi * n_layer + half)


@dataclass(frozen=True)
class Term:
    """One intersection of constraints; ``None`` means unconstrained."""

    component: str = "KV"
    layers: tuple[int, ...] | None = None
    layer_fraction: tuple[Fraction, Fraction] | None = None
    positions: tuple[int, int | None] | None = None  # half-open; None end = open
    selector: "Selector | None" = None

    def layer_mask(self, n_layer: int) -> np.ndarray:
        mask = np.zeros(n_layer, dtype=bool)
        if self.layers is not None:
            mask[np.asarray(self.layers, dtype=np.int64)] = True
        elif self.layer_fraction is not None:
            a, b = layer_fraction_bounds(*self.layer_fraction, n_layer)
            mask[a:b] = True
        else:
            mask[:] = True
        return mask

    def cell_mask(self, positions: np.ndarray) -> np.ndarray:
        if self.positions is None:
            return np.ones(len(positions), dtype=bool)
        start, end = self.positions
        pos = np.asarray(positions, dtype=np.int64)
        m = pos >= start
        if end is not None:
            m &= pos < end
        return m

    def describe(self) -> str:
        parts = []
        if self.selector is not None:
            parts.append(self.selector.name)
        if self.layers is not None:
            parts.append(f"layers {list(self.layers)}")
        if self.layer_fraction is not None:
            parts.append(f"layer fraction [{self.layer_fraction[0]}, {self.layer_fraction[1]})")
        if self.component != "KV" or not parts:
            parts.append(self.component)
        if self.positions is not None:
            end = "inf" if self.positions[1] is None else self.positions[1]
            parts.append(f"positions [{self.positions[0]}, {end})")
        return " & ".join(parts)


@dataclass(frozen=True)
class Selector:
    """A named union of :class:`Term` s (references already resolved)."""

    name: str
    terms: tuple[Term, ...]
    description: str = ""
    source: str | None = field(default=None, compare=False)

    def validate(self, n_layer: int) -> None:
        """Raise :class:`SelectorError` if any (referenced) term names a layer the model lacks."""
        for i, term in enumerate(self.terms, 1):
            if term.layers is not None:
                for layer in term.layers:
                    if not -n_layer <= layer < n_layer:
                        raise SelectorError(
                            f"selector {self.name!r} ({self.source}): term {i} selects layer {layer}, "
                            f"but the model has {n_layer} layers (valid: 0..{n_layer - 1}, or -{n_layer}..-1)"
                        )
            if term.selector is not None:
                term.selector.validate(n_layer)

    def describe(self) -> str:
        if not self.terms:
            return "(nothing)"
        return " | ".join(f"({t.describe()})" for t in self.terms)


def default_search_dirs() -> list[Path]:
    dirs = [Path(p) for p in os.environ.get("STATELAB_SELECTORS", "").split(os.pathsep) if p]
    dirs.append(_REPO_SELECTORS)
    return dirs


def _dirs(search_dirs) -> list[Path]:
    return default_search_dirs() if search_dirs is None else [Path(d) for d in search_dirs]


def list_selectors(search_dirs=None) -> list[str]:
    """Names of all selectors on the search path, sorted."""
    names = set()
    for d in _dirs(search_dirs):
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.toml") if _NAME_RE.match(p.stem))
    return sorted(names)


def _find(name: str, dirs: list[Path]) -> Path:
    for d in dirs:
        p = d / f"{name}.toml"
        if p.is_file():
            return p
    known = list_selectors(dirs)
    raise SelectorError(
        f"unknown selector {name!r}; known: {', '.join(known) or '(none)'} "
        f"(searched: {', '.join(str(d) for d in dirs)})"
    )


def _fraction(value, where: str) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise SelectorError(f"{where}: layer fraction {value!r} must be a number or a string like '1/3'")
    try:
        f = Fraction(repr(value)) if isinstance(value, float) else Fraction(value)
    except (ValueError, ZeroDivisionError):
        raise SelectorError(f"{where}: layer fraction {value!r} is not a number") from None
    if not 0 <= f <= 1:
        raise SelectorError(f"{where}: layer fraction {value!r} is outside [0, 1]")
    return f


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_term(raw, where: str, resolve) -> Term:
    if not isinstance(raw, dict):
        raise SelectorError(f"{where}: a term must be a table, got {raw!r}")
    unknown = sorted(set(raw) - set(_TERM_KEYS))
    if unknown:
        raise SelectorError(f"{where}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(_TERM_KEYS)})")
    comp = raw.get("component", "KV")
    if comp not in COMPONENTS:
        raise SelectorError(f"{where}: unknown component {comp!r} (allowed: {', '.join(COMPONENTS)})")
    if "layers" in raw and "layer_fraction" in raw:
        raise SelectorError(f"{where}: give either 'layers' or 'layer_fraction', not both")
    layers = None
    if "layers" in raw:
        lv = raw["layers"]
        if not isinstance(lv, list) or not lv or not all(_is_int(x) for x in lv):
            raise SelectorError(f"{where}: 'layers' must be a non-empty list of integers, got {lv!r}")
        layers = tuple(lv)
    frac = None
    if "layer_fraction" in raw:
        fv = raw["layer_fraction"]
        if not isinstance(fv, list) or len(fv) != 2:
            raise SelectorError(f"{where}: 'layer_fraction' must be [lo, hi], got {fv!r}")
        lo, hi = _fraction(fv[0], where), _fraction(fv[1], where)
        if not lo < hi:
            raise SelectorError(f"{where}: empty layer fraction range [{fv[0]}, {fv[1]})")
        frac = (lo, hi)
    positions = None
    if "positions" in raw:
        pv = raw["positions"]
        if not isinstance(pv, list) or len(pv) not in (1, 2) or not _is_int(pv[0]):
            raise SelectorError(f"{where}: 'positions' must be [start] or [start, end] (end may be inf), got {pv!r}")
        start, end = pv[0], None
        if len(pv) == 2:
            e = pv[1]
            if isinstance(e, float) and e == math.inf:
                end = None
            elif _is_int(e):
                end = e
            else:
                raise SelectorError(f"{where}: position range end {e!r} must be an integer or inf")
        if end is not None and end <= start:
            raise SelectorError(f"{where}: empty position range [{start}, {end})")
        positions = (start, end)
    ref = None
    if "selector" in raw:
        name = raw["selector"]
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise SelectorError(f"{where}: 'selector' must be a selector name, got {name!r}")
        ref = resolve(name)
    return Term(component=comp, layers=layers, layer_fraction=frac, positions=positions, selector=ref)


def _load_file(path: Path, name: str, dirs: list[Path], stack: tuple[str, ...]) -> Selector:
    if name in stack:
        raise SelectorError(f"selector reference cycle: {' -> '.join(stack + (name,))}")
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except tomllib.TOMLDecodeError as err:
        raise SelectorError(f"{path}: malformed TOML: {err}") from None
    except OSError as err:
        raise SelectorError(f"{path}: cannot read selector: {err}") from None
    unknown = sorted(set(data) - set(_TOP_KEYS))
    if unknown:
        raise SelectorError(f"{path}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(_TOP_KEYS)})")
    desc = data.get("description", "")
    if not isinstance(desc, str):
        raise SelectorError(f"{path}: 'description' must be a string")
    raw_terms = data.get("term", [])
    if not isinstance(raw_terms, list):
        raise SelectorError(f"{path}: 'term' must be an array of tables ([[term]])")
    ref_dirs = [path.parent] + [d for d in dirs if d != path.parent]

    def resolve(ref_name: str) -> Selector:
        return _load_file(_find(ref_name, ref_dirs), ref_name, ref_dirs, stack + (name,))

    terms = tuple(_parse_term(t, f"{path}: term {i}", resolve) for i, t in enumerate(raw_terms, 1))
    return Selector(name=name, terms=terms, description=desc, source=str(path))


def load_selector(name_or_path: str | os.PathLike, search_dirs=None) -> Selector:
    """Load a selector by name (searched on the selector path) or from a ``.toml`` file path.

    All schema errors and references are checked here; layer bounds need the model and are
    checked by :meth:`Selector.validate` (called by :func:`select`).
    """
    dirs = _dirs(search_dirs)
    s = os.fspath(name_or_path)
    if isinstance(name_or_path, os.PathLike) or s.endswith(".toml") or os.sep in s or "/" in s:
        path = Path(s)
        if not path.is_file():
            raise SelectorError(f"selector file {path} does not exist")
        return _load_file(path, path.stem, dirs, ())
    if not _NAME_RE.match(s):
        raise SelectorError(f"{s!r} is not a selector name (letters, digits, underscore) nor a .toml path")
    return _load_file(_find(s, dirs), s, dirs, ())


# --------------------------------------------------------------------------- masks


@dataclass(eq=False)
class Selection:
    """Boolean masks with the shapes of ``state.k`` / ``state.v`` (True = selected value)."""

    k: list[np.ndarray]
    v: list[np.ndarray]
    k_itemsize: tuple[int, ...]
    v_itemsize: tuple[int, ...]
    v_trans: bool
    name: str = ""

    @property
    def n_layer(self) -> int:
        return len(self.k)

    @staticmethod
    def _selected_bytes(masks: list[np.ndarray], itemsizes: tuple[int, ...]) -> np.ndarray:
        return np.array([int(np.count_nonzero(m)) * s for m, s in zip(masks, itemsizes)], dtype=np.int64)

    @property
    def k_bytes(self) -> np.ndarray:
        """Selected K bytes per layer (int64 array)."""
        return self._selected_bytes(self.k, self.k_itemsize)

    @property
    def v_bytes(self) -> np.ndarray:
        """Selected V bytes per layer (int64 array)."""
        return self._selected_bytes(self.v, self.v_itemsize)

    @property
    def selected_bytes(self) -> int:
        return int(self.k_bytes.sum() + self.v_bytes.sum())

    @property
    def selected_values(self) -> int:
        return int(sum(np.count_nonzero(m) for m in self.k) + sum(np.count_nonzero(m) for m in self.v))

    @property
    def total_bytes(self) -> int:
        """All K/V value bytes of the state the masks describe."""
        return int(
            sum(m.size * s for m, s in zip(self.k, self.k_itemsize))
            + sum(m.size * s for m, s in zip(self.v, self.v_itemsize))
        )

    @property
    def share(self) -> float:
        """``selected_bytes / total_bytes`` (0.0 for an empty state)."""
        total = self.total_bytes
        return self.selected_bytes / total if total else 0.0

    def layer_bytes(self) -> np.ndarray:
        """``(n_layer, 2)`` int64 array of selected bytes: column 0 = K, column 1 = V."""
        return np.stack([self.k_bytes, self.v_bytes], axis=1) if self.k else np.zeros((0, 2), np.int64)

    def records(self) -> list[dict]:
        """One dict per layer and component: selected and total bytes."""
        kb, vb = self.k_bytes, self.v_bytes
        out = []
        for il in range(self.n_layer):
            for comp, sel, m, s in (("K", kb[il], self.k[il], self.k_itemsize[il]),
                                    ("V", vb[il], self.v[il], self.v_itemsize[il])):
                out.append({"layer": il, "component": comp, "selected_bytes": int(sel), "total_bytes": m.size * s})
        return out

    def _check_compatible(self, other: "Selection") -> None:
        if (
            [m.shape for m in self.k] != [m.shape for m in other.k]
            or [m.shape for m in self.v] != [m.shape for m in other.v]
            or self.k_itemsize != other.k_itemsize
            or self.v_itemsize != other.v_itemsize
            or self.v_trans != other.v_trans
        ):
            raise SelectorError("selections describe states of different geometry")

    def _combine(self, other: "Selection", op, name: str) -> "Selection":
        self._check_compatible(other)
        return Selection(
            k=[op(a, b) for a, b in zip(self.k, other.k)], v=[op(a, b) for a, b in zip(self.v, other.v)],
            k_itemsize=self.k_itemsize, v_itemsize=self.v_itemsize, v_trans=self.v_trans, name=name,
        )

    def union(self, other: "Selection") -> "Selection":
        return self._combine(other, np.logical_or, f"({self.name} | {other.name})")

    def intersection(self, other: "Selection") -> "Selection":
        return self._combine(other, np.logical_and, f"({self.name} & {other.name})")

    __or__ = union
    __and__ = intersection

    def is_subset_of(self, other: "Selection") -> bool:
        self._check_compatible(other)
        return all(not np.any(a & ~b) for a, b in zip(self.k + self.v, other.k + other.v))

    def equals(self, other: "Selection") -> bool:
        self._check_compatible(other)
        return all(np.array_equal(a, b) for a, b in zip(self.k + self.v, other.k + other.v))

    def to_flat(self) -> np.ndarray:
        """One bool vector in blob order (all K layers, then all V layers, each in storage order)."""
        parts = [m.ravel() for m in self.k + self.v]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=bool)

    def check_matches(self, state: KVState) -> None:
        """Raise :class:`KVFormatError` unless the masks have the shapes of ``state``'s arrays."""
        if (
            [m.shape for m in self.k] != [a.shape for a in state.k]
            or [m.shape for m in self.v] != [a.shape for a in state.v]
            or bool(self.v_trans) != bool(state.v_trans)
        ):
            raise KVFormatError(
                f"selection {self.name!r} does not match the state's geometry "
                f"({self.n_layer} layers vs {state.n_layer}, or different widths / cells / v_trans)"
            )


def _eval(selector: Selector, state: KVState) -> tuple[list[np.ndarray], list[np.ndarray]]:
    k = [np.zeros(a.shape, dtype=bool) for a in state.k]
    v = [np.zeros(a.shape, dtype=bool) for a in state.v]
    if not state.n_layer:  # empty state: nothing to select
        return k, v
    for term in selector.terms:
        lm = term.layer_mask(state.n_layer)
        cm = term.cell_mask(state.positions)
        base = _eval(term.selector, state) if term.selector is not None else None
        k_cells = cm[:, None]                               # K: a cell is a row
        v_cells = cm[None, :] if state.v_trans else cm[:, None]  # V^T: a cell is a column
        for il in np.flatnonzero(lm):
            if "K" in term.component:
                t = np.broadcast_to(k_cells, k[il].shape)
                k[il] |= (t & base[0][il]) if base is not None else t
            if "V" in term.component:
                t = np.broadcast_to(v_cells, v[il].shape)
                v[il] |= (t & base[1][il]) if base is not None else t
    return k, v


def select(selector: Selector, state: KVState) -> Selection:
    """Masks of the values ``selector`` names in ``state`` (real strides, stored positions).

    An empty state (no cells: its blob carries no layers) gives an empty selection without
    checking layer bounds, since the blob does not say how many layers the model has.
    """
    if state.n_layer:
        selector.validate(state.n_layer)
    k, v = _eval(selector, state)
    return Selection(
        k=k, v=v,
        k_itemsize=tuple(int(a.dtype.itemsize) for a in state.k),
        v_itemsize=tuple(int(a.dtype.itemsize) for a in state.v),
        v_trans=bool(state.v_trans), name=selector.name,
    )


def apply_subset(recipient: KVState, donor: KVState, selection: Selection) -> KVState:
    """A copy of ``recipient`` whose selected values come from ``donor``.

    Refuses (:class:`KVFormatError`) states of different geometry, different stored
    positions (cells would not correspond) or a selection made for another geometry.
    """
    check_same_geometry(recipient, donor, ("recipient", "donor"))
    if not np.array_equal(recipient.positions, donor.positions):
        first = int(np.flatnonzero(np.asarray(recipient.positions) != np.asarray(donor.positions))[0])
        raise KVFormatError(
            f"recipient and donor store different positions (first at cell {first}: "
            f"{int(recipient.positions[first])} vs {int(donor.positions[first])}); cells do not correspond"
        )
    selection.check_matches(recipient)
    out = recipient.copy()
    for dst, src, m in zip(out.k + out.v, donor.k + donor.v, selection.k + selection.v):
        np.copyto(dst, src, where=m)
    return out
