"""What the generic suites cannot see in the norms: LLaMA's casting bit for bit, Gemma's offset,
what the memory-saving backward keeps, the in-place add_rms_norm_, and how the CPU adds the
parameter gradients over chunks of rows."""

import pytest
import torch

import fusedops
from conftest import device_params

DEVICES = device_params()


def _llama_rms_norm(x, w, eps):
    """Hugging Face's LlamaRMSNorm.forward, as written there: normalise in float32, cast, scale."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _gemma_rms_norm(x, w, eps):
    """Gemma's RMSNorm: everything in float32, scale by (1 + weight), cast once."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + w.float())).type_as(x)


# Widths that a block caches, and one past it (on sm_90: the staged cluster forward).
WIDTHS = [1024, 40960]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", WIDTHS)
def test_cast_before_weight_rounds_like_llama(device, n):
    """With a weight in the input's dtype, cast_before_weight=True gives LLaMA's result (both
    roundings); the default float32 mode rounds once and so differs from it on many elements."""
    x = torch.randn(64, n, dtype=torch.bfloat16, device=device)
    w = torch.randn(n, dtype=torch.bfloat16, device=device)
    llama = _llama_rms_norm(x, w, 1e-6)
    cast = fusedops.rms_norm(x, w, 1e-6, cast_before_weight=True)
    fp32 = fusedops.rms_norm(x, w, 1e-6)
    cast_mismatch = (cast != llama).float().mean().item()
    fp32_mismatch = (fp32 != llama).float().mean().item()
    # (a last-bit difference in rstd can still flip a rounding now and then: the normalised
    # value's, which the weight multiply can carry to two units in the last place)
    assert cast_mismatch < 0.002, cast_mismatch
    assert fp32_mismatch > 0.05, fp32_mismatch
    torch.testing.assert_close(cast, llama, atol=0.0, rtol=2**-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", WIDTHS)
def test_offset_is_gemma(device, n):
    x = torch.randn(16, n, dtype=torch.bfloat16, device=device)
    w = 0.1 * torch.randn(n, dtype=torch.float32, device=device)
    torch.testing.assert_close(fusedops.rms_norm(x, w, 1e-6, offset=1.0), _gemma_rms_norm(x, w, 1e-6), atol=0, rtol=2**-7)
    norm = fusedops.nn.RMSNorm(n, eps=1e-6, offset=1.0, device=device)
    assert torch.equal(norm.weight, torch.zeros_like(norm.weight)), "Gemma's weights start at 0 (scale 1)"
    assert "offset=1.0" in repr(norm)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_weight", [True, False])
def test_save_output_keeps_the_output_not_the_input(device, with_weight):
    x = torch.randn(8, 256, device=device, requires_grad=True)
    w = (1.5 + torch.rand(256, device=device)).requires_grad_() if with_weight else None
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fusedops.rms_norm(x, w, save_output=True)
    assert any(t.data_ptr() == y.data_ptr() for t in saved), "the output is saved"
    assert all(t.data_ptr() != x.data_ptr() for t in saved), "the input is not saved"
    assert sum(t.numel() for t in saved) == y.numel() + 8 + (256 if with_weight else 0), "output, rstd, weight"
    g = torch.randn_like(y)
    params = [x] + ([w] if with_weight else [])
    got = torch.autograd.grad(y, params, g)
    expected = torch.autograd.grad(fusedops.rms_norm(x, w), params, g)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def check_save_output_with_a_zero_scale(backward, device, rows, n):
    """Gemma's offset with a weight at -offset (column 3): the output there is 0 whatever the
    input, so the memory-saving backward cannot recover xhat in that column. That column's
    gradients come out NaN, and only that column's: every other one matches the backward from
    the saved input. `backward` has rms_norm_backward's signature."""
    x = torch.randn(rows, n, device=device)
    w = 0.1 * torch.randn(n, device=device)
    w[3] = -1.0
    y, rstd = torch.ops.fusedops.rms_norm(x, w, 1e-6, 1.0)
    dy = torch.randn_like(y)
    dx, dw = backward(dy, y, w, rstd, 1.0, True, True)
    dx_ref, dw_ref = torch.ops.fusedops.rms_norm_backward(dy, x, w, rstd, 1.0, False, True)
    assert dx[:, 3].isnan().all() and dw[3].isnan()
    others = torch.arange(n, device=device) != 3
    torch.testing.assert_close(dx[:, others], dx_ref[:, others], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dw[others], dw_ref[others], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [96, 40960])
def test_save_output_with_a_zero_scale(device, n):
    check_save_output_with_a_zero_scale(torch.ops.fusedops.rms_norm_backward, device, 6, n)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", WIDTHS)
def test_layer_norm_far_from_zero(device, n):
    """Rows whose mean is 1e5 times their spread: the mean keeps its digits (a plain float32 sum
    of the row is off by whole units there, and every output with it). What is left is the
    float32 mean's own rounding, half a unit in the last place of 1e5 (0.004)."""
    x = 1e5 + torch.randn(8, n, device=device)
    w, b = torch.randn(n, device=device), torch.randn(n, device=device)
    expected = torch.nn.functional.layer_norm(x.double(), (n,), w.double(), b.double(), 1e-5)
    got = fusedops.layer_norm(x, w, b, 1e-5)
    torch.testing.assert_close(got.double(), expected, atol=0.01 * w.abs().max().item(), rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_wide_rows_sum_accurately(device):
    """Rows of 2^20 and 2^22 float32 values: the statistics stay within 2e-7 of float64's, as
    at ordinary widths (one float32 sum over the row, as the CPU kernels had it, was 4e-6 and 3e-5
    off there). rms_norm, layer_norm (mean and rstd) and add_rms_norm, forward and backward."""
    for n in (2**20, 2**22):
        x = torch.randn(2, n, device=device) + 0.5
        x64 = x.double()
        ms = x64.pow(2).mean(-1)
        _, rstd = torch.ops.fusedops.rms_norm(x, None, 1e-6)
        torch.testing.assert_close(rstd.double(), (ms + 1e-6).rsqrt(), rtol=2e-7, atol=0)
        _, _, rstd = torch.ops.fusedops.add_rms_norm(x, torch.zeros_like(x), None, 1e-6)
        torch.testing.assert_close(rstd.double(), (ms + 1e-6).rsqrt(), rtol=2e-7, atol=0)
        _, mean, rstd = torch.ops.fusedops.layer_norm(x, None, None, 1e-5)
        torch.testing.assert_close(mean.double(), x64.mean(-1), rtol=0, atol=2e-7)
        torch.testing.assert_close(rstd.double(), (x64.var(-1, unbiased=False) + 1e-5).rsqrt(), rtol=2e-7, atol=0)
        # The backward's row sum: against float64 through the same rstd.
        dy = torch.randn_like(x)
        x_ = x.clone().requires_grad_()
        (dx,) = torch.autograd.grad(fusedops.rms_norm(x_, None, 1e-6), x_, dy)
        x64_ = x64.clone().requires_grad_()
        (dx64,) = torch.autograd.grad(torch.nn.functional.rms_norm(x64_, (n,), None, 1e-6), x64_, dy.double())
        torch.testing.assert_close(dx.double(), dx64, rtol=0, atol=2e-6 * dx64.abs().max().item())


def _residual_views(device, dtype):
    """Residuals the in-place form must update where they lie: contiguous, rows sliced out of a
    wider buffer, and a strided last dimension (updated through a copy)."""
    yield "contiguous", torch.randn(6, 96, dtype=dtype, device=device)
    yield "sliced rows", torch.randn(6, 128, dtype=dtype, device=device)[:, 16:112]
    yield "strided last dim", torch.randn(6, 192, dtype=dtype, device=device)[:, ::2]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("residual_dtype", [torch.bfloat16, torch.float32])
def test_add_rms_norm_inplace(device, residual_dtype):
    x = torch.randn(6, 96, dtype=torch.bfloat16, device=device)
    w = torch.randn(96, device=device)
    for desc, residual in _residual_views(device, residual_dtype):
        expected_out, expected_residual = fusedops.add_rms_norm(x, residual, w)
        version = residual._version
        base = residual._base
        out = fusedops.add_rms_norm_(x, residual, w)
        assert residual._version > version, desc
        assert residual._base is base, desc
        assert torch.equal(out, expected_out), desc
        assert torch.equal(residual, expected_residual), desc


@pytest.mark.parametrize("device", DEVICES)
def test_add_rms_norm_inplace_refuses_gradients(device):
    x = torch.randn(4, 32, device=device, requires_grad=True)
    residual = torch.randn(4, 32, device=device)
    with pytest.raises(RuntimeError, match=r"add_rms_norm_ updates residual in place and has no gradient"):
        fusedops.add_rms_norm_(x, residual)
    with pytest.raises(RuntimeError, match=r"add_rms_norm_ updates residual in place and has no gradient"):
        torch.ops.fusedops.add_rms_norm_(x, residual, None, 1e-6)
    with torch.no_grad():
        fusedops.add_rms_norm_(x, residual)


@pytest.mark.parametrize("route", ["public", "registered"])
def test_add_rms_norm_residual_out_needs_no_grad_from_the_weight(route):
    """residual_out = x + residual does not depend on the weight: with only the weight trainable
    it needs no gradient (as torch's own x + residual), and a backward from it alone raises as
    torch's would; out still carries the weight's gradient."""
    x, residual = torch.randn(4, 32), torch.randn(4, 32)
    w = torch.randn(32, requires_grad=True)
    if route == "public":
        out, residual_out = fusedops.add_rms_norm(x, residual, w)
    else:
        out, residual_out, _rstd = torch.ops.fusedops.add_rms_norm(x, residual, w, 1e-6)
    assert out.requires_grad and not residual_out.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        residual_out.sum().backward()
    (grad_w,) = torch.autograd.grad(out, w, torch.ones_like(out))
    r64 = (x + residual).double()
    expected = (r64 * torch.rsqrt(r64.pow(2).mean(-1, keepdim=True) + 1e-6)).sum(0)
    torch.testing.assert_close(grad_w.double(), expected, atol=1e-5, rtol=1e-5)
    x.requires_grad_()
    assert fusedops.add_rms_norm(x, residual, w)[1].requires_grad


def test_add_rms_norm_inplace_refuses_inference_tensors():
    """As torch's in-place ops: an inference tensor is written only inside inference_mode."""
    x = torch.randn(4, 32)
    with torch.inference_mode():
        residual = torch.randn(4, 32)
    before = residual.clone()
    message = r"fusedops.add_rms_norm_: residual is an inference tensor, which cannot be updated in place outside"
    with pytest.raises(RuntimeError, match=message):
        fusedops.add_rms_norm_(x, residual)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.fusedops.add_rms_norm_(x, residual, None, 1e-6)
    assert torch.equal(residual, before)
    with torch.inference_mode():
        fusedops.add_rms_norm_(x, residual)
    assert torch.equal(residual, x + before)


@pytest.mark.parametrize("device", DEVICES)
def test_add_rms_norm_inplace_compiles(device):
    """torch.compile functionalises the mutation and writes the result back into residual."""
    x = torch.randn(4, 64, device=device)
    w = torch.randn(64, device=device)
    residual, expected_residual = torch.randn(4, 64, device=device), None
    expected_residual = residual.clone()
    expected_out = fusedops.add_rms_norm_(x, expected_residual, w)
    compiled = torch.compile(lambda a, r, b: fusedops.add_rms_norm_(a, r, b) * 2, fullgraph=True)
    out = compiled(x, residual, w)
    torch.testing.assert_close(out, expected_out * 2)
    torch.testing.assert_close(residual, expected_residual)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("view", ["select", "transpose"])
def test_add_rms_norm_inplace_compiles_into_views(device, view):
    """residual a view made in the compiled function (a slot of a stacked buffer, at a storage
    offset; a transposed slice), compiled by Inductor with dynamic shapes over three row counts:
    the buffer and output come out as eager's. Inductor (torch 2.11-2.13) wrote a custom op's
    in-place update of such a view at offset 0: add_rms_norm_ goes out of place and copies back
    there."""

    def step(x, buf, w):
        r = buf[1] if view == "select" else buf[:, 1].transpose(0, 1).transpose(0, 1)
        return fusedops.add_rms_norm_(x, r, w)

    compiled = torch.compile(step, backend="inductor", fullgraph=True, dynamic=True)
    w = torch.randn(16, device=device, dtype=torch.float64)
    with torch.no_grad():
        for rows in (4, 6, 7):
            x = torch.randn(rows, 16, device=device, dtype=torch.float64)
            shape = (2, rows, 16) if view == "select" else (rows, 2, 16)
            buf = torch.randn(shape, device=device, dtype=torch.float64)
            eager_buf, compiled_buf = buf.clone(), buf.clone()
            eager_out = step(x, eager_buf, w)
            out = compiled(x, compiled_buf, w)
            assert not torch.equal(eager_buf, buf)
            torch.testing.assert_close(compiled_buf, eager_buf, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(out, eager_out, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_add_rms_norm_gradient_through_one_output(device):
    """Only one of the two outputs used: the other's gradient is zero, not an error."""
    x = torch.randn(4, 48, device=device, requires_grad=True)
    r = torch.randn(4, 48, device=device, requires_grad=True)
    out, residual_out = fusedops.add_rms_norm(x, r)
    (gx,) = torch.autograd.grad(residual_out.sum(), x, retain_graph=True)
    torch.testing.assert_close(gx, torch.ones_like(x))
    gx, gr = torch.autograd.grad((out * out).sum(), [x, r])
    expected = torch.autograd.grad((fusedops.rms_norm(x + r) ** 2).sum(), x)[0]
    torch.testing.assert_close(gx, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gr, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_add_rms_norm_module(device):
    norm = fusedops.nn.AddRMSNorm(64, eps=1e-5, device=device)
    assert list(norm.state_dict()) == ["weight"]
    norm.load_state_dict(fusedops.nn.RMSNorm(64, device=device).state_dict())
    x, r = torch.randn(3, 64, device=device), torch.randn(3, 64, device=device)
    out, residual_out = norm(x, r)
    torch.testing.assert_close(out, fusedops.rms_norm(x + r, norm.weight, 1e-5))
    norm.inplace = True
    with torch.no_grad():
        out2, residual_out2 = norm(x, r)
    assert residual_out2 is r and torch.equal(r, residual_out) and torch.equal(out2, out)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "add_rms_norm"])
@pytest.mark.parametrize("rows", [7, 300, 1000])
def test_cpu_parameter_gradients_over_row_chunks(op, rows):
    """The CPU backward sums the parameter gradients over a fixed split of the rows into chunks
    (fewer for fewer rows: here 1, 2 and 7 of them): right against float64 torch at each split,
    and bitwise the same with one thread as with two."""
    n = 256
    gen = torch.Generator().manual_seed(rows)
    x, r, g = (torch.randn(rows, n, generator=gen) for _ in range(3))
    w, b = torch.randn(n, generator=gen), torch.randn(n, generator=gen)

    def run(f, dtype):
        params = [w.to(dtype).requires_grad_(), b.to(dtype).requires_grad_()]
        xs, rs = x.to(dtype), r.to(dtype)
        if op == "layer_norm":
            out = f["layer_norm"](xs, params[0], params[1])
        elif op == "rms_norm":
            out = f["rms_norm"](xs, params[0])
            params = params[:1]
        else:
            out = f["add_rms_norm"](xs, rs, params[0])
            params = params[:1]
        return torch.autograd.grad(out, params, g.to(dtype))

    ours = {"layer_norm": lambda x, w, b: fusedops.layer_norm(x, w, b, eps=1e-5),
            "rms_norm": lambda x, w: fusedops.rms_norm(x, w, eps=1e-6),
            "add_rms_norm": lambda x, r, w: fusedops.add_rms_norm(x, r, w, eps=1e-6)[0]}
    torch_ = {"layer_norm": lambda x, w, b: torch.nn.functional.layer_norm(x, (n,), w, b, eps=1e-5),
              "rms_norm": lambda x, w: torch.nn.functional.rms_norm(x, (n,), w, eps=1e-6),
              "add_rms_norm": lambda x, r, w: torch.nn.functional.rms_norm(x + r, (n,), w, eps=1e-6)}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = run(ours, torch.float32)
        torch.set_num_threads(1)
        one = run(ours, torch.float32)
    finally:
        torch.set_num_threads(threads)
    expected = run(torch_, torch.float64)
    for a, c, e in zip(two, one, expected):
        assert torch.equal(a, c)
        torch.testing.assert_close(a, e.float(), rtol=1e-5, atol=1e-4)


def test_gpu_code_coverage_rules():
    """Which builds have code for which GPU (fusedops falls back to Triton when none has)."""
    from fusedops._native import archs_cover

    release = "8.0;8.6;8.9;9.0;10.0;12.0+PTX"
    assert archs_cover(release, (8, 0)) and archs_cover(release, (8, 7)) and archs_cover(release, (9, 0))
    assert archs_cover(release, (12, 1)), "the PTX of 12.0 is compiled for newer GPUs"
    assert archs_cover("9.0", (9, 0)) and not archs_cover("9.0", (8, 0)) and not archs_cover("9.0", (10, 0))
    assert archs_cover("8.0", (8, 6)), "an sm_80 cubin runs on sm_86"
    assert not archs_cover("8.6", (8, 0))
    assert archs_cover("8.0+PTX", (9, 0)) and not archs_cover("9.0+PTX", (8, 9))
    assert archs_cover("9.0a", (9, 0)) and not archs_cover("9.0a", (9, 1))
    assert not archs_cover("", (9, 0))
