"""The drop-in modules: same constructor arguments, parameters and state_dict keys as their torch
counterparts, and the same results (within the op's tolerance) after loading torch's state."""

import numpy as np
import pytest
import torch

import fusedops
from conftest import device_params

# (fusedops module, torch module, constructor kwargs variants)
PAIRS = [
    pytest.param(fusedops.nn.RMSNorm, torch.nn.RMSNorm,
                 [{}, {"eps": 1e-5}, {"elementwise_affine": False}], id="RMSNorm"),
    pytest.param(fusedops.nn.LayerNorm, torch.nn.LayerNorm,
                 [{}, {"eps": 1e-6}, {"bias": False}, {"elementwise_affine": False}], id="LayerNorm"),
]


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("ours, theirs, variants", PAIRS)
def test_drop_in(ours, theirs, variants, device):
    for kwargs in variants:
        for shape in ((64,), (4, 16)):
            mine, ref = ours(shape, device=device, **kwargs), theirs(shape, device=device, **kwargs)
            assert list(mine.state_dict()) == list(ref.state_dict()), kwargs
            with torch.no_grad():
                for p in ref.parameters():
                    p.normal_()  # not the initial ones and zeros
            mine.load_state_dict(ref.state_dict())
            for lead in ((3, 5), (0,)):  # (an empty batch: parameter gradients of zeros)
                x = torch.randn(*lead, *shape, device=device, requires_grad=True)
                y, y_ref = mine(x), ref(x)
                torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
                g = torch.randn_like(y)
                params = [x] + list(mine.parameters())
                ref_params = [x] + list(ref.parameters())
                for a, b in zip(torch.autograd.grad(y, params, g), torch.autograd.grad(y_ref, ref_params, g)):
                    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
            # (torch's repr gained fields over versions, e.g. LayerNorm's bias=: ours is 2.13's)
            assert repr(mine).startswith(repr(ref)[:-1]), (repr(mine), repr(ref))


@pytest.mark.parametrize("ours", [fusedops.nn.RMSNorm, fusedops.nn.LayerNorm])
def test_wrong_trailing_shape(ours):
    with pytest.raises(ValueError, match=r"input's trailing shape \[8\] does not match normalized_shape \[16\]"):
        ours(16)(torch.randn(2, 8))


@pytest.mark.parametrize("affine", [True, False])
def test_add_rms_norm_checks_the_width(affine):
    """As RMSNorm: the input is named, not the module's own weight."""
    with pytest.raises(ValueError, match=r"AddRMSNorm: input's trailing shape \[8\] does not match hidden_size 16"):
        fusedops.nn.AddRMSNorm(16, elementwise_affine=affine)(torch.randn(2, 8), torch.randn(2, 8))


@pytest.mark.parametrize("ours", [fusedops.nn.RMSNorm, fusedops.nn.AddRMSNorm])
def test_offset_without_weight_is_refused_by_the_constructor(ours):
    """An offset scales the weight; without one every forward would raise, so the module is never made."""
    with pytest.raises(ValueError, match=rf"^{ours.__name__}: offset scales the weight .* needs elementwise_affine=True; "
                                         r"got offset 1 without a weight"):
        ours(16, elementwise_affine=False, offset=1.0)
    assert ours(16, elementwise_affine=False, offset=0.0).weight is None


# (module, constructor arguments, its float options, its bool options)
OPTIONS = [
    pytest.param(fusedops.nn.RMSNorm, (16,), ["offset"], ["cast_before_weight", "save_output"], id="RMSNorm"),
    pytest.param(fusedops.nn.AddRMSNorm, (16,), ["offset"], ["cast_before_weight", "inplace"], id="AddRMSNorm"),
    pytest.param(fusedops.nn.CrossEntropyLoss, (), ["z_loss", "softcap"], ["inplace_grad"], id="CrossEntropyLoss"),
    pytest.param(fusedops.nn.LinearCrossEntropyLoss, (4, 6), ["label_smoothing", "z_loss", "softcap"],
                 ["low_memory"], id="LinearCrossEntropyLoss"),
]


@pytest.mark.parametrize("ours, args, floats, flags", OPTIONS)
def test_constructors_refuse_mistyped_options(ours, args, floats, flags):
    """A number given as a string, or a flag as a string ("False" is truthy), is refused by the
    constructor naming the module and the option, as the functions refuse them, instead of being
    converted (float("0.5")) or switching a mode on (bool("False"))."""
    for name in floats:
        with pytest.raises(TypeError, match=rf"^{ours.__name__}: {name} must be a float(| or None), got str$"):
            ours(*args, **{name: "0.5"})
        assert getattr(ours(*args, **{name: np.float32(0.5)}), name) == 0.5
    for name in flags:
        with pytest.raises(TypeError, match=rf"^{ours.__name__}: {name} must be a bool, got str$"):
            ours(*args, **{name: "False"})
        assert getattr(ours(*args, **{name: np.bool_(True)}), name) is True


