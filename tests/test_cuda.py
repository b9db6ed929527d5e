"""CUDA-only behaviour of every op: the backend in use, a non-default stream, CUDA-graph
capture, 64-bit indexing and a second GPU. Run once per backend (FUSEDOPS_BACKEND unset, then
=triton)."""

import os

import pytest
import torch

import fusedops
from fusedops.testing import OP_TESTS, OP_TESTS_BY_NAME, Sample, check_against_reference, grads_for, outputs_of
from conftest import HAS_CUDA, NO_GPU_REASON, gpu_memory_to_itself

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
    _check_side_stream(info, "cuda")


def _check_side_stream(info, device, current=None):
    """The op's outputs and gradients on `device` computed on a side stream of that device equal
    the default stream's, bitwise. The input is written on the side stream after a sleep queued
    there: a kernel launched on any other stream would read it too early. `current`: the current
    device during the op's calls, when not `device`."""
    sample = info.sample_for_shape(device, torch.bfloat16, (4, 3, 256), requires_grad=True)
    expected = outputs_of(info.public(*sample.args))
    g = grads_for(expected)
    expected_grads = torch.autograd.grad(expected, _grad_tensors(info, sample.args), g)
    with torch.cuda.device(device):
        stream = torch.cuda.Stream()
    x = torch.empty_like(sample.args[0])
    with torch.cuda.stream(stream):  # (which makes the stream's device current)
        torch.cuda._sleep(1_000_000)
        x.copy_(sample.args[0].detach())
        x.requires_grad_()
        args = _with_input(sample, x)
        with torch.cuda.device(current if current is not None else device):
            out = outputs_of(info.public(*args))
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
    g = grads_for(outputs_of(info.public(*args)))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (autotuning, lazy init) outside the capture
        for _ in range(2):
            torch.autograd.grad(info.public(*args), tensors, g)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = outputs_of(info.public(*args))
        grads = torch.autograd.grad(out, tensors, g)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    expected = outputs_of(info.public(*args))
    expected_grads = torch.autograd.grad(expected, tensors, g)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("info", OPS)
def test_more_than_2_31_elements(info):
    """64-bit indexing: the last rows of a tensor of more than 2^31 elements are right."""
    if info.large_input_check is not None:
        info.large_input_check("cuda")
        return
    with gpu_memory_to_itself():
        _check_more_than_2_31_elements(info)


def _check_more_than_2_31_elements(info):
    n = 4096
    rows = (2**31) // n + 8
    try:
        x = torch.randn(rows, n, dtype=torch.bfloat16, device="cuda")
    except torch.OutOfMemoryError:
        pytest.skip("not enough GPU memory for a 2^31-element tensor")
    # Every other tensor argument of x's shape is x itself (a residual, say): one 4 GiB tensor.
    sample = _sample(info, (2, n), requires_grad=False)
    args = [x if isinstance(a, torch.Tensor) and a.shape == (2, n) else a for a in sample.args]
    out = outputs_of(info.public(*args))
    for part in (slice(rows - 16, rows), slice(0, 16)):
        part_args = [a[part] if a is x else a for a in args]
        expected = outputs_of(info.reference(*part_args))
        for o, e in zip(out, expected, strict=True):
            torch.testing.assert_close(o[part].double(), e.double(), atol=1e-2, rtol=1e-2)


TWO_GPUS = pytest.mark.skipif(
    not HAS_CUDA or torch.cuda.device_count() < 2,
    reason="needs two GPUs (README, 'Tests and benchmarks on a GPU')")


@TWO_GPUS
@pytest.mark.parametrize("info", OPS)
def test_second_gpu_while_the_first_is_current(info):
    """Tensors on cuda:1 while cuda:0 is the current device: every sample, forward and backward,
    of the op and its other public forms (in-place functions) matches the fp64 reference, and
    the outputs and gradients are on cuda:1. A launch on the
    current device instead of the tensors' would read another GPU's addresses."""
    with torch.cuda.device(0):
        for dtype in (torch.float32, torch.bfloat16):
            for sample in info.samples("cuda:1", dtype, requires_grad=True):
                check_against_reference(info, sample, dtype)
            for variant in info.public_variants:
                for sample in info.samples("cuda:1", dtype, requires_grad=variant.differentiable):
                    check_against_reference(info, sample, dtype, variant)
            sample = info.sample_for_shape("cuda:1", dtype, (3, 5, 256), requires_grad=True)
            out = outputs_of(info.public(*sample.args))
            grads = torch.autograd.grad(out, _grad_tensors(info, sample.args), grads_for(out))
            assert all(t.device == torch.device("cuda:1") for t in out + grads), info.name


