"""QB attention on Vulkan (native/patches/0007-vulkan-qb-attention.patch), on lavapipe in CI.

Natively ggml-vulkan refuses QB's two products (K x q and V^T x softmax with K/V's fourth extent
1 and one query per dim-3 index); the patch admits them and computes each query with the
matrix-vector shader of a 1-row decode. What must hold on the device: the 4-row QB block gives
bitwise the logits of four 1-row decodes (the layout oracle), the locator finds no divergence
between ubatch 1 and ubatch 4 with QB, and a C_QB arm qualifies against R. Without the patch
every QB request on Vulkan is refused with one line. Each check runs in a subprocess (the
Vulkan backend reads GGML_VK_VISIBLE_DEVICES once, when it registers); a few tokens only,
lavapipe decodes a few tokens per second.
"""
import json
import os
import subprocess
import sys

import pytest
from test_vulkan import _run, vulkan_device  # noqa: F401  (the module's device probe fixture)

from statelab.errors import ConfigError
from statelab.runtime import layouts


def on_device(fn):
    return pytest.mark.model(pytest.mark.vulkan(fn))


PRELUDE = """
import json
import numpy as np
from statelab import prompts
from statelab.runtime import Context, ContextConfig, Model, layouts, prepare_backend
prepare_backend("vulkan")
m = Model(None, backend="vulkan")
if not layouts.vulkan_qb_available():
    print(json.dumps({"patch": False}))
    raise SystemExit(0)
"""

ORACLE = PRELUDE + """
from statelab.runtime.admission import device_refusal
toks = m.tokenize(prompts.humaneval(2).text)[:28]  # a short prefix: lavapipe prefills slowly
prefix, block = toks[:-4], toks[-4:]
cfg = ContextConfig(backend="vulkan", n_ctx=512, n_batch=256, n_ubatch=256)  # n_kv 256 < 512: V is a strided view
out = {"patch": True, "refusal": device_refusal(m, "QB", 4), "device": m.device_name}
with Context(m, cfg) as ctx:
    ctx.decode(prefix, 0, logits="none")
    one = []
    for i, t in enumerate(block):  # the reference: four 1-row decodes (one query each)
        ctx.decode([t], len(prefix) + i, logits="all")
        one.append(ctx.logits(0))
    one = np.stack(one)
    for lay in ("QB", "MQ"):  # one 4-row micro-batch at the same cache lengths
        assert ctx.seq_rm(0, len(prefix), -1)
        layouts.set_layout(ctx, lay)
        layouts.set_max_queries(ctx, 4)
        ctx.decode(block, len(prefix), logits="all")
        got = np.stack([ctx.logits(i) for i in range(4)])
        adm = layouts.last_admission(ctx)
        out[lay] = {"built": adm.built, "admitted": adm.admitted, "equal": got.tobytes() == one.tobytes(),
                    "rows_equal": [bool((got[i] == one[i]).all()) for i in range(4)],
                    "max_abs": float(np.abs(got - one).max())}
print(json.dumps(out))
"""

LOCATE = PRELUDE + """
from statelab.audit.locate import locate
toks = m.tokenize(prompts.humaneval(2).text)[:8]
cfg = ContextConfig(backend="vulkan", n_ctx=256)
res = locate(m, toks, "ub1", "ub4:QB", cfg, layers="0,last", logits="all")
ds = res.dataset
kq = ds.where((ds["name"] == "kq") & (ds["layer"] == 0), drop=True)
print(json.dumps({"patch": True, "diverged": bool(res.diverged), "first": res.first,
                  "logits_equal": int(ds.attrs["logits_equal"]), "backend": ds.attrs["backend"],
                  "kq0": kq["status"].values.tolist(), "kq0_positions": kq["n_positions"].values.tolist()}))
"""


def _run_env(code, timeout, **env):
    e = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=e)


