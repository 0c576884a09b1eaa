"""Backend admission: do the backends accept the operators the MQ/PQ/QB layouts build? (paper 6.3, S6.3)

A layout can be mathematically legal (the address oracle in :mod:`statelab.audit.oracles`)
and still be refused by a backend. Here the exact operator shapes of each layout are built
in a ``no_alloc`` ggml context through ctypes, exactly as ``build_attn_mha`` (and the layout
patch) builds them from the KV-cache views:

* Q: ``Qcur`` (d, h_Q, q) F32 -> ``permute(0, 2, 1, 3)`` -> (d, q, h_Q);
* K: the F16 cache (n_embd_k_gqa, kv_size) -> view (d, h_KV, n_kv) -> permute -> (d, n_kv, h_KV);
* V: the transposed F16 cache -> view (n_kv, h_KV, d) -> permute -> (n_kv, d, h_KV);
* mask: (n_kv, q, 1, 1) F32;
* MQ: ``kq = mul_mat(K, Q)``, ``soft_max_ext(kq, mask)``, ``kqv = mul_mat(V, kq)``;
* QB: Q viewed (d, 1, h_Q, q) with nb[3] = the query-column stride, mask viewed
  (n_kv, 1, 1, q), then the same three operators (K/V broadcast over dim 3);
* PQ: per query j, Q column view (d, 1, h_Q, 1) and mask row view (n_kv, 1, 1, 1), the three
  operators, and ``concat`` of the per-query results along dim 1.

Every registered backend device is asked ``ggml_backend_dev_supports_op(dev, op)`` for every
operator. The answer is the backend's own declared predicate for that shape: "rejected" is a
proven refusal; "supported" says only that the predicate accepted it. What the runtime then
actually built (``layouts.last_admission``, patched build only) is reported next to it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from statelab.errors import ConfigError
from statelab.runtime import Context, ContextConfig, Model, layouts
from statelab.runtime.ggml_ops import OpGraph, backend_devices
from statelab.runtime.layouts import ATTENTION_LAYOUTS, Layout
from statelab.runtime.native import devices_for_backend

LAYOUTS = ATTENTION_LAYOUTS
OPS = ("qk", "softmax", "av", "concat")


@dataclass(frozen=True)
class AttnShape:
    d: int = 64
    n_kv: int = 256
    h_q: int = 9
    h_kv: int = 3
    kv_size: int = 256
    scale: float = 0.125

    @classmethod
    def of_model(cls, model, n_kv: int = 256) -> "AttnShape":
        i = model.info
        if i.head_dim_k != i.head_dim_v:
            raise ConfigError("models with different K and V head sizes are not covered")
        return cls(i.head_dim_k, n_kv, i.n_head, i.n_head_kv, max(n_kv, 256), 1.0 / float(np.sqrt(i.head_dim_k)))

    def check(self, q: int):
        if isinstance(q, bool) or not isinstance(q, (int, np.integer)) or q < 1:
            raise ConfigError(f"q (occupied queries) must be an integer >= 1, got {q!r}")
        if self.h_kv < 1 or self.h_q % self.h_kv:
            raise ConfigError(f"non-integral GQA ratio {self.h_q}/{self.h_kv}")
        if self.n_kv > self.kv_size:
            raise ConfigError(f"n_kv {self.n_kv} exceeds the cache size {self.kv_size}")


def build_layout(g, shape: AttnShape, layout: str, q: int) -> dict:
    """Build one layout's attention operators in an OpGraph; returns {op: [tensors]}."""
    if layout not in LAYOUTS:
        raise ConfigError(f"unknown layout {layout!r}; use MQ, PQ or QB")
    shape.check(q)
    d, n, hq, hk, size = shape.d, shape.n_kv, shape.h_q, shape.h_kv, shape.kv_size
    qcur = g.new_tensor("f32", (d, hq, q), "Qcur")
    qp = g.permute(qcur, (0, 2, 1, 3), "Qcur (permuted)")
    kc = g.new_tensor("f16", (d * hk, size), "cache_k")
    kv = g.view_4d(kc, (d, hk, n, 1), (2 * d, 2 * d * hk, 2 * d * hk * size), 0, "cache_k (view)")
    kp = g.permute(kv, (0, 2, 1, 3), "cache_k (permuted)")
    vc = g.new_tensor("f16", (size * d * hk,), "cache_v")
    vv = g.view_4d(vc, (n, hk, d, 1), (2 * size * d, 2 * size, 2 * size * d * hk), 0, "cache_v (view)")
    vp = g.permute(vv, (0, 2, 1, 3), "cache_v (permuted)")
    mask = g.new_tensor("f32", (n, q, 1, 1), "kq_mask")
    out = {o: [] for o in OPS}
    if layout == "PQ" and q > 1:
        prev = None
        for j in range(q):
            qj = g.view_4d(qp, (d, 1, hq, 1), qp.nb[1:], j * qp.nb[1], f"q_{j}")
            mj = g.view_4d(mask, (n, 1, 1, 1), mask.nb[1:], j * mask.nb[1], f"mask_{j}")
            kq = g.mul_mat(kp, qj, f"kq_pq{j}")
            sm = g.soft_max_ext(kq, mj, shape.scale, 0.0, f"kq_soft_max_pq{j}")
            av = g.mul_mat(vp, sm, f"kqv_pq{j}", prec_f32=False)
            out["qk"].append(kq)
            out["softmax"].append(sm)
            out["av"].append(av)
            if prev is not None:
                prev = g.concat(prev, av, 1, f"kqv_concat{j}")
                out["concat"].append(prev)
            else:
                prev = av
        return out
    qq, mm = qp, mask
    if layout == "QB" and q > 1:
        qq = g.view_4d(qp, (d, 1, hq, q), (qp.nb[1], qp.nb[2], qp.nb[1]), 0, "Qcur (qb view)")
        mm = g.view_4d(mask, (n, 1, 1, q), (mask.nb[1], mask.nb[1], mask.nb[1]), 0, "kq_mask (qb view)")
    kq = g.mul_mat(kp, qq, "kq")
    sm = g.soft_max_ext(kq, mm, shape.scale, 0.0, "kq_soft_max")
    av = g.mul_mat(vp, sm, "kqv", prec_f32=False)
    out["qk"].append(kq)
    out["softmax"].append(sm)
    out["av"].append(av)
    return out