@TWO_GPUS
@pytest.mark.parametrize("info", OPS)
def test_second_gpu_current_stream(info):
    """On cuda:1 with cuda:0 current, kernels run on cuda:1's current stream (a side stream
    there), after the work queued on it, as on the default device (test_side_stream)."""
    _check_side_stream(info, "cuda:1", current=0)


def _takes_several_tensors(info):
    sample = info.sample_for_shape("cpu", torch.float32, (2, 8), requires_grad=False)
    return sum(isinstance(a, torch.Tensor) for a in sample.args) > 1


@TWO_GPUS
@pytest.mark.parametrize("info", [p for p in OPS if _takes_several_tensors(p.values[0])])
def test_arguments_on_two_gpus_are_refused(info):
    """Each tensor argument moved to cuda:1 beside the others on cuda:0: a ValueError naming
    the argument and both devices, from the public function, before any kernel runs."""
    sample = info.sample_for_shape("cuda:0", torch.float32, (4, 3, 256), requires_grad=False)
    names = [a.name for a in info.op._schema.arguments]
    checked = 0
    for i, arg in enumerate(sample.args):
        if i == 0 or not isinstance(arg, torch.Tensor):
            continue
        args = list(sample.args)
        args[i] = arg.to("cuda:1")
        with pytest.raises(ValueError, match=rf"^{info.name}: {names[i]} is on cuda:1 but \w+ is on cuda:0"):
            info.public(*args)
        checked += 1
    assert checked > 0
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)


