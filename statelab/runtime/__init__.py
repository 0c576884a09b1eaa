"""The only statelab package that touches llama-cpp-python / ctypes."""
from statelab.runtime.context import CapturedTensor, Context, ContextConfig, ContextPool, Model, TensorCapture, context_identity, read_tensor
from statelab.runtime.native import BACKENDS, Device, build_identity, list_devices, prepare_backend

__all__ = ["BACKENDS", "CapturedTensor", "Context", "ContextConfig", "ContextPool", "Device", "Model", "TensorCapture",
           "build_identity", "context_identity", "list_devices", "prepare_backend", "read_tensor"]
