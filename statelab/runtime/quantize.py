"""llama.cpp's own quantizer (``llama_model_quantize``) on a GGUF file."""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

from statelab.errors import ModelError
from statelab.runtime.native import build_identity, llama


def quantize_model(src: str | os.PathLike, dst: str | os.PathLike, ftype: int, threads: int = 0) -> None:
    """Write DST, SRC quantised by llama.cpp to the ``llama_ftype`` FTYPE (tensor types chosen
    by llama.cpp exactly as its ``llama-quantize`` tool does; no importance matrix). The
    quantiser's output does not depend on the thread count."""
    L = llama()
    params = L.llama_model_quantize_default_params()
    params.ftype = int(ftype)
    params.nthread = int(threads)
    rc = L.llama_model_quantize(str(Path(src)).encode(), str(Path(dst)).encode(), ctypes.byref(params))
    if rc != 0:
        raise ModelError(f"llama.cpp could not quantise {src} to file type {ftype} (set STATELAB_NATIVE_LOG=1 "
                         "to see its log)")


def quantizer_identity() -> dict:
    """What the quantiser's bytes depend on: the llama.cpp source (sdist) and statelab's patch
    series, from the build identity."""
    ident = build_identity()
    return {"sdist_sha256": ident.get("sdist_sha256"), "patch_series_sha256": ident.get("patch_series_sha256")}
