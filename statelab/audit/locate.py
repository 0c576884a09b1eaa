"""Divergence locator: the first graph node whose outputs differ between two geometries.

Both runs decode the same tokens in fresh contexts with every (wanted) graph node's output
captured right after it was computed (:func:`statelab.audit.capture.run_graph`). Nodes are
aligned by canonical name and occurrence within their graph (names carry the layer:
``Qcur-0``, ``kq-0``, ``cache_k_l0 (view)``; unnamed nodes become ``<OP>``). A node appears
once per micro-batch; its rows are put back on the token axis (the same node of every
micro-batch, concatenated along tokens) and compared per token position, on the positions
both runs computed:

* activations: the token axis is the axis whose extent equals the micro-batch's token
  count (or, after the last layer's output-row selection, its output count) in every
  micro-batch of both runs; a flattened token-major node (``Vcur (reshaped)``) is split
  into equal rows;
* attention scores ``kq`` / ``kq_soft_max`` (``(n_kv, n_tokens, heads)``): per token row,
  only the visible KV columns 0..position are compared (the rest are masked: the raw
  scores there depend on which cells the micro-batch had already written);
* KV-cache writes (``SET_ROWS``): the cells written for each token (reduced at capture);
* views of the KV cache are not compared (they are the state, compared at the writes).

Comparison is bitwise (``tobytes``); max |difference| and max ULP distance describe a
difference, they never decide it. The report names the first differing node in graph
order, and summarises per layer (xarray Dataset and Markdown).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from statelab.errors import ConfigError
from statelab.audit.capture import (OUTPUT_NAMES, Geometry, GraphRun, check_layer, is_kv_cache_node, layer_filter,
                                    parse_geometry, parse_layers, parse_node_name, run_graph)
from statelab.audit.oracles import ulp_distance

_KV_AXIS = re.compile(r"^kq(_soft_max)?(_pq\d+)?$")
_HEAD_MAJOR = re.compile(r"^(kq(_soft_max)?(_pq\d+)?|kqv(_pq\d+)?|(Qcur|<node>) \(view\) \(permuted\))$")
INPUT_LAYER = -1


_PQ_SLICE = re.compile(r"^(kq|kq_soft_max)_pq(\d+)$")


@dataclass
class _Occ:
    """One occurrence of a node in one micro-batch."""

    node: object
    layer: int
    key: tuple  # (layer, canonical name, occurrence)
    order: int  # index within its graph
    query: int | None = None  # PQ slice: the micro-batch row it computes


def _occurrences(run: GraphRun) -> dict[tuple, list[_Occ]]:
    """Group a run's captured nodes by alignment key, in micro-batch order."""
    out: dict[tuple, list[_Occ]] = {}
    by_graph: dict[tuple, list] = {}
    for n in run.nodes:
        by_graph.setdefault((n.call, n.graph), []).append(n)
    for gk in sorted(by_graph):
        seen: dict[tuple, int] = {}
        layer = INPUT_LAYER
        for n in sorted(by_graph[gk], key=lambda x: x.index):
            canon, il = parse_node_name(n.name, n.op)
            if il is not None:
                layer = il
            elif canon in OUTPUT_NAMES:
                layer = run.n_layer
            m = _PQ_SLICE.match(canon)
            if m:  # PQ computes kq / kq_soft_max one query row at a time: align with MQ's rows
                key = (layer, m.group(1), 0)
                out.setdefault(key, []).append(_Occ(n, layer, key, n.index, int(m.group(2))))
                continue
            occ = seen.get((layer, canon), 0)
            seen[(layer, canon)] = occ + 1
            key = (layer, canon, occ)
            out.setdefault(key, []).append(_Occ(n, layer, key, n.index))
    return out


def _kind(name: str, canon: str, op: str) -> str:
    if is_kv_cache_node(name):
        return "kv_write" if op == "SET_ROWS" else "kv_view"
    base = canon.split(" (")[0]
    if _KV_AXIS.match(base) and op in ("MUL_MAT", "SOFT_MAX"):
        return "attn_scores"
    return "rows"


