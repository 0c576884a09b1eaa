"""Weight-product audit: is a q-row product bitwise equal to q 1-row products?

For each weight type present in a model (and each distinct input width K of that type), one
2-D weight tensor of the model file is read byte for byte (its first ``max_rows`` output rows:
output rows are independent in every kernel, the cut only bounds the time; a multiple of 16
keeps the repacked row groups whole). On each backend device, and in each buffer type a
model loader may place the weight in (the device's default one, then its extra ones: CPU_REPACK
on CPU, which llama.cpp tries first), one ggml graph computes for q = 1..max_q:

* native: ``mul_mat(W, X_q)`` with X_q the first q rows of a fixed random F32 input, one
  [K, q] tensor (what a q-row micro-batch does);
* hinted: ``mul_mat(W, X_q)`` carrying the row-invariance hint (op_params[2] = 1, what
  native/patches/0005 puts on every weight product of a context with row-invariant kernels: the
  QB/PQ layouts); backends without a row-count-dependent kernel ignore it (then hinted = native);
* repaired: for each row j a view of row j of X_q, ``mul_mat(W, view)``, concatenated in row
  order (exactly what native/patches/0003 builds for the "+W" layouts);
* reference: ``mul_mat(W, x_j)`` with x_j its own [K, 1] tensor (what a 1-row micro-batch does).

Row j of native (resp. hinted, repaired) is compared bitwise (``tobytes``) with reference j; max |d|
only describes a difference. A buffer type that does not accept the weight type (e.g. a
type CPU_REPACK cannot repack on this CPU) is reported as such, not computed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from statelab.errors import ConfigError
from statelab.models import model_sha256
from statelab.runtime.ggml_ops import OpGraph, backend_devices, type_code, weight_buffer_types
from statelab.runtime.native import devices_for_backend

MAX_Q = 8
SEED = 0
ROW_INVARIANT_HINT = 1  # MUL_MAT op_params[2] of native/patches/0005-row-invariant-kernels.patch


@dataclass(frozen=True)
class WeightCase:
    """One weight tensor standing for its (type, K): raw bytes of its first `rows` output rows."""

    type_name: str  # ggml type name, e.g. q4_K
    tensor: str
    k: int  # input width ne0
    rows: int  # output rows used (ne1, cut to max_rows)
    data: bytes


def weight_cases(path, max_rows: int = 1024) -> list[WeightCase]:
    """One case per (weight type, K) among the model's 2-D tensors (products' weights), in file order.

    The token embedding is used only where no other tensor has its type and K (it is the output
    head when the model ties them)."""
    import gguf

    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 16 or max_rows % 16:
        raise ConfigError(f"max rows must be a positive multiple of 16, got {max_rows!r}")
    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read GGUF tensors of {path}: {e}") from None
    found: dict[tuple[str, int], WeightCase] = {}
    for t in sorted(reader.tensors, key=lambda t: t.name.startswith("token_embd")):
        if len(t.shape) != 2 or not t.name.endswith(".weight"):
            continue
        k, n = int(t.shape[0]), int(t.shape[1])
        type_name = _ggml_type_name(t.tensor_type.name)
        if (type_name, k) in found:
            continue
        rows = min(n, max_rows)
        raw = np.asarray(t.data).reshape(n, -1)[:rows]  # one GGUF row = one output row of ne0 elements
        found[(type_name, k)] = WeightCase(type_name, t.name, k, rows, raw.tobytes())
    if not found:
        raise ConfigError(f"{path} has no 2-D weight tensor")
    return list(found.values())


def _ggml_type_name(gguf_name: str) -> str:
    """gguf's enum name (Q4_K, F16, BF16, IQ4_NL) -> ggml's type name (q4_K, f16, bf16, iq4_nl)."""
    base = gguf_name.lower()
    name = base[:-2] + "_K" if base.endswith("_k") else base
    type_code(name)  # a type this ggml does not know is a GgmlError
    return name


def _inputs(k: int, max_q: int) -> np.ndarray:
    """The fixed input rows: (max_q, K) float32, standard normal from SEED."""
    return np.random.default_rng(SEED).standard_normal((max_q, k)).astype(np.float32)


def audit_case(case: WeightCase, device, buft_name: str, buft, max_q: int = MAX_Q,
               threads: int | None = None) -> dict:
    """Compute one case on one device and buffer type. Returns {"status", "native": [bool]*max_q,
    "hinted": [...], "repaired": [...], "native_max_abs": [...], ...} (index q-1)."""
    x = _inputs(case.k, max_q)
    n_tensors = 8 + 6 * max_q * (max_q + 3)
    with OpGraph(max_tensors=n_tensors) as g:
        w = g.new_tensor(type_code(case.type_name), (case.k, case.rows), "W")
        ins = {}
        refs = []
        for j in range(max_q):
            xj = g.new_tensor("f32", (case.k, 1), f"x{j}")
            ins[xj] = x[j:j + 1]
            refs.append(g.mul_mat(w, xj, f"ref{j}", prec_f32=False))
        native, hinted, repaired = [], [], []
        for q in range(1, max_q + 1):
            xq = g.new_tensor("f32", (case.k, q), f"X{q}")
            ins[xq] = x[:q]
            native.append(g.mul_mat(w, xq, f"native{q}", prec_f32=False))
            hinted.append(g.mul_mat(w, xq, f"hinted{q}", prec_f32=False))
            hinted[-1].set_op_params([0, 0, ROW_INVARIANT_HINT])  # [0] precision, [1] ggml op hint: defaults
            out = None
            for j in range(q):
                view = g.view_4d(xq, (case.k, 1, 1, 1), (xq.nb[1], xq.nb[1], xq.nb[1]), j * xq.nb[1])
                rj = g.mul_mat(w, view, prec_f32=False)
                out = rj if out is None else g.concat(out, rj, 1)
            repaired.append(out)
        if buft is not None:
            g.place(w, buft)
        ops = refs + native + hinted + repaired
        if not all(g.supports(device.handle, o) for o in ops):
            return {"status": f"not accepted by {device.name} with the weight in {buft_name}"}
        ins[w] = case.data
        res = g.compute(ops, ins, device=device, threads=threads)
    ref = [res[f"ref{j}"].reshape(-1) for j in range(max_q)]
    out = {"status": "computed"}
    for kind, tensors in (("native", native), ("hinted", hinted), ("repaired", repaired)):
        eq, mx = [], []
        for q, t in enumerate(tensors, start=1):
            got = res[t.name].reshape(q, case.rows)
            same = [got[j].tobytes() == ref[j].tobytes() for j in range(q)]
            eq.append(all(same))
            mx.append(float(max(np.abs(got[j].astype(np.float64) - ref[j]).max() for j in range(q))))
        out[kind], out[kind + "_max_abs"] = eq, mx
    return out


def audit_devices(backend: str) -> list:
    """The devices a weight-product audit on ``backend`` asks: the CPU, then the backend's own."""
    return [d for d in backend_devices() if d.type == "CPU"] + devices_for_backend(backend)


