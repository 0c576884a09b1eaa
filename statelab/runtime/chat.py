"""The model's own chat template, applied by llama.cpp (``llama_chat_apply_template`` on the
GGUF's ``tokenizer.chat_template``), from a vocabulary-only load: no weights are read."""
from __future__ import annotations

import ctypes

from statelab.errors import ModelError
from statelab.models import resolve_model
from statelab.runtime.native import llama, prepare_backend


def apply_chat_template(messages, model_path=None, add_assistant: bool = True, backend: str = "cpu") -> str:
    """Render ``messages`` ([(role, content), ...]) with the chat template stored in the GGUF
    (the embedded model by default); the result ends with the assistant's turn opener.
    ``backend``: the backend the calling process will use (llama.cpp registers its backends
    once per process, so a Vulkan run must be prepared before this first native call)."""
    prepare_backend(backend)
    L = llama()
    path = resolve_model(model_path)
    params = L.llama_model_default_params()
    params.vocab_only = True
    params.n_gpu_layers = 0
    ptr = L.llama_model_load_from_file(str(path).encode(), params)
    if not ptr:
        raise ModelError(f"llama.cpp could not read the vocabulary of {path}")
    try:
        tmpl = L.llama_model_chat_template(ptr, None)
        if not tmpl:
            raise ModelError(f"{path.name} carries no chat template (tokenizer.chat_template)")
        raw = [(str(r).encode(), str(c).encode()) for r, c in messages]
        arr = (L.llama_chat_message * len(raw))(*[L.llama_chat_message(role=r, content=c) for r, c in raw])
        size = 4096 + 2 * sum(len(r) + len(c) for r, c in raw)
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = L.llama_chat_apply_template(tmpl, arr, len(raw), bool(add_assistant), buf, size)
            if n < 0:
                raise ModelError(f"llama.cpp does not know the chat template of {path.name}")
            if n <= size:
                return buf.raw[:n].decode("utf-8")
            size = n + 1
        raise ModelError(f"chat template of {path.name}: output size changed between calls")
    finally:
        L.llama_model_free(ptr)
