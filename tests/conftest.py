"""Shared test setup.

Without a GPU the Triton kernels run in Triton's interpreter, which must be switched on before
triton is first imported. GPU tests carry the `gpu` marker and skip, saying why, without one."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fusedops  # noqa: E402,F401  (after TRITON_INTERPRET)

NO_GPU_REASON = "no CUDA device here: the GPU suites run on the H200 (see README, 'Tests on a GPU')"


def device_params():
    """`cpu`, and `cuda` marked gpu (skipped with the reason when there is no GPU)."""
    return [
        "cpu",
        pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason=NO_GPU_REASON)]),
    ]