def _token_axis(canon: str, recs: list[tuple[tuple, int, int]]):
    """(axis in ggml order, 'tokens'|'outputs'|'flat') fitting every record (ne, T, T_out) of a run.

    An axis fits when its extent equals the micro-batch's token count (or output count) in
    every micro-batch; axes whose extent is 1 everywhere are uninformative (a run of
    one-token micro-batches fits every size-1 axis) and are used only when nothing else fits.
    Among several fitting axes the head-major attention tensors (kq, kq_soft_max, kqv, the
    permuted Q) take dim 1 (MQ) or dim 3 (QB); others take the outermost.
    """
    def fits(vals):
        return [k for k in range(4) if all(ne[k] == v for ne, v in vals)]

    def informative(cands):
        return [k for k in cands if any(ne[k] != 1 for ne, _, _ in recs)]

    tok = fits([(ne, t) for ne, t, _ in recs])
    outs = fits([(ne, o) for ne, _, o in recs])
    for cands, what in ((informative(tok), "tokens"), (informative(outs), "outputs"), (tok, "tokens"),
                        (outs, "outputs")):
        if not cands:
            continue
        if len(cands) > 1 and _HEAD_MAJOR.match(canon):
            for k in (1, 3):
                if k in cands:
                    return k, what
        return max(cands), what
    sizes = [(int(np.prod(ne)), t) for ne, t, _ in recs]
    if all(t > 0 and n % t == 0 for n, t in sizes) and len({n // t for n, t in sizes}) == 1:
        return None, "flat"
    return None, None


def _rows(occs: list[_Occ], run: GraphRun, axis, what: str, kind: str) -> dict[int, np.ndarray]:
    """position -> row array (token axis removed, size-1 axes squeezed)."""
    rows: dict[int, np.ndarray] = {}
    for o in occs:
        n = o.node
        meta = run.meta(n.call, n.graph)
        if n.data is None or isinstance(n.data, (bytes, bytearray)):
            continue
        arr = np.asarray(n.data)
        if kind == "kv_write":
            pos = meta.positions
            for i, p in enumerate(pos):
                rows[int(p)] = arr[i]
            continue
        pos = meta.positions if what in ("tokens", "flat") else meta.out_positions
        if o.query is not None:
            pos = meta.positions[o.query:o.query + 1]
        if what == "flat":
            flat = arr.reshape(len(pos), -1) if len(pos) else arr.reshape(0, 1)
            for i, p in enumerate(pos):
                rows[int(p)] = flat[i]
            continue
        np_axis = arr.ndim - 1 - axis
        for i, p in enumerate(pos):
            r = np.take(arr, i, axis=np_axis)
            if kind == "attn_scores":
                r = r[..., :int(p) + 1]  # visible KV cells 0..p (fresh single-sequence cache)
            rows[int(p)] = np.squeeze(r)
    return rows


def _float_view(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float64)


def _compare_rows(ra: dict, rb: dict):
    common = sorted(set(ra) & set(rb))
    n_diff, first, maxabs, maxulp = 0, None, 0.0, 0
    shape_mismatch = None
    for p in common:
        a, b = ra[p], rb[p]
        if a.shape != b.shape or a.dtype != b.dtype:
            shape_mismatch = f"position {p}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
            break
        if a.tobytes() == b.tobytes():
            continue
        n_diff += 1
        if first is None:
            first = p
        fa, fb = _float_view(a), _float_view(b)
        both = np.isfinite(fa) & np.isfinite(fb)
        if both.any():
            maxabs = max(maxabs, float(np.abs(fa[both] - fb[both]).max()))
        if a.dtype in (np.float32, np.float16):
            u = ulp_distance(a, b, nan="sentinel")
            maxulp = max(maxulp, int(u.max()) if u.size else 0)
    return common, n_diff, first, maxabs, maxulp, shape_mismatch


def compare_runs(a: GraphRun, b: GraphRun):
    """Align and compare two runs' nodes. Returns an xarray Dataset (dim ``node``, graph order)."""
    import xarray as xr

    if a.tokens.tobytes() != b.tokens.tobytes():
        raise ConfigError("the two runs decoded different tokens; the locator compares one input")
    if a.identity.get("model_sha256") != b.identity.get("model_sha256"):
        raise ConfigError("the two runs used different model files")
    oa, ob = _occurrences(a), _occurrences(b)
    # graph order: every micro-batch runs the same graph; order by layer, then node index (run A's if present)
    order_of: dict[tuple, tuple] = {}
    for tag, runocc in ((0, oa), (1, ob)):
        for key, occs in runocc.items():
            order_of.setdefault(key, (key[0], occs[0].order, tag))
    keys = sorted(order_of, key=lambda k: order_of[k])
    recs = []
    for key in keys:
        layer, canon, occ = key
        la, lb = oa.get(key), ob.get(key)
        any_occ = (la or lb)[0]
        name, op = any_occ.node.name, any_occ.node.op
        kind = _kind(name, canon, op)
        rec = {"layer": layer, "name": canon, "occurrence": occ, "node_name": name, "op": op, "kind": kind,
               "status": "", "max_abs": np.nan, "max_ulp": -1, "n_positions": 0, "n_diff_positions": 0,
               "first_diff_position": -1, "reason": ""}
        if la is None or lb is None:
            rec["status"] = "only in A" if lb is None else "only in B"
            rec["reason"] = f"not in the {'second' if lb is None else 'first'} run's graph"
            recs.append(rec)
            continue
        if kind == "kv_view":
            rec["status"] = "skipped"
            rec["reason"] = "view of the KV cache (the state; compared at its SET_ROWS writes)"
            recs.append(rec)
            continue
        if kind == "kv_write":
            ra, rb = _rows(la, a, 0, "tokens", kind), _rows(lb, b, 0, "tokens", kind)
        else:
            # the token axis of each run on its own: layouts differ in where they put the queries
            # (MQ kq (n_kv, T, h), QB kq (n_kv, 1, h, T))
            picked = []
            for run, occs in ((a, la), (b, lb)):
                shapes = [(o.node.ne, 1 if o.query is not None else run.meta(o.node.call, o.node.graph).n_tokens,
                           1 if o.query is not None else run.meta(o.node.call, o.node.graph).n_outputs)
                          for o in occs]
                picked.append((_token_axis(canon, shapes), shapes))
            if any(ax[1] is None for ax, _ in picked):
                ext = sorted({str(s[0]) for _, shp in picked for s in shp})[:3]
                rec["status"] = "skipped"
                rec["reason"] = "no token axis (extents " + ", ".join(ext) + ")"
                recs.append(rec)
                continue
            (axa, wa), _ = picked[0]
            (axb, wb), _ = picked[1]
            ra, rb = _rows(la, a, axa, wa, kind), _rows(lb, b, axb, wb, kind)
        common, n_diff, first, maxabs, maxulp, mismatch = _compare_rows(ra, rb)
        rec["n_positions"] = len(common)
        if mismatch:
            rec["status"], rec["reason"] = "shape mismatch", mismatch
        elif not common:
            rec["status"], rec["reason"] = "skipped", "no position computed by both runs"
        else:
            rec["status"] = "differs" if n_diff else "equal"
            rec["n_diff_positions"] = n_diff
            rec["first_diff_position"] = -1 if first is None else int(first)
            rec["max_abs"] = maxabs if n_diff else 0.0
            rec["max_ulp"] = maxulp if n_diff else 0
        recs.append(rec)

    cols = {k: [r[k] for r in recs] for k in recs[0]} if recs else {}
    ds = xr.Dataset(
        {k: ("node", np.asarray(v, dtype=object if isinstance(v[0], str) else None).astype(str)
             if isinstance(v[0], str) else np.asarray(v))
         for k, v in cols.items() if k not in ("layer",)},
        coords={"node": np.arange(len(recs)), "layer": ("node", np.asarray(cols.get("layer", []), dtype=int))},
    )
    first = next((r for r in recs if r["status"] == "differs"), None)
    ds.attrs.update({
        "title": "statelab divergence locator",
        "geometry_a": a.geometry.describe(), "geometry_b": b.geometry.describe(),
        "name_a": a.geometry.name, "name_b": b.geometry.name,
        "n_tokens": int(len(a.tokens)), "n_layer": int(a.n_layer),
        "model_sha256": str(a.identity.get("model_sha256")), "backend": str(a.identity.get("backend")),
        "device": str(a.identity.get("device")), "build_key": str(a.identity.get("build_key")),
        "logits": str(a.extra.get("logits")),
        "logits_equal": int(a.logits.tobytes() == b.logits.tobytes()),
        "logits_max_abs": float(np.abs(a.logits.astype(np.float64) - b.logits).max()),
        "diverged": int(first is not None),
        "first_node": first["node_name"] if first else "",
        "first_name": first["name"] if first else "",
        "first_layer": int(first["layer"]) if first else -2,
        "first_op": first["op"] if first else "",
        "first_max_abs": float(first["max_abs"]) if first else 0.0,
        "first_max_ulp": int(first["max_ulp"]) if first else 0,
        "first_position": int(first["first_diff_position"]) if first else -1,
        "compare": "bitwise per token position; visible KV columns only for kq/kq_soft_max",
    })
    return ds


@dataclass
class LocateResult:
    dataset: object
    runs: tuple

    @property
    def diverged(self) -> bool:
        return bool(self.dataset.attrs["diverged"])

    @property
    def first(self) -> dict | None:
        a = self.dataset.attrs
        if not a["diverged"]:
            return None
        return {"node": a["first_node"], "name": a["first_name"], "layer": a["first_layer"], "op": a["first_op"],
                "max_abs": a["first_max_abs"], "max_ulp": a["first_max_ulp"], "position": a["first_position"]}


def locate(model, tokens, geometry_a, geometry_b, base_config=None, *, layers="all", logits: str = "last",
           n_ctx: int | None = None) -> LocateResult:
    """Run both geometries with capture and compare (see module doc)."""
    ga = parse_geometry(geometry_a) if isinstance(geometry_a, str) else geometry_a
    gb = parse_geometry(geometry_b) if isinstance(geometry_b, str) else geometry_b
    if not isinstance(ga, Geometry) or not isinstance(gb, Geometry):
        raise ConfigError("geometries must be strings like ub1, ub4, A, 16+rest, ub4:QB")
    toks = np.asarray(tokens, dtype=np.int32).ravel()
    if len(toks) < 1:
        raise ConfigError("the locator needs at least one token")
    lay = [check_layer(model, il) for il in layers] if isinstance(layers, list) else parse_layers(layers, model.n_layer)
    want = layer_filter(lay, model.n_layer)
    ra = run_graph(model, toks, ga, base_config, want=want, logits=logits, n_ctx=n_ctx,
                   keep_data=_keep_data)
    rb = run_graph(model, toks, gb, base_config, want=want, logits=logits, n_ctx=n_ctx,
                   keep_data=_keep_data)
    ds = compare_runs(ra, rb)
    ds.attrs["layers"] = "all" if lay is None else ",".join(map(str, lay))
    return LocateResult(ds, (ra, rb))


def _keep_data(name: str, op: str) -> bool:
    """Copy node outputs except pure views of the KV cache (its SET_ROWS writes are copied)."""
    return not (is_kv_cache_node(name) and op != "SET_ROWS")


def layer_summary(ds) -> list[dict]:
    """Per layer: nodes compared, nodes differing, first differing node, max |d| at the layer output."""
    out = []
    layers = sorted(set(int(x) for x in ds["layer"].values))
    for il in layers:
        sel = ds.where(ds["layer"] == il, drop=True)
        status = sel["status"].values
        names = sel["name"].values
        ops = sel["op"].values
        mx = sel["max_abs"].values.astype(float)
        compared = int(np.isin(status, ["equal", "differs"]).sum())
        diff_idx = [i for i, s in enumerate(status) if s == "differs"]
        first = diff_idx[0] if diff_idx else None
        lo = [i for i, n in enumerate(names) if n in ("l_out", "result_output")]
        out_diff = float(mx[lo[-1]]) if lo and status[lo[-1]] in ("equal", "differs") else float("nan")
        fin = mx[np.isfinite(mx)]
        out.append({
            "layer": il, "label": _layer_label(il, int(ds.attrs["n_layer"])), "compared": compared,
            "differing": len(diff_idx), "first_name": names[first] if first is not None else "",
            "first_op": ops[first] if first is not None else "",
            "first_max_abs": float(mx[first]) if first is not None else 0.0,
            "max_abs": float(fin.max()) if fin.size else 0.0, "out_max_abs": out_diff,
        })
    return out


def _layer_label(il: int, n_layer: int) -> str:
    if il == INPUT_LAYER:
        return "input"
    if il == n_layer:
        return "output"
    return str(il)


def _g(x: float) -> str:
    if x != x:
        return "-"
    return "0" if x == 0 else f"{x:.6g}"


def locate_markdown(ds, max_nodes: int = 80) -> str:
    a = ds.attrs
    lines = [
        "# Divergence locator", "",
        f"- A: `{a['geometry_a']}`", f"- B: `{a['geometry_b']}`",
        f"- tokens: {a['n_tokens']}, layers captured: {a.get('layers', 'all')}, logits: {a['logits']}, "
        f"backend: {a['backend']} ({a['device']}), build {a['build_key']}",
        f"- final logits bitwise equal: {'yes' if a['logits_equal'] else 'no'} (max |d| {_g(a['logits_max_abs'])})",
        "",
    ]
    if a["diverged"]:
        lbl = _layer_label(int(a["first_layer"]), int(a["n_layer"]))
        lines += [f"**First divergence**: node `{a['first_node']}` (layer {lbl}, op {a['first_op']}), "
                  f"max |d| {_g(a['first_max_abs'])}, max ULP {a['first_max_ulp']}, "
                  f"first differing position {a['first_position']}.", ""]
    else:
        lines += ["**No divergence**: every compared node is bitwise equal on every common position.", ""]
    lines += ["## Per layer", "", "| layer | nodes compared | differing | first differing node (op) | its max abs diff "
              "| layer max abs diff | layer output max abs diff |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in layer_summary(ds):
        fn = f"{r['first_name']} ({r['first_op']})" if r["first_name"] else "-"
        lines.append(f"| {r['label']} | {r['compared']} | {r['differing']} | {fn} | {_g(r['first_max_abs'])} | "
                     f"{_g(r['max_abs'])} | {_g(r['out_max_abs'])} |")
    # every node of the layer of the first divergence, in graph order
    status = ds["status"].values
    idx = [i for i, st in enumerate(status) if st == "differs"]
    first_layer = int(ds["layer"].values[idx[0]]) if idx else None
    sel = [i for i in range(len(status)) if first_layer is not None and int(ds["layer"].values[i]) == first_layer]
    sel = sel[:max_nodes]
    if sel:
        lines += ["", f"## Nodes of layer {_layer_label(first_layer, int(a['n_layer']))} in graph order", "",
                  "| node | op | kind | status | positions | differing | first differing position "
                  "| max abs diff | max ULP | note |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for i in sel:
            occ = int(ds["occurrence"].values[i])
            nm = ds["name"].values[i] + (f" #{occ}" if occ else "")
            mu = int(ds["max_ulp"].values[i])
            fp = int(ds["first_diff_position"].values[i])
            lines.append(f"| `{nm}` | {ds['op'].values[i]} | {ds['kind'].values[i]} | {status[i]} | "
                         f"{int(ds['n_positions'].values[i])} | {int(ds['n_diff_positions'].values[i])} | "
                         f"{fp if fp >= 0 else '-'} | {_g(float(ds['max_abs'].values[i]))} | "
                         f"{mu if mu >= 0 else '-'} | {ds['reason'].values[i]} |")
    lines.append("")
    return "\n".join(lines)


__all__ = ["LocateResult", "compare_runs", "layer_summary", "locate", "locate_markdown"]
