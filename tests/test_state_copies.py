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


def test_a_mapped_state_is_imported_where_it_lies_and_checked_in_chunks(model, base_config, he, tmp_path):
    """state_set takes a read-only map of a payload file (no copy: llama.cpp only reads it) and
    state_matches compares the read-back chunk by chunk: equal, and unequal after one byte."""
    import mmap

    toks = model.tokenize(he(2).text)
    with Context(model, base_config) as src:
        src.decode(toks, 0, logits="none")
        blob = src.state_get()
    path = tmp_path / "kv.bin"
    path.write_bytes(blob)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm, \
            Context(model, base_config) as dst:
        view = memoryview(mm)
        dst.state_set(view)
        assert dst.state_matches(view, chunk=4096) and dst.state_matches(blob)
        flipped = bytearray(blob)
        flipped[len(blob) // 2] ^= 1
        assert not dst.state_matches(flipped, chunk=4096)
        assert not dst.state_matches(blob[:-1])
        view.release()
