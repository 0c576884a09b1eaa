"""Row-count-invariant weight products (native/patches/0003, layout families "+W"): the audit of
q-row vs 1-row products, the QB+W arms against R on Gemma 3 270M Q4_K_M and SmolLM2 (CPU, two
prompts each), the locator, counters, graph reuse and bad input."""
import functools

import numpy as np
import pytest

from statelab.audit.capture import parse_geometry, parse_node_name
from statelab.errors import ConfigError
from statelab.speculative.transaction import Arm, PhaseGuard, Runner, SpecConfig, qualify

from conftest import one_line_error

CAP = 24
PROMPTS = ("HumanEval/2", "HumanEval/4")


def _repair_or_skip():
    from statelab.runtime import layouts

    if not layouts.weight_repair_available():
        pytest.skip("weight-product patch (0003) not in this build")


def test_family_names_parse():
    from statelab.runtime import layouts

    assert Arm.parse("M_QB+W") == Arm("M_QB+W", "QB+W", False)
    assert Arm.parse("C_PQ+W").draft and Arm.parse("C_PQ+W").layout == "PQ+W"
    g = PhaseGuard("QB+W", 1)
    assert g.active("target") == "QB+W" and g.active("draft") == "MQ"
    g.phase["target"] = "continuation"
    assert g.active("target") == "MQ"
    assert layouts.parse_family("qb+w") == ("QB", True) and layouts.parse_family("MQ") == ("MQ", False)
    assert parse_geometry("ub4:QB+W").layout == "QB+W" and parse_geometry("ub4:QB+W").name == "ub4:QB+W"
    for bad in ("M_GS+W", "M_QB+", "C_QBW"):
        with pytest.raises(ConfigError, match="unknown arm"):
            Arm.parse(bad)
    with pytest.raises(layouts.LayoutError, match="unknown layout"):
        layouts.parse_family("QB+X")
    with pytest.raises(ConfigError, match="unknown attention layout"):
        parse_geometry("ub4:GS+W")


def test_unnamed_node_names_align_across_layouts():
    """ggml numbers unnamed nodes by graph position; their decorated names get a stable base."""
    assert parse_node_name("node_9 (view) (permuted)", "PERMUTE") == ("<node> (view) (permuted)", None)
    assert parse_node_name("node_57 (view) (permuted)", "PERMUTE") == ("<node> (view) (permuted)", None)
    assert parse_node_name("node_34", "MUL_MAT") == ("<MUL_MAT>", None)
    assert parse_node_name("Qcur-3 (view) (permuted)", "PERMUTE") == ("Qcur (view) (permuted)", 3)


@pytest.mark.model
def test_matmul_audit_repairs_every_weight_type(gemma, model, monkeypatch):
    """Every weight type of both models on CPU, in every buffer type: the repaired q-row product
    equals q 1-row products for q = 1..8 (the native one need not)."""
    from statelab.audit import matmul
    from statelab.audit.matmul import matmul_markdown, repaired_everywhere, run_matmul_audit
    from statelab.runtime.ggml_ops import backend_devices

    # each model's weight cases read once (gguf's reader parses the whole vocabulary: ~10 s for
    # Gemma's 262k tokens), here and inside the audit
    weight_cases = functools.cache(matmul.weight_cases)
    monkeypatch.setattr(matmul, "weight_cases", weight_cases)
    cpu = [d for d in backend_devices() if d.type == "CPU"]
    types = {c.type_name for c in weight_cases(gemma.path, 64)}
    assert {"q4_K", "q6_K", "q5_0", "q8_0"} <= types
    for m in (gemma, model):
        ds = run_matmul_audit(m.path, cpu, max_q=8, max_rows=64, threads=1)
        assert int(ds.computed.sum()) >= len(weight_cases(m.path, 64)), matmul_markdown(ds)
        assert repaired_everywhere(ds), matmul_markdown(ds)
        # q = 1: the native product is the 1-row product itself
        assert bool(ds.native_equal.sel(q=1).where(ds.computed, True).all())
        print("\n" + matmul_markdown(ds))


def _panel(m, he, arms, cap=CAP):
    runner = Runner(m, m, SpecConfig(k=3, ubatch=4, mask=3, cap=cap, threads=1))
    out = []
    for task in PROMPTS:
        out += qualify([runner.run(a, he(task)) for a in arms])
    return out


@pytest.mark.model
def test_qb_w_arms_reproduce_r_on_gemma3(gemma, he):
    """Gemma 3 Q4_K_M on CPU: M_QB and C_QB are not guaranteed (weight products are not
    row-invariant); M_QB+W and C_QB+W reproduce R's complete endpoint, with every weight
    product of the verify calls computed row by row and no layout refused."""
    _repair_or_skip()
    res = _panel(gemma, he, ("R", "M_QB+W", "C_QB+W"))
    for r in res:
        assert r.qualified, f"{r.prompt_id} {r.arm}: first difference at output {r.first_diff}"
        if r.arm != "R":
            assert r.counters.layout_not_admitted == 0


