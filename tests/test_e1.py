"""E1 on the real model (CPU): controls before any layout comparison; MQ now, PQ/QB native
comparisons when the layout patch is in the build (skipped with the reason otherwise);
standalone replay of the frozen operands; operator replay with in-place aliasing excluded."""
import json

import numpy as np
import pytest

from statelab.audit.e1 import NOT_AVAILABLE, extract_attention, load_capture, run_e1, run_phase, save_capture
from statelab.audit.replay import replay_attention, replay_e1, replay_ops
from statelab.errors import ConfigError, IdentityError
from statelab.runtime import layouts

pytestmark = pytest.mark.model

LAYER = 0
QS = (1, 2, 3, 4)


@pytest.fixture(scope="module")
def prompt_tokens(model, he):
    return model.tokenize(he(2).text)[:20]


@pytest.fixture(scope="module")
def e1(model, base_config, prompt_tokens):
    return run_e1(model, prompt_tokens, layers=[LAYER], qs=QS, base_config=base_config)


def test_controls_pass_for_mq_at_every_q(e1):
    ds, _ = e1
    mq = ds.sel(layout="MQ", layer=LAYER)
    assert (mq["observed"] == 1).all()
    assert (mq["repeat_equal"] == 1).all(), "the same layout twice must be bitwise repeatable"
    assert (mq["capture_onoff_equal"] == 1).all(), "capture on/off must give the same logits"
    assert (mq["views_read_canonical_q"] == 1).all()
    assert (ds["operands_identical"] == 1).all()
    # pair by pair too (Q, K, V and the mask as applied); -1: a layout of the pair not in the build
    assert (ds["pair_operands_identical"] == (1 if layouts.available() else -1)).all()
    vis = ds.sel(layer=LAYER)
    assert vis["visible_first"].sel(phase="prefill").values.tolist() == [1, 1, 1, 1]
    assert vis["visible_last"].sel(phase="prefill").values.tolist() == list(QS)
    assert (vis["visible_first"].sel(phase="continuation") == 21).all()  # 20 prompt tokens + 1


def test_frozen_operands_have_the_model_geometry(e1, model):
    _, detail = e1
    cap = detail["runs"][("prefill", 3, "MQ")].captures[LAYER]
    i = model.info
    assert cap.operands["q"].ne[:3] == (i.head_dim_k, 3, i.n_head) and cap.operands["q"].type == "f32"
    assert cap.operands["k"].ne[0] == i.head_dim_k and cap.operands["k"].ne[2] == i.n_head_kv
    assert cap.operands["k"].type == cap.operands["v"].type == "f16"
    assert cap.operands["mask"].ne[:2] == (cap.n_kv, 3)
    assert cap.head_map == [a // (i.n_head // i.n_head_kv) for a in range(i.n_head)]
    assert cap.scale == pytest.approx(1 / np.sqrt(i.head_dim_k))
    assert cap.outputs["qk"].shape == (i.n_head, 3, cap.n_kv) and cap.outputs["av"].shape == (i.n_head, 3, 64)


def test_layout_comparisons(e1):
    ds, _ = e1
    if not layouts.available():
        assert (ds["status"].sel(pair=["MQ-PQ", "MQ-QB", "PQ-QB"]) == NOT_AVAILABLE).all()
        reason = "PQ/QB native comparison: the layout patch (native/patches/0002) is not in this build"
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    # controls first, then: PQ and QB agree bitwise at every stage; with one query all layouts coincide
    assert (ds["observed"] == 1).all() and (ds["repeat_equal"] == 1).all()
    assert (ds["status"] == "compared").all()
    assert (ds["bitwise_equal"].sel(pair="PQ-QB") == 1).all()
    assert (ds["bitwise_equal"].sel(q=1) == 1).all()


def test_standalone_replay_of_the_frozen_operands(e1):
    ds, detail = e1
    rds = replay_e1(detail)
    assert (rds["own_path_equal"] == 1).all(), "MQ replay must reproduce the native MQ capture bitwise"
    assert (rds["replay_repeat_equal"] == 1).all()
    assert (rds["status"] == "compared").all()
    assert (rds["bitwise_equal"].sel(pair="PQ-QB") == 1).all()
    assert (rds["bitwise_equal"].sel(q=1) == 1).all()
    print("MQ vs PQ (replay) max |d| at qk for q=2..4:",
          rds["max_abs"].sel(pair="MQ-PQ", stage="qk", q=[2, 3, 4]).values.ravel().tolist())


def test_operator_replay_excludes_in_place_aliasing(e1):
    _, detail = e1
    # the heavy capture of prefill q=4 has sources of every attention operator; replay them
    run_caps = detail["runs"][("prefill", 4, "MQ")].captures[LAYER]
    nodes = {n.name: n for n in run_caps.nodes}
    kq, sm = nodes[f"kq-{LAYER}"], nodes[f"kq_soft_max-{LAYER}"]

    class _Run:  # replay_ops needs only .nodes
        pass

    r = _Run()
    r.nodes = run_caps.nodes
    rows = {x.node: x for x in replay_ops(r, LAYER)}
    assert rows[kq.name].status == "qualified"
    assert rows[f"kqv-{LAYER}"].status == "qualified"
    soft = rows[sm.name]
    if sm.srcs[0].span[0] < sm.span[1] and sm.span[0] < sm.srcs[0].span[1]:  # ggml-alloc ran it in place
        assert soft.status == "aliased" and soft.requalified is True and "in-place" in soft.reason
    else:
        assert soft.status == "qualified"


def test_saved_capture_round_trip_and_another_models_capture(e1, model, tmp_path):
    _, detail = e1
    r = detail["runs"][("continuation", 2, "MQ")]
    cap = r.captures[LAYER]
    d = save_capture(cap, r.identity, tmp_path / "cap", {"phase": "continuation"})
    back, man = load_capture(d, model)
    assert back.hashes() == cap.hashes() and man["phase"] == "continuation"
    out = replay_attention(back, "MQ")
    assert all(out[s].tobytes() == cap.outputs[s].tobytes() for s in ("qk", "softmax", "av"))
    mf = d / "manifest.json"
    m = json.loads(mf.read_text())
    m["model_sha256"] = "f" * 64
    mf.write_text(json.dumps(m))
    with pytest.raises(IdentityError, match="made with model ffffffff"):
        load_capture(d, model)


def test_bad_input(model, base_config, prompt_tokens):
    with pytest.raises(ConfigError, match="q must be"):
        run_e1(model, prompt_tokens, layers=[0], qs=(0,), base_config=base_config)
    with pytest.raises(ConfigError, match="layer 30 does not exist"):
        run_e1(model, prompt_tokens, layers=[30], qs=(1,), base_config=base_config)
    with pytest.raises(ConfigError, match="q must be"):
        run_phase(model, prompt_tokens, None, "prefill", 0, "MQ", [0], base_config)
    with pytest.raises(ConfigError, match="unknown phase"):
        run_e1(model, prompt_tokens, layers=[0], phases=("decode",), base_config=base_config)
    if not layouts.available():
        from statelab.audit.capture import Geometry, run_graph
        from statelab.lab.formation import Schedule

        with pytest.raises(ConfigError, match="layout patch"):
            run_graph(model, prompt_tokens[:2], Geometry(Schedule("q2", (2,), 2, 512), "QB"), base_config)


def test_extract_attention_needs_the_layer(e1):
    _, detail = e1
    r = detail["runs"][("prefill", 2, "MQ")]

    class _Run:
        nodes = r.captures[LAYER].nodes

    with pytest.raises(ConfigError, match="no captured node of layer 5"):
        extract_attention(_Run(), 5)
