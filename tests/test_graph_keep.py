"""Graphs kept per ubatch shape (native patch 0008) on the real model (CPU): a loop that alternates
shapes revives kept graphs instead of rebuilding, and every call computes what a rebuilt graph computes."""
import numpy as np
import pytest

from statelab.errors import ConfigError
from statelab.runtime import Context, layouts
from statelab.speculative.transaction import SpecConfig

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(not layouts.graph_keep_available(), reason="patch 0008 not in this build")]


def _alternate(model, cfg, toks, n, seq, keep, layout="QB"):
    """Decode toks[:n] once, then for each row count r in seq the r tokens after it (removed again after
    each call) under `layout`; every row's logits and the graph counters."""
    out = []
    with Context(model, cfg.with_(n_ubatch=8, n_batch=512)) as ctx:
        layouts.set_max_queries(ctx, 8)
        ctx.decode(toks[:n], 0, logits="none")
        assert layouts.set_graph_keep(ctx, keep)
        assert layouts.get_graph_keep(ctx) == keep
        layouts.set_layout(ctx, layout)
        layouts.reset_counters(ctx)
        for r in seq:
            ctx.decode(toks[n:n + r], n, logits="all")
            out.append(np.stack([ctx.logits(i) for i in range(r)]))
            ctx.seq_rm(0, n, -1)
        return out, layouts.counters(ctx)


def test_alternating_shapes_revive_kept_graphs_and_compute_the_same(model, base_config, he):
    toks = model.tokenize(he(2).text)
    n = len(toks) - 8
    seq = [1, 8, 1, 8, 4, 1, 8, 4, 4, 1]
    kept, c_kept = _alternate(model, base_config, toks, n, seq, keep=4)
    rebuilt, c_rebuilt = _alternate(model, base_config, toks, n, seq, keep=0)
    changes = 1 + sum(a != b for a, b in zip(seq, seq[1:]))
    # without kept graphs every change of shape builds; with them each shape is built once
    assert c_rebuilt["graph_builds"] == changes and c_rebuilt["graph_revivals"] == 0
    assert c_kept["graph_builds"] == len(set(seq))
    assert c_kept["graph_revivals"] == changes - len(set(seq))
    assert c_kept["graph_reuses"] == len(seq) - len(set(seq))
    # node for node the same graphs: every row's logits bitwise equal
    for r, a, b in zip(seq, kept, rebuilt):
        assert a.tobytes() == b.tobytes(), f"a revived {r}-row graph computed other logits"


def test_a_kept_graph_of_another_layout_is_never_revived(model, base_config, he):
    toks = model.tokenize(he(2).text)
    n = len(toks) - 4
    with Context(model, base_config.with_(n_ubatch=8, n_batch=512)) as ctx:
        layouts.set_max_queries(ctx, 8)
        ctx.decode(toks[:n], 0, logits="none")
        layouts.set_graph_keep(ctx, 4)
        layouts.reset_counters(ctx)
        got = {}
        for lay in ("QB", "MQ", "QB", "MQ"):
            layouts.set_layout(ctx, lay)
            ctx.decode(toks[n:], n, logits="all")
            assert layouts.last_admission(ctx).built == lay
            got.setdefault(lay, set()).add(np.stack([ctx.logits(i) for i in range(4)]).tobytes())
            ctx.seq_rm(0, n, -1)
        c = layouts.counters(ctx)
    assert c["graph_builds"] == 2 and c["graph_revivals"] == 2
    assert len(got["QB"]) == 1 and len(got["MQ"]) == 1


@pytest.mark.parametrize("bad", [-1, layouts.GRAPH_KEEP_MAX + 1, True, 1.5])
def test_bad_graph_keep_is_refused(bad):
    with pytest.raises(ConfigError):
        SpecConfig(graph_keep=bad)
