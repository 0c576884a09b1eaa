"""A few tokens on a Vulkan device (lavapipe in CI). Runs in a subprocess, because the
Vulkan backend reads GGML_VK_VISIBLE_DEVICES once, when it registers."""
import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.model, pytest.mark.vulkan]

PROBE = """
import json
from statelab.runtime import prepare_backend
prepare_backend("vulkan")
from statelab.runtime.native import build_identity, list_devices
print(json.dumps({"build": build_identity().get("backend"),
                  "devices": [d.registry + ":" + d.name + ":" + d.description for d in list_devices()]}))
"""

RUN = """
import json, sys
from statelab import prompts
from statelab.lab.formation import PRESETS, form, parse_schedule
from statelab.lab.intervene import natural
from statelab.kvstate import compare
from statelab.runtime import ContextConfig, Model, prepare_backend
prepare_backend("vulkan")
m = Model(None, backend="vulkan")
base = ContextConfig(backend="vulkan", n_ctx=512)
# 23 tokens: ubatch 16 ends with a 7-token micro-batch (ggml-vulkan's matrix-vector shaders take
# products of at most 8 columns, mul_mm larger ones), A's one micro-batch does not
p = prompts.resolve("text:def add(a, b):\\n    return a + b\\n\\nprint(add(2, 3))")
a, ea = natural(m, p, PRESETS["A"], base, cap=3)
c = form(m, p, parse_schedule("ub16"), base)
d = compare(a.state, c.state)
# ubatch 12: micro-batches of 12 and 11 tokens, both on mul_mm, whose per-token results do not
# depend on the column count (on the H200's Vulkan device B and C formed A's state on the 22 of 24
# findings prompts whose last micro-batch exceeds 8 tokens, docs/findings.md)
w = form(m, p, parse_schedule("ub12"), base)
print(json.dumps({"n_prompt": a.n_prompt, "tokens": ea.tokens.tolist(), "device": m.device_name,
                  "kv_identical": d.identical, "kv_max_abs": d.max_abs, "first_layer": d.first_differing_layer,
                  "logits_identical": a.logits.tobytes() == c.logits.tobytes(),
                  "ub12_identical": compare(a.state, w.state).identical and a.logits.tobytes() == w.logits.tobytes()}))
"""


def _run(code, timeout=900):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def vulkan_device():
    r = _run(PROBE, 120)
    if r.returncode != 0:
        pytest.fail(f"probe failed: {r.stderr[-1500:]}")
    info = json.loads(r.stdout.strip().splitlines()[-1])
    vk = [d for d in info["devices"] if d.lower().startswith("vulkan")]
    if not vk:
        reason = f"no Vulkan device (build {info['build']}, devices {info['devices']})"
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    return vk[0]


def test_vulkan_generates_and_partition_changes_the_state_only_with_a_matrix_vector_batch(vulkan_device):
    r = _run(RUN)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"Vulkan {vulkan_device}: {res}")
    assert res["n_prompt"] == 23 and len(res["tokens"]) == 3
    assert res["device"] != "CPU"
    # ARCHITECTURE.md / paper 6.1: an internal partition (ubatch 16, like C's ubatch 128 on a
    # longer prompt, docs/backends.md) forms another state
    assert not res["kv_identical"], "A and ubatch 16 formed identical states on Vulkan"
    # ... and a partition whose micro-batches all exceed 8 tokens forms A's state and logits
    assert res["ub12_identical"], "ubatch 12 (12 + 11 tokens) did not form A's state on Vulkan"


REFUSAL = """
import json
from statelab.runtime.admission import device_refusal
from statelab.runtime import Model, layouts, prepare_backend
prepare_backend("vulkan")
m = Model(None, backend="vulkan")
out = {q: {lo: device_refusal(m, lo, q) for lo in ("QB", "QB+W", "PQ", "GS")} for q in (1, 4)}
print(json.dumps(dict(out, patch=layouts.vulkan_qb_available())))
"""


def test_qb_is_reported_not_admitted_on_vulkan(vulkan_device, cli_subprocess):
    """Unpatched ggml-vulkan rejects QB's two products (src0 ne3 1, src1 ne3 q); the scheduler would
    silently run them on the CPU, so speculative arms report QB as not admitted, with the shapes and the
    missing patch, instead of running. With patch 0007 the device admits them (tests/test_vulkan_qb.py)."""
    r = _run(REFUSAL, 300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["1"] == {"QB": None, "QB+W": None, "PQ": None, "GS": None}  # one query: the native graph
    assert res["4"]["PQ"] is None and res["4"]["GS"] is None
    if res["patch"]:
        assert res["4"]["QB"] is None and res["4"]["QB+W"] is None
        return
    for lo in ("QB", "QB+W"):
        why = res["4"][lo]
        assert why.startswith("not admitted on Vulkan:") and "qk MUL_MAT (64,256,3,1) x (64,1,9,4)" in why, why
        assert "av MUL_MAT (256,64,3,1) x (256,1,9,4)" in why, why
        assert "0007-vulkan-qb-attention.patch" in why and "\n" not in why, why
    # a new process: lavapipe is visible only if GGML_VK_VISIBLE_DEVICES is set before ggml registers its backends
    s = cli_subprocess("spec", "run", "-p", "def add(a, b):", "--cap", "1", "--arms", "R,M_QB", "--backend", "vulkan",
                       timeout=900)
    assert s.returncode == 0, s.stderr[-2000:]
    assert "M_QB: not admitted on Vulkan" in " ".join(s.stderr.split())
    assert "M_QB" not in s.stdout
