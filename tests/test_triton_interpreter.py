"""The Triton kernels of every op, run by Triton's interpreter on the CPU (small shapes; no
bfloat16 there), against the CPU kernels, which the generic suites check against fp64.
On a GPU machine the same kernels run for real in the generic suites under
FUSEDOPS_BACKEND=triton, so this module is skipped there."""

import os

import pytest
import torch

from fusedops.testing import OP_TESTS
from conftest import HAS_CUDA

pytestmark = pytest.mark.skipif(
    HAS_CUDA or os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs in Triton's interpreter on a machine without a GPU (the GPU runs the real kernels)",
)
OPS = [pytest.param(info, id=info.name) for info in OP_TESTS if info.triton_kernels]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("info", OPS)
def test_triton_matches_cpu_kernels(info, dtype):
    pytest.importorskip("triton")
    forward, backward = info.triton_kernels()
    tol = info.tol[dtype]
    checked = 0
    for sample in info.samples("cpu", dtype, requires_grad=False):
        if sample.args[0].numel() > 2048:
            continue  # the interpreter costs about 0.5 ms per program instance
        expected = info.op(*sample.args)
        got = forward(*sample.args)
        for g, e in zip(got, expected):
            assert g.shape == e.shape and g.dtype == e.dtype, sample.desc
            torch.testing.assert_close(g, e, atol=tol.atol, rtol=tol.rtol, msg=lambda m: f"{sample.desc}: {m}")
        grad = torch.randn_like(expected[0])
        args = info.backward_args(sample, expected, grad)
        expected_grads = info.backward_ops[0](*args)
        got_grads = backward(*args)
        gtol = info.grad_tol[dtype]
        for g, e in zip(got_grads, expected_grads):
            assert g.shape == e.shape and g.dtype == e.dtype, sample.desc
            scale = max(1.0, e.abs().max().item()) if e.numel() else 1.0
            torch.testing.assert_close(g / scale, e / scale, atol=gtol.atol, rtol=gtol.rtol,
                                       msg=lambda m: f"{sample.desc}: {m}")
        checked += 1
    assert checked > 0