@pytest.mark.parametrize("ours, args", [(fusedops.nn.CrossEntropyLoss, ()),
                                        (fusedops.nn.LinearCrossEntropyLoss, (4, 6))])
def test_check_target_mode_of_the_loss_modules(ours, args):
    """check_target: a bad mode is refused by the constructor in the module's name; numpy's bools
    pass for bools (as the functions' other bool options take them)."""
    with pytest.raises(ValueError, match=rf"^{ours.__name__}: check_target must be True, False or 'sync', got 'yes'$"):
        ours(*args, check_target="yes")
    assert ours(*args, check_target=np.False_).check_target is False


@pytest.mark.parametrize("module, args", [
    (fusedops.nn.RMSNorm(4), ()), (fusedops.nn.RMSNorm(4, eps=None), ()), (fusedops.nn.LayerNorm(4), ()),
    (fusedops.nn.AddRMSNorm(4, eps=None), (torch.randn(2, 4),)),
])
def test_norm_modules_name_a_non_tensor_input(module, args):
    """A TypeError naming the argument (as torch's modules give), not a missing attribute."""
    name = type(module).__name__
    with pytest.raises(TypeError, match=rf"{name}: input must be a Tensor, got list"):
        module([[1.0] * 4], *args)
    if args:
        with pytest.raises(TypeError, match=rf"{name}: residual must be a Tensor, got NoneType"):
            module(torch.randn(2, 4), None)


def test_linear_cross_entropy_from_linear_takes_loss_options_only():
    linear = torch.nn.Linear(4, 6)
    with pytest.raises(TypeError, match=r"from_linear: device is linear's .* pass only loss options"):
        fusedops.nn.LinearCrossEntropyLoss.from_linear(linear, device="cpu")
    module = fusedops.nn.LinearCrossEntropyLoss.from_linear(linear, reduction="sum")
    assert module.weight is linear.weight and module.reduction == "sum"


@pytest.mark.parametrize("ours", [fusedops.nn.RMSNorm, fusedops.nn.LayerNorm])
def test_empty_normalized_shape(ours):
    """As torch: a module of normalized_shape () constructs, and refuses every input."""
    norm = ours(())
    for x in (torch.randn(2, 8), torch.randn(())):
        with pytest.raises(ValueError, match=r"normalized_shape must have at least one dimension, got \[\]"):
            norm(x)


@pytest.mark.parametrize("ours, args", [
    (fusedops.nn.RMSNorm, (16,)), (fusedops.nn.LayerNorm, (16,)), (fusedops.nn.AddRMSNorm, (16,)),
    (fusedops.nn.SwiGLUMLP, (16, 40)), (fusedops.nn.LinearCrossEntropyLoss, (16, 50)),
])
def test_modules_run_on_meta(ours, args):
    """Modules built on the meta device (how a model's shapes are taken before its weights are
    loaded) run there, 16-bit ones included, as torch's."""
    module = ours(*args, device="meta", dtype=torch.bfloat16)
    x = torch.empty(2, 3, 16, device="meta", dtype=torch.bfloat16)
    if isinstance(module, fusedops.nn.LinearCrossEntropyLoss):
        out = module(x, torch.empty(2, 3, dtype=torch.long, device="meta"))
        assert out.shape == () and out.dtype == torch.bfloat16
    elif isinstance(module, fusedops.nn.AddRMSNorm):
        out, residual = module(x, torch.empty_like(x))
        assert out.shape == residual.shape == x.shape
    else:
        assert module(x).shape == x.shape and module(x).device.type == "meta"


