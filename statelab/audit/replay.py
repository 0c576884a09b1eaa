"""Operator replay: captured operands re-run through standalone ggml graphs on a chosen backend.

Two kinds of replay (paper 4.3, 6.1, S4.2):

* **Attention replay** (:func:`replay_attention`, :func:`replay_e1`): the frozen E1 operands
  (Q, K, V, mask with their exact extents and byte strides, softmax scale and max_bias) are
  re-run as MQ, PQ and QB attention graphs built with the same ggml calls llama.cpp (and the
  layout patch) uses. Own-path correspondence comes first: the MQ replay must equal the
  native MQ capture bitwise at QK, softmax and AV, and a second replay must equal the first;
  only then are the replayed layouts compared with each other. This works on an unpatched
  build too: the operators are plain ggml, only the in-model PQ/QB graphs need the patch.
* **Operator replay** (:func:`replay_ops`): every captured operator call of a layer
  (``MUL_MAT`` including quantised weights, ``SOFT_MAX``, ``RMS_NORM``, ``MUL``, ``ADD``) is
  re-run from the operands *as read right after the call* (the capture copies a node's
  sources at that moment). A call qualifies when the replay equals the native output bitwise.
  When an operand's bytes overlap the call's own output (ggml-alloc ran the consumer in
  place: ``attn_norm = norm * w`` over ``norm``, ``kq_soft_max`` over ``kq``, residual ``ADD``),
  the captured operand is already overwritten: the call fails correspondence and is
  excluded with that reason; if the producer's own output was captured, the call is replayed
  again from it (``requalified``).

Standalone ggml graphs allocate every tensor separately, so no replay is in place itself.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from statelab.audit.capture import VIEW_OPS, Geometry, check_layer, name_layer, parse_node_name, run_graph
from statelab.audit.e1 import MAX_Q, AttnCapture, LAYOUTS, PAIRS, STAGES, _diff, _f32, extract_attention
from statelab.errors import ConfigError
from statelab.lab.formation import Schedule
from statelab.runtime.ggml_ops import OpGraph, backend_devices
from statelab.runtime.layouts import Layout, attention

REPLAY_OPS = ("MUL_MAT", "SOFT_MAX", "RMS_NORM", "MUL", "ADD")


def _device(device):
    if hasattr(device, "handle"):  # already resolved: no device enumeration (memory queries) per replay
        return device
    devs = backend_devices()
    if device is None:
        return devs[0]
    if isinstance(device, int):
        if not 0 <= device < len(devs):
            raise ConfigError(f"device {device} does not exist ({len(devs)} backend devices)")
        return devs[device]
    for d in devs:
        if d.name.lower() == str(device).lower() or d.registry.lower() == str(device).lower():
            return d
    raise ConfigError(f"no backend device named {device!r} (have: {', '.join(d.name for d in devs)})")


def replay_attention(cap: AttnCapture, layout: str, device=None, threads: int | None = None) -> dict:
    """Re-run a captured attention layer's operands as `layout`; outputs in native order."""
    att = attention(layout, cap.q)
    dev = _device(device)
    ops = cap.operands
    with OpGraph(max_tensors=64 + 10 * cap.q) as g:
        inputs, t = {}, {}
        for role in ("q", "k", "v", "mask"):
            o = ops[role]
            t[role], i = g.operand(o.type, o.ne, o.nb, o.data, role)
            inputs.update(i)
        outs = att.build(g, t["q"], t["k"], t["v"], t["mask"], cap.scale, cap.max_bias)
        res = g.compute([x for s in STAGES for x in outs[s]], inputs, dev, threads)
        return {s: att.native_order([res[x.name] for x in outs[s]]) for s in STAGES}