def _shape_text(t) -> str:
    def fmt(x):
        return "(" + ",".join(str(v) for v in x.ne) + ")"

    srcs = t.srcs
    return f"{t.op} {' x '.join(fmt(s) for s in srcs)} -> {fmt(t)}"


def runtime_admission(model, layout: str, q: int, backend_config=None) -> dict:
    """What the patched runtime built for a q-query micro-batch with `layout` (prefill of q tokens)."""
    if not layouts.available():
        return {"requested": layout, "built": "", "admitted": -1, "reason": "not available (patch missing)"}
    cfg = (backend_config or ContextConfig(backend=model.backend)).with_(n_ctx=256, n_batch=max(q, 1),
                                                                       n_ubatch=max(q, 1))
    toks = model.tokenize("The quick brown fox jumps over the lazy dog. " * 2)[:q]
    if len(toks) < q:
        raise ConfigError(f"need {q} tokens for the runtime admission probe")
    with Context(model, cfg) as ctx:
        layouts.set_layout(ctx, layout)
        ctx.decode(toks, 0)
        a = layouts.last_admission(ctx)
    return {"requested": a.requested, "built": a.built, "admitted": int(a.admitted), "reason": a.reason}


def run_admission(shape: AttnShape | None = None, qs=(1, 2, 3, 4), layouts=LAYOUTS, devices=None, model=None,
                  backend_config=None):
    """Ask every backend device about every layout's operators. Returns an xarray Dataset."""
    import xarray as xr


    shape = shape or (AttnShape.of_model(model) if model is not None else AttnShape())
    devs = list(devices) if devices is not None else backend_devices()
    if not devs:
        raise ConfigError("no backend device is registered")
    qs = list(qs)
    for q in qs:
        shape.check(q)
    nD, nY, nQ, nO = len(devs), len(layouts), len(qs), len(OPS)
    supported = np.full((nD, nY, nQ, nO), -1, dtype=np.int8)  # 1 all calls accepted, 0 one rejected, -1 no such op
    n_calls = np.zeros((nY, nQ, nO), dtype=int)
    shapes = np.full((nY, nQ, nO), "", dtype=object)
    rejected = np.full((nD, nY, nQ, nO), "", dtype=object)
    for yi, lo in enumerate(layouts):
        for qi, q in enumerate(qs):
            with OpGraph(max_tensors=64 + 10 * q) as g:
                built = build_layout(g, shape, lo, q)
                for oi, op in enumerate(OPS):
                    ts = built[op]
                    n_calls[yi, qi, oi] = len(ts)
                    if not ts:
                        continue
                    shapes[yi, qi, oi] = "; ".join(sorted({_shape_text(t) for t in ts}))
                    for di, dev in enumerate(devs):
                        ans = [OpGraph.supports(dev.handle, t) for t in ts]
                        supported[di, yi, qi, oi] = int(all(ans))
                        bad = [_shape_text(t) for t, a in zip(ts, ans) if not a]
                        rejected[di, yi, qi, oi] = "; ".join(sorted(set(bad)))
    run = {}
    if model is not None:
        for lo in layouts:
            for q in qs:
                run[(lo, q)] = runtime_admission(model, lo, q, backend_config)
    ds = xr.Dataset(
        {
            "supported": (("device", "layout", "q", "op"), supported),
            "rejected_shapes": (("device", "layout", "q", "op"), rejected.astype(str)),
            "n_calls": (("layout", "q", "op"), n_calls),
            "shapes": (("layout", "q", "op"), shapes.astype(str)),
        },
        coords={"device": [f"{d.registry}:{d.name}" for d in devs], "layout": list(layouts), "q": qs,
                "op": list(OPS), "device_type": ("device", [d.type for d in devs]),
                "device_description": ("device", [d.description for d in devs])},
    )
    if run:
        ds["runtime_built"] = (("layout", "q"), np.array([[run[(lo, q)]["built"] for q in qs] for lo in layouts],
                                                         dtype=object).astype(str))
        ds["runtime_admitted"] = (("layout", "q"), np.array([[run[(lo, q)]["admitted"] for q in qs]
                                                             for lo in layouts], dtype=np.int8))
        ds["runtime_reason"] = (("layout", "q"), np.array([[run[(lo, q)]["reason"] for q in qs] for lo in layouts],
                                                          dtype=object).astype(str))
    ds.attrs.update({
        "title": "statelab backend admission of the MQ/PQ/QB attention operators",
        "d": shape.d, "n_kv": shape.n_kv, "h_q": shape.h_q, "h_kv": shape.h_kv, "kv_size": shape.kv_size,
        "model_backend": model.backend if model is not None else "",
        "note": "supported = ggml_backend_dev_supports_op accepted every call of that operator; a rejection is "
                "proven, an acceptance is the backend's declared predicate only (no placement observed)",
    })
    return ds