@pytest.mark.parametrize("ours, args, options, inputs", [
    (fusedops.nn.RMSNorm, ((4, 8),), {}, lambda: (torch.randn(3, 4, 8),)),
    (fusedops.nn.RMSNorm, (32,), {"eps": None, "offset": 1.0}, lambda: (torch.randn(3, 32),)),
    (fusedops.nn.LayerNorm, (32,), {}, lambda: (torch.randn(3, 32),)),
    (fusedops.nn.AddRMSNorm, (32,), {}, lambda: (torch.randn(3, 32), torch.randn(3, 32))),
    (fusedops.nn.AddRMSNorm, (32,), {"eps": None, "inplace": True}, lambda: (torch.randn(3, 32), torch.randn(3, 32))),
    (fusedops.nn.SwiGLUMLP, (32, 48), {}, lambda: (torch.randn(3, 32),)),
    (fusedops.nn.CrossEntropyLoss, (), {"label_smoothing": 0.1}, lambda: (torch.randn(6, 10), torch.randint(0, 10, (6,)))),
    (fusedops.nn.LinearCrossEntropyLoss, (32, 10), {}, lambda: (torch.randn(6, 32), torch.randint(0, 10, (6,)))),
    (fusedops.nn.RotaryEmbedding, (16,), {}, lambda: (torch.randn(2, 5, 4, 16, dtype=torch.bfloat16),
                                                      torch.randint(0, 2048, (2, 5)))),
], ids=lambda v: getattr(v, "__name__", None) if isinstance(v, type) else "")
def test_modules_trace_with_torch_fx(ours, args, options, inputs):
    """torch.fx.symbolic_trace (what FX quantization and Hugging Face's fx tracer run) records
    each module as a call of its forward's function, which makes the module's checks when the
    graph runs; the graph gives the module's result, bit for bit (the in-place form's update of
    residual too)."""
    module = ours(*args, **options)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()  # (not the initial ones)
    graph_module = torch.fx.symbolic_trace(module)
    assert any(n.op == "call_function" for n in graph_module.graph.nodes)
    torch.manual_seed(0)
    given = inputs()
    into_graph, into_module = [t.clone() for t in given], [t.clone() for t in given]
    got, expected = graph_module(*into_graph), module(*into_module)
    assert all(torch.equal(a, b) for a, b in zip(into_graph, into_module))
    for g, e in zip(got if isinstance(got, tuple) else (got,), expected if isinstance(expected, tuple) else (expected,)):
        assert torch.equal(g, e)
    if isinstance(module, (fusedops.nn.RMSNorm, fusedops.nn.LayerNorm)):
        with pytest.raises(ValueError, match=r"input's trailing shape \[.*\] does not match normalized_shape"):
            graph_module(torch.randn(3, 5))


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_rms_norm_default_eps(dtype, device):
    # eps=None is the computation type's epsilon (float32's for 16-bit input), as in torch: with
    # rows this small the 16-bit types' own epsilon (bf16: 7.8e-3) would change the result by
    # far more than rounding.
    shape = (4, 64)
    x = torch.randn(shape, device=device, dtype=torch.float64).mul_(1e-2).to(dtype)
    mine, ref = fusedops.nn.RMSNorm(64, device=device, dtype=dtype), torch.nn.RMSNorm(64, device=device, dtype=dtype)
    expected = torch.nn.functional.rms_norm(x.double(), (64,), None, torch.finfo(
        torch.float64 if dtype == torch.float64 else torch.float32).eps).to(dtype)
    torch.testing.assert_close(mine(x), expected)
    torch.testing.assert_close(mine(x), ref(x))
    # AddRMSNorm takes eps=None the same way (of input + residual, here input + 0).
    add = fusedops.nn.AddRMSNorm(64, eps=None, device=device, dtype=dtype)
    torch.testing.assert_close(add(x, torch.zeros_like(x))[0], expected)


class _Block(torch.nn.Module):
    """A small pre-norm decoder block made of fusedops modules and ops (attention left out)."""

    def __init__(self, hidden=64, heads=4, device=None):
        super().__init__()
        self.heads = heads
        self.norm = fusedops.nn.RMSNorm(hidden, device=device)
        self.qk = torch.nn.Linear(hidden, 2 * hidden, bias=False, device=device)
        self.rotary = fusedops.nn.RotaryEmbedding(hidden // heads, device=device)
        self.mlp_norm = fusedops.nn.LayerNorm(hidden, device=device)
        self.mlp = fusedops.nn.SwiGLUMLP(hidden, 2 * hidden, device=device)

    def forward(self, x, positions):
        B, S, H = x.shape
        q, k = self.qk(self.norm(x)).view(B, S, 2, self.heads, H // self.heads).unbind(2)
        cos, sin = self.rotary(q, positions)
        q, k = fusedops.rope(q, k, cos, sin, layout="bshd")
        h, residual = fusedops.add_rms_norm((q + k).reshape(B, S, H), x)
        return self.mlp(self.mlp_norm(h)) + residual


@pytest.mark.parametrize("device", device_params())
def test_block_through_aot_inductor(device, tmp_path):
    """Deployment without Python model code: torch.export with a free batch and sequence, then
    AOTInductor's compiled package, which calls the fusedops ops through the dispatcher (the
    process must have imported fusedops), gives eager's outputs at other shapes."""
    torch.manual_seed(0)
    block = _Block(device=device).eval()

    def inputs(B, S):
        return torch.randn(B, S, 64, device=device), torch.arange(S, device=device).expand(B, S)

    dims = {"x": {0: torch.export.Dim("B", min=2), 1: torch.export.Dim("S", min=2)}}
    dims["positions"] = {0: dims["x"][0], 1: dims["x"][1]}
    with torch.no_grad():
        program = torch.export.export(block, inputs(2, 5), dynamic_shapes=dims)
        called = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
        for op in ("rms_norm", "rope", "add_rms_norm", "layer_norm", "swiglu"):
            assert f"fusedops.{op}.default" in called, called
        package = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "block.pt2"))
        compiled = torch._inductor.aoti_load_package(package)
        for B, S in [(3, 7), (2, 16)]:
            x, positions = inputs(B, S)
            torch.testing.assert_close(compiled(x, positions), block(x, positions), rtol=1e-5, atol=1e-5)