def _eq(a, b) -> bool:
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def replay_e1(detail: dict, layouts=LAYOUTS, device=None, threads: int | None = None):
    """Replay every MQ capture of an E1 run (:func:`statelab.audit.e1.run_e1` detail) as MQ,
    PQ and QB. Returns an xarray Dataset with the own-path and repeat controls and the
    pairwise comparisons of the replayed layouts."""
    import xarray as xr


    runs = detail["runs"]
    keys = sorted({(ph, q) for (ph, q, lo) in runs if lo == Layout.MQ}, key=lambda k: (k[0] != "prefill", k[1]))
    if not keys:
        raise ConfigError("the E1 detail has no MQ capture to replay")
    layers = sorted(next(iter(runs.values())).captures)
    phases = sorted({k[0] for k in keys}, key=lambda p: p != "prefill")
    qs = sorted({k[1] for k in keys})
    nL, nP, nQ, nR, nS = len(layers), len(phases), len(qs), len(PAIRS), len(STAGES)
    own = np.full((nL, nP, nQ, nS), -1, dtype=np.int8)
    rep = np.full((nL, nP, nQ, len(layouts)), -1, dtype=np.int8)
    status = np.full((nL, nP, nQ, nR), "", dtype=object)
    equal = np.full((nL, nP, nQ, nR, nS), -1, dtype=np.int8)
    maxabs = np.full((nL, nP, nQ, nR, nS), np.nan)
    maxulp = np.full((nL, nP, nQ, nR, nS), -1, dtype=np.int64)
    dev = _device(device)
    for (ph, q) in keys:
        pi, qi = phases.index(ph), qs.index(q)
        r = runs[(ph, q, Layout.MQ)]
        for li, L in enumerate(layers):
            cap = r.captures[L]
            out = {}
            for yi, lo in enumerate(layouts):
                a = replay_attention(cap, lo, dev, threads)
                b = replay_attention(cap, lo, dev, threads)
                rep[li, pi, qi, yi] = all(_eq(a[s], b[s]) for s in STAGES)
                out[lo] = a if rep[li, pi, qi, yi] else None
            mq = out.get(Layout.MQ)
            for si, s in enumerate(STAGES):
                own[li, pi, qi, si] = int(mq is not None and _eq(mq[s], cap.outputs[s]))
            own_ok = bool((own[li, pi, qi] == 1).all())
            for ri, (x, y) in enumerate(PAIRS):
                if x not in out or y not in out:
                    status[li, pi, qi, ri] = "not requested"
                elif not own_ok:
                    status[li, pi, qi, ri] = "withheld: MQ replay does not reproduce the native capture"
                elif out[x] is None or out[y] is None:
                    status[li, pi, qi, ri] = "withheld: replay not repeatable"
                else:
                    status[li, pi, qi, ri] = "compared"
                    for si, s in enumerate(STAGES):
                        e, m, u = _diff(out[x][s], out[y][s])
                        equal[li, pi, qi, ri, si], maxabs[li, pi, qi, ri, si], maxulp[li, pi, qi, ri, si] = e, m, u
    ds = xr.Dataset(
        {
            "own_path_equal": (("layer", "phase", "q", "stage"), own),
            "replay_repeat_equal": (("layer", "phase", "q", "layout"), rep),
            "status": (("layer", "phase", "q", "pair"), status.astype(str)),
            "bitwise_equal": (("layer", "phase", "q", "pair", "stage"), equal),
            "max_abs": (("layer", "phase", "q", "pair", "stage"), maxabs),
            "max_ulp": (("layer", "phase", "q", "pair", "stage"), maxulp),
        },
        coords={"layer": layers, "phase": phases, "q": qs, "layout": list(layouts),
                "pair": [f"{x}-{y}" for x, y in PAIRS], "stage": list(STAGES)},
    )
    ds.attrs.update({"title": "statelab E1 standalone replay (frozen MQ operands)", "device": dev.name,
                     "device_registry": dev.registry})
    return ds


