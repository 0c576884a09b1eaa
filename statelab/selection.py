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
    layer_kind     = "swa"             # optional: "swa" (sliding-window layers) or "full"
    window         = "inside"          # optional: "inside" or "outside" the sliding window
    heads          = [0]               # optional: KV heads (needs the model's head count)

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

Layer kinds (iSWA models such as Gemma 2/3): ``layer_kind = "swa"`` selects the layers
that attend through the sliding window (stored in the sliding-window cache), ``"full"``
the layers of the full cache; on a model without a window every layer is ``full``.
``window = "inside"`` selects the cells whose position ``p`` the window of the last
position still sees (``pos_max - p < n_swa``, llama.cpp's ``is_masked_swa``), ``"outside"``
the older ones; without a window every position is inside. Layer indices, fractions and
positions always mean *model* layers and stored positions, whatever cache part holds them,
so the named selectors keep their meaning on every model (a state of several parts needs
the model's layer map, which captures record).

``heads = [h, ...]`` keeps the features of those KV heads (head ``h`` = features
``h*d .. (h+1)*d - 1`` of a K or V row, ``d`` = row width / KV heads); the head count comes
from the model's layout (captures record it). A quantised row (Q8_0) is addressed whole:
a term that asks for some but not all heads of a quantised row is refused.

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

import hashlib
import math
import os
import re
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import numpy as np

from statelab.errors import StatelabError
from statelab.mapping import release
from statelab.resources import data_dir
from statelab.kvstate import (
    SWA_CHUNKED,
    SWA_SYMMETRIC,
    KVFormatError,
    KVState,
    type_name,
    check_same_geometry,
    is_quantised,
)

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
    "window_mask",
]

COMPONENTS = ("K", "V", "KV")
_TOP_KEYS = ("description", "term")
_TERM_KEYS = ("selector", "layers", "layer_fraction", "component", "positions", "layer_kind", "window", "heads")
LAYER_KINDS = ("swa", "full")
WINDOW_SIDES = ("inside", "outside")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_REPO_SELECTORS = data_dir("selectors")  # the checkout's selectors/, or the installed package's copy


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
    layer_kind: str | None = None  # "swa" / "full"
    window: str | None = None  # "inside" / "outside"
    heads: tuple[int, ...] | None = None  # KV head indices

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

    def cell_mask(self, positions: np.ndarray, inside: np.ndarray | None = None) -> np.ndarray:
        """Cells this term keeps; ``inside``: which of them the sliding window sees (None: all)."""
        m = np.ones(len(positions), dtype=bool)
        if self.positions is not None:
            start, end = self.positions
            pos = np.asarray(positions, dtype=np.int64)
            m &= pos >= start
            if end is not None:
                m &= pos < end
        if self.window is not None and inside is not None:
            m &= inside if self.window == "inside" else ~inside
        elif self.window == "outside":
            m[:] = False
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
        if self.layer_kind is not None:
            parts.append(f"{self.layer_kind} layers")
        if self.window is not None:
            parts.append(f"{self.window} the window")
        if self.heads is not None:
            parts.append(f"heads {list(self.heads)}")
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
    kind = raw.get("layer_kind")
    if kind is not None and kind not in LAYER_KINDS:
        raise SelectorError(f"{where}: unknown layer_kind {kind!r} (allowed: {', '.join(LAYER_KINDS)})")
    side = raw.get("window")
    if side is not None and side not in WINDOW_SIDES:
        raise SelectorError(f"{where}: unknown window {side!r} (allowed: {', '.join(WINDOW_SIDES)})")
    heads = raw.get("heads")
    if heads is not None:
        if not isinstance(heads, list) or not heads or not all(_is_int(h) and h >= 0 for h in heads):
            raise SelectorError(f"{where}: 'heads' must be a non-empty list of head indices >= 0, got {heads!r}")
        heads = tuple(sorted(set(heads)))
    ref = None
    if "selector" in raw:
        name = raw["selector"]
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise SelectorError(f"{where}: 'selector' must be a selector name, got {name!r}")
        ref = resolve(name)
    return Term(component=comp, layers=layers, layer_fraction=frac, positions=positions, selector=ref,
                layer_kind=kind, window=side, heads=heads)


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


def flat_mask_sha256(flat) -> str:
    """sha256 of a flat bool mask, packed to bits (equal masks, equal hashes); ``flat`` may also
    be an iterable of consecutive pieces of it (the hash is that of their concatenation)."""
    if isinstance(flat, np.ndarray):
        return hashlib.sha256(np.packbits(flat).tobytes()).hexdigest()
    h, carry = hashlib.sha256(), np.zeros(0, dtype=bool)
    for piece in flat:
        bits = np.concatenate([carry, piece]) if carry.size else np.asarray(piece, dtype=bool)
        whole = bits.size - bits.size % 8
        h.update(np.packbits(bits[:whole]).tobytes())
        carry = bits[whole:]
    if carry.size:
        h.update(np.packbits(carry).tobytes())
    return h.hexdigest()


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
        return np.array([_count(m) * s for m, s in zip(masks, itemsizes)], dtype=np.int64)

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

    def flat_pieces(self) -> Iterator[np.ndarray]:
        """:meth:`to_flat` piece by piece (one layer and component at a time)."""
        for m in self.k + self.v:
            yield m.ravel()

    def to_flat(self) -> np.ndarray:
        """One bool vector in blob order (all K layers, then all V layers, each in storage order)."""
        parts = [m.ravel() for m in self.k + self.v]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=bool)

    def mask_sha256(self) -> str:
        """The byte mask's identity: :func:`flat_mask_sha256` of :meth:`to_flat` (streamed over
        the layers: no flat copy of the masks)."""
        return flat_mask_sha256(self.flat_pieces())

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