def device_refusal(model, layout: str, q: int) -> str | None:
    """Why the model's own device would not run `layout`'s attention products for q queries, or None.

    A product the device's ``supports_op`` rejects is not an error in llama.cpp: the graph scheduler
    quietly runs it on the CPU backend, so an arm would "qualify" without its layout ever running on
    the device. Callers report such an arm as not admitted instead of running it. QB on Vulkan needs
    native/patches/0007 (ggml-vulkan's QB products); a build without it is refused with that reason."""
    lay = Layout.parse(layout)
    base = lay.attention
    if not lay.device_must_admit(model.backend) or base == "MQ" or q < 2:
        return None
    devs = devices_for_backend(model.backend)[:1]
    ds = run_admission(AttnShape.of_model(model), qs=[q], layouts=[base], devices=devs)
    bad = [f"{op} {ds.rejected_shapes.values[0, 0, 0, i]}" for i, op in enumerate(OPS)
           if ds.supported.values[0, 0, 0, i] == 0]
    if not bad:
        return None
    why = (f"not admitted on {ds.device.values[0]}: its supports_op rejects {'; '.join(bad)} "
           f"(the scheduler would run them on the CPU)")
    patch = layouts.patch_refusal(base, model.backend)
    return why + (f"; {patch}" if patch else "")