# Row widths past the block-caching kernels (16384 bf16, 8192 fp32 values). Forward on sm_90,
# rms_norm and layer_norm stage their rows in shared memory in chunks of up to 64 KB: 16392,
# 40960, 131080 and 262144 bf16 values in clusters of 1, 2, 5 and 8 blocks, fp32 16392 and
# 40960 in 2 and 3 (fp32 rows of 131080 and more are swept); add_rms_norm caches them in the
# registers of a cluster, 131080 in one of 8 with a vector to spare, 262144 in a full one.
# 262143, no multiple of any vector, is swept. The backward takes its cluster kernel for the
# aligned widths.
WIDE_ROWS = [16392, 40960, 131080, 262144, 262143]
NORMS = [pytest.param(OP_TESTS_BY_NAME[name], id=name) for name in ("rms_norm", "add_rms_norm", "layer_norm")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("n", WIDE_ROWS)
@pytest.mark.parametrize("info", NORMS)
def test_wide_rows(info, n, dtype):
    """Values and gradients of rows up to 262144 wide against the fp64 reference."""
    check_against_reference(info, info.sample_for_shape("cuda", dtype, (3, n), requires_grad=True), dtype)


# Rows wider than a block caches run on sm_90 in persistent clusters (rms_norm's and
# layer_norm's staged forward, every norm's backward): more rows than resident clusters, so that
# each cluster walks several rows, refilling its shared memory and exchanging its row sums for
# each, through the two halves of its blocks' inboxes in turn (2 and 4 blocks a cluster forward).
STAGED_SHAPES = [(600, 40960), (300, 131072)]


@pytest.mark.parametrize("shape", STAGED_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("info", NORMS)
def test_wide_rows_many_per_cluster(info, shape):
    """Values and gradients of many wide rows against the fp64 reference."""
    sample = info.sample_for_shape("cuda", torch.bfloat16, shape, requires_grad=True)
    check_against_reference(info, sample, torch.bfloat16)


# layer_norm's cluster kernels merge each block's mean and squared deviations into the row's.
# Random rows of mean zero would hide a wrong merge (every block's mean is then near the row's),
# so these rows drift along their length, on top of an offset much larger than their spread:
# staged in clusters of 2 and 3 blocks, cached in registers (262144), and a staged walk of rows.
DRIFTING = [
    pytest.param((rows, n), dtype, id=f"{rows}x{n}-{name}")
    for rows, n, dtype, name in [
        (3, 16392, torch.bfloat16, "bf16"),
        (3, 40960, torch.bfloat16, "bf16"),
        (3, 262144, torch.bfloat16, "bf16"),
        (300, 131072, torch.bfloat16, "bf16"),
        (3, 131072, torch.float32, "fp32"),
    ]
]


@pytest.mark.parametrize("shape,dtype", DRIFTING)
def test_layer_norm_wide_rows_drifting_mean(shape, dtype):
    """layer_norm of wide rows whose mean differs from block to block, against the fp64 reference."""
    info = OP_TESTS_BY_NAME["layer_norm"]
    rows, n = shape
    drift = torch.linspace(-4, 4, n, device="cuda")
    x = (torch.randn(rows, n, device="cuda") * 0.5 + drift + 40).to(dtype).requires_grad_()
    sample = info.sample_for_shape("cuda", dtype, shape, requires_grad=True)
    check_against_reference(info, Sample(_with_input(sample, x), f"{list(shape)}-drifting"), dtype)


@pytest.mark.parametrize("n", [40960, 262144])
def test_layer_norm_wide_rows_float32_parameters(n):
    """bf16 rows with float32 weight and bias (mixed precision) through the cluster backward, which
    keeps the parameter-gradient partials of 16-bit rows in shared memory, against float64:
    40 rows, more than the resident clusters at 262144, so that clusters add partials over rows."""
    x = torch.randn(40, n, device="cuda").to(torch.bfloat16).requires_grad_()
    w = (1 + 0.1 * torch.randn(n, device="cuda")).requires_grad_()
    b = (0.1 * torch.randn(n, device="cuda")).requires_grad_()
    y = fusedops.layer_norm(x, w, b, 1e-5)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, w, b), dy)
    ref_in = [t.detach().double().requires_grad_() for t in (x, w, b)]
    ref = torch.nn.functional.layer_norm(ref_in[0], (n,), ref_in[1], ref_in[2], 1e-5)
    ref_grads = torch.autograd.grad(ref, ref_in, dy.double())
    assert y.dtype == torch.bfloat16 and [g.dtype for g in grads] == [torch.bfloat16, torch.float32, torch.float32]
    torch.testing.assert_close(y.double(), ref, atol=2e-2, rtol=1e-2)
    # grad_input is rounded to bf16 (2^-8 relative); the parameter gradients are float32 sums of
    # 40 rows computed from the same bf16 values as the reference: far tighter.
    for g, r, rtol in zip(grads, ref_grads, (8e-3, 1e-4, 1e-4)):
        scale = r.abs().max().item()
        torch.testing.assert_close(g.double(), r, atol=rtol * scale, rtol=0)


# More rows than one wave of blocks holds, so that the backward's persistent blocks walk several
# rows each and add their parameter-gradient partials across them: widths that pick one row
# slot of 8 threads per vector (64), 32 threads (1000 bf16), 4 vectors of 256 threads (4104
# bf16), 8 vectors (8200 bf16, one block an SM), and for float32 the sweep (8200); 4096 is the
# common width, where the 16-bit forwards take 4 vectors of 128 threads.
MANY_ROWS_WIDTHS = [64, 1000, 4096, 4104, 8200]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("n", MANY_ROWS_WIDTHS)
@pytest.mark.parametrize("info", NORMS)
def test_many_rows(info, n, dtype):
    """Values and gradients of 3000 rows against the fp64 reference."""
    check_against_reference(info, info.sample_for_shape("cuda", dtype, (3000, n), requires_grad=True), dtype)


