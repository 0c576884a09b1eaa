"""Native objects are freed exactly once: a close that a Ctrl-C interrupted right after a native
free, followed by the finaliser's close, frees nothing twice (``import-state`` aborted with
``double free or corruption`` so).  Run in a child process: a double free aborts it."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from conftest import REPO

INTERRUPTED_CLOSES = """
    import gc
    from statelab.runtime import Context, ContextConfig, Model
    from statelab.runtime.native import llama

    L = llama()
    m = Model(None, backend="cpu")
    done = []

    def interrupted_after(name):
        real = getattr(L, name)

        def free(*a):
            real(*a)
            done.append(name)
            raise KeyboardInterrupt  # a Ctrl-C that lands just after the native free

        return real, free

    for name in ("llama_batch_free", "llama_sampler_free", "llama_free"):
        ctx = Context(m, ContextConfig(backend="cpu", n_ctx=64, n_batch=8, n_ubatch=8))
        real, free = interrupted_after(name)
        setattr(L, name, free)
        try:
            ctx.close()
        except KeyboardInterrupt:
            pass
        setattr(L, name, real)
        ctx.close()  # again, as the finaliser does
        del ctx
        gc.collect()
    real, free = interrupted_after("llama_model_free")
    L.llama_model_free = free
    try:
        m.close()
    except KeyboardInterrupt:
        pass
    L.llama_model_free = real
    m.close()
    del m
    gc.collect()
    print("closed", *done)
"""


@pytest.mark.model
def test_a_close_interrupted_after_a_free_frees_nothing_twice():
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(INTERRUPTED_CLOSES)], capture_output=True, text=True,
                       cwd=REPO, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.split() == ["closed", "llama_batch_free", "llama_sampler_free", "llama_free", "llama_model_free"]
