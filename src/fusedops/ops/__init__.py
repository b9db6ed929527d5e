"""The Python half of every op: fake kernels, autograd formulas, autocast rules and, where the
CUDA kernels are not loaded, the Triton kernels registered for CUDA tensors.

Each op lives in ops/<op>.py; importing this package registers them all."""

import torch

from .. import _native
from . import layer_norm, rms_norm

# Every public op of the library, by name (the same name as the schema, the C++/Triton files,
# the docs page and the benchmark id).
OPS = {"rms_norm": rms_norm, "layer_norm": layer_norm}


def backend_for(op: str, device) -> str:
    """Which kernel serves `op` for tensors on `device`: "cpu", "cuda" or "triton"."""
    if op not in OPS:
        raise ValueError(f"unknown fusedops op {op!r}; known: {', '.join(OPS)}")
    device = torch.device(device)
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda" and _native.cuda_backend is not None:
        return _native.cuda_backend
    raise ValueError(f"fusedops has no kernels for device {device}")
