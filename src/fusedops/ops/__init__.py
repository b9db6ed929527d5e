"""The Python half of every op: fake kernels, autograd formulas, autocast rules and, where the
CUDA kernels do not serve CUDA tensors, the Triton kernels registered in their place.

Each op lives in ops/<op>.py; importing this package registers them all. Their DTensor
sharding rules live together in ops/_sharding.py, registered when torch.distributed.tensor is
imported; their vmap batching rules in ops/_batching.py.

Which kernels serve CUDA tensors is settled in two steps. At import (fusedops/_native.py): the
CUDA kernels when they are built and FUSEDOPS_BACKEND does not say otherwise, else Triton. The
GPU itself is only looked at when CUDA initialises (asking earlier would initialise CUDA in
every process that imports fusedops): if this build has no code for one of the visible GPUs
(say, a wheel without sm_120 on a Blackwell workstation card), every op switches to its Triton
kernels, with one warning saying why.
"""

import warnings

import torch

from .. import _native
from . import add_rms_norm, cross_entropy, geglu, geglu_packed, layer_norm, rms_norm, rope, swiglu, swiglu_packed
from . import linear_cross_entropy
from . import _batching, _sharding

# Every public op of the library, by name (the same name as the schema, the C++/Triton files,
# the docs page and the benchmark id).
OPS = {
    "rms_norm": rms_norm,
    "add_rms_norm": add_rms_norm,
    "layer_norm": layer_norm,
    "swiglu": swiglu,
    "geglu": geglu,
    "swiglu_packed": swiglu_packed,
    "geglu_packed": geglu_packed,
    "rope": rope,
    "cross_entropy": cross_entropy,
    "linear_cross_entropy": linear_cross_entropy,
}

_sharding.register_when_dtensor_is_imported()
_batching.register_all()

_triton_lib = None


def use_triton_for_cuda() -> None:
    """Registers every op's Triton kernels for CUDA tensors, over the CUDA kernels if loaded."""
    global _triton_lib
    if _triton_lib is not None:
        return
    lib = torch.library.Library("fusedops", "IMPL")
    with warnings.catch_warnings():
        # Replacing the C++ CUDA kernels is the point; torch warns about each override.
        warnings.simplefilter("ignore")
        for module in OPS.values():
            if getattr(module, "DISPATCHES_TO_FUSEDOPS_OPS", False):
                continue  # (a composite over other fusedops ops, which switch themselves)
            for name, kernel in module.TRITON_IMPLS.items():
                lib.impl(name, kernel, "CUDA")
    _triton_lib = lib
    _native.cuda_backend = "triton"


def _fall_back_if_no_code_for_gpu() -> None:
    missing = _native.gpus_without_code()
    if not missing:
        return
    gpus = ", ".join(f"cuda:{i} {name} (sm_{major}{minor})" for i, name, (major, minor) in missing)
    archs = _native.build_info()["cuda_archs"]
    warnings.warn(
        f"fusedops: this build's CUDA kernels have no code for {gpus}; it was built for {archs}. "
        "Every fusedops op now runs its Triton kernels on CUDA tensors (same results, possibly slower). "
        "For the CUDA kernels, install a fusedops wheel built for this GPU or build from source with "
        "TORCH_CUDA_ARCH_LIST including it (docs/install.md); FUSEDOPS_BACKEND=triton silences this warning.",
        RuntimeWarning,
        stacklevel=2,
    )
    use_triton_for_cuda()


if _native.cuda_backend == "triton":
    use_triton_for_cuda()
elif _native.cuda_backend == "cuda":
    # Runs when CUDA initialises, or now if it already has.
    torch.cuda._lazy_call(_fall_back_if_no_code_for_gpu)


def backend_for(op: str, device) -> str:
    """Which kernel serves `op` for tensors on `device`: "cpu", "cuda" or "triton". For a CUDA
    device this initialises CUDA (the answer depends on the GPU)."""
    if op not in OPS:
        raise ValueError(f"unknown fusedops op {op!r}; known: {', '.join(OPS)}")
    device = torch.device(device)
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda" and _native.cuda_backend is not None:
        torch.cuda.init()
        return _native.cuda_backend
    raise ValueError(f"fusedops has no kernels for device {device}")
