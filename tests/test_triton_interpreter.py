"""The Triton kernels of every op, run by Triton's interpreter on the CPU (small shapes; no
bfloat16 there), against the CPU kernels, which the generic suites check against fp64.
On a GPU machine the same kernels run for real in the generic suites under
FUSEDOPS_BACKEND=triton, so this module is skipped there."""

import os

import pytest
import torch

from fusedops.ops import OPS as OP_MODULES
from fusedops.testing import OP_TESTS, outputs_of
from conftest import HAS_CUDA

pytestmark = pytest.mark.skipif(
    HAS_CUDA or os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs in Triton's interpreter on a machine without a GPU (the GPU runs the real kernels)",
)
OPS = [pytest.param(info, id=info.name) for info in OP_TESTS]


def _assert_all_close(got, expected, tol, desc, scaled=False):
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape and g.dtype == e.dtype, desc
        scale = max(1.0, e.abs().max().item()) if scaled and e.numel() else 1.0
        torch.testing.assert_close(g / scale, e / scale, atol=tol.atol, rtol=tol.rtol, msg=lambda m: f"{desc}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("info", OPS)
def test_triton_matches_cpu_kernels(info, dtype):
    pytest.importorskip("triton")
    kernels = OP_MODULES[info.name].TRITON_IMPLS  # op name -> Triton kernel, the op's signature
    backward_op = info.backward_ops[0]
    tol = info.tol[dtype]
    checked = 0
    for sample in info.samples("cpu", dtype, requires_grad=False):
        if sample.args[0].numel() > 2048:
            continue  # the interpreter costs about 0.5 ms per program instance
        # (ops of one output return a tensor: compared as a 1-tuple)
        expected = outputs_of(info.op(*sample.args))
        _assert_all_close(outputs_of(kernels[info.name](*sample.args)), expected, tol, sample.desc)
        args = info.backward_args(sample, expected, torch.randn_like(expected[0]))
        got_grads = outputs_of(kernels[backward_op._schema.name.removeprefix("fusedops::")](*args))
        _assert_all_close(got_grads, outputs_of(backward_op(*args)), info.grad_tol[dtype], sample.desc, scaled=True)
        for variant, variant_args in info.variant_ops:
            # (both calls mutate their own copy of any mutated argument; compare those too)
            expected_args, got_args = variant_args(sample), variant_args(sample)
            expected = variant(*expected_args)
            got = kernels[variant._schema.name.removeprefix("fusedops::")](*got_args)
            # (an op returning nothing gives None)
            got, expected = (() if r is None else outputs_of(r) for r in (got, expected))
            _assert_all_close(got + got_args[:2], expected + expected_args[:2], tol, sample.desc)
        checked += 1
    assert checked > 0
