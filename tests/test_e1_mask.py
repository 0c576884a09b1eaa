"""E1's operand identity compares the mask as each softmax applied it, not the buffer it was
read from: layouts that hand the same rows to their softmaxes through other views (or other
buffers with other padding) are the same operands; a changed visible key is not."""
from types import SimpleNamespace

import numpy as np

from statelab.audit.e1 import applied_mask
from statelab.runtime.layouts import ATTENTION, Layout

H, Q, NKV, PAD = 6, 3, 10, 16


def _mask(rng, rows=PAD):
    """A causal-looking mask (0 visible, -inf hidden) for Q rows of NKV keys, then padding rows of junk."""
    m = np.where(np.arange(NKV)[None, :] <= np.arange(Q)[:, None] + 5, 0.0, -np.inf).astype(np.float32)
    return np.concatenate([m, rng.normal(size=(rows - Q, NKV)).astype(np.float32)])


def _softmax(out_ne, mask4):  # a node as the capture keeps it: ne in ggml order, data ne-reversed
    return SimpleNamespace(ne=out_ne, srcs=[None, SimpleNamespace(data=mask4)])


def _nodes(layout, m):
    if layout is Layout.MQ:   # one softmax (n_kv, q, h, 1) reading rows 0..q-1 of the padded mask
        return [_softmax((NKV, Q, H, 1), m[None, None])]
    if layout is Layout.PQ:   # one softmax per query, its own one-row view
        return [_softmax((NKV, 1, H, 1), m[j:j + 1][None, None]) for j in range(Q)]
    # QB: one softmax (n_kv, 1, h, q), the mask viewed (n_kv, 1, 1, q)
    return [_softmax((NKV, 1, H, Q), m[:Q][:, None, None, :])]


def test_every_layout_applies_the_same_mask_whatever_the_padding():
    rng = np.random.default_rng(0)
    masks = {lo: applied_mask(ATTENTION[lo], _nodes(lo, _mask(rng, rows=PAD + 8 * i)))
             for i, lo in enumerate((Layout.MQ, Layout.PQ, Layout.QB))}
    want = np.broadcast_to(_mask(rng)[:Q], (H, Q, NKV))
    for lo, got in masks.items():
        assert got.shape == (H, Q, NKV), lo
        np.testing.assert_array_equal(got, want, err_msg=str(lo))


def test_a_changed_visible_key_is_a_different_mask():
    rng = np.random.default_rng(1)
    m = _mask(rng)
    other = m.copy()
    other[Q - 1, NKV - 1] = 0.0 if np.isinf(other[Q - 1, NKV - 1]) else -np.inf
    a = applied_mask(ATTENTION[Layout.MQ], _nodes(Layout.MQ, m))
    b = applied_mask(ATTENTION[Layout.QB], _nodes(Layout.QB, other))
    assert not np.array_equal(a, b)