def replay_markdown(ds) -> str:
    lines = ["# E1 standalone replay", "",
             f"Device: {ds.attrs['device']} ({ds.attrs['device_registry']}). Own path: the MQ replay of the "
             "frozen operands against the native MQ capture (qk/softmax/av); repeat: each layout replayed twice.", "",
             "| layer | phase | q | own path | repeat " + " ".join(ds["layout"].values) + " | "
             + " | ".join(ds["pair"].values) + " |",
             "| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in ds["pair"].values) + " |"]
    for li, L in enumerate(ds["layer"].values):
        for pi, ph in enumerate(ds["phase"].values):
            for qi, q in enumerate(ds["q"].values):
                own = "".join("-" if v < 0 else str(int(v)) for v in ds["own_path_equal"].values[li, pi, qi])
                rp = "".join("-" if v < 0 else str(int(v)) for v in ds["replay_repeat_equal"].values[li, pi, qi])
                cells = []
                for ri in range(ds.sizes["pair"]):
                    st = str(ds["status"].values[li, pi, qi, ri])
                    if st != "compared":
                        cells.append(st)
                        continue
                    parts = []
                    for si, s in enumerate(ds["stage"].values):
                        if int(ds["bitwise_equal"].values[li, pi, qi, ri, si]) == 1:
                            parts.append(f"{s} =")
                        else:
                            parts.append(f"{s} ≠ {float(ds['max_abs'].values[li, pi, qi, ri, si]):.3g} "
                                         f"({int(ds['max_ulp'].values[li, pi, qi, ri, si])} ulp)")
                    cells.append(", ".join(parts))
                lines.append(f"| {L} | {ph} | {q} | {own} | {rp} | " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------- operator replay


@dataclass
class OpReplay:
    node: str
    op: str
    layer: int | None
    call: int
    graph: int
    status: str  # qualified / failed / aliased / unsupported / no operands
    reason: str
    max_abs: float
    requalified: bool | None  # aliased calls: replay from the producer's captured output


def _overlaps(a: tuple, b: tuple) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def replay_node(node, device=None, threads: int | None = None, src_override: dict | None = None) -> np.ndarray:
    """Re-run one captured operator call from its captured operands; returns its output."""
    if node.op not in REPLAY_OPS:
        raise ConfigError(f"operator {node.op} is not replayed (supported: {', '.join(REPLAY_OPS)})")
    dev = _device(device)
    src_override = src_override or {}
    with OpGraph(max_tensors=32) as g:
        inputs, ts = {}, []
        for s in node.srcs:
            data = src_override.get(s.slot, s.data)
            if data is None:
                raise ConfigError(f"{node.name}: operand {s.slot} ({s.name}) was not captured")
            t, inp = g.operand(s.type, s.ne, s.nb, data, f"src{s.slot}")
            inputs.update(inp)
            ts.append(t)
        if node.op == "MUL_MAT":
            out = g.mul_mat(ts[0], ts[1], "out", prec_f32=False)
        elif node.op == "SOFT_MAX":
            out = g.soft_max_ext(ts[0], ts[1] if len(ts) > 1 else None, _f32(node.op_params[0]),
                                 _f32(node.op_params[1]), "out")
        elif node.op == "RMS_NORM":
            out = g.rms_norm(ts[0], _f32(node.op_params[0]), "out")
        elif node.op == "MUL":
            out = g.mul(ts[0], ts[1], "out")
        else:
            out = g.add(ts[0], ts[1], "out")
        out.set_op_params(node.op_params)
        res = g.compute([out], inputs, dev, threads)
    return res["out"]


def replay_ops(run, layer: int | None = None, device=None, threads: int | None = None, call: int | None = None,
               graph: int = 0) -> list[OpReplay]:
    """Replay every supported operator call captured (with sources) in one micro-batch of a run."""
    nodes = [n for n in run.nodes if (call is None or n.call == call) and n.graph == graph]
    if call is None and nodes:
        first_call = min(n.call for n in nodes)
        nodes = [n for n in nodes if n.call == first_call]
    if layer is not None:
        nodes = [n for n in nodes if parse_node_name(n.name, n.op)[1] == layer]
    dev = _device(device)
    out = []
    produced = {}
    for n in sorted(nodes, key=lambda x: x.index):
        lay = parse_node_name(n.name, n.op)[1]
        if n.op not in REPLAY_OPS:
            if n.op not in VIEW_OPS:
                out.append(OpReplay(n.name, n.op, lay, n.call, n.graph, "unsupported", "operator not replayed",
                                    np.nan, None))
            produced[n.name] = n
            continue
        if any(s.data is None for s in n.srcs) or n.data is None:
            out.append(OpReplay(n.name, n.op, lay, n.call, n.graph, "no operands",
                                "sources were not captured (want_srcs)", np.nan, None))
            produced[n.name] = n
            continue
        aliased = [s for s in n.srcs if _overlaps(s.span, n.span)]
        got = replay_node(n, dev, threads)
        native = np.asarray(n.data)
        same = got.shape == native.shape and got.tobytes() == native.tobytes()
        fin = np.isfinite(got) & np.isfinite(native) if got.shape == native.shape else None
        mx = float(np.abs(got.astype(np.float64)[fin] - native.astype(np.float64)[fin]).max()) \
            if fin is not None and fin.any() else (0.0 if same else np.nan)
        if aliased:
            names = ", ".join(s.name for s in aliased)
            fixes, requal = {}, None
            for s in aliased:
                prod = produced.get(s.name)
                if prod is not None and prod.data is not None and tuple(prod.ne) == tuple(s.ne):
                    fixes[s.slot] = prod.data
            if len(fixes) == len(aliased):
                again = replay_node(n, dev, threads, fixes)
                requal = again.tobytes() == native.tobytes()
            status = "aliased" if not same else "qualified"
            reason = (f"operand {names} shares its bytes with this call's output (in-place consumer): "
                      f"captured after it was overwritten; excluded" if not same else
                      f"operand {names} is in place but replays equal")
            out.append(OpReplay(n.name, n.op, lay, n.call, n.graph, status, reason, mx, requal))
        else:
            out.append(OpReplay(n.name, n.op, lay, n.call, n.graph, "qualified" if same else "failed",
                                "" if same else "replay differs from the native output", mx, None))
        produced[n.name] = n
    return out


def ops_markdown(rows: list[OpReplay]) -> str:
    q = sum(r.status == "qualified" for r in rows)
    tried = sum(r.status in ("qualified", "failed", "aliased") for r in rows)
    lines = ["# Operator replay", "", f"{q} of {tried} replayed operator calls qualify (bitwise equal to the native "
             "output); aliased calls are excluded.", "",
             "| node | op | status | max abs diff | re-run from producer | reason |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        rq = "-" if r.requalified is None else ("equal" if r.requalified else "differs")
        mx = "-" if r.max_abs != r.max_abs else f"{r.max_abs:.3g}"
        lines.append(f"| `{r.node}` | {r.op} | {r.status} | {mx} | {rq} | {r.reason} |")
    lines.append("")
    return "\n".join(lines)


def replay_layer(model, tokens, layer: int, q: int, layout: str, base_config=None, device=None,
                 threads: int | None = None) -> tuple[list[OpReplay], AttnCapture, str]:
    """The first ``q`` prompt tokens in one micro-batch built natively as ``layout``: every
    captured operator call of ``layer`` replayed (:func:`replay_ops`), and the layer's frozen
    attention operands; returns (rows, capture, layout)."""
    check_layer(model, layer)
    if isinstance(q, bool) or not 1 <= q <= MAX_Q:
        raise ConfigError(f"--q must be in 1..{MAX_Q} (occupied queries), got {q}")
    if len(tokens) < q:
        raise ConfigError(f"the prompt has {len(tokens)} tokens, fewer than q={q}")
    lay = Layout.parse(layout, LAYOUTS, "attention layout").value

    def mine(name):
        return name_layer(name) == layer

    run = run_graph(model, tokens[:q], Geometry(Schedule(f"q{q}", (q,), q, 512), lay), base_config, want=mine,
                    want_srcs=mine, logits="all")
    return replay_ops(run, layer, device, threads), extract_attention(run, layer), lay


def replay_report(title: str, rows: list[OpReplay], cap: AttnCapture, device=None, threads: int | None = None) -> str:
    """Markdown of an operator replay (:func:`ops_markdown`, when there are rows) and of the
    capture's attention operands replayed as every layout, each stage compared with the
    native output."""
    lines = [f"# Replay: {title}", ""]
    if rows:
        lines.append(ops_markdown(rows))
    lines += [f"## Attention operands replayed as {' / '.join(LAYOUTS)}", "",
              "| layout | qk | softmax | av |", "| --- | --- | --- | --- |"]
    results = {}
    for lo in LAYOUTS:
        results[lo] = replay_attention(cap, lo, device, threads)
        cells = []
        for s in STAGES:
            a, b = results[lo][s], cap.outputs[s]
            if a.tobytes() == b.tobytes():
                cells.append("= native")
            else:
                fin = np.isfinite(a) & np.isfinite(b)
                cells.append(f"≠ native (max abs diff {float(np.abs(a[fin].astype(np.float64) - b[fin]).max()):.3g})")
        lines.append(f"| {lo} | " + " | ".join(cells) + " |")
    same = [f"{x} vs {y} replay bitwise equal at every stage: "
            f"{all(results[x][s].tobytes() == results[y][s].tobytes() for s in STAGES)}"
            for x, y in PAIRS if Layout.MQ not in (x, y)]
    lines.append(f"\nNative capture was built as {cap.layout}; {'; '.join(same)}.")
    return "\n".join(lines) + "\n"


__all__ = ["OpReplay", "REPLAY_OPS", "ops_markdown", "replay_attention", "replay_e1", "replay_layer",
           "replay_markdown", "replay_node", "replay_ops", "replay_report"]
