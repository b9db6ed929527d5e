"""The Triton kernels of every op, run by Triton's interpreter on the CPU (small shapes; no
bfloat16 there), against the CPU kernels, which the generic suites check against fp64.
On a GPU machine the same kernels run for real in the generic suites under
FUSEDOPS_BACKEND=triton, so this module is skipped there."""

import os

import pytest
import torch

from fusedops.ops import OPS as OP_MODULES
from fusedops.testing import OP_TESTS, outputs_of, row_scale
from conftest import HAS_CUDA

pytestmark = pytest.mark.skipif(
    HAS_CUDA or os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs in Triton's interpreter on a machine without a GPU (the GPU runs the real kernels)",
)
OPS = [pytest.param(info, id=info.name) for info in OP_TESTS]


def _assert_all_close(got, expected, tol, desc, scaled=False):
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape and g.dtype == e.dtype, desc
        scale = row_scale(e.double()) if scaled else 1.0  # (as check_against_reference's)
        torch.testing.assert_close(g / scale, e / scale, atol=tol.atol, rtol=tol.rtol, msg=lambda m: f"{desc}: {m}")


def _check_samples(info, dtype, min_row=0, max_numel=2048):
    """Every sample of `info` of at most `max_numel` elements (with `min_row`: rows of at least
    that many) through the op's Triton kernels against its CPU kernels, forward, backward and
    variants; returns how many ran."""
    kernels = OP_MODULES[info.name].TRITON_IMPLS  # op name -> Triton kernel, the op's signature
    backward_op = info.backward_ops[0]
    tol = info.tol[dtype]
    checked = 0
    for sample in info.samples("cpu", dtype, requires_grad=False):
        x = sample.args[0]
        if x.numel() > max_numel or (min_row and (x.ndim == 0 or x.shape[-1] < min_row)):
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
    return checked


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("info", OPS)
def test_triton_matches_cpu_kernels(info, dtype):
    pytest.importorskip("triton")
    assert _check_samples(info, dtype) > 0


@pytest.mark.parametrize("info", OPS)
def test_triton_kernels_refuse_bad_inputs(info):
    """The Triton kernels' argument checks (Python) raise what the CPU kernels' (C++) raise, with
    the same messages, for every bad input of the registry."""
    pytest.importorskip("triton")
    kernels = OP_MODULES[info.name].TRITON_IMPLS
    for err in info.error_samples("cpu"):
        if err.on_values:
            continue  # (the GPU kernels check values on the device: tested on the GPU)
        op = err.op or info.op
        with pytest.raises(err.error, match=err.match):
            kernels[op._schema.name.removeprefix("fusedops::")](*err.sample.args)


NORMS = [
    pytest.param(info, id=info.name) for info in OP_TESTS if info.name in ("rms_norm", "layer_norm", "add_rms_norm")
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("info", NORMS)
def test_norm_long_row_kernels(info, dtype, monkeypatch):
    """The norms' kernels for rows longer than one program holds (the looped forward; the
    backward's row statistics and its (row group, column chunk) grid, software-pipelined),
    which the real limits keep from every interpreter-sized sample: shrunk to rows of 8 values
    and chunks of 8 (4 in float64), so that rows span several chunks and row groups several rows."""
    pytest.importorskip("triton")
    from fusedops.triton import _norm

    for knob in ("_FWD_FUSED_MAX_N", "_BWD_FUSED_MAX_N", "_BWD_FUSED_MAX_N_WITH_DB", "_LOOP_BLOCK_N"):
        monkeypatch.setattr(_norm, knob, 8)
    assert _check_samples(info, dtype, min_row=9, max_numel=400) > 0


@pytest.mark.parametrize("long_rows", [False, True])
def test_rms_norm_save_output_with_a_zero_scale(long_rows, monkeypatch):
    """test_norm_options' check on the Triton backward, for rows in one program and (shrunk
    limits, as above) rows over several chunks."""
    pytest.importorskip("triton")
    from fusedops.triton import _norm
    from test_norm_options import check_save_output_with_a_zero_scale

    if long_rows:
        for knob in ("_BWD_FUSED_MAX_N", "_LOOP_BLOCK_N"):
            monkeypatch.setattr(_norm, knob, 8)
    check_save_output_with_a_zero_scale(OP_MODULES["rms_norm"].TRITON_IMPLS["rms_norm_backward"], "cpu", 5, 24)


def test_rope_empty_sliced_outputs_have_the_kernels_strides():
    """An empty q/k sliced from a fused projection (a batch of 0): torch calls any empty tensor
    contiguous, but the Triton path still gives it the CPU kernel's (and the fake kernel's)
    dense strides, not the input's gapped ones."""
    pytest.importorskip("triton")
    kernels = OP_MODULES["rope"].TRITON_IMPLS
    x = torch.randn(0, 3, 4, 8)  # (B, S, Hq + 2 Hk, D), Hq = 2, Hk = 1
    q, k = x[:, :, :2].transpose(1, 2), x[:, :, 2:3].transpose(1, 2)
    cos = sin = torch.randn(1, 3, 8)
    got = kernels["rope"](q, k, cos, sin, None, False)
    expected = torch.ops.fusedops.rope(q, k, cos, sin, None, False)
    assert [t.stride() for t in got[:2]] == [t.stride() for t in expected[:2]]


@pytest.mark.parametrize("info", NORMS)
def test_norm_backward_takes_strided_statistics(info):
    """The backward ops take rstd (and mean) with any strides, as the CPU kernels do: here every
    other element of a larger tensor."""
    pytest.importorskip("triton")
    kernels = OP_MODULES[info.name].TRITON_IMPLS
    backward_op = info.backward_ops[0]
    checked = 0
    for sample in info.samples("cpu", torch.float32, requires_grad=False):
        x = sample.args[0]
        if x.numel() > 2048 or x.ndim != 2 or x.shape[0] < 2 or x.shape[1] == 0:
            continue
        outputs = outputs_of(info.op(*sample.args))
        args = list(info.backward_args(sample, outputs, torch.randn_like(outputs[0])))
        for i, a in enumerate(args):  # the row statistics: float32 tensors of the rows' shape
            if isinstance(a, torch.Tensor) and a.shape == x.shape[:-1] and a.dtype == torch.float32:
                args[i] = torch.stack([a, torch.full_like(a, float("nan"))], -1)[..., 0]
                assert not args[i].is_contiguous()
        expected = outputs_of(backward_op(*args))
        got = outputs_of(kernels[backward_op._schema.name.removeprefix("fusedops::")](*args))
        _assert_all_close(got, expected, info.grad_tol[torch.float32], sample.desc, scaled=True)
        checked += 1
    assert checked > 0