def window_mask(state: KVState, positions: np.ndarray) -> np.ndarray | None:
    """Which of ``positions`` the sliding window of the state's last position sees
    (llama.cpp's ``is_masked_swa``, negated); None when the state has no window."""
    swa = [p for p in state.part_list if p.kind == "swa"]
    if not swa or not swa[0].n_swa:
        return None
    n_swa, swa_type = int(swa[0].n_swa), int(swa[0].swa_type)
    pos = np.asarray(positions, dtype=np.int64)
    p1 = int(max((int(p.positions.max()) for p in state.part_list if p.n_cells), default=0))
    if swa_type == SWA_CHUNKED:
        return pos >= (p1 // n_swa) * n_swa
    if swa_type == SWA_SYMMETRIC:
        return np.abs(p1 - pos) <= n_swa // 2
    return p1 - pos < n_swa


def _layer_map(state: KVState) -> np.ndarray:
    ids = state.layer_ids
    if ids is None:
        raise SelectorError(
            "the state has a full and a sliding-window cache but no layer map (parse it with the model's "
            "MemoryLayout: captures record it); selectors name model layers"
        )
    return np.asarray(ids, dtype=np.int64)


def _nothing(shape) -> np.ndarray:
    return np.broadcast_to(np.False_, shape)


def _count(mask: np.ndarray) -> int:
    """Selected elements of a mask; a broadcast one value (an untouched layer's
    :func:`_nothing`) without visiting every element."""
    if mask.size and not any(mask.strides):
        return mask.size if bool(mask.flat[0]) else 0
    return int(np.count_nonzero(mask))


def _own(mask: np.ndarray) -> np.ndarray:
    """``mask`` as an array of its own (a writable copy of a broadcast), to be or-ed into."""
    return mask if mask.flags.writeable else np.zeros(mask.shape, dtype=bool)


def _eval(selector: Selector, state: KVState) -> tuple[list[np.ndarray], list[np.ndarray]]:
    # a layer no term touches keeps a read-only all-False broadcast (no memory); a touched one
    # gets its own mask: the masks of a selector over a few layers cost those layers only
    k = [_nothing(a.shape) for a in state.k]
    v = [_nothing(a.shape) for a in state.v]
    if not state.n_layer:  # empty state: nothing to select
        return k, v
    ids = _layer_map(state)
    kinds = np.array(["swa" if x == "swa" else "full" for x in state.layer_kinds])
    lpart = state.layer_part
    parts = state.part_list
    inside = [window_mask(state, p.positions) for p in parts]
    for term in selector.terms:
        lm = term.layer_mask(state.n_layer)[ids]  # model layers -> stored layers
        if term.layer_kind is not None:
            lm &= kinds == term.layer_kind
        cms = [term.cell_mask(p.positions, w) for p, w in zip(parts, inside)]
        base = _eval(term.selector, state) if term.selector is not None else None
        for il in np.flatnonzero(lm):
            cm = cms[int(lpart[il])]
            if "K" in term.component:
                f = _head_features(selector, term, state, il, "K")
                t = cm[:, None] & f[None, :]                         # K: a cell is a row
                k[il] = _own(k[il])
                k[il] |= (t & base[0][il]) if base is not None else t
            if "V" in term.component:
                f = _head_features(selector, term, state, il, "V")
                t = (f[:, None] & cm[None, :]) if state.v_trans else (cm[:, None] & f[None, :])  # V^T: a column
                v[il] = _own(v[il])
                v[il] |= (t & base[1][il]) if base is not None else t
    return k, v


def _head_features(selector: Selector, term: Term, state: KVState, il: int, comp: str) -> np.ndarray:
    """Which stored columns (features, or bytes of a quantised row) of layer ``il``'s K/V rows the
    term keeps: all of them unless it names heads."""
    a, t = (state.k[il], state.k_types[il]) if comp == "K" else (state.v[il], state.v_types[il])
    width = a.shape[0] if comp == "V" and state.v_trans else a.shape[1]
    f = np.ones(width, dtype=bool)
    if term.heads is None:
        return f
    nh = state.part_list[int(state.layer_part[il])].n_head_kv
    if nh <= 0:
        raise SelectorError(f"selector {selector.name!r} names heads, but the state's KV head count is unknown "
                            "(captures record it with the model's layout)")
    if term.heads[-1] >= nh:
        raise SelectorError(f"selector {selector.name!r} names head {term.heads[-1]}, but the model has {nh} KV "
                            f"heads (valid: 0..{nh - 1})")
    if is_quantised(t):
        if len(term.heads) != nh:
            raise SelectorError(
                f"selector {selector.name!r} asks for heads {list(term.heads)} of {nh} in layer "
                f"{state.layer_ids[il]}'s {type_name(t)} {comp} rows: quantised rows are addressed whole "
                "(layer x cell x K/V); select every head or none"
            )
        return f
    d = width // nh
    f[:] = False
    for h in term.heads:
        f[h * d:(h + 1) * d] = True
    return f


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


def _cell_map(rp, dp) -> np.ndarray | None:
    """Donor cell of each recipient cell of one part, matched by stored position (None: same order).

    A ring-buffer cache (the sliding-window cache once the prompt outgrows it) may hold the
    same positions in another cell order; any other difference is refused."""
    if np.array_equal(rp.positions, dp.positions):
        return None
    r_order, d_order = np.argsort(rp.positions, kind="stable"), np.argsort(dp.positions, kind="stable")
    if not np.array_equal(rp.positions[r_order], dp.positions[d_order]) or \
            len(np.unique(rp.positions)) != len(rp.positions):
        first = int(np.flatnonzero(np.asarray(rp.positions) != np.asarray(dp.positions))[0])
        raise KVFormatError(
            f"recipient and donor store different positions in the {rp.kind} cache (first at cell {first}: "
            f"{int(rp.positions[first])} vs {int(dp.positions[first])}); cells do not correspond"
        )
    perm = np.empty(len(r_order), dtype=np.int64)
    perm[r_order] = d_order
    return perm


def _check_cross(recipient: KVState, donor: KVState, selection: Selection) -> list:
    check_same_geometry(recipient, donor, ("recipient", "donor"))
    maps = [_cell_map(rp, dp) for rp, dp in zip(recipient.part_list, donor.part_list)]
    selection.check_matches(recipient)
    return [maps[int(i)] for i in recipient.layer_part]


def _donor_values(donor: KVState, il: int, comp: str, perm) -> np.ndarray:
    d = donor.k[il] if comp == "K" else donor.v[il]
    if perm is not None:
        d = d[:, perm] if comp == "V" and donor.v_trans else d[perm]
    return d


def apply_subset(recipient: KVState, donor: KVState, selection: Selection) -> KVState:
    """A state holding ``recipient`` with its selected values taken from ``donor``.

    Cells correspond by stored position (a part whose cells hold the same positions in
    another order is matched position by position). Refuses (:class:`KVFormatError`)
    states of different geometry, different stored positions or a selection made for
    another geometry.

    Only the layers and components the selection touches are copied; every other array of
    the result is a read-only view of the recipient's own (an 8B state's cross over a few
    layers costs those layers, not the state)."""
    perms = _check_cross(recipient, donor, selection)
    out = recipient.copy(values=False)
    for il, perm in enumerate(perms):
        for comp, arrs, mask in (("K", out.k, selection.k), ("V", out.v, selection.v)):
            if not mask[il].any():
                continue
            own = np.array(arrs[il], copy=True)
            np.copyto(own, _donor_values(donor, il, comp, perm), where=mask[il])
            release(arrs[il])  # states mapped from their files: their pages go back once copied
            release(donor.k[il] if comp == "K" else donor.v[il])
            arrs[il] = own
    return out


def subset_payload(recipient: KVState, donor: KVState, selection: Selection) -> tuple[bytearray, KVState]:
    """What a subset cross imports: the blob of :func:`apply_subset`'s state, made in one buffer
    (the recipient's serialisation, the donor's selected values written into it), and that state,
    whose changed layers are views of the buffer and whose other layers are the recipient's own
    arrays (read-only). The buffer is the only copy of the state made."""
    perms = _check_cross(recipient, donor, selection)
    buf = recipient.to_buffer()
    mixed = KVState.parse(buf, copy=False)  # writable views of buf
    out = recipient.copy(values=False)
    for il, perm in enumerate(perms):
        for comp, arrs, views, mask in (("K", out.k, mixed.k, selection.k), ("V", out.v, mixed.v, selection.v)):
            if not mask[il].any():
                continue
            np.copyto(views[il], _donor_values(donor, il, comp, perm), where=mask[il])
            release(donor.k[il] if comp == "K" else donor.v[il])
            arrs[il] = views[il]
    return buf, out.freeze()
