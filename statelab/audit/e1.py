"""E1: same-input attention correspondence of MQ, PQ and QB on the real model (paper 4.3, 5.2, S3.2).

A *context* is (target layer, phase, q): phase ``prefill`` decodes the first q prompt tokens
in one micro-batch (visible keys 1..q), phase ``continuation`` decodes q greedy continuation
tokens after the whole prompt (visible keys n+1..n+q), q = 1..4 occupied queries. For every
(phase, q) and layout, a fresh context is run three times: a capture, a repeat capture and a
run without any eval callback. From the captures of each target layer we freeze:

* the operands: Q (``Qcur-L (view) (permuted)``, (d, q, h_Q)), K and V (the permuted KV-cache
  views), the mask (the ``soft_max_ext`` mask input, through its view to the base tensor),
  each with type, extents, byte strides and a sha256 of the logical values; the views each
  layout actually hands to its operators (extents, strides, offsets); the GQA head map and
  the softmax parameters (scale, max_bias);
* the outputs at QK (``kq``), softmax (``kq_soft_max``) and AV (``kqv``), put in the native
  order (h_Q, q, n_kv) / (h_Q, q, d) whatever the layout (PQ: ``kq_pq<j>``... concatenated).

Controls come first and withhold comparisons they fail: observation (the nodes were found
and the library built the requested layout, or q = 1 where every layout is the native
graph), capture on/off (the logits of every output row of the run equal bitwise with and
without the callback), repeatability (the same layout twice gives bitwise-equal operands and
outputs), operand identity per pair of layouts (hashes of Q, K and V as the operators read them
and of the mask as each softmax applied it: the rows its input's rows read, broadcast over the
heads and put in the native order, so that layouts that hand the same mask to their operators
through different views or buffers compare equal). Then, per pair of layouts and stage:
bitwise equal or not, max |difference| and max ULP distance (:func:`oracles.ulp_distance`);
no tolerance decides anything. PQ and QB need the layout patch; without it their columns
say "not available (patch missing)".
"""
from __future__ import annotations

import hashlib
import io
import itertools
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from statelab.audit.capture import Geometry, check_layer, context_size, parse_node_name, run_graph
from statelab.audit.oracles import ulp_distance
from statelab.audit.outputs import write_report
from statelab.errors import ConfigError, IdentityError
from statelab.lab.formation import Schedule
from statelab.paths import atomic_write_bytes, atomic_write_netcdf, atomic_write_text, read_json_record
from statelab.runtime import Context, ContextConfig, layouts as lay_api
from statelab.runtime.layouts import ATTENTION, ATTENTION_LAYOUTS, STAGES, Layout, attention

PHASES = ("prefill", "continuation")
LAYOUTS = ATTENTION_LAYOUTS
PAIRS = tuple(itertools.combinations(LAYOUTS, 2))
MAX_Q = 4
NOT_AVAILABLE = "not available (patch missing)"


# --------------------------------------------------------------------------- frozen operands


@dataclass
class Operand:
    name: str  # node or tensor it was read from
    type: str
    ne: tuple
    nb: tuple
    data: np.ndarray

    @property
    def sha256(self) -> str:
        h = hashlib.sha256()
        h.update(f"{self.type}|{self.ne}|{self.nb}|".encode())
        h.update(np.ascontiguousarray(self.data).tobytes())
        return h.hexdigest()

    def describe(self) -> dict:
        return {"name": self.name, "type": self.type, "ne": list(self.ne), "nb": list(self.nb),
                "sha256": self.sha256}