@pytest.mark.parametrize("n", WIDE_ROWS)
def test_wide_rows_add_rms_norm_float32_residual(n):
    """add_rms_norm's wide rows with a float32 residual stream under bf16 activations, also in place."""
    info = OP_TESTS_BY_NAME["add_rms_norm"]
    x = torch.randn(3, n, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    r = torch.randn(3, n, dtype=torch.float32, device="cuda", requires_grad=True)
    w = torch.randn(n, dtype=torch.float32, device="cuda", requires_grad=True)
    check_against_reference(info, Sample((x, r, w, 1e-6), f"[3, {n}]-residual_fp32"), torch.bfloat16)
    with torch.no_grad():
        expected_out, expected_res = fusedops.add_rms_norm(x, r, w)
        r2 = r.detach().clone()
        out = fusedops.add_rms_norm_(x.detach(), r2, w.detach())
    torch.testing.assert_close(out, expected_out, atol=0, rtol=0)
    torch.testing.assert_close(r2, expected_res, atol=0, rtol=0)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32], ids=["weight_bf16", "weight_fp32"])
@pytest.mark.parametrize("n", [40960, 262144])
def test_add_rms_norm_wide_rows_float32_residual_gradients(n, weight_dtype):
    """bf16 rows with a float32 residual stream through the cluster backward, which keeps their
    weight-gradient partials in shared memory, against float64: 40 rows, more than the resident
    clusters at 262144, so that clusters add partials over rows; every gradient checked."""
    x = torch.randn(40, n, device="cuda").to(torch.bfloat16).requires_grad_()
    r = torch.randn(40, n, device="cuda", requires_grad=True)
    w = (1 + 0.1 * torch.randn(n, device="cuda")).to(weight_dtype).requires_grad_()
    out, h = fusedops.add_rms_norm(x, r, w, 1e-6)
    dout, dh = torch.randn_like(out), torch.randn_like(h)
    grads = torch.autograd.grad((out, h), (x, r, w), (dout, dh))
    ref_in = [t.detach().double().requires_grad_() for t in (x, r, w)]
    ref_h = ref_in[0] + ref_in[1]
    ref_out = torch.nn.functional.rms_norm(ref_h, (n,), ref_in[2], 1e-6)
    ref_grads = torch.autograd.grad((ref_out, ref_h), ref_in, (dout.double(), dh.double()))
    assert (out.dtype, h.dtype) == (torch.bfloat16, torch.float32)
    assert [g.dtype for g in grads] == [torch.bfloat16, torch.float32, weight_dtype]
    torch.testing.assert_close(out.double(), ref_out, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(h.double(), ref_h, atol=1e-6, rtol=1e-6)
    # grad x and a bf16 grad weight are rounded to bf16 (2^-8 relative); grad residual and a
    # float32 grad weight are float32 results from the same values as the reference: far tighter.
    weight_rtol = 8e-3 if weight_dtype == torch.bfloat16 else 1e-4
    for g, ref, rtol in zip(grads, ref_grads, (8e-3, 1e-4, weight_rtol)):
        scale = ref.abs().max().item()
        torch.testing.assert_close(g.double(), ref, atol=rtol * scale, rtol=0)


def test_gpu_without_code_falls_back_to_triton():
    """A build with no code for this GPU (here: the record says sm_80 only) switches every op to
    Triton when CUDA initialises, with one warning, and computes the same values."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import warnings
        import torch
        import fusedops
        if not fusedops.build_info()["cuda_built"]:
            print("SKIP no CUDA kernels in this build"); raise SystemExit
        import fusedops._build_info
        fusedops._build_info.BUILD_INFO["cuda_archs"] = "8.0"   # before CUDA initialises
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            x = torch.randn(8, 256, device="cuda")
            y = fusedops.rms_norm(x, None, 1e-6)
        messages = [str(w.message) for w in caught if "no code for" in str(w.message)]
        assert len(messages) == 1, messages
        major, minor = torch.cuda.get_device_capability()
        assert "no code for cuda:0 " in messages[0] and f"(sm_{major}{minor})" in messages[0], messages[0]
        assert "it was built for 8.0" in messages[0], messages[0]
        assert fusedops.backend_for("rms_norm", "cuda") == "triton"
        expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        torch.testing.assert_close(y, expected)
        print("OK")
    """)
    env = dict(os.environ, FUSEDOPS_BACKEND="auto")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    if result.stdout.startswith("SKIP"):
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr
