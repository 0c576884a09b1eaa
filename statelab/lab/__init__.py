"""The laboratory: forming states (formation), archiving them (archive: sealed manifests,
identities), the common receiver (receiver: pending token, continuation, endpoint),
interventions (intervene: shams, whole and subset crosses, byte accounting) and llama.cpp /
llama-cpp-python state interoperability (interop).  Calls runtime, kvstate, selection."""
