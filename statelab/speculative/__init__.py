"""The reference-preserving speculative path: arms R/M/C, the phase guard, drafters (self,
derived, GGUF, n-gram), the verify transaction and its counters (:mod:`.transaction`), and
layer-truncated draft models (:mod:`.derive`).  Calls runtime and lab."""