def _json(r):
    assert r.returncode == 0, r.stderr[-2500:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _patched_or_skip(res):
    if not res["patch"]:
        reason = "this build lacks native/patches/0007-vulkan-qb-attention.patch (QB is refused on Vulkan)"
        print(f"SKIP: {reason}")
        pytest.skip(reason)


@on_device
def test_qb_block_is_bitwise_four_one_row_decodes_on_vulkan(vulkan_device):  # noqa: F811
    """The layout oracle on the device: after a natively prefilled prefix, a 4-row QB micro-batch
    equals four 1-row decodes at the same cache lengths, bitwise, in every row; the native 4-row MQ
    block is the control. With ggml-vulkan's op fusion off: with it on, row 0 of the block differs
    from its 1-row decode in the last bits on lavapipe for PQ and PQ+W as much as for QB, so outside
    the attention and weight products (docs/backends.md); the locator test runs with fusion on."""
    res = _json(_run_env(ORACLE, 900, GGML_VK_DISABLE_FUSION="1"))
    _patched_or_skip(res)
    print(f"Vulkan {vulkan_device}: {res}")
    assert res["device"] != "CPU"
    assert res["refusal"] is None  # the device's supports_op accepts QB's products: they run on Vulkan
    qb, mq = res["QB"], res["MQ"]
    assert qb["built"] == "QB" and qb["admitted"]
    assert qb["equal"] and qb["rows_equal"] == [True] * 4, qb
    # the control: the native multi-query block reduces over the queries in another kernel and differs
    assert mq["built"] == "MQ" and not mq["equal"] and mq["max_abs"] > 0, mq


@on_device
def test_locator_finds_no_divergence_between_ubatch_one_and_qb_on_vulkan(vulkan_device):  # noqa: F811
    """ubatch 1 against ubatch 4 with QB from position 0, every row's logits compared (fusion on)."""
    res = _json(_run(LOCATE, 900))
    _patched_or_skip(res)
    assert res["backend"] == "vulkan"
    assert not res["diverged"], res["first"]
    assert res["logits_equal"] == 1
    assert res["kq0"] == ["equal"] and res["kq0_positions"] == [8]  # QK of every position was compared


@on_device
def test_c_qb_qualifies_on_vulkan(vulkan_device, cli_subprocess, tmp_path):  # noqa: F811
    """The speculative arm with QB verifies (fixed 4-row verifies: every verify is a QB micrograph)
    reproduces R's endpoint on the device, with no micrograph left to MQ."""
    from statelab.runtime import layouts

    _patched_or_skip({"patch": layouts.vulkan_qb_available()})  # the library's version function: no device process
    out = tmp_path / "spec.json"
    # a short prompt that repeats itself: the n-gram drafter proposes from the first cycle, R's prefill is short
    r = cli_subprocess("spec", "run", "-p", "x = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,", "--cap", "8", "--arms", "R,C_QB",
                       "--draft", "ngram:1-8", "--fixed-rows", "--backend", "vulkan", "--no-warmup", "--json", str(out),
                       timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "not admitted" not in r.stderr
    recs = {x["arm"]: x for x in json.loads(out.read_text())}
    c = recs["C_QB"]
    assert c["qualified"] is True, c
    assert c["tokens"] == recs["R"]["tokens"] and len(c["tokens"]) == 8
    assert c["verify_calls"] > 0 and c["proposals"] > 0 and c["layout_not_admitted"] == 0, c


# ------------------------------------------------------------------ without the patch (no device needed)


def test_qb_on_vulkan_without_the_patch_is_refused_with_one_line(monkeypatch):
    from statelab.audit.capture import check_layout

    monkeypatch.setattr(layouts, "vulkan_qb_available", lambda: False)
    for lay in ("QB", "QB+W"):
        why = layouts.patch_refusal(lay, "vulkan")
        assert why and "\n" not in why and "0007-vulkan-qb-attention.patch" in why
    assert layouts.patch_refusal("QB", "cpu") is None and layouts.patch_refusal("QB", "cuda") is None
    assert layouts.patch_refusal("PQ", "vulkan") is None and layouts.patch_refusal("GS", "vulkan") is None
    if layouts.available():  # check_layout first asks for the layout patch itself
        with pytest.raises(ConfigError, match="QB on Vulkan needs native/patches/0007"):
            check_layout("QB", "vulkan")
        check_layout("QB", "cpu")
    monkeypatch.setattr(layouts, "vulkan_qb_available", lambda: True)
    assert layouts.patch_refusal("QB", "vulkan") is None
