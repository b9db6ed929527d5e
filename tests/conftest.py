"""Shared test setup.

Without a GPU the Triton kernels run in Triton's interpreter, which must be switched on before
triton is first imported. GPU tests carry the `gpu` marker and skip, saying why, without one."""

import contextlib
import fcntl
import os
import tempfile

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fusedops  # noqa: E402,F401  (after TRITON_INTERPRET)

NO_GPU_REASON = (
    "no CUDA device here: the GPU suites run on the H200 (README: 'Tests and benchmarks on a GPU')"
)


def device_params():
    """`cpu`, and `cuda` marked gpu (skipped with the reason when there is no GPU)."""
    return [
        "cpu",
        pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason=NO_GPU_REASON)]),
    ]


@contextlib.contextmanager
def gpu_memory_to_itself():
    """Held by a test that needs a large share of the GPU's memory (tensors of more than 2^31
    elements): one such test at a time across pytest-xdist workers, and across the two
    backends' suites run side by side (benchmarks/gpu_session.sh PARALLEL=1), whose workers
    share one GPU. The test's memory is handed back to the driver before the next one starts."""
    path = os.path.join(tempfile.gettempdir(), "fusedops-tests-gpu-memory.lock")
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextlib.contextmanager
def vmap_fallback(enabled: bool):
    """torch's per-sample vmap fallback on or off inside the block (off: an op without a batching
    rule raises under vmap instead of looping), restored after."""
    before = torch._C._functorch._is_vmap_fallback_enabled()
    torch._C._functorch._set_vmap_fallback_enabled(enabled)
    try:
        yield
    finally:
        torch._C._functorch._set_vmap_fallback_enabled(before)