def run_matmul_audit(model_path, devices=None, max_q: int = MAX_Q, max_rows: int = 1024,
                     threads: int | None = None):
    """Every weight case on every device and buffer type. Returns an xarray Dataset (dims case, q)."""
    import xarray as xr


    if isinstance(max_q, bool) or not isinstance(max_q, int) or not 1 <= max_q <= 16:
        raise ConfigError(f"max q must be an integer in 1..16, got {max_q!r}")
    cases = weight_cases(model_path, max_rows)
    devs = list(devices) if devices is not None else backend_devices()
    if not devs:
        raise ConfigError("no backend device is registered")
    recs = []
    for dev in devs:
        for i_buft, (buft_name, buft) in enumerate(weight_buffer_types(dev)):
            for case in cases:
                # the default buffer type is the one compute() allocates in: no explicit placement
                r = audit_case(case, dev, buft_name, None if i_buft == 0 else buft, max_q, threads)
                recs.append((dev, buft_name, case, r))
    qs = np.arange(1, max_q + 1)

    def col(key, fill):
        return np.array([r.get(key, [fill] * max_q) for *_, r in recs])

    ds = xr.Dataset(
        {"native_equal": (("case", "q"), col("native", False)),
         "hinted_equal": (("case", "q"), col("hinted", False)),
         "hinted_max_abs": (("case", "q"), col("hinted_max_abs", np.nan)),
         "repaired_equal": (("case", "q"), col("repaired", False)),
         "native_max_abs": (("case", "q"), col("native_max_abs", np.nan)),
         "repaired_max_abs": (("case", "q"), col("repaired_max_abs", np.nan)),
         "computed": ("case", np.array([r["status"] == "computed" for *_, r in recs])),
         "status": ("case", np.array([r["status"] for *_, r in recs], dtype=str)),
         "device": ("case", np.array([f"{d.registry}:{d.name}" for d, *_ in recs], dtype=str)),
         "buffer_type": ("case", np.array([b for _, b, *_ in recs], dtype=str)),
         "weight_type": ("case", np.array([c.type_name for _, _, c, _ in recs], dtype=str)),
         "tensor": ("case", np.array([c.tensor for _, _, c, _ in recs], dtype=str)),
         "k": ("case", np.array([c.k for _, _, c, _ in recs])),
         "rows": ("case", np.array([c.rows for _, _, c, _ in recs]))},
        coords={"case": np.arange(len(recs)), "q": qs},
    )
    ds.attrs.update({"title": "statelab weight-product audit", "model": str(model_path),
                     "model_sha256": model_sha256(model_path), "max_q": int(max_q), "max_rows": int(max_rows),
                     "seed": SEED, "compare": "bitwise per row against a 1-row product of the same row"})
    return ds