@pytest.mark.model
def test_qb_w_arms_still_reproduce_r_on_smollm2(model, he):
    _repair_or_skip()
    for r in _panel(model, he, ("R", "M_QB+W", "C_QB+W")):
        assert r.qualified, f"{r.prompt_id} {r.arm}: first difference at output {r.first_diff}"


@pytest.mark.model
def test_locator_finds_no_divergence_with_qb_w(gemma, he):
    """ub1 vs ub4:QB diverges at a weight product (attention is repaired); ub1 vs ub4:QB+W does not."""
    _repair_or_skip()
    from statelab.audit.locate import locate

    toks = gemma.tokenize(he("HumanEval/2").text)[:12]
    qb = locate(gemma, toks, "ub1", "ub4:QB", logits="all")
    assert qb.diverged and qb.first["op"] == "MUL_MAT"
    assert not qb.first["name"].startswith("kq")
    qbw = locate(gemma, toks, "ub1", "ub4:QB+W", logits="all")
    assert not qbw.diverged, qbw.first
    assert qbw.dataset.attrs["logits_equal"] == 1


@pytest.mark.model
def test_counters_admission_and_graph_reuse(gemma, base_config):
    """Repaired products are counted (per computed micro-batch), the admission says "+W", and a
    graph reused across repair on/off gives the logits of a freshly built graph."""
    _repair_or_skip()
    from statelab.runtime import Context, layouts

    toks = np.asarray(gemma.tokenize("def add(a, b):\n    return a + b\n"), dtype=np.int32)
    cfg = base_config.with_(n_ctx=256, n_ubatch=4, n_batch=64, n_threads=1)

    def run(seq):
        """Prefill natively, then decode 4-row blocks under each layout of seq (reset between)."""
        out = []
        with Context(gemma, cfg) as ctx:
            ctx.decode(toks[:8], 0, logits="none")
            for lay in seq:
                layouts.set_layout(ctx, lay)
                layouts.reset_counters(ctx)
                ctx.decode(toks[8:12], 8, logits="all")
                out.append((lay, [ctx.logits(i).copy() for i in range(4)], layouts.counters(ctx),
                            layouts.last_admission(ctx)))
                ctx.seq_rm(0, 8, -1)
        return out

    mixed = run(["QB+W", "QB", "QB+W"])
    fresh = run(["QB+W"])
    lay, logits, cnt, adm = mixed[0]
    assert adm.requested == "QB+W" and adm.built == "QB+W" and adm.admitted, adm
    n_layer = gemma.info.n_layer
    assert cnt["weight_products"] >= 7 * n_layer and cnt["weight_row_products"] == 4 * cnt["weight_products"]
    assert mixed[1][2]["weight_products"] == 0 and mixed[1][3].requested == "QB"
    assert mixed[2][2]["graph_builds"] == 1  # the repair flag is part of the graph-reuse check
    assert all(a.tobytes() == b.tobytes() for a, b in zip(mixed[2][1], fresh[0][1]))
    assert all(a.tobytes() == b.tobytes() for a, b in zip(mixed[0][1], fresh[0][1]))


@pytest.mark.model
def test_bad_input_is_one_line(cli):
    one_line_error(cli("spec", "run", "-H", "2", "--cap", "4", "--arms", "R,M_QB+X"), "unknown arm")
    one_line_error(cli("audit", "matmul", "--max-q", "0"), "max q")
    one_line_error(cli("audit", "matmul", "--max-rows", "10"), "max rows")
    one_line_error(cli("locate", "-H", "2", "-a", "ub1", "-b", "ub4:QB+Y", "--max-tokens", "4"),
                   "unknown attention layout")


@pytest.mark.model
def test_rows_above_max_queries_are_left_native_and_reported(model, base_config):
    """Above the admitted maximum query count the native products are built, counted as
    rejected, and the admission says why (QB+W is then not admitted)."""
    _repair_or_skip()
    from statelab.runtime import Context, layouts

    toks = np.asarray(model.tokenize("def add(a, b):\n    return a + b\n"), dtype=np.int32)
    with Context(model, base_config.with_(n_ctx=256, n_ubatch=4, n_batch=64, n_threads=1)) as ctx:
        layouts.set_layout(ctx, "QB+W")
        layouts.set_max_queries(ctx, 2)
        assert layouts.get_layout(ctx) == "QB+W"
        ctx.decode(toks[:4], 0, logits="all")
        adm, w = layouts.last_admission(ctx), layouts.last_weight_repair(ctx)
        assert not adm.admitted and adm.requested == "QB+W" and adm.built == "MQ"
        assert "weights not repaired: n rows = 4 exceeds max queries 2" in adm.reason
        assert w.requested and w.repaired == 0 and w.rejected >= 7 * model.info.n_layer
        assert layouts.counters(ctx)["weight_products"] == 0
        layouts.set_layout(ctx, "MQ")
        assert layouts.get_layout(ctx) == "MQ"
        ctx.decode(toks[4:6], 4, logits="all")
        assert not layouts.last_weight_repair(ctx).requested
