"""Attention layouts of the patched library on the real model (CPU)."""
import json
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest

from statelab.runtime import Context, TensorCapture, layouts

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(not layouts.available(), reason="attention-layout patch not in this build")]
REPO = Path(__file__).resolve().parents[1]
LAYER0 = ("kqv_out-0", "kq_soft_max-0")


def _attention(model, cfg, prefix, block, layout):
    """Decode `prefix` (MQ) then `block` as one ubatch under `layout`; capture layer-0 attention."""
    cap = TensorCapture(lambda n: n in LAYER0)
    with Context(model, cfg.with_(n_ubatch=512), capture=cap) as ctx:
        if len(prefix):
            ctx.decode(prefix, 0, logits="none")
        cap.clear()
        layouts.set_layout(ctx, layout)
        ctx.decode(block, len(prefix), logits="all")
        adm = layouts.last_admission(ctx)
        logits = np.stack([ctx.logits(i) for i in range(len(block))])
    out = {t.name: t.data for t in cap.tensors}
    return out, logits, adm


@pytest.mark.parametrize("phase", ["prefill", "continuation"])
def test_pq_and_qb_bitwise_equal_for_q_1_to_4(model, base_config, he, phase):
    toks = model.tokenize(he(2).text)
    for q in (1, 2, 3, 4):
        prefix, block = (toks[:0], toks[:q]) if phase == "prefill" else (toks[:-q], toks[-q:])
        res = {lay: _attention(model, base_config, prefix, block, lay) for lay in ("MQ", "PQ", "QB")}
        pq, qb, mq = res["PQ"], res["QB"], res["MQ"]
        assert qb[2].built == "QB" or q == 1, qb[2]
        assert pq[2].built == "PQ" or q == 1, pq[2]
        assert pq[0]["kqv_out-0"].tobytes() == qb[0]["kqv_out-0"].tobytes(), f"q={q}: PQ and QB attention differ"
        assert pq[1].tobytes() == qb[1].tobytes(), f"q={q}: PQ and QB logits differ"
        if q == 1:
            assert mq[0]["kqv_out-0"].tobytes() == qb[0]["kqv_out-0"].tobytes()
            assert mq[1].tobytes() == qb[1].tobytes()


def test_admission_is_reported_never_silent(model, base_config, he):
    toks = model.tokenize(he(2).text)
    with Context(model, base_config) as ctx:
        layouts.set_layout(ctx, "QB")
        ctx.decode(toks[:6], 0)  # 6 queries > default max 4
        adm = layouts.last_admission(ctx)
        assert adm.requested == "QB" and adm.built == "MQ" and not adm.admitted
        assert "exceeds max queries 4" in adm.reason
        layouts.set_max_queries(ctx, 8)
        ctx.decode(toks[6:12], 6)
        assert layouts.last_admission(ctx).built == "QB"
    with pytest.raises(layouts.LayoutError):
        layouts.set_layout(ctx, "XY")


def test_graph_reuse_never_serves_the_wrong_layout(model, base_config, he):
    toks = model.tokenize(he(2).text)
    n = len(toks) - 4
    seen: dict[str, set] = {"MQ": set(), "QB": set()}
    with Context(model, base_config.with_(n_ubatch=512)) as ctx:
        ctx.decode(toks[:n], 0, logits="none")
        layouts.reset_counters(ctx)
        seq = ["QB", "MQ", "QB", "QB", "MQ", "MQ", "QB"]
        for lay in seq:
            ctx.seq_rm(0, n, -1)
            layouts.set_layout(ctx, lay)
            ctx.decode(toks[n:], n, logits="all")
            assert layouts.last_admission(ctx).built == lay
            seen[lay].add(np.stack([ctx.logits(i) for i in range(4)]).tobytes())
        c = layouts.counters(ctx)
    changes = sum(a != b for a, b in zip(seq, seq[1:])) + 1
    assert c["graph_builds"] == changes and c["graph_reuses"] == len(seq) - changes
    # each layout's result equals what a fresh context (a graph built for it) computes
    for lay in ("MQ", "QB"):
        with Context(model, base_config.with_(n_ubatch=512)) as fresh:
            fresh.decode(toks[:n], 0, logits="none")
            layouts.set_layout(fresh, lay)
            fresh.decode(toks[n:], n, logits="all")
            ref = np.stack([fresh.logits(i) for i in range(4)]).tobytes()
        assert seen[lay] == {ref}, f"a reused graph served other results for {lay}"


@pytest.fixture(scope="module")
def unpatched_lib(tmp_path_factory):
    """The same sdist and CPU build with the patch series up to 0001 (no layout patch): the one
    `./install.sh --tests` builds in the install step (cached by its build key), else built now."""
    r = subprocess.run([sys.executable, str(REPO / "native" / "build.py"), "--backend", "cpu", "--upto", "0001",
                        "--no-install"], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"could not build the unpatched library: {r.stderr[-2000:]}")
    if "[native] building" in r.stdout:
        warnings.warn("built the library without the layout patches in the test phase: "
                      "`./install.sh --tests` builds it in the install step")
    wheel = Path(r.stdout.strip().splitlines()[-1])
    d = tmp_path_factory.mktemp("unpatched")
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.startswith("llama_cpp/lib/"):
                z.extract(name, d)
    return d / "llama_cpp" / "lib"


@pytest.mark.slow  # the library with the patch series up to 0001 (`./install.sh --tests` builds it)
@pytest.mark.timeout(3600)  # the build, on 2 cores, when install.sh did not build it
def test_mq_layout_matches_the_unpatched_library(unpatched_lib, cli, cli_subprocess):
    args = ("generate", "-H", "2", "--cap", "24", "--schedule", "ub4", "--json")
    patched = cli(*args)
    base = cli_subprocess(*args, env={"LLAMA_CPP_LIB_PATH": str(unpatched_lib)})
    assert patched.returncode == 0 and base.returncode == 0, base.stderr
    check = cli_subprocess("doctor", env={"LLAMA_CPP_LIB_PATH": str(unpatched_lib)})
    assert check.returncode == 0 and "lib_override" in check.stdout
    assert json.loads(patched.stdout)["tokens"] == json.loads(base.stdout)["tokens"]
