"""Backend admission: do the backends accept the operators the MQ/PQ/QB layouts build? (paper 6.3, S6.3)

The answer itself is a runtime fact (:mod:`statelab.runtime.admission`: each layout's exact
operators over the KV-cache views, every device asked ``ggml_backend_dev_supports_op``; a run
asks :func:`~statelab.runtime.admission.device_refusal`).  This audit asks it for every
attention layout, q and registered device, adds what the patched runtime then actually built
(``layouts.last_admission``, patched build only) and keeps it as an xarray Dataset for the
report.
"""
from __future__ import annotations

import numpy as np

from statelab.errors import ConfigError
from statelab.runtime import Context, ContextConfig, Model, layouts
from statelab.runtime.admission import OPS, AttnShape, attention_operators, device_refusal, operator_admission
from statelab.runtime.ggml_ops import backend_devices
from statelab.runtime.layouts import ATTENTION_LAYOUTS, Layout

LAYOUTS = ATTENTION_LAYOUTS
build_layout = attention_operators  # {op: [tensors]} of one layout in an OpGraph


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
            for oi, (op, a) in enumerate(operator_admission(shape, lo, q, devs).items()):
                n_calls[yi, qi, oi], shapes[yi, qi, oi] = a.calls, a.shapes
                supported[:, yi, qi, oi], rejected[:, yi, qi, oi] = a.supported, a.rejected
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
        "title": "statelab backend admission of the attention layouts' operators",
        "d": shape.d, "n_kv": shape.n_kv, "h_q": shape.h_q, "h_kv": shape.h_kv, "kv_size": shape.kv_size,
        "model_backend": model.backend if model is not None else "",
        "note": "supported = ggml_backend_dev_supports_op accepted every call of that operator; a rejection is "
                "proven, an acceptance is the backend's declared predicate only (no placement observed)",
    })
    return ds


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
    qb = str(Layout.QB)
    with Model(model_path, backend=backend) as m:
        if m.memory_kind in ("recurrent", "hybrid"):
            return ("QB admission", "refused", f"{m.memory_kind} memory: no attention layout to choose")
        ds = run_admission(AttnShape.of_model(m), qs=(4,), layouts=(qb,), model=m,
                           backend_config=ContextConfig(backend=backend))
    sup = ds["supported"].sel(layout=qb, q=4)
    ok = bool((sup != 0).all())
    built = str(ds["runtime_built"].sel(layout=qb, q=4).item()) if "runtime_built" in ds else ""
    admitted = int(ds["runtime_admitted"].sel(layout=qb, q=4).item()) if "runtime_admitted" in ds else -1
    reason = str(ds["runtime_reason"].sel(layout=qb, q=4).item()) if "runtime_reason" in ds else ""
    status = "supported" if ok and admitted == 1 else "refused"
    return ("QB admission", status, f"{backend}: supports_op {'accepts' if ok else 'rejects'} QB's operators; "
                                    f"runtime built {built or '-'} for 4 queries ({reason or 'admitted'}); "
                                    "admission only: `statelab spec run` qualifies the arms against R")


__all__ = ["AttnShape", "LAYOUTS", "OPS", "admission_markdown", "build_layout", "device_refusal", "qb_admission",
           "run_admission", "runtime_admission"]
