"""Memory kinds and layer maps from GGUF metadata (synthetic headers, no model file)."""
import pytest

from statelab.kvstate import SWA_STANDARD, KVFormatError, KVState, MemoryLayout, PartLayout, make_iswa_state
from statelab.models import memory_kind_of, capabilities


def header(**kv):
    return lambda key, default=None: kv.get(key, default)


@pytest.mark.parametrize("arch, keys, n_layer, want", [
    ("llama", {}, 4, ("kv", 0, [], True)),
    ("gemma3", {}, 6, ("kv", 0, [], True)),  # gemma3 without a window key: one cache
    ("gemma3", {"gemma3.attention.sliding_window": 512}, 12, ("iswa", 512, [0, 1, 2, 3, 4, 6, 7, 8, 9, 10], True)),
    ("gemma2", {"gemma2.attention.sliding_window": 4096}, 4, ("iswa", 4096, [0, 2], True)),
    ("cohere2", {"cohere2.attention.sliding_window": 8, "cohere2.attention.sliding_window_pattern": 2}, 4,
     ("iswa", 8, [0, 2], True)),
    ("foo", {"foo.attention.sliding_window": 8, "foo.attention.sliding_window_pattern": [True, False, True]}, 3,
     ("iswa", 8, [0, 2], True)),
    ("llama4", {"llama4.attention.sliding_window": 8192}, 4, ("iswa", 8192, [], False)),
    ("mamba", {}, 4, ("recurrent", 0, [], True)),
    ("jamba", {}, 4, ("hybrid", 0, [], True)),
])
def test_memory_kind_follows_the_pinned_llama_cpp(arch, keys, n_layer, want):
    assert memory_kind_of(arch, n_layer, header(**keys)) == want


def test_layout_record_round_trips_and_refuses_junk():
    s = make_iswa_state(4, 3, swa_layers=[0, 1], n_swa=2)
    layout = MemoryLayout("iswa", tuple(), 3, "m")
    assert MemoryLayout.from_dict(layout.as_dict()) == layout
    with pytest.raises(KVFormatError, match="malformed memory layout"):
        MemoryLayout.from_dict({"kind": "iswa"})
    assert s.parts[1].swa_type == SWA_STANDARD
    known = MemoryLayout("iswa", (PartLayout("full", (2,)), PartLayout("swa", (0, 1), 2, SWA_STANDARD)), 3, "m")
    assert KVState.parse(s.to_bytes()).with_layout(known).layer_ids == (2, 0, 1)


def test_capabilities_name_refusals():
    from statelab.models import ModelInfo

    base = dict(path="x", sha256="0", architecture="mamba", name="M", n_layer=4, n_embd=8, n_head=1, n_head_kv=1,
                head_dim_k=8, head_dim_v=8, n_embd_k_gqa=8, n_embd_v_gqa=8, n_vocab=10, n_ctx_train=8, file_type=1,
                memory_kind="recurrent", n_swa=0, swa_layers=[], layer_kinds_known=True)
    rows = capabilities(ModelInfo(**base))
    assert rows[0][:2] == ("codec parts", "refused") and "recurrent" in rows[0][2]
    assert ModelInfo(**base).memory_layout().kind == "recurrent"
    unknown = dict(base, architecture="llama4", memory_kind="iswa", n_swa=8192, layer_kinds_known=False)
    assert ("layer kinds", "refused") in [r[:2] for r in capabilities(ModelInfo(**unknown))]
    assert ModelInfo(**unknown).memory_layout() is None
