"""Divergence locator on the real model (CPU): ubatch 1 vs 4 names a node and a layer; the
same geometry twice, and whole vs split (every micro-batch >= 2 rows), report nothing."""
import copy

import numpy as np
import pytest

from statelab.audit.capture import parse_geometry, parse_layers, parse_node_name, plan_calls
from statelab.audit.locate import compare_runs, layer_summary, locate, locate_markdown
from statelab.errors import ConfigError
from statelab.lab.formation import parse_schedule

pytestmark = pytest.mark.model

N_TOKENS = 24  # a multiple of 4: every ub4 micro-batch has 4 rows


@pytest.fixture(scope="module")
def tokens(model, he):
    return model.tokenize(he(2).text)[:N_TOKENS]


@pytest.fixture(scope="module")
def ub1_vs_ub4(model, base_config, tokens):
    return locate(model, tokens, "ub1", "ub4", base_config, layers="0-1")


def test_ubatch_one_vs_four_names_the_first_differing_node(ub1_vs_ub4, model):
    res = ub1_vs_ub4
    assert res.diverged
    first = res.first
    # CPU, F16 KV: the Q.K^T mul_mat of layer 0 takes ggml_vec_dot_f16 with one row (ne11 == 1)
    # and llamafile's tinyBLAS with more (docs/locator.md); everything before it is bitwise equal
    assert (first["layer"], first["name"], first["op"], first["node"]) == (0, "kq", "MUL_MAT", "kq-0")
    assert 0 < first["max_abs"] < 1e-3 and first["max_ulp"] > 0
    ds = res.dataset
    layer0 = ds.where(ds["layer"] == 0, drop=True)
    names = list(layer0["name"].values)
    before = list(layer0["status"].values)[:names.index("kq")]
    assert all(s in ("equal", "skipped") for s in before)
    assert "equal" in before  # Q, K, V projections were compared
    summary = {r["label"]: r for r in layer_summary(ds)}
    assert summary["0"]["first_name"] == "kq" and summary["input"]["differing"] == 0
    md = locate_markdown(ds)
    assert "First divergence" in md and "`kq-0`" in md and "| 0 |" in md


def test_micro_batches_are_put_back_on_the_token_axis(ub1_vs_ub4):
    ra, rb = ub1_vs_ub4.runs
    assert len(ra.graphs) == N_TOKENS and len(rb.graphs) == N_TOKENS // 4
    ds = ub1_vs_ub4.dataset
    compared = ds.where(ds["status"].isin(["equal", "differs"]), drop=True)
    rows = compared.where(compared["layer"] >= 0, drop=True)
    rows = rows.where(rows["layer"] < ds.attrs["n_layer"], drop=True)
    assert set(rows["n_positions"].values.astype(int)) == {N_TOKENS}  # every position of every node


def test_same_geometry_twice_reports_no_divergence(model, base_config, tokens):
    res = locate(model, tokens, "ub4", "ub4", base_config, layers="0,last")
    assert not res.diverged and res.first is None
    assert res.dataset.attrs["logits_equal"] == 1
    assert (res.dataset["status"] != "differs").all()
    assert "No divergence" in locate_markdown(res.dataset)


def test_whole_and_split_prefill_agree(model, base_config, tokens):
    res = locate(model, tokens, "A", "8+rest", base_config, layers="0")
    assert not res.diverged, res.first


def test_node_names_and_schedules():
    assert parse_node_name("kq_soft_max-12", "SOFT_MAX") == ("kq_soft_max", 12)
    assert parse_node_name("Qcur-3 (view) (permuted)", "PERMUTE") == ("Qcur (view) (permuted)", 3)
    assert parse_node_name("cache_v_l7 (reshaped) (view)", "SET_ROWS") == ("cache_v (reshaped) (view)", 7)
    assert parse_node_name("node_1073", "GET_ROWS") == ("<GET_ROWS>", None)
    assert parse_node_name("result_output", "MUL_MAT") == ("result_output", None)
    calls = plan_calls(10, parse_schedule("ub4"), "last")
    assert [len(p) for p, _ in calls[0]["ubatches"]] == [4, 4, 2]
    assert [o.tolist() for _, o in calls[0]["ubatches"]] == [[], [], [9]]
    assert parse_layers("first,middle,last", 30) == [0, 15, 29] and parse_layers("all", 30) is None
    assert parse_geometry("ub4:qb").layout == "QB"