@dataclass
class AttnCapture:
    """Operands and outputs of one attention layer in one run."""

    layer: int
    layout: str  # layout built (read from the graph)
    q: int
    n_kv: int
    operands: dict  # "q", "k", "v", "mask" -> Operand
    consumed: dict  # e.g. "qk.src1" -> descriptor of the view the operator read
    outputs: dict  # stage -> np.ndarray (h_Q, q, n_kv) or (h_Q, q, d)
    scale: float
    max_bias: float
    head_map: list  # query head a -> KV head
    nodes: list = field(default_factory=list)  # the CapturedNodes (for replay)
    mask_applied: np.ndarray | None = None  # (h_Q, q, n_kv) float32: the mask as the softmax(es) applied it

    def hashes(self) -> dict:
        return {k: v.sha256 for k, v in self.operands.items()}

    def identity(self) -> dict:
        """What operand identity across layouts compares: Q, K and V as captured, and the mask
        as applied (:func:`applied_mask`; the captured mask buffer where it is not known)."""
        h = {k: v.sha256 for k, v in self.operands.items() if k != "mask"}
        if self.mask_applied is None:
            h["mask"] = self.operands["mask"].sha256
        else:
            m = np.ascontiguousarray(self.mask_applied, np.float32)
            h["mask"] = hashlib.sha256(f"{m.shape}|".encode() + m.tobytes()).hexdigest()
        return h


def applied_mask(att, softmaxes) -> np.ndarray:
    """The mask as ggml's ``soft_max_ext`` applies it, in the native order (h_Q, q, n_kv):
    for each softmax node (arrays in ggml order, ne reversed) the input row i1 of head i2 and
    batch i3 reads mask row i1 of mask plane (i2 mod ne2, i3 mod ne3); rows past the input's
    (padding) are not read. ``att`` puts the per-node arrays in the native order as it does
    the outputs."""
    per = []
    for s in softmaxes:
        m = np.asarray(s.srcs[1].data, dtype=np.float32)
        m = m.reshape((1,) * (4 - m.ndim) + m.shape)
        n3, n2, n1, n0 = (int(x) for x in reversed(tuple(s.ne)[:4]))
        per.append(m[np.arange(n3) % m.shape[0]][:, np.arange(n2) % m.shape[1]][:, :, :n1, :n0])
    return att.native_order(per)


def _f32(word: int) -> float:
    return struct.unpack("<f", struct.pack("<i", int(word)))[0]


def _desc(src) -> dict:
    return {"name": src.name, "op": src.op, "type": src.type, "ne": list(src.ne), "nb": list(src.nb),
            "view_of": src.view_src, "view_offs": src.view_offs}


