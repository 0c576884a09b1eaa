"""A Python API for notebooks: captures as xarray Datasets, crosses, continuations, diffs.

No hidden global state: every function takes what it works on (capture folders or
:class:`~statelab.lab.formation.Capture` objects, and optionally an open
:class:`~statelab.runtime.Model`) and loads nothing it is not given except the model file
the capture names, which it opens for the call and closes again.  See ``docs/api.md``.
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import xarray as xr

from statelab import prompts
from statelab.errors import ConfigError, IdentityError
from statelab.kvstate import GGML_BF16, KVState, check_same_geometry, compare, values_f64
from statelab.lab.archive import check_importable, load_capture, save_capture
from statelab.mapping import release
from statelab.lab.formation import Capture, form, parse_schedule
from statelab.lab.intervene import config_of, cross as whole_cross, import_and_continue, subset_cross
from statelab.lab.receiver import DEFAULT_CAP, Endpoint, check_cap
from statelab.models import read_model_info
from statelab.runtime import ContextConfig, Model
from statelab.selection import load_selector, select

CaptureLike = Capture | str | os.PathLike


def load(capture: CaptureLike) -> Capture:
    """A Capture object from a folder (verified against its manifest) or the object itself."""
    return capture if isinstance(capture, Capture) else load_capture(capture)


def _attr(value):
    """xarray/NetCDF attributes hold scalars and strings: nested values become JSON text."""
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    if isinstance(value, (str, int, float, np.integer, np.floating)):
        return value
    return json.dumps(value, sort_keys=True, default=str)


def head_dims(capture: Capture, model_path=None) -> tuple[int, int]:
    """(head_dim_k, head_dim_v) of the capture's model, read from its GGUF header (hash checked)."""
    path = model_path or capture.identity.get("model_path")
    if not path or not Path(path).is_file():
        raise ConfigError(f"the capture's model file {path!r} is not here: pass model_path= (the GGUF) or head_dim=")
    info = read_model_info(path)
    if info.sha256 != capture.identity.get("model_sha256"):
        raise IdentityError(f"{path} is not the capture's model")
    return info.head_dim_k, info.head_dim_v


def model_order(st: KVState) -> np.ndarray:
    """Stored layer indices in model-layer order (an iSWA blob stores its full-cache layers first)."""
    ids = st.layer_ids
    if ids is None:
        raise ConfigError("a multi-part state parsed without its memory layout: its stored layers cannot be "
                          "named by model layer")
    return np.argsort(np.asarray(ids), kind="stable")


