"""statelab: KV-state formation, intervention and transplantation on llama.cpp."""

__version__ = "0.1.0"

_API = ("open_capture", "capture", "continue_", "cross", "diff")


def __getattr__(name):  # the notebook API (statelab.api), imported on first use: xarray is not needed by the CLI
    if name in _API:
        from statelab import api

        return getattr(api, name)
    raise AttributeError(f"module 'statelab' has no attribute {name!r}")