def extract_attention(run, layer: int, micro_batch: tuple[int, int] | None = None) -> AttnCapture:
    """Pick the attention operands and outputs of `layer` from a run's captured nodes, in one
    micro-batch ((call, graph); default: the first captured one)."""
    nodes = [n for n in run.nodes if parse_node_name(n.name, n.op)[1] == layer]
    if not nodes:
        raise ConfigError(f"no captured node of layer {layer}")
    key = micro_batch or min((n.call, n.graph) for n in nodes)
    nodes = [n for n in nodes if (n.call, n.graph) == tuple(key)]
    if not nodes:
        raise ConfigError(f"no captured node of layer {layer} in micro-batch {key}")
    by = {}
    for n in nodes:
        canon = parse_node_name(n.name, n.op)[0]
        by.setdefault(canon, []).append(n)

    def one(canon, op=None):
        c = [n for n in by.get(canon, []) if op is None or n.op == op]
        if len(c) != 1:
            raise ConfigError(f"layer {layer}: expected one {canon!r} node{' (' + op + ')' if op else ''}, "
                              f"found {len(c)}")
        return c[0]

    qn = one("Qcur (view) (permuted)", "PERMUTE")
    kn = one("cache_k (view) (permuted)", "PERMUTE")
    vn = one("cache_v (view) (permuted)", "PERMUTE")
    nq = int(qn.ne[1])
    # the layout the library built: the first whose node names are there and whose QK extents fit (MQ last)
    for att in sorted(ATTENTION.values(), key=lambda a: a.layout is Layout.MQ):
        names = att.names(nq)
        if all(by.get(x) for x in names["qk"]) and att.recognises(one(names["qk"][0], "MUL_MAT").ne, nq):
            break
    layout = att.layout.value
    kq, sm, av = ([one(x, op) for x in names[s]] for s, op in zip(STAGES, ("MUL_MAT", "SOFT_MAX", "MUL_MAT")))
    outs = {s: att.native_order([t.data for t in ts]) for s, ts in zip(STAGES, (kq, sm, av))}
    msrc = sm[0].srcs[1] if len(sm[0].srcs) > 1 else None
    if msrc is None or msrc.data is None:
        raise ConfigError(f"layer {layer}: the softmax mask operand was not captured")
    if msrc.view_src is not None and msrc.base_data is not None:
        mask = Operand(msrc.view_src, msrc.type, msrc.base_ne, msrc.base_nb, np.asarray(msrc.base_data))
    else:
        mask = Operand(msrc.name, msrc.type, msrc.ne, msrc.nb, np.asarray(msrc.data))
    ops = {
        "q": Operand(qn.name, qn.type, qn.ne, qn.nb, np.asarray(qn.data)),
        "k": Operand(kn.name, kn.type, kn.ne, kn.nb, np.asarray(kn.data)),
        "v": Operand(vn.name, vn.type, vn.ne, vn.nb, np.asarray(vn.data)),
        "mask": mask,
    }
    consumed = {}
    for j, (a, b, c) in enumerate(zip(kq, sm, av)):
        tag = f"[{j}]" if len(kq) > 1 else ""
        consumed[f"qk{tag}.src0"] = _desc(a.srcs[0])
        consumed[f"qk{tag}.src1"] = _desc(a.srcs[1])
        consumed[f"softmax{tag}.mask"] = _desc(b.srcs[1])
        consumed[f"av{tag}.src0"] = _desc(c.srcs[0])
    try:
        mask_applied = applied_mask(att, sm)
    except (ValueError, IndexError, TypeError, AttributeError):  # a mask view the capture did not keep whole
        mask_applied = None
    h_q, h_kv = int(qn.ne[2]), int(kn.ne[2])
    if h_kv == 0 or h_q % h_kv:
        raise ConfigError(f"layer {layer}: non-integral GQA ratio {h_q}/{h_kv}")
    r2 = h_q // h_kv
    return AttnCapture(layer, layout, nq, int(kn.ne[1]), ops, consumed, outs, _f32(sm[0].op_params[0]),
                       _f32(sm[0].op_params[1]), [a // r2 for a in range(h_q)],
                       [n for n in nodes if n.op not in ("PERMUTE", "VIEW")] + [qn, kn, vn], mask_applied)


def view_maps_ok(cap: AttnCapture) -> bool:
    """Do the views the layout handed to QK read the canonical Q operand (query j, head a)?"""
    q = np.asarray(cap.operands["q"].data)[0]  # (h_Q, q, d)
    att = attention(cap.layout, cap.q)
    by = {parse_node_name(n.name, n.op)[0]: n for n in cap.nodes if n.op == "MUL_MAT"}
    reads = [by.get(x) for x in att.names(cap.q)["qk"]]
    if any(n is None or n.srcs[1].data is None for n in reads):
        return False
    return np.array_equal(att.native_order([n.srcs[1].data for n in reads]), q)


# --------------------------------------------------------------------------- runs


def continuation_tokens(model, prompt_tokens, n: int, base_config=None) -> np.ndarray:
    """The first n greedy continuation tokens after the whole prompt (native graph)."""
    toks = np.asarray(prompt_tokens, dtype=np.int32)
    cfg = (base_config or ContextConfig(backend=model.backend)).with_(
        n_ctx=context_size(len(toks) + n), n_batch=max(512, len(toks)), n_ubatch=max(512, len(toks)))
    out = []
    with Context(model, cfg) as ctx:
        ctx.decode(toks, 0)
        t = ctx.greedy(ctx.logits(-1))
        for i in range(n):
            out.append(t)
            if i + 1 < n:
                ctx.decode([t], len(toks) + i)
                t = ctx.greedy(ctx.logits(-1))
    return np.asarray(out, dtype=np.int32)


def _want(layers):
    keep = set(layers)
    wanted = {"Qcur (view) (permuted)", "cache_k (view) (permuted)", "cache_v (view) (permuted)",
              "kq", "kq_soft_max", "kqv"}

    def want(name: str) -> bool:
        canon, il = parse_node_name(name, "")
        if il not in keep:
            return False
        return canon in wanted or canon.startswith("kq_pq") or canon.startswith("kq_soft_max_pq") \
            or canon.startswith("kqv_pq")

    def want_srcs(name: str) -> bool:
        canon, il = parse_node_name(name, "")
        return il in keep and canon.split("_pq")[0] in ("kq", "kq_soft_max", "kqv")

    return want, want_srcs


@dataclass
class PhaseRun:
    phase: str
    q: int
    layout: str
    captures: dict  # layer -> AttnCapture (first capture)
    repeats: dict  # layer -> AttnCapture (repeat)
    onoff_equal: bool
    onoff_max_abs: float
    admission: object
    visible: tuple  # visible keys of the first and last query
    built: str
    identity: dict = field(default_factory=dict)


def run_phase(model, prompt_tokens, cont_tokens, phase: str, q: int, layout: str, layers, base_config=None):
    if phase not in PHASES:
        raise ConfigError(f"phase must be one of {PHASES}, got {phase!r}")
    if isinstance(q, bool) or not isinstance(q, (int, np.integer)) or not 1 <= q <= MAX_Q:
        raise ConfigError(f"q must be an integer in 1..{MAX_Q} (occupied queries), got {q!r}")
    if phase == "prefill":
        if len(prompt_tokens) < q:
            raise ConfigError(f"the prompt has {len(prompt_tokens)} tokens, fewer than q={q}")
        toks, prefix = prompt_tokens[:q], None
    else:
        toks, prefix = cont_tokens[:q], prompt_tokens
    geo = Geometry(Schedule(f"q{q}", (q,), max(q, 1), 512), layout)
    want, want_srcs = _want(layers)
    kw = dict(logits="all", prefix=prefix)
    r1 = run_graph(model, toks, geo, base_config, want=want, want_srcs=want_srcs, require_admitted=False, **kw)
    r2 = run_graph(model, toks, geo, base_config, want=want, want_srcs=want_srcs, require_admitted=False, **kw)
    r0 = run_graph(model, toks, geo, base_config, capture=False, require_admitted=False, **kw)
    caps = {L: extract_attention(r1, L) for L in layers}
    reps = {L: extract_attention(r2, L) for L in layers}
    la, lb = r1.extra["out_logits"], r0.extra["out_logits"]
    onoff = la.tobytes() == lb.tobytes()
    n0 = 0 if prefix is None else len(prefix)
    adm = r1.extra["admissions"][-1] if r1.extra["admissions"] else None
    built = caps[layers[0]].layout
    return PhaseRun(phase, q, layout, caps, reps, onoff, float(np.abs(la.astype(np.float64) - lb).max()) if la.size
                    else 0.0, adm, (n0 + 1, n0 + q), built, r1.identity)


def _same(a: AttnCapture, b: AttnCapture) -> bool:
    if a.hashes() != b.hashes():
        return False
    return all(a.outputs[s].tobytes() == b.outputs[s].tobytes() for s in STAGES)


def _diff(x: np.ndarray, y: np.ndarray):
    if x.shape != y.shape:
        return False, np.nan, -1
    eq = x.tobytes() == y.tobytes()
    fx, fy = x.astype(np.float64), y.astype(np.float64)
    fin = np.isfinite(fx) & np.isfinite(fy)
    mx = float(np.abs(fx[fin] - fy[fin]).max()) if fin.any() else 0.0
    u = ulp_distance(x, y, nan="sentinel")
    return eq, mx, int(u.max()) if u.size else 0


def run_e1(model, prompt_tokens, *, layers=None, phases=PHASES, qs=(1, 2, 3, 4), layouts=LAYOUTS,
           base_config=None, progress=None):
    """Run E1 over layers x phases x qs (see module doc). Returns (xarray.Dataset, detail)."""
    import xarray as xr


    n_layer = model.n_layer
    layers = [0, n_layer // 2, n_layer - 1] if layers is None else [check_layer(model, int(x)) for x in layers]
    layers = sorted(set(layers))
    qs = tuple(int(q) if not isinstance(q, bool) else q for q in qs)
    for q in qs:
        if isinstance(q, bool) or not 1 <= q <= MAX_Q:
            raise ConfigError(f"q must be in 1..{MAX_Q} (occupied queries), got {q!r}")
    for ph in phases:
        if ph not in PHASES:
            raise ConfigError(f"unknown phase {ph!r}; use prefill and/or continuation")
    layouts = [Layout.parse(lo, LAYOUTS, "attention layout").value for lo in layouts]
    toks = np.asarray(prompt_tokens, dtype=np.int32)
    if len(toks) < max(qs):
        raise ConfigError(f"the prompt has {len(toks)} tokens, fewer than q={max(qs)}")
    avail = {lo: (not Layout(lo).needs_patch or lay_api.available()) for lo in layouts}
    cont = continuation_tokens(model, toks, max(qs), base_config) if "continuation" in phases else None
    runs: dict[tuple, PhaseRun] = {}
    for ph in phases:
        for q in qs:
            for lo in layouts:
                if not avail[lo]:
                    continue
                if progress:
                    progress(f"{ph} q={q} {lo}")
                runs[(ph, q, lo)] = run_phase(model, toks, cont, ph, q, lo, layers, base_config)

    nL, nP, nQ, nY, nS, nR = len(layers), len(phases), len(qs), len(layouts), len(STAGES), len(PAIRS)
    observed = np.zeros((nL, nP, nQ, nY), dtype=np.int8)
    repeat = np.zeros_like(observed)
    onoff = np.zeros_like(observed)
    viewmap = np.zeros_like(observed)
    built = np.full((nL, nP, nQ, nY), "", dtype=object)
    reason = np.full((nL, nP, nQ, nY), "", dtype=object)
    operands_same = np.zeros((nL, nP, nQ), dtype=np.int8)
    pair_same = np.full((nL, nP, nQ, nR), -1, dtype=np.int8)  # -1: not compared (a layout missing or failing)
    n_kv = np.zeros((nL, nP, nQ), dtype=int)
    vis0 = np.zeros((nL, nP, nQ), dtype=int)
    vis1 = np.zeros((nL, nP, nQ), dtype=int)
    scale = np.zeros((nL, nP, nQ))
    status = np.full((nL, nP, nQ, nR), "", dtype=object)
    equal = np.full((nL, nP, nQ, nR, nS), -1, dtype=np.int8)
    maxabs = np.full((nL, nP, nQ, nR, nS), np.nan)
    maxulp = np.full((nL, nP, nQ, nR, nS), -1, dtype=np.int64)
    hashes = {}
    for li, L in enumerate(layers):
        for pi, ph in enumerate(phases):
            for qi, q in enumerate(qs):
                ok_layouts = {}
                for yi, lo in enumerate(layouts):
                    if not avail[lo]:
                        observed[li, pi, qi, yi] = repeat[li, pi, qi, yi] = onoff[li, pi, qi, yi] = -1
                        viewmap[li, pi, qi, yi] = -1
                        reason[li, pi, qi, yi] = NOT_AVAILABLE
                        continue
                    r = runs[(ph, q, lo)]
                    c = r.captures[L]
                    built[li, pi, qi, yi] = c.layout
                    obs = c.layout == lo or q == 1
                    observed[li, pi, qi, yi] = obs
                    repeat[li, pi, qi, yi] = _same(c, r.repeats[L])
                    onoff[li, pi, qi, yi] = r.onoff_equal
                    viewmap[li, pi, qi, yi] = view_maps_ok(c)
                    why = [w for w, good in (("not observed as " + lo + f" (built {c.layout})", obs),
                                             ("repeat differs", repeat[li, pi, qi, yi]),
                                             ("capture on/off logits differ", r.onoff_equal),
                                             ("layout views do not read the canonical Q", viewmap[li, pi, qi, yi]))
                           if not good]
                    reason[li, pi, qi, yi] = "; ".join(why) if why else "ok"
                    if not why:
                        ok_layouts[lo] = c
                    n_kv[li, pi, qi] = c.n_kv
                    vis0[li, pi, qi], vis1[li, pi, qi] = r.visible
                    scale[li, pi, qi] = c.scale
                    hashes[(L, ph, q, lo)] = c.identity()
                hs = [hashes[(L, ph, q, lo)] for lo in layouts if (L, ph, q, lo) in hashes]
                operands_same[li, pi, qi] = all(h == hs[0] for h in hs) if hs else False
                for ri, (x, y) in enumerate(PAIRS):
                    if x not in layouts or y not in layouts:
                        status[li, pi, qi, ri] = "not requested"
                        continue
                    if not (avail[x] and avail[y]):
                        status[li, pi, qi, ri] = NOT_AVAILABLE
                        continue
                    if x not in ok_layouts or y not in ok_layouts:
                        status[li, pi, qi, ri] = "withheld: a control failed"
                        continue
                    pair_same[li, pi, qi, ri] = hashes[(L, ph, q, x)] == hashes[(L, ph, q, y)]
                    if not pair_same[li, pi, qi, ri]:
                        status[li, pi, qi, ri] = "withheld: operands differ"
                        continue
                    status[li, pi, qi, ri] = "compared"
                    for si, st in enumerate(STAGES):
                        e, m, u = _diff(ok_layouts[x].outputs[st], ok_layouts[y].outputs[st])
                        equal[li, pi, qi, ri, si] = e
                        maxabs[li, pi, qi, ri, si] = m
                        maxulp[li, pi, qi, ri, si] = u
    ds = xr.Dataset(
        {
            "observed": (("layer", "phase", "q", "layout"), observed),
            "repeat_equal": (("layer", "phase", "q", "layout"), repeat),
            "capture_onoff_equal": (("layer", "phase", "q", "layout"), onoff),
            "views_read_canonical_q": (("layer", "phase", "q", "layout"), viewmap),
            "built_layout": (("layer", "phase", "q", "layout"), built.astype(str)),
            "control_reason": (("layer", "phase", "q", "layout"), reason.astype(str)),
            "operands_identical": (("layer", "phase", "q"), operands_same),
            "pair_operands_identical": (("layer", "phase", "q", "pair"), pair_same),
            "n_kv": (("layer", "phase", "q"), n_kv),
            "visible_first": (("layer", "phase", "q"), vis0),
            "visible_last": (("layer", "phase", "q"), vis1),
            "softmax_scale": (("layer", "phase", "q"), scale),
            "status": (("layer", "phase", "q", "pair"), status.astype(str)),
            "bitwise_equal": (("layer", "phase", "q", "pair", "stage"), equal),
            "max_abs": (("layer", "phase", "q", "pair", "stage"), maxabs),
            "max_ulp": (("layer", "phase", "q", "pair", "stage"), maxulp),
        },
        coords={"layer": layers, "phase": list(phases), "q": list(qs), "layout": list(layouts),
                "pair": [f"{x}-{y}" for x, y in PAIRS], "stage": list(STAGES)},
    )
    any_cap = next(iter(runs.values())).captures[layers[0]] if runs else None
    ds.attrs.update({
        "title": "statelab E1: same-input attention correspondence of " + "/".join(LAYOUTS),
        "n_prompt": int(len(toks)), "layouts_available": ",".join(lo for lo in layouts if avail[lo]),
        "layout_patch": int(lay_api.available()),
        "head_map": (f"query head a -> KV head a // {len(any_cap.head_map) // (max(any_cap.head_map) + 1)} "
                     f"({any_cap.head_map})") if any_cap else "",
        "model_sha256": model.sha256,
        "note": "bitwise equality decides; max_abs and max_ulp describe (no tolerance). "
                "-1 in a control or bitwise_equal: not evaluated",
    })
    return ds, {"runs": runs, "continuation_tokens": cont, "hashes": hashes}


def e1_markdown(ds) -> str:
    def cell(li, pi, qi, ri):
        st = str(ds["status"].values[li, pi, qi, ri])
        if st != "compared":
            return st
        parts = []
        for si, s in enumerate(STAGES):
            e = int(ds["bitwise_equal"].values[li, pi, qi, ri, si])
            if e == 1:
                parts.append(f"{s} =")
            else:
                m = float(ds["max_abs"].values[li, pi, qi, ri, si])
                u = int(ds["max_ulp"].values[li, pi, qi, ri, si])
                parts.append(f"{s} ≠ {m:.3g} ({u} ulp)")
        return ", ".join(parts)

    a = ds.attrs
    lines = ["# E1: same-input attention correspondence", "",
             f"Prompt tokens: {a['n_prompt']}; layouts available: {a['layouts_available']} "
             f"(layout patch {'present' if a['layout_patch'] else 'missing'}); head map: {a['head_map']}.", "",
             "Controls per layout: observed / repeat bitwise / capture on-off logits / layout views read the "
             "canonical Q (1 pass, 0 fail, - not available). Operands identical: across every layout, else the "
             "pairs whose Q, K, V and applied mask are equal. A pair's comparison is withheld when a control fails "
             "or when its operands differ (at deeper layers the earlier layers already ran under each layout; "
             "the standalone replay compares the layouts on the frozen MQ operands instead).", "",
             "| layer | phase | q | visible keys | n_kv | controls " + " ".join(f"{lo}" for lo in ds["layout"].values)
             + " | operands identical | " + " | ".join(ds["pair"].values) + " |",
             "| --- | --- | --- | --- | --- | --- | --- | " + " | ".join("---" for _ in ds["pair"].values) + " |"]

    def c(v):
        return "-" if int(v) < 0 else str(int(v))

    def same_text(li, pi, qi):
        if ds["operands_identical"].values[li, pi, qi] == 1:
            return "yes"
        pairs = ds["pair_operands_identical"].values[li, pi, qi] if "pair_operands_identical" in ds else ()
        same = [str(p).replace("-", "=") for p, v in zip(ds["pair"].values, pairs) if v == 1]
        return "no" + (f" ({', '.join(same)} only)" if same else "")

    for li, L in enumerate(ds["layer"].values):
        for pi, ph in enumerate(ds["phase"].values):
            for qi, q in enumerate(ds["q"].values):
                ctl = " ".join(
                    f"{c(ds['observed'].values[li, pi, qi, yi])}{c(ds['repeat_equal'].values[li, pi, qi, yi])}"
                    f"{c(ds['capture_onoff_equal'].values[li, pi, qi, yi])}"
                    f"{c(ds['views_read_canonical_q'].values[li, pi, qi, yi])}"
                    for yi in range(ds.sizes["layout"]))
                lines.append(
                    f"| {L} | {ph} | {q} | {int(ds['visible_first'].values[li, pi, qi])}.."
                    f"{int(ds['visible_last'].values[li, pi, qi])} | {int(ds['n_kv'].values[li, pi, qi])} | {ctl} | "
                    f"{same_text(li, pi, qi)} | "
                    + " | ".join(cell(li, pi, qi, ri) for ri in range(ds.sizes["pair"])) + " |")
    lines.append("")
    return "\n".join(lines)




# --------------------------------------------------------------------------- frozen captures on disk

CAPTURE_FORMAT = "statelab-attention-capture/1"


def save_capture(cap: AttnCapture, identity: dict, path, meta: dict | None = None):
    """Write a frozen attention capture (operands, outputs, parameters, identity) to a folder."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    arrays = {f"operand_{k}": np.asarray(v.data) for k, v in cap.operands.items()}
    arrays.update({f"output_{k}": v for k, v in cap.outputs.items()})
    bio = io.BytesIO()
    np.savez(bio, **arrays)
    atomic_write_bytes(p / "tensors.npz", bio.getvalue())
    manifest = {
        "format": CAPTURE_FORMAT, "layer": cap.layer, "layout": cap.layout, "q": cap.q, "n_kv": cap.n_kv,
        "scale": cap.scale, "max_bias": cap.max_bias, "head_map": cap.head_map,
        "operands": {k: v.describe() for k, v in cap.operands.items()}, "consumed": cap.consumed,
        "model_sha256": identity.get("model_sha256"), "identity": identity, **(meta or {}),
    }
    atomic_write_text(p / "manifest.json", json.dumps(manifest, indent=1, default=str))
    return p


def write_e1(out, md: str, ds, replay_ds, detail: dict, prompt_id: str) -> list[Path]:
    """An E1 run into ``out``: report.md, results.nc, replay.nc (with a replay) and every
    frozen attention capture under ``captures/L<layer>_<phase>_q<q>_<layout>``."""
    written = write_report(out, md, ds)
    if replay_ds is not None:
        atomic_write_netcdf(Path(out) / "replay.nc", replay_ds)
    for (ph, q, lo), r in detail["runs"].items():
        for L, cap in r.captures.items():
            save_capture(cap, r.identity, Path(out) / "captures" / f"L{L}_{ph}_q{q}_{lo}",
                         {"prompt": prompt_id, "phase": ph})
    return written


def load_capture(path, model=None) -> tuple[AttnCapture, dict]:
    """Read a folder written by :func:`save_capture`; with `model`, refuse a capture of another model."""
    p = Path(path)
    man = read_json_record(p / "manifest.json", CAPTURE_FORMAT, ConfigError,
                           missing="not an attention capture folder (no manifest.json): {folder}",
                           invalid="unreadable capture manifest {file}: {error}",
                           wrong_format="{folder} is not a {want} folder (format {got!r})")
    if model is not None and man.get("model_sha256") != model.sha256:
        raise IdentityError(f"the capture in {p} was made with model {str(man.get('model_sha256'))[:16]}…, "
                            f"not {model.path.name} ({model.sha256[:16]}…)")
    with np.load(p / "tensors.npz") as z:
        ops = {}
        for k, d in man["operands"].items():
            ops[k] = Operand(d["name"], d["type"], tuple(d["ne"]), tuple(d["nb"]), z[f"operand_{k}"])
            if ops[k].sha256 != d["sha256"]:
                raise IdentityError(f"operand {k} of {p} does not match its recorded sha256 (file changed)")
        outs = {s: z[f"output_{s}"] for s in STAGES}
    cap = AttnCapture(int(man["layer"]), man["layout"], int(man["q"]), int(man["n_kv"]), ops, man["consumed"], outs,
                      float(man["scale"]), float(man["max_bias"]), list(man["head_map"]))
    return cap, man


__all__ = ["AttnCapture", "CAPTURE_FORMAT", "LAYOUTS", "NOT_AVAILABLE", "Operand", "PAIRS", "PHASES", "STAGES",
           "continuation_tokens", "load_capture", "save_capture", "write_e1",
           "e1_markdown", "extract_attention", "run_e1", "run_phase", "view_maps_ok"]
