"""Backend admission of the MQ/PQ/QB attention operators (ggml_backend_dev_supports_op)."""
import pytest

from statelab.audit.admission import AttnShape, admission_markdown, build_layout, run_admission
from statelab.errors import ConfigError
from statelab.runtime import layouts, list_devices
from statelab.runtime.ggml_ops import OpGraph

pytestmark = pytest.mark.model


def _devices(registry):
    return [d for d in list_devices() if d.registry.lower() == registry]


def test_qb_view_shapes_are_the_papers():
    shape = AttnShape()  # SmolLM2-135M: d 64, 9 query heads, 3 KV heads
    with OpGraph() as g:
        qb = build_layout(g, shape, "QB", 3)
        kq = qb["qk"][0]
        k, q = kq.srcs
        assert k.ne == (64, 256, 3, 1) and q.ne == (64, 1, 9, 3)
        assert q.nb[3] == q.nb[1] == 4 * 64 * 9  # the query-column stride
        mask = qb["softmax"][0].srcs[1]
        assert mask.ne == (256, 1, 1, 3) and mask.nb[3] == mask.nb[1] == 4 * 256
        assert qb["av"][0].ne == (64, 1, 9, 3)
        pq = build_layout(g, shape, "PQ", 3)
        assert len(pq["qk"]) == 3 and pq["concat"][-1].ne == (64, 3, 9, 1)
        mq = build_layout(g, shape, "MQ", 3)
        assert mq["qk"][0].ne == (256, 3, 9, 1)


def test_cpu_accepts_every_layout(model):
    ds = run_admission(AttnShape.of_model(model), qs=(1, 2, 4), devices=_devices("cpu"), model=model)
    cpu = ds.sel(device="CPU:CPU")
    assert (cpu["supported"].where(ds["n_calls"] > 0, 1) == 1).all()
    assert "MUL_MAT (64,256,3,1) x (64,1,9,2) -> (256,1,9,2)" in str(ds["shapes"].sel(layout="QB", q=2, op="qk").item())
    md = admission_markdown(ds)
    assert "| QB | 4 | qk | 1 |" in md
    if layouts.available():
        assert ds["runtime_built"].sel(layout="QB", q=2).item() == "QB"
        assert ds["runtime_built"].sel(layout="QB", q=1).item() == "MQ"  # trivial
    else:
        assert (ds["runtime_reason"] == "not available (patch missing)").all()


VULKAN_PROBE = """
import json
from statelab.runtime import prepare_backend
prepare_backend("vulkan")  # sets GGML_VK_VISIBLE_DEVICES=0 before the backends register
from statelab.audit.admission import AttnShape, run_admission
from statelab.runtime import layouts, list_devices
vk = [d for d in list_devices() if d.registry.lower() == "vulkan"]
if not vk:
    print(json.dumps({"devices": [d.registry + ":" + d.name for d in list_devices()]}))
else:
    ds = run_admission(AttnShape(), qs=(1, 2), devices=vk)
    sup = ds["supported"].sel(device=ds["device"].values[0])
    print(json.dumps({"device": str(ds["device"].values[0]), "patch": layouts.vulkan_qb_available(),
                      **{f"{lay}{q}{op}": int(sup.sel(layout=lay, q=q, op=op))
                         for lay in ("MQ", "PQ", "QB") for q in (1, 2) for op in ("qk", "av")}}))
"""


def test_vulkan_admits_the_qb_batch_broadcast_only_with_patch_0007():
    """In a fresh process: the Vulkan backend reads GGML_VK_VISIBLE_DEVICES once, at registration."""
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", VULKAN_PROBE], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    if "device" not in res:
        reason = f"no Vulkan device in this build/machine (devices: {res['devices']})"
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    # ggml_backend_vk_device_supports_op: mul_mat needs src0->ne[3] == src1->ne[3]; QB has (1, q), which
    # native/patches/0007-vulkan-qb-attention.patch admits (F16 src0, single-vector F32 src1 batched over dim 3)
    want = 1 if res["patch"] else 0
    assert res["QB2qk"] == want and res["QB2av"] == want, res
    assert res["MQ2qk"] == 1 and res["PQ2qk"] == 1 and res["QB1qk"] == 1, res


def test_bad_input():
    with pytest.raises(ConfigError, match="q \\(occupied queries\\)"):
        run_admission(AttnShape(), qs=(0,))
    with pytest.raises(ConfigError, match="GQA"):
        run_admission(AttnShape(h_q=8, h_kv=3), qs=(2,))
    with pytest.raises(ConfigError, match="unknown attention layout 'XB'; choose one of MQ, PQ or QB"):
        with OpGraph() as g:
            build_layout(g, AttnShape(), "XB", 2)
