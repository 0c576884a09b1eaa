"""statelab: KV-state formation, intervention and transplantation on llama.cpp."""

__version__ = "0.1.0"
