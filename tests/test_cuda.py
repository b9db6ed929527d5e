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


def _first_weighted_sample(info, dtype=torch.bfloat16):
    return next(s for s in info.samples("cuda", dtype, requires_grad=True, edge=False)
                if s.args[1] is not None and s.args[0].shape[-1] >= 64)


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
    sample = _first_weighted_sample(info)
    expected = info.public(*sample.args)
    g = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, sample.args[:2], g)
    stream = torch.cuda.Stream()
    x = torch.empty_like(sample.args[0])
    with torch.cuda.stream(stream):
        torch.cuda._sleep(1_000_000)  # if the op used another stream it would read x too early
        x.copy_(sample.args[0].detach())
        x.requires_grad_()
        out = info.public(x, *sample.args[1:])
        grads = torch.autograd.grad(out, (x, sample.args[1]), g)
    stream.synchronize()
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("info", OPS)
def test_cuda_graph_capture(info):
    """Forward and backward capture in a CUDA graph (no host sync) and replay on new data."""
    sample = _first_weighted_sample(info)
    x, w = sample.args[0].detach().clone().requires_grad_(), sample.args[1]
    rest = sample.args[2:]
    g = torch.randn_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (autotuning, lazy init) outside the capture
        for _ in range(2):
            torch.autograd.grad(info.public(x, w, *rest), (x, w), g)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = info.public(x, w, *rest)
        gx, gw = torch.autograd.grad(out, (x, w), g)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    expected = info.public(x, w, *rest)
    ex, ew = torch.autograd.grad(expected, (x, w), g)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    torch.testing.assert_close(gx, ex, atol=0, rtol=0)
    torch.testing.assert_close(gw, ew, atol=0, rtol=0)


@pytest.mark.parametrize("info", OPS)
def test_more_than_2_31_elements(info):
    """64-bit indexing: the last rows of a tensor of more than 2^31 elements are right."""
    n = 4096
    rows = (2**31) // n + 8
    try:
        x = torch.randn(rows, n, dtype=torch.bfloat16, device="cuda")
    except torch.OutOfMemoryError:
        pytest.skip("not enough GPU memory for a 2^31-element tensor")
    w = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    out = info.public(x, w, 1e-6)
    tail = slice(rows - 16, rows)
    expected = info.reference(x[tail], w, 1e-6)
    torch.testing.assert_close(out[tail].double(), expected, atol=1e-2, rtol=1e-2)
    head = info.reference(x[:16], w, 1e-6)
    torch.testing.assert_close(out[:16].double(), head, atol=1e-2, rtol=1e-2)