def test_bad_input(model, base_config, tokens):
    with pytest.raises(ConfigError, match="layer 30 does not exist"):
        locate(model, tokens, "ub1", "ub4", base_config, layers="30")
    with pytest.raises(ConfigError, match="attention layout"):
        parse_geometry("ub4:XX")
    with pytest.raises(ConfigError, match="unknown schedule"):
        locate(model, tokens, "ub1", "ubatch-four", base_config, layers="0")


def test_runs_of_another_model_are_refused(ub1_vs_ub4):
    ra, rb = ub1_vs_ub4.runs
    other = copy.copy(rb)
    other.identity = dict(rb.identity, model_sha256="0" * 64)
    with pytest.raises(ConfigError, match="different model"):
        compare_runs(ra, other)
    shorter = copy.copy(rb)
    shorter.tokens = np.asarray(rb.tokens[:-1])
    with pytest.raises(ConfigError, match="different tokens"):
        compare_runs(ra, shorter)


def test_cli_locate_errors_are_one_line(cli):
    r = cli("locate", "-H", "2", "--layers", "40", "--max-tokens", "8", env={"STATELAB_THREADS": "1"})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "layer 40 does not exist" in r.stderr


def test_query_to_batch_layout_reproduces_the_serial_reference(model, base_config, tokens):
    """With the layout patch: ubatch 4 with QB (and PQ) attention equals ubatch 1 node for node;
    MQ vs QB at ubatch 4 diverges at the same kq-0 as ubatch 1 vs 4."""
    from statelab.runtime import layouts

    if not layouts.available():
        reason = "the layout patch (native/patches/0002) is not in this build: no QB/PQ graphs"
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    qb = locate(model, tokens, "ub1", "ub4:QB", base_config, layers="0,last")
    assert not qb.diverged and qb.dataset.attrs["logits_equal"] == 1
    ds = qb.dataset
    kq = ds.where((ds["name"] == "kq") & (ds["layer"] == 0), drop=True)
    assert kq["status"].values.tolist() == ["equal"] and int(kq["n_positions"].values[0]) == N_TOKENS
    pq = locate(model, tokens, "ub1", "ub4:PQ", base_config, layers="0")
    assert not pq.diverged
    mq_qb = locate(model, tokens, "ub4", "ub4:QB", base_config, layers="0")
    assert mq_qb.first["node"] == "kq-0"


def test_eight_row_ubatches_build_the_layout_they_name(model, base_config, tokens):
    """ub8:QB is QB (the capture admits as many queries as the ubatch holds; the library's default
    is 4, above which the graph used to fall back to MQ silently): on the CPU it equals ubatch 1,
    unlike ub8 in MQ; a layout that cannot be built (ub32: more queries than the limit of 16) is a
    one-line refusal, not another graph compared under its name."""
    from statelab.errors import StatelabError
    from statelab.runtime import layouts

    if not layouts.available():
        pytest.skip("the layout patch (native/patches/0002) is not in this build: no QB/PQ graphs")
    qb = locate(model, tokens, "ub1", "ub8:QB", base_config, layers="0")
    assert not qb.diverged
    assert locate(model, tokens, "ub1", "ub8", base_config, layers="0").diverged
    with pytest.raises(StatelabError, match="ub32:QB: layout QB was not built"):
        locate(model, tokens, "ub1", "ub32:QB", base_config, layers="0")