def admission_markdown(ds) -> str:
    a = ds.attrs
    lines = ["# Backend admission", "",
             f"Shapes: d={a['d']}, n_kv={a['n_kv']}, h_Q={a['h_q']}, h_KV={a['h_kv']} (F16 K/V cache of "
             f"{a['kv_size']} cells, F32 Q and mask). Devices: "
             + ", ".join(f"{d} ({t})" for d, t in zip(ds["device"].values, ds["device_type"].values)) + ".", "",
             "| layout | q | op | calls | shape (src0 x src1 -> dst) | " + " | ".join(ds["device"].values) + " |",
             "| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in ds["device"].values) + " |"]
    for yi, lo in enumerate(ds["layout"].values):
        for qi, q in enumerate(ds["q"].values):
            for oi, op in enumerate(ds["op"].values):
                n = int(ds["n_calls"].values[yi, qi, oi])
                if not n:
                    continue
                cells = []
                for di in range(ds.sizes["device"]):
                    v = int(ds["supported"].values[di, yi, qi, oi])
                    cells.append("supported" if v == 1 else ("**rejected**" if v == 0 else "-"))
                lines.append(f"| {lo} | {q} | {op} | {n} | {ds['shapes'].values[yi, qi, oi]} | " + " | ".join(cells)
                             + " |")
    if "runtime_built" in ds:
        lines += ["", f"## What the runtime built ({a.get('model_backend')})", "",
                  "| layout | q | built | admitted | reason |", "| --- | --- | --- | --- | --- |"]
        for yi, lo in enumerate(ds["layout"].values):
            for qi, q in enumerate(ds["q"].values):
                adm = int(ds["runtime_admitted"].values[yi, qi])
                lines.append(f"| {lo} | {q} | {ds['runtime_built'].values[yi, qi] or '-'} | "
                             f"{'-' if adm < 0 else ('yes' if adm else 'no')} | "
                             f"{ds['runtime_reason'].values[yi, qi]} |")
    lines.append("")
    return "\n".join(lines)


def qb_admission(model_path, backend: str = "cpu") -> tuple[str, str, str]:
    """The capability row of the QB layout for a model: what the patched runtime builds for a
    4-query micro-batch with QB requested, and whether every device's supports_op accepts QB's
    operators at the model's attention shape (loads the model)."""
    with Model(model_path, backend=backend) as m:
        if m.memory_kind in ("recurrent", "hybrid"):
            return ("QB admission", "refused", f"{m.memory_kind} memory: no attention layout to choose")
        ds = run_admission(AttnShape.of_model(m), qs=(4,), layouts=("QB",), model=m,
                           backend_config=ContextConfig(backend=backend))
    sup = ds["supported"].sel(layout="QB", q=4)
    ok = bool((sup != 0).all())
    built = str(ds["runtime_built"].sel(layout="QB", q=4).item()) if "runtime_built" in ds else ""
    admitted = int(ds["runtime_admitted"].sel(layout="QB", q=4).item()) if "runtime_admitted" in ds else -1
    reason = str(ds["runtime_reason"].sel(layout="QB", q=4).item()) if "runtime_reason" in ds else ""
    status = "supported" if ok and admitted == 1 else "refused"
    return ("QB admission", status, f"{backend}: supports_op {'accepts' if ok else 'rejects'} QB's operators; "
                                    f"runtime built {built or '-'} for 4 queries ({reason or 'admitted'}); "
                                    "admission only: `statelab spec run` qualifies the arms against R")


__all__ = ["AttnShape", "LAYOUTS", "OPS", "admission_markdown", "build_layout", "qb_admission", "run_admission",
           "runtime_admission"]
