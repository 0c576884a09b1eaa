"""Patch 0004: the host state reader and writer move a transposed V layer in one strided copy
(one cudaMemcpy2D on CUDA) instead of one copy per V row, and the bytes are the same."""
import numpy as np

from statelab.kvstate import KVState
from statelab.runtime import Context, layouts


def _delta(before: dict) -> dict:
    after = layouts.state_copies()
    return {k: after[k] - before[k] for k in before}


def test_one_copy_per_layer_and_the_same_bytes(model, base_config, he):
    toks = model.tokenize(he(2).text)
    with Context(model, base_config) as src:
        src.decode(toks[:-1], 0, logits="none")
        c = layouts.state_copies()
        blob = src.state_get()
        export = _delta(c)
        src.decode(toks[-1:], len(toks) - 1, logits=None)
        want = src.logits().copy()
    st = KVState.parse(blob)
    assert st.v_trans, "the test needs a transposed V cache (no flash attention)"
    n_layer = len(st.k)
    # K: one piece per layer; transposed V: one piece per layer and V row (n_embd_v_gqa rows)
    pieces = n_layer + sum(int(v.shape[0]) for v in st.v)
    assert pieces > 2 * n_layer
    assert export == {"pieces": pieces, "copies": 2 * n_layer}
    with Context(model, base_config) as dst:
        c = layouts.state_copies()
        dst.state_set(blob)
        assert _delta(c) == {"pieces": pieces, "copies": 2 * n_layer}
        assert dst.state_get() == blob  # the imported bytes read back as the exported ones
        dst.decode(toks[-1:], len(toks) - 1, logits=None)
        np.testing.assert_array_equal(dst.logits(), want)  # and decode on as the source did