def _cells_heads(st: KVState, i: int, a: np.ndarray, trans: bool, head_dim: int, t: int) -> np.ndarray:
    """One layer's K or V values as (cell, kv_head, head_dim) over all the state's cells,
    whatever their stored order; cells the layer does not store are NaN. BF16 is widened to F32."""
    if int(t) == GGML_BF16:
        a = values_f64(a, t).astype(np.float32)
    if a.dtype.kind != "f":
        raise ConfigError(f"layer {i} stores quantised KV rows ({a.dtype}): no per-value view")
    cells_major = a.T if trans else a
    n, width = cells_major.shape
    if width % head_dim:
        raise ConfigError(f"a K/V width of {width} is not a multiple of head_dim {head_dim}")
    vals = np.ascontiguousarray(cells_major).reshape(n, width // head_dim, head_dim)
    if n == st.n_cells:
        return vals
    out = np.full((st.n_cells,) + vals.shape[1:], np.nan, dtype=vals.dtype)
    out[np.searchsorted(np.asarray(st.positions), np.asarray(st.layer_positions(i)))] = vals
    return out


def open_capture(path: CaptureLike, model_path=None, head_dim: int | None = None) -> xr.Dataset:
    """A capture as an xarray Dataset.

    ``kv`` has dims (layer, component, cell, kv_head, head_dim) in the stored type (F16 or
    F32; V is un-transposed), with ``position`` and ``token`` as cell coordinates;
    ``logits`` (vocab) holds the initial FP32 logits.  Identities, prompt, schedule and
    hashes are attributes (nested ones as JSON text).  The head size comes from the
    capture's model file unless ``head_dim`` is given.  When K and V heads differ in size
    the Dataset holds ``k`` and ``v`` (dims without ``component``) instead of ``kv``.
    """
    cap = load(path)
    st = cap.state
    hk, hv = (head_dim, head_dim) if head_dim else head_dims(cap, model_path)
    order = model_order(st)
    k = np.stack([_cells_heads(st, i, st.k[i], False, hk, st.k_types[i]) for i in order])
    v = np.stack([_cells_heads(st, i, st.v[i], st.v_trans, hv, st.v_types[i]) for i in order])
    coords = {"layer": np.asarray(st.layer_ids, np.int64)[order], "cell": np.arange(st.n_cells),
              "layer_kind": ("layer", [st.layer_kinds[i] for i in order]),
              "position": ("cell", np.asarray(st.positions, np.int32)),
              "token": ("cell", np.asarray(cap.tokens, np.int32))}
    if k.shape == v.shape and k.dtype == v.dtype:
        data = {"kv": (("layer", "component", "cell", "kv_head", "head_dim"), np.stack([k, v], axis=1))}
        coords["component"] = ["K", "V"]
    else:
        data = {"k": (("layer", "cell", "kv_head", "head_dim_k"), k), "v": (("layer", "cell", "kv_head", "head_dim_v"), v)}
    data["logits"] = (("vocab",), np.asarray(cap.logits, np.float32))
    attrs = {"prompt_id": cap.prompt_id, "prompt_sha256": cap.prompt_sha256, "schedule": _attr(cap.schedule.as_dict()),
             "kv_sha256": cap.hashes()["kv"], "v_trans": int(st.v_trans)}
    attrs.update({f"identity_{k_}": _attr(v_) for k_, v_ in cap.identity.items()})
    attrs.update({f"extra_{k_}": _attr(v_) for k_, v_ in cap.extra.items()})
    return xr.Dataset(data, coords=coords, attrs=attrs)


@contextmanager
def _model_for(cap: Capture, model, backend: str | None):
    """The model given, or the capture's model file opened for this call only."""
    if model is not None and not isinstance(model, (str, os.PathLike)):
        yield model
        return
    path = model or cap.identity.get("model_path")
    with Model(path, backend=backend or _config(cap).backend) as m:
        yield m


def _config(cap: Capture):
    return config_of(cap)


def capture(prompt: str, schedule: str = "A", out=None, model=None, backend: str = "cpu", n_ctx: int = 1024,
            threads: int = 0) -> Capture:
    """Form a state: ``prompt`` is a spec (``HumanEval/2``, ``text:...``, ``file:PATH``); saved to
    ``out`` when given.  ``model``: a GGUF path, an open Model, or None (the embedded default)."""
    p = prompts.resolve(prompt)
    sched = parse_schedule(schedule)
    base = ContextConfig(backend=backend, n_ctx=n_ctx, n_threads=threads)
    if model is None or isinstance(model, (str, os.PathLike)):
        with Model(model, backend=backend) as m:
            cap = form(m, p, sched, base)
    else:
        cap = form(model, p, sched, base)
    if out is not None:
        save_capture(cap, out)
    return cap


def continue_(capture: CaptureLike, cap: int = DEFAULT_CAP, model=None, backend: str | None = None,
              allow_other_backend: bool = False) -> Endpoint:
    """Continue greedily from a capture through the common receiver; the Endpoint (tokens,
    eog, stop_reason; ``as_dict()`` for JSON)."""
    c = load(capture)
    check_cap(cap)
    cfg = _config(c) if backend is None else _config(c).with_(backend=backend)
    with _model_for(c, model, cfg.backend) as m:
        check_importable(c, m, cfg, allow_other_backend)
        return import_and_continue(m, cfg, c.blob, c.logits, c.n_prompt, cap)


@dataclass
class CrossResult:
    """What a cross did: the endpoint, the byte account, and the class against the natural
    endpoints when they are given (B reproduces the donor, C a third trajectory, D keeps the
    recipient; a match is D when both naturals coincide)."""

    endpoint: Endpoint
    selector: str
    selected_bytes: int
    changed_bytes: int
    total_value_bytes: int
    first_differing_layer: int | None
    klass: str | None = None

    def as_dict(self) -> dict:
        return {"endpoint": self.endpoint.as_dict(), "selector": self.selector, "selected_bytes": self.selected_bytes,
                "changed_bytes": self.changed_bytes, "total_value_bytes": self.total_value_bytes,
                "first_differing_layer": self.first_differing_layer, "class": self.klass}


def cross(donor: CaptureLike, recipient: CaptureLike, selector=None, cap: int = DEFAULT_CAP, model=None,
          natural: tuple[Endpoint, Endpoint] | None = None, allow_other_backend: bool = False) -> CrossResult:
    """Donor KV in the recipient's path.  ``selector`` None (or "ALL") is the whole-KV cross
    with the recipient's logits; a selector name or TOML path is a subset cross.  With
    ``natural=(donor_endpoint, recipient_endpoint)`` the result carries its class."""
    d, r = load(donor), load(recipient)
    with _model_for(r, model, _config(r).backend) as m:
        if selector is None:
            ep, acc = whole_cross(m, d, r, cap=cap, allow_other_backend=allow_other_backend)
            name = "ALL (whole KV)"
        else:
            sel = select(load_selector(selector), r.state)
            ep, acc = subset_cross(m, d, r, sel, cap=cap, allow_other_backend=allow_other_backend)
            name = sel.name
    klass = None
    if natural is not None:
        nd, nr = natural
        klass = "D" if ep.same(nr) else ("B" if ep.same(nd) else "C")
    return CrossResult(ep, name, acc.selected_bytes, acc.changed_bytes, acc.total_value_bytes,
                       acc.first_differing_layer, klass)


def first_differing_cells(a: KVState, b: KVState) -> tuple[np.ndarray, np.ndarray]:
    """Per layer, the first cell whose K (resp. V) values differ bit for bit; -1 where none do."""
    check_same_geometry(a, b)

    def first(xs, ys, trans):
        out = np.full(len(xs), -1, dtype=np.int64)
        for il, (x, y) in enumerate(zip(xs, ys)):
            bits = np.ascontiguousarray(x).view(np.uint8 if x.dtype.itemsize == 1 else f"<u{x.dtype.itemsize}")
            other = np.ascontiguousarray(y).view(bits.dtype)
            rows = np.any(bits != other, axis=0 if trans else 1)
            if rows.any():
                out[il] = int(np.argmax(rows))
            release(x)  # states mapped from their files: only the layer at hand stays resident
            release(y)
        return out

    return first(a.k, b.k, False), first(a.v, b.v, a.v_trans)


def _first_token_difference(ta: np.ndarray, tb: np.ndarray) -> int | None:
    n = min(len(ta), len(tb))
    dt = np.flatnonzero(np.asarray(ta[:n]) != np.asarray(tb[:n]))
    return int(dt[0]) if dt.size else (None if len(ta) == len(tb) else n)


def prefix_state(st: KVState, n: int) -> KVState:
    """The state's first ``n`` cells (positions 0..n-1): a prompt's part of a state that also
    holds generated tokens (a server slot saved after a completion)."""
    parts = st.parts
    if len(st.part_list) > 1:
        raise IdentityError("a state of several caches (iSWA) is compared only with one of the same length")
    idx = np.flatnonzero(np.asarray(st.positions) < n)
    if len(idx) != n:
        raise IdentityError(f"the state does not hold positions 0..{n - 1} once each")
    seq_ids = tuple(st.seq_ids[i] for i in idx)
    kw = {"positions": np.asarray(st.positions)[idx], "seq_ids": seq_ids, "k": [a[idx] for a in st.k],
          "v": [a[:, idx] if st.v_trans else a[idx] for a in st.v]}
    if parts:
        kw["parts"] = [replace(parts[0], positions=kw["positions"], seq_ids=seq_ids)]
    return replace(st, **kw)


def comparable_states(ca: Capture, cb: Capture) -> tuple[KVState, KVState]:
    """The two states cell for cell: equal token lists, or one a prefix of the other (then the
    longer state's first cells); anything else is refused in one line."""
    first = _first_token_difference(ca.tokens, cb.tokens)
    if first is None:
        return ca.state, cb.state
    n = min(ca.n_prompt, cb.n_prompt)
    if first < n:
        raise IdentityError(f"the captures hold different tokens from token {first} on ({ca.n_prompt} and "
                            f"{cb.n_prompt} tokens): not the same prompt as tokenized, their cells do not correspond")
    return prefix_state(ca.state, n), prefix_state(cb.state, n)


def diff(a: CaptureLike, b: CaptureLike) -> xr.Dataset:
    """Per-layer K/V differences of two captures (same geometry), as a Dataset over (layer, component):
    changed_bytes, changed_values, max_abs, l2, l2_rel and first_cell/first_position (-1: equal).
    Attributes: first_layer and first_position (the lowest differing layer and, in it, the
    lowest differing position; -1 when the KV is identical), the earliest differing position in
    any layer, whether tokens and initial logits agree."""
    ca, cb = load(a), load(b)
    sa, sb = comparable_states(ca, cb)
    d = compare(sa, sb)
    rec = d.records()
    order = model_order(sa)
    layers = np.asarray(sa.layer_ids, np.int64)[order]
    comps = ["K", "V"]
    cols = ("changed_bytes", "changed_values", "max_abs", "l2", "l2_rel")
    table = {c: np.zeros((len(layers), 2), dtype=np.float64 if c in ("max_abs", "l2", "l2_rel") else np.int64)
             for c in cols}
    row = {int(m): j for j, m in enumerate(layers)}
    for r_ in rec:
        for c in cols:
            table[c][row[r_["layer"]], comps.index(r_["component"])] = r_[c]
    first_cell = np.stack(first_differing_cells(sa, sb), axis=1)
    first_pos = _cell_positions(sa, first_cell)
    summary = difference_summary(ca, cb, (sa, sb), first_cell)
    ds = xr.Dataset({c: (("layer", "component"), v) for c, v in table.items()},
                    coords={"layer": layers, "component": comps,
                            "layer_kind": ("layer", [sa.layer_kinds[i] for i in order])})
    # first_cell indexes the cells of the layer's own cache part (a sliding-window cache holds fewer)
    ds["first_cell"] = (("layer", "component"), first_cell[order])
    ds["first_position"] = (("layer", "component"), first_pos[order])
    ds.attrs.update({k: _attr(v) for k, v in summary.items()})
    ds.attrs.update({"a": ca.prompt_id, "b": cb.prompt_id, "a_schedule": ca.schedule.name, "b_schedule": cb.schedule.name})
    return ds


def _cell_positions(st: KVState, cells: np.ndarray) -> np.ndarray:
    """(layer, component) cell indices -> the positions those cells hold (-1 stays -1)."""
    out = np.full(cells.shape, -1, dtype=np.int64)
    for i in np.flatnonzero((cells >= 0).any(axis=1)):
        pos = np.asarray(st.layer_positions(int(i)), dtype=np.int64)
        ok = cells[i] >= 0
        out[i, ok] = pos[cells[i, ok]]
    return out


def difference_summary(ca: Capture, cb: Capture, states: tuple[KVState, KVState] | None = None,
                       first_cell: np.ndarray | None = None) -> dict:
    """First differing layer and position, earliest differing position, tokens and logits agreement
    (``states``: the compared states, from :func:`comparable_states`)."""
    sa, sb = comparable_states(ca, cb) if states is None else states
    if first_cell is None:
        first_cell = np.stack(first_differing_cells(sa, sb), axis=1)
    first_pos = _cell_positions(sa, first_cell)
    differ = np.flatnonzero((first_pos >= 0).any(axis=1))
    out = {"first_layer": -1, "first_position": -1, "first_component": "", "earliest_position": -1,
           "earliest_layer": -1}
    if differ.size:
        # stored layers follow the blob (an iSWA state stores its full-cache layers first): report model layers
        ids = np.asarray(sa.layer_ids or range(len(first_pos)), dtype=np.int64)
        big = np.iinfo(np.int64).max
        masked = np.where(first_pos >= 0, first_pos, big)
        L = int(differ[np.argmin(ids[differ])])
        j = int(np.argmin(masked[L]))
        out.update(first_layer=int(ids[L]), first_position=int(masked[L, j]), first_component="KV"[j])
        lay = int(np.lexsort((ids, masked.min(axis=1)))[0])
        out.update(earliest_position=int(masked[lay].min()), earliest_layer=int(ids[lay]))
    out["tokens_equal"] = _first_token_difference(ca.tokens, cb.tokens) is None
    out["compared_cells"] = sa.n_cells  # fewer than a capture holds when it extends the other's tokens
    la, lb = np.asarray(ca.logits), np.asarray(cb.logits)
    known = bool(np.all(np.isfinite(la)) and np.all(np.isfinite(lb)))
    out["logits_known"] = known
    out["logits_equal"] = bool(known and la.tobytes() == lb.tobytes())
    out["logits_max_abs"] = float(np.max(np.abs(la.astype(np.float64) - lb))) if known else float("nan")
    return out


__all__ = ["CrossResult", "capture", "comparable_states", "continue_", "cross", "diff", "difference_summary", "first_differing_cells",
           "head_dims", "load", "open_capture", "prefix_state"]