def _qs_text(flags, qs) -> str:
    """"all" / "none" / the q values where the flag holds."""
    ok = [int(q) for q, f in zip(qs, flags) if f]
    if len(ok) == len(qs):
        return "all"
    return ",".join(map(str, ok)) if ok else "none"


def matmul_markdown(ds) -> str:
    qs = ds.q.values
    lines = [f"# Weight-product audit: q-row product vs q 1-row products (q = 1..{int(qs[-1])})", "",
             f"Model {ds.attrs['model']} (sha256 {ds.attrs['model_sha256'][:12]}), first {ds.attrs['max_rows']} "
             "output rows of one tensor per (type, K), fixed random F32 input rows. Bitwise per row.", "",
             "| device | buffer type | weight type | K | tensor | q where native = 1-row | max abs d (native) "
             "| q where hinted = 1-row | q where repaired = 1-row |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for i in ds.case.values:
        c = ds.sel(case=i)
        head = f"| {c.device.item()} | {c.buffer_type.item()} | {c.weight_type.item()} | {int(c.k)} | {c.tensor.item()} |"
        if not bool(c.computed):
            lines.append(f"{head} {c.status.item()} | | | |")
            continue
        mx = float(np.nanmax(c.native_max_abs.values))
        lines.append(f"{head} {_qs_text(c.native_equal.values, qs)} | {mx:.3g} | "
                     f"{_qs_text(c.hinted_equal.values, qs)} | {_qs_text(c.repaired_equal.values, qs)} |")
    n = int(ds.computed.sum())
    inv = int(ds.native_equal.all("q").where(ds.computed, False).sum())
    hint = int(ds.hinted_equal.all("q").where(ds.computed, False).sum())
    rep = int(ds.repaired_equal.all("q").where(ds.computed, False).sum())
    lines += ["", f"{n} cases computed: {inv} row-count-invariant without the repair, {hint} with the "
              f"row-invariance hint (patch 0005), {rep} with the row-by-row repair."]
    return "\n".join(lines) + "\n"


def repaired_everywhere(ds) -> bool:
    """Every computed case is row-invariant with the repair (the audit's pass condition)."""
    return bool(ds.repaired_equal.all("q").where(ds.computed, True).all())


__all__ = ["MAX_Q", "WeightCase", "audit_case", "audit_devices", "matmul_markdown", "repaired_everywhere",
           "run_matmul_audit", "weight_cases"]
