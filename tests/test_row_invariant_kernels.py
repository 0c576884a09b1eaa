"""Patch 0005: the row-invariance hint on weight products (real model, CPU).

The hint changes kernels only where a backend's kernel depends on the row count (ggml-cuda's
mmvq for 5-8 rows; measured on the H200, docs/benchmarks.md). Here, on the CPU, the tests
check what every backend must hold: which layouts set it, that the mark reaches the graph
(a change rebuilds it instead of reusing a graph built without it), and that the CPU ignores
it (bitwise the same logits for 8 rows with and without the mark, and the audit's hinted
column equal to its native one).
"""
import numpy as np
import pytest

from statelab.audit.matmul import run_matmul_audit
from statelab.models import default_model_path
from statelab.runtime import Context, layouts
from statelab.runtime.ggml_ops import backend_devices

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(not layouts.row_invariant_kernels_available(),
                                 reason="patch 0005 (row-invariant kernels) not in this build")]


@pytest.mark.parametrize("layout,want", [("QB", True), ("PQ", True), ("MQ", False), ("QB+W", False),
                                         ("PQ+W", False), ("MQ+W", False)])
def test_the_reference_preserving_layouts_set_the_hint(model, base_config, layout, want):
    with Context(model, base_config) as ctx:
        assert layouts.get_row_invariant_kernels(ctx) is False  # a new context: native kernels
        layouts.set_layout(ctx, layout)
        assert layouts.get_row_invariant_kernels(ctx) is want
        layouts.set_layout(ctx, "MQ")  # and back: MQ is always llama.cpp's own numerics
        assert layouts.get_row_invariant_kernels(ctx) is False


def test_the_hint_takes_part_in_graph_reuse_and_the_cpu_ignores_it(model, base_config, he):
    """Eight rows decoded in QB with and without the mark (the library call, not set_layout):
    the second graph is built, not reused, and its logits are bitwise those of the first."""
    toks = model.tokenize(he(2).text)
    prefix, block = toks[:-8], toks[-8:]
    fn = layouts._fn("llama_statelab_set_row_invariant_kernels")
    got = []
    with Context(model, base_config.with_(n_ubatch=512)) as ctx:
        ctx.decode(prefix, 0, logits="none")
        layouts.set_layout(ctx, "QB")
        layouts.set_max_queries(ctx, 8)
        for hint in (1, 0):
            assert fn(ctx.ptr, hint) == 0
            layouts.reset_counters(ctx)
            ctx.decode(block, len(prefix), logits="all")
            c = layouts.counters(ctx)
            assert c["graph_builds"] == 1 and c["graph_reuses"] == 0, (hint, c)
            assert layouts.last_admission(ctx).built == "QB"
            got.append(np.stack([ctx.logits(i) for i in range(len(block))]).tobytes())
            assert ctx.seq_rm(0, len(prefix), -1)
        assert fn(ctx.ptr, 2) == -1  # only 0 or 1; nothing changed
    assert got[0] == got[1]


def test_audit_hinted_column_equals_native_on_cpu():
    cpu = [d for d in backend_devices() if d.type == "CPU"]
    ds = run_matmul_audit(default_model_path(), devices=cpu, max_q=8, max_rows=64, threads=1)
    done = ds.computed.values
    assert done.any()
    np.testing.assert_array_equal(ds.hinted_equal.values[done], ds.native_equal.values[done])
    np.testing.assert_array_equal(ds.hinted_max_abs.values[done], ds.native_max_abs.values[done])


def test_the_qb_columns_version_follows_the_patch_series():
    """Patch 0006 raises the hint's version to 2 (QB's attention products marked for one launch);
    the runtime reports it exactly when the build carries 0006, and the hint's own check still
    accepts the later version."""
    from statelab.runtime.native import build_identity

    series = build_identity().get("patches", [])
    assert layouts.qb_columns_available() == any(p.startswith("0006-") for p in series)
    assert layouts.row_invariant_kernels_available()
