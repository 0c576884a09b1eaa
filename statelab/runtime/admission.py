"""Whether a device admits a layout's attention operators (paper 6.3, S6.3): a runtime fact.

A layout can be legal (the address oracle) and still be refused by a backend.  The exact
operators of each layout (:meth:`statelab.runtime.layouts.Attention.build`) are built in a
``no_alloc`` ggml context over the same KV-cache views as llama.cpp's ``build_attn_mha``:

* Q: ``Qcur`` (d, h_Q, q) F32 -> ``permute(0, 2, 1, 3)`` -> (d, q, h_Q);
* K: the F16 cache (n_embd_k_gqa, kv_size) -> view (d, h_KV, n_kv) -> permute -> (d, n_kv, h_KV);
* V: the transposed F16 cache -> view (n_kv, h_KV, d) -> permute -> (n_kv, d, h_KV);
* mask: (n_kv, q, 1, 1) F32;

and every device is asked ``ggml_backend_dev_supports_op`` for every call.  "Rejected" is a
proven refusal; "supported" says only that the backend's predicate accepted the shape.  A
product the model's device rejects is not an error in llama.cpp (the scheduler quietly runs
it on the CPU), so a run asks :func:`device_refusal` first and reports the arm as not
admitted.  No xarray here: ``audit admission`` turns :func:`operator_admission` into its
Dataset for display.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from statelab.errors import ConfigError
from statelab.runtime.ggml_ops import OpGraph
from statelab.runtime.layouts import Layout, attention, patch_refusal
from statelab.runtime.native import devices_for_backend

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


def attention_operators(g, shape: AttnShape, layout, q: int) -> dict:
    """One attention layout's operators for q queries over the cache views, in an OpGraph:
    {op: [tensors]} for :data:`OPS`."""
    att = attention(layout, q)
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
    return att.build(g, qp, kp, vp, mask, shape.scale, 0.0)


def shape_text(t) -> str:
    """``OP (src0) x (src1) -> (dst)``: an operator call's extents."""
    def fmt(x):
        return "(" + ",".join(str(v) for v in x.ne) + ")"

    return f"{t.op} {' x '.join(fmt(s) for s in t.srcs)} -> {fmt(t)}"


@dataclass(frozen=True)
class OpAdmission:
    """One operator of a layout: its calls, their shapes, and per device 1 (every call accepted),
    0 (one rejected, ``rejected`` names the shapes) or -1 (the layout has no such operator)."""
    calls: int
    shapes: str
    supported: tuple[int, ...]
    rejected: tuple[str, ...]


def operator_admission(shape: AttnShape, layout, q: int, devices) -> dict[str, OpAdmission]:
    """Ask each device (``runtime.ggml_ops`` devices) about every operator of ``layout`` for q queries."""
    out = {}
    with OpGraph(max_tensors=64 + 10 * q) as g:
        built = attention_operators(g, shape, layout, q)
        for op in OPS:
            ts = built[op]
            sup, rej = [], []
            for dev in devices:
                ans = [OpGraph.supports(dev.handle, t) for t in ts] if ts else []
                sup.append(int(all(ans)) if ts else -1)
                rej.append("; ".join(sorted({shape_text(t) for t, a in zip(ts, ans) if not a})))
            out[op] = OpAdmission(len(ts), "; ".join(sorted({shape_text(t) for t in ts})), tuple(sup), tuple(rej))
    return out


def device_refusal(model, layout, q: int) -> str | None:
    """Why the model's own device would not run ``layout``'s attention products for q queries, or None
    (the CPU runs every layout; MQ and one query are the native graph)."""
    lay = Layout.parse(layout)
    if not lay.device_must_admit(model.backend) or lay.attention == Layout.MQ or q < 2:
        return None
    dev = devices_for_backend(model.backend)[0]
    ans = operator_admission(AttnShape.of_model(model), lay.attention, q, [dev])
    bad = [f"{op} {a.rejected[0]}" for op, a in ans.items() if a.supported[0] == 0]
    if not bad:
        return None
    why = (f"not admitted on {dev.registry}:{dev.name}: its supports_op rejects {'; '.join(bad)} "
           f"(the scheduler would run them on the CPU)")
    patch = patch_refusal(lay.attention, model.backend)  # QB on Vulkan without patch 0007
    return why + (f"; {patch}" if patch else "")
