"""What the generic suites do not see of the gated activations (swiglu, geglu and their packed
forms): the packed forms against the unpacked ones bit for bit (so every alignment of the
halves is checked against the well-aligned kernels), the activations' float32 accuracy over
their whole range, NaN propagation, and nn.SwiGLUMLP against a plain-torch LLaMA MLP."""

import math

import pytest
import torch

import fusedops
from fusedops.testing._gated import activation
from conftest import device_params

DEVICES = device_params()
ACTS = [
    pytest.param(fusedops.swiglu, fusedops.swiglu_packed, (), "silu", id="swiglu"),
    pytest.param(fusedops.geglu, fusedops.geglu_packed, ("none",), "gelu", id="geglu"),
    pytest.param(fusedops.geglu, fusedops.geglu_packed, ("tanh",), "gelu_tanh", id="geglu-tanh"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("unpacked, packed, mode, act", ACTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_packed_equals_unpacked(unpacked, packed, mode, act, dtype, device):
    """For every width n (so halves at every alignment: n * elem_size a multiple of 16, of 8, of
    4, of 2, or odd), the packed op's output and its one (..., 2n) gradient equal the unpacked
    op's output and the concatenation of its two gradients, bit for bit."""
    for n in (1, 2, 3, 4, 5, 7, 8, 12, 16, 33, 1030, 4100):
        gu = (2 * torch.randn(6, 2 * n, device=device)).to(dtype).requires_grad_()
        y = packed(gu, *mode)
        assert y.shape == (6, n) and y.dtype == dtype and y.is_contiguous()
        g, u = gu.detach()[:, :n].contiguous().requires_grad_(), gu.detach()[:, n:].contiguous().requires_grad_()
        expected = unpacked(g, u, *mode)
        assert torch.equal(y, expected), f"n={n}"
        dy = torch.randn_like(y)
        (grad,) = torch.autograd.grad(y, gu, dy)
        dg, du = torch.autograd.grad(expected, (g, u), dy)
        assert grad.shape == gu.shape and grad.is_contiguous()
        assert torch.equal(grad, torch.cat([dg, du], -1)), f"n={n}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("unpacked, packed, mode, act", ACTS)
def test_float32_accuracy(unpacked, packed, mode, act, device):
    """The float32 activations (the CPU's own exp and erf, CUDA's intrinsics) against float64
    over [-30, 30]: within 3e-7 absolute plus 1e-6 relative (a few ulp), forward and both
    gradient factors."""
    g64 = torch.linspace(-30, 30, 60_001, dtype=torch.float64, device=device)
    g = g64.float().requires_grad_()
    one = torch.ones_like(g, requires_grad=True)
    y = unpacked(g, one, *mode)
    ref_g = g.detach().double().requires_grad_()
    ref = activation(ref_g, act)
    torch.testing.assert_close(y.double(), ref.detach(), atol=3e-7, rtol=1e-6)
    dg, du = torch.autograd.grad(y, (g, one), torch.ones_like(y))
    (ref_dg,) = torch.autograd.grad(ref, ref_g, torch.ones_like(ref))
    torch.testing.assert_close(dg.double(), ref_dg, atol=3e-7, rtol=1e-6)
    torch.testing.assert_close(du.double(), ref.detach(), atol=3e-7, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("unpacked, packed, mode, act", ACTS)
def test_nan_propagates(unpacked, packed, mode, act, device):
    g = torch.tensor([[0.5, math.nan, -2.0, 1.0]], device=device)
    u = torch.tensor([[1.0, 1.0, math.nan, 2.0]], device=device)
    y = unpacked(g, u, *mode)
    assert torch.isnan(y[0, 1]) and torch.isnan(y[0, 2]), y
    assert torch.isfinite(y[0, [0, 3]]).all(), y


@pytest.mark.parametrize("device", DEVICES)
def test_sigmoid_keeps_its_subnormal_tail(device):
    """The sigmoid of a gate in [-88.7, -87.3] is a subnormal float32, not 0, as torch's: a huge
    `up` (1e38) scales it back to an ordinary value, as in float64. (The CPU exp overflowed from
    88.4, where e^88.7 is still finite; the CUDA kernels' reciprocal flushed subnormals to 0.)"""
    g64 = torch.linspace(-88.7, -86.0, 2701, dtype=torch.float64)
    g = g64.float().to(device).requires_grad_()
    u = torch.full_like(g, 1e38, requires_grad=True)
    y = fusedops.swiglu(g, u)
    ref_g, ref_u = g.detach().double().requires_grad_(), u.detach().double().requires_grad_()
    ref = activation(ref_g, "silu") * ref_u
    torch.testing.assert_close(y.double(), ref.detach(), atol=0, rtol=2e-5)
    dg, du = torch.autograd.grad(y, (g, u), torch.ones_like(y))
    ref_dg, ref_du = torch.autograd.grad(ref, (ref_g, ref_u), torch.ones_like(ref))
    torch.testing.assert_close(dg.double(), ref_dg, atol=0, rtol=2e-5)
    torch.testing.assert_close(du.double(), ref_du, atol=0, rtol=2e-5)
    assert (fusedops.swiglu(g.detach(), torch.full_like(u, math.inf)) == -math.inf).all()


# ---- nn.SwiGLUMLP -------------------------------------------------------------------------------


class _TorchLlamaMLP(torch.nn.Module):
    """A plain-torch LLaMA MLP (the structure of Hugging Face's LlamaMLP)."""

    def __init__(self, hidden, intermediate, bias):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = torch.nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = torch.nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_mlp_matches_llama_mlp(bias, device):
    ref = _TorchLlamaMLP(32, 88, bias).to(device)
    mlp = fusedops.nn.SwiGLUMLP(32, 88, bias=bias, device=device)
    assert list(mlp.state_dict()) == list(ref.state_dict())
    expected_keys = ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
    if bias:
        expected_keys = ["gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias", "down_proj.weight",
                         "down_proj.bias"]
    assert list(mlp.state_dict()) == expected_keys
    mlp.load_state_dict(ref.state_dict())
    x = torch.randn(3, 5, 32, device=device, requires_grad=True)
    y, y_ref = mlp(x), ref(x)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, *mlp.parameters()], dy)
    ref_grads = torch.autograd.grad(y_ref, [x, *ref.parameters()], dy)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # And back: our state_dict loads into the plain module.
    ref2 = _TorchLlamaMLP(32, 88, bias).to(device)
    ref2.load_state_dict(mlp.state_dict())
    torch.testing.assert_close(ref2(x), y, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_swiglu_mlp_bf16_and_compile(device):
    mlp = fusedops.nn.SwiGLUMLP(64, 128, device=device, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in mlp.parameters())
    assert "hidden_size=64, intermediate_size=128" in repr(mlp)
    x = torch.randn(4, 64, device=device, dtype=torch.bfloat16)
    compiled = torch.compile(mlp, fullgraph=True)
    torch.testing.assert_close(compiled(x), mlp(x), atol=1e-2, rtol=1e-2)
