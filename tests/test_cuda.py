"""CUDA-only behaviour of every op: the backend in use, a non-default stream, CUDA-graph
capture and 64-bit indexing. Run once per backend (FUSEDOPS_BACKEND unset, then =triton)."""

import os

import pytest
import torch

import fusedops
from fusedops.testing import OP_TESTS
from conftest import HAS_CUDA, NO_GPU_REASON

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason=NO_GPU_REASON)]
OPS = [pytest.param(info, id=info.name) for info in OP_TESTS]


def _sample(info, shape=(4, 3, 256), requires_grad=True):
    return info.sample_for_shape("cuda", torch.bfloat16, shape, requires_grad=requires_grad)


def _with_input(sample, x):
    return (x,) + tuple(sample.args[1:])


def _grad_tensors(info, args):
    return [args[i] for i in info.grad_argnums]


@pytest.mark.parametrize("info", OPS)
def test_backend_is_the_requested_one(info):
    wanted = os.environ.get("FUSEDOPS_BACKEND", "auto")
    got = fusedops.backend_for(info.name, "cuda")
    if wanted == "auto":
        assert got == ("cuda" if fusedops.build_info()["cuda_built"] else "triton")
    else:
        assert got == wanted


@pytest.mark.parametrize("info", OPS)
def test_side_stream(info):
    """Kernels run on the caller's current stream: results on a side stream, ordered after
    work queued on that stream, match the default stream's."""
    sample = _sample(info)
    expected = info.public(*sample.args)
    g = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, _grad_tensors(info, sample.args), g)
    stream = torch.cuda.Stream()
    x = torch.empty_like(sample.args[0])
    with torch.cuda.stream(stream):
        torch.cuda._sleep(1_000_000)  # if the op used another stream it would read x too early
        x.copy_(sample.args[0].detach())
        x.requires_grad_()
        args = _with_input(sample, x)
        out = info.public(*args)
        grads = torch.autograd.grad(out, _grad_tensors(info, args), g)
    stream.synchronize()
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("info", OPS)
def test_cuda_graph_capture(info):
    """Forward and backward capture in a CUDA graph (no host sync) and replay on new data."""
    sample = _sample(info)
    x = sample.args[0].detach().clone().requires_grad_()
    args = _with_input(sample, x)
    tensors = _grad_tensors(info, args)
    g = torch.randn_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (autotuning, lazy init) outside the capture
        for _ in range(2):
            torch.autograd.grad(info.public(*args), tensors, g)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = info.public(*args)
        grads = torch.autograd.grad(out, tensors, g)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    expected = info.public(*args)
    expected_grads = torch.autograd.grad(expected, tensors, g)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("info", OPS)
def test_more_than_2_31_elements(info):
    """64-bit indexing: the last rows of a tensor of more than 2^31 elements are right."""
    n = 4096
    rows = (2**31) // n + 8
    try:
        x = torch.randn(rows, n, dtype=torch.bfloat16, device="cuda")
    except torch.OutOfMemoryError:
        pytest.skip("not enough GPU memory for a 2^31-element tensor")
    sample = _sample(info, (2, n), requires_grad=False)
    rest = sample.args[1:]
    out = info.public(x, *rest)
    for part in (slice(rows - 16, rows), slice(0, 16)):
        expected = info.reference(x[part], *rest)
        torch.testing.assert_close(out[part].double(), expected, atol=1e-2, rtol=1e-2)
