"""cross_entropy samples for the generic suites. A sample holds the op's arguments: (logits,
target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap, compute_grad), the
class dimension last; compute_grad is True so that opcheck and the Triton comparison see the
gradient the forward writes (the public function decides it by itself). The in-place form
cross_entropy_ runs through opcheck as a variant; tests/test_cross_entropy.py covers the
backward scaling, retain_graph, the in-place mode, bad targets, the nn module and torch.compile
by name."""

import torch
import torch.nn.functional as F

import fusedops
from fusedops.ops import cross_entropy as _op

from . import ErrorSample, OpTestInfo, PublicVariant, Sample, Tolerance


def reference(logits, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0,
              softcap=None, compute_grad=False):
    """torch.nn.functional.cross_entropy on the (softcapped) logits as (rows, V), plus the z-term
    written from its definition (z * lse^2 per row not ignored; "mean" divides by their count)."""
    x = logits if softcap is None else softcap * torch.tanh(logits / softcap)
    V = x.shape[-1]
    x2 = x.reshape(-1, V)
    t = target.reshape(-1).long()  # (the generic suites pass every tensor as float64)
    w = None if weight is None else weight.to(x2.dtype)
    ce = F.cross_entropy(x2, t, weight=w, ignore_index=ignore_index, reduction=reduction,
                         label_smoothing=label_smoothing)
    kept = t != ignore_index
    zrow = torch.where(kept, z_loss * torch.logsumexp(x2, dim=-1) ** 2, torch.zeros((), dtype=x2.dtype))
    if reduction == "none":
        return (ce + zrow).reshape(target.shape)
    if reduction == "sum":
        return ce + zrow.sum()
    return ce + zrow.sum() / kept.sum()


def public(logits, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0,
           softcap=None, compute_grad=False):
    """fusedops.cross_entropy with the op's argument order (compute_grad is the function's own call)."""
    return fusedops.cross_entropy(logits, target, weight=weight, ignore_index=ignore_index, reduction=reduction,
                                  label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)


def public_inplace_grad(logits, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                        z_loss=0.0, softcap=None, compute_grad=False):
    """`public` with inplace_grad=True, on a copy of the logits (which receives their gradient:
    a leaf's own memory is refused)."""
    return fusedops.cross_entropy(logits.clone(), target, weight=weight, ignore_index=ignore_index,
                                  reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss,
                                  softcap=softcap, inplace_grad=True)


def torch_equivalent(logits, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                     z_loss=0.0, softcap=None, compute_grad=False):
    return reference(logits, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap)


def _logits(shape, dtype, device, rg, spread=3.0):
    # Sharper than randn, so that softmax has several large probabilities per row (gradient
    # errors show in more than the target's element).
    return (spread * torch.randn(shape, device=device)).to(dtype).requires_grad_(rg)


def _targets(shape, V, device, ignore_every=0, ignore_index=-100, dtype=torch.int64):
    t = torch.randint(0, V, shape, device=device)
    if ignore_every:
        flat = t.view(-1)
        flat[::ignore_every] = ignore_index
    return t.to(dtype)


def _weight(V, dtype, device):
    return (0.25 + 1.5 * torch.rand(V, device=device)).to(dtype)


def weight_dtypes(dtype):
    return (dtype, torch.float32) if dtype in (torch.bfloat16, torch.float16) else (dtype,)


def samples(device, dtype, requires_grad=False, edge=True):
    rg = requires_grad
    wdt = weight_dtypes(dtype)[-1]
    # (shape, reduction, weight, ignore_every, label_smoothing, z_loss, softcap, what)
    for shape, red, weighted, ignore, ls, z, cap, what in [
        ((8, 64), "sum", False, 0, 0.0, 0.0, None, "plain"),
        ((5, 300), "mean", False, 3, 0.0, 0.0, None, "ignore_index"),
        ((2, 3, 100), "none", True, 4, 0.1, 0.0, None, "(B, T, V) weight+ignore+smoothing"),
        ((6, 257), "mean", True, 2, 0.2, 0.0, None, "weight+ignore+smoothing"),
        ((4, 250), "sum", True, 3, 0.3, 0.0, None, "weight+ignore+smoothing sum"),
        ((6, 256), "mean", False, 3, 0.1, 0.01, None, "ignore+smoothing+z_loss (no weight)"),
        ((4, 64), "sum", False, 0, 0.0, 0.1, None, "z_loss"),
        ((5, 96), "mean", True, 2, 0.0, 0.05, None, "z_loss weight mean"),
        ((4, 128), "none", False, 3, 0.0, 0.0, 5.0, "softcap"),
        ((5, 136), "mean", True, 2, 0.0, 0.01, 6.0, "softcap weight z_loss"),
        ((3, 72), "sum", False, 0, 0.1, 0.0, 4.0, "softcap+smoothing (no weight)"),
        ((7, 96), "mean", True, 3, 0.1, 0.05, 3.0, "every option"),
        ((3, 40), "sum", False, 0, 1.0, 0.0, None, "label_smoothing 1"),
        ((5, 1), "sum", False, 0, 0.1, 0.0, None, "V=1"),
        ((33,), "sum", False, 0, 0.0, 0.0, None, "unbatched (V,)"),
    ]:
        V = shape[-1]
        x = _logits(shape, dtype, device, rg, spread=10.0 if cap else 3.0)
        t = _targets(shape[:-1], V, device, ignore)
        w = _weight(V, wdt, device) if weighted else None
        yield Sample((x, t, w, -100, red, ls, z, cap, True), f"{what} {list(shape)} {red}")
    # A class index as ignore_index, int32 targets, and shifted-label rows logits[:, :-1].
    x = _logits((6, 50), dtype, device, rg)
    yield Sample((x, _targets((6,), 50, device, 2, ignore_index=7), None, 7, "mean", 0.0, 0.0, None, True),
                 "ignore_index=7 (a class)")
    x = _logits((4, 50), dtype, device, rg)
    yield Sample((x, _targets((4,), 50, device, 3, dtype=torch.int32), _weight(50, wdt, device), -100, "mean", 0.1,
                  0.0, None, True), "int32 targets")
    base = _logits((2, 5, 70), dtype, device, rg)
    yield Sample((base[:, :-1], _targets((2, 4), 70, device, 3), None, -100, "sum", 0.0, 0.01, None, True),
                 "shifted rows logits[:, :-1] of (2, 5, 70)")
    if not edge:
        return
    for shape, red in [((0, 16), "sum"), ((0, 16), "none"), ((2, 0, 8), "none")]:
        x = _logits(shape, dtype, device, rg)
        yield Sample((x, _targets(shape[:-1], shape[-1], device), None, -100, red, 0.0, 0.0, None, True),
                     f"empty {list(shape)} {red}")
    # Rows of very different scales (a row's statistics must be its own), with -inf logits.
    x = 3.0 * torch.randn(4, 40, device=device) * torch.logspace(-2, 2, 4, device=device)[:, None]
    x[1, ::3] = float("-inf")
    t = torch.tensor([0, 1, 2, 3], device=device)
    yield Sample((x.to(dtype).requires_grad_(rg), t, None, -100, "none", 0.0, 0.0, None, True), "scales and -inf")


def sample_for_shape(device, dtype, shape, requires_grad=False):
    V = shape[-1]
    x = _logits(shape, dtype, device, requires_grad)
    t = _targets(tuple(shape[:-1]), V, device, 3)
    return Sample((x, t, _weight(V, weight_dtypes(dtype)[-1], device), -100, "mean", 0.1, 0.01, None, True),
                  f"logits{list(shape)}")


def error_samples(device):
    other = "meta" if device != "meta" else "cpu"
    x = torch.randn(4, 10, device=device)
    t = torch.randint(0, 10, (4,), device=device)

    def bad(args, match, desc, op=None, on_values=False):
        return ErrorSample(Sample(args, desc), ValueError, match, op=op, on_values=on_values)

    opts = (-100, "mean", 0.0, 0.0, None)
    yield bad((x, t.float(), None) + opts,
              r"cross_entropy: target must hold class indices \(int64 or int32\); probability \(float32\) targets "
              r"are not supported", "probability targets")
    yield bad((x, t.to(torch.uint8), None) + opts, r"cross_entropy: target dtype must be int64 or int32, got uint8",
              "uint8 target")
    yield bad((x, t[:3], None) + opts,
              r"cross_entropy: target shape \[3\] does not match logits shape \[4, 10\] without its last \(class\) "
              r"dimension: expected \[4\]", "target shape")
    yield bad((x.view(2, 2, 10), t, None) + opts,
              r"cross_entropy: target shape \[4\] does not match logits shape \[2, 2, 10\]", "target rank")
    yield bad((x, torch.randint(0, 10, (4,), device=other), None) + opts,
              r"cross_entropy: target is on (meta|cpu) but logits is on", "target device")
    yield bad((x.int(), t, None) + opts,
              r"cross_entropy: logits dtype must be float32, bfloat16, float16 or float64, got int32", "int logits")
    yield bad((torch.tensor(1.0, device=device), t, None) + opts,
              r"cross_entropy: logits must have at least 1 dimension \(\.\.\., classes\), got a 0-dimensional tensor",
              "0-d logits")
    yield bad((torch.randn(4, 0, device=device), t, None) + opts,
              r"cross_entropy: logits must have at least one class \(logits.size\(-1\) is 0\)", "no classes")
    yield bad((x, t, torch.ones(9, device=device)) + opts,
              r"cross_entropy: weight must be a 1-D tensor of logits.size\(-1\) = 10 class weights, got shape \[9\]",
              "weight shape")
    yield bad((x, t, torch.ones(10, device=device, dtype=torch.float16)) + opts,
              r"cross_entropy: weight dtype float16 does not go with logits dtype float32: use logits' dtype or "
              r"float32", "weight dtype")
    yield bad((x, t, torch.ones(10, device=other)) + opts,
              r"cross_entropy: weight is on (meta|cpu) but logits is on", "weight device")
    yield bad((x, t, None, -100, "avg", 0.0, 0.0, None),
              r"cross_entropy: reduction must be 'mean', 'sum' or 'none', got 'avg'", "reduction")
    yield bad((x, t, None, -100, "mean", -0.1, 0.0, None),
              r"cross_entropy: label_smoothing must be in \[0, 1\], got -0\.1", "negative label_smoothing")
    yield bad((x, t, None, -100, "mean", 1.5, 0.0, None),
              r"cross_entropy: label_smoothing must be in \[0, 1\], got 1\.5", "label_smoothing > 1")
    yield bad((x, t, None, -100, "mean", 0.0, -1.0, None),
              r"cross_entropy: z_loss must be a finite number >= 0, got -1", "negative z_loss")
    yield bad((x, t, None, -100, "mean", 0.0, 0.0, 0.0),
              r"cross_entropy: softcap must be a finite number > 0 \(or None\), got 0", "softcap 0")
    yield bad((x, t, None, -100, "mean", 0.0, 0.0, -2.0),
              r"cross_entropy: softcap must be a finite number > 0 \(or None\), got -2", "negative softcap")
    yield bad((x, t, None, -100, "mean", 0.0, 0.0, 1e39),
              r"cross_entropy: softcap must be at most float32's largest value, 3.40282e\+38, got 1e\+39",
              "softcap past float32")
    yield bad((x, t, None, -100, "mean", 0.0, 4e38, None),
              r"cross_entropy: z_loss must be at most float32's largest value, 3.40282e\+38, got 4e\+38",
              "z_loss past float32")
    if device == "cpu":  # values are seen by the CPU kernel only (GPU: tests/test_cross_entropy.py)
        yield bad((x, torch.tensor([1, 2, 10, 3], device=device), None) + opts,
                  r"cross_entropy: target\[2\] = 10 is outside \[0, 10\) and is not ignore_index \(-100\)",
                  "target too large", on_values=True)
        yield bad((x.view(2, 2, 10), torch.tensor([[1, 2], [-1, 3]], device=device, dtype=torch.int32), None) + opts,
                  r"cross_entropy: target\[1, 0\] = -1 is outside \[0, 10\) and is not ignore_index \(-100\)",
                  "negative target", on_values=True)
    # The in-place form checks under its own name and refuses what it cannot write into.
    yield bad((x, t[:3], None) + opts, r"cross_entropy_: target shape \[3\] does not match", "in-place target shape",
              op=_op.forward_)
    yield bad((torch.randn(10, 4, device=device).t(), t, None) + opts,
              r"cross_entropy_: logits must have a contiguous last dimension \(stride 1\) to receive the gradient in "
              r"place, got stride 4", "in-place strided classes", op=_op.forward_)
    yield bad((torch.randn(1, 10, device=device).expand(4, 10), t, None) + opts,
              r"cross_entropy_: logits has elements that share memory \(an expanded tensor\?\)", "in-place expanded",
              op=_op.forward_)
    # The backward op checks grad_output against the gradient.
    g = torch.randn(4, 10, device=device)
    for args, match, desc in [
        ((torch.randn(3, device=device), g),
         r"cross_entropy_backward: grad_output must be a 0-dimensional tensor \(reduction 'mean' or 'sum'\) or have "
         r"shape \[4\] \(reduction 'none'\), got shape \[3\]", "bwd grad_output shape"),
        ((torch.tensor(1, device=device), g), r"cross_entropy_backward: grad_output dtype must be floating point, got "
         r"int64", "bwd grad_output dtype"),
        ((torch.tensor(1.0, device=device), g.long()),
         r"cross_entropy_backward: grad_logits must be a floating-point tensor of at least 1 dimension, got int64",
         "bwd grad dtype"),
    ]:
        yield ErrorSample(Sample(args, desc), ValueError, match, op=_op.backward)


def strided_samples(device, dtype):
    """Logits as slices and permutations of larger buffers (leading dimensions; sometimes a
    strided class dimension, which is copied), with random options."""
    from hypothesis import strategies as st

    @st.composite
    def strided(draw):
        ndim = draw(st.integers(1, 3))
        lead = draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim))
        V = draw(st.sampled_from([1, 3, 8, 33, 130]))
        steps = [draw(st.integers(1, 2)) for _ in range(ndim)] + [draw(st.sampled_from([1, 1, 1, 2]))]
        order = draw(st.permutations(list(range(ndim))))
        logical = lead + [V]
        storage = [logical[i] * steps[i] for i in order] + [V * steps[-1] + draw(st.sampled_from([0, 3]))]
        base = _logits(storage, dtype, device, False)
        inverse = [order.index(i) for i in range(ndim)] + [ndim]
        x = base.permute(*inverse)
        x = x[tuple(slice(None, logical[i] * steps[i], steps[i]) for i in range(ndim + 1))]
        assert list(x.shape) == logical
        red = draw(st.sampled_from(["mean", "sum", "none"]))
        ignore = draw(st.sampled_from([0, 2]))
        t = _targets(tuple(lead), V, device, ignore)
        w = _weight(V, dtype, device) if draw(st.booleans()) else None
        ls = draw(st.sampled_from([0.0, 0.15]))
        z = draw(st.sampled_from([0.0, 0.02]))
        if red == "mean" and ignore and t.numel() <= 2:
            ignore = 0
            t = _targets(tuple(lead), V, device, 0)
        return Sample((x, t, w, -100, red, ls, z, None, True),
                      f"logits{logical} stride={list(x.stride())} {red} weight={w is not None} ls={ls} z={z}")

    return strided()


def check_autocast(device):
    """Nothing is cast: the logits run in their own dtype; the loss is float32 under autocast (as
    torch's, whose autocast runs cross_entropy in float32) and equals the op's float32 loss."""
    amp = torch.bfloat16 if device == "cpu" else torch.float16
    for xdt in (torch.float32, torch.bfloat16):
        x = _logits((4, 6, 64), xdt, device, False)
        t = _targets((4, 6), 64, device, 3)
        with torch.autocast(device_type=device, dtype=amp):
            loss = fusedops.cross_entropy(x, t, label_smoothing=0.1)
        assert loss.dtype == torch.float32, (xdt, loss.dtype)
        expected = _op.forward(x, t, None, -100, "mean", 0.1, 0.0, None, False)[0]
        torch.testing.assert_close(loss, expected, atol=0, rtol=0)
        outside = fusedops.cross_entropy(x, t, label_smoothing=0.1)
        assert outside.dtype == xdt
    # Under autocast the logits a matmul makes are bfloat16/float16: gradients flow back in that dtype.
    a = torch.randn(8, 32, device=device, requires_grad=True)
    b = torch.randn(32, 64, device=device)
    t = _targets((8,), 64, device)
    with torch.autocast(device_type=device, dtype=amp):
        logits = a @ b
        loss = fusedops.cross_entropy(logits, t)
    assert logits.dtype == amp and loss.dtype == torch.float32
    loss.backward()
    a64 = a.detach().double().requires_grad_()
    ref = F.cross_entropy(a64 @ b.double(), t)
    ref.backward()
    assert a.grad is not None and a.grad.dtype == torch.float32
    # The logits (of order 10) are rounded to 16 bits, 2^-9 of them in bfloat16, which moves
    # the probabilities by a few percent: over 200 draws (CPU, bfloat16) the loss was at most
    # 0.25% off float64's and the gradient 3.2% of its largest element.
    torch.testing.assert_close(loss.double(), ref, atol=0, rtol=1e-2)
    scale = a64.grad.abs().max().item()
    torch.testing.assert_close(a.grad.double(), a64.grad, atol=0.1 * scale, rtol=0)


def backward_args(sample, outputs, grad_output):
    return (grad_output, outputs[2])


def inplace_args(sample):
    """The in-place form's arguments for `sample`: a contiguous copy of the logits, no compute_grad."""
    args = [a.detach() if isinstance(a, torch.Tensor) else a for a in sample.args[:8]]
    args[0] = args[0].contiguous().clone()
    return tuple(args)


def check_large_input(device):
    """64-bit offsets: logits of more than 2^31 elements; the last rows' losses and gradients are right."""
    V = 32000
    rows = 2**31 // V + 8
    try:
        x = torch.randn(rows, V, dtype=torch.bfloat16, device=device)
    except torch.OutOfMemoryError:
        import pytest

        pytest.skip("not enough GPU memory for a 2^31-element tensor")
    assert x.numel() > 2**31
    t = torch.randint(0, V, (rows,), device=device)
    loss = fusedops.cross_entropy(x, t, reduction="none")
    for part in (slice(rows - 16, rows), slice(0, 16)):
        expected = F.cross_entropy(x[part].double(), t[part], reduction="none")
        torch.testing.assert_close(loss[part].double(), expected, atol=2e-2, rtol=2e-2)
    del loss
    x.requires_grad_()
    loss = fusedops.cross_entropy(x, t, reduction="sum")
    (g,) = torch.autograd.grad(loss, x)
    part = slice(rows - 4, rows)
    xp = x[part].detach().double().requires_grad_()
    (eg,) = torch.autograd.grad(F.cross_entropy(xp, t[part], reduction="sum"), xp)
    torch.testing.assert_close(g[part].double(), eg, atol=2e-2, rtol=2e-2)


# The loss rounds once (float32 math against fp64); the sums of exp add about one ulp per
# term. Gradients round once to the logits' dtype (twice when scaled by a grad_output other than
# 1: the unscaled gradient is stored in that dtype), compared relative to their largest element.
TOL = {
    torch.float32: Tolerance(atol=2e-5, rtol=2e-5),
    torch.bfloat16: Tolerance(atol=1e-2, rtol=1.6e-2),
    torch.float16: Tolerance(atol=2e-3, rtol=2e-3),
    torch.float64: Tolerance(atol=1e-10, rtol=1e-10),
}
GRAD_TOL = {
    torch.float32: Tolerance(atol=1e-5, rtol=1e-5),
    torch.bfloat16: Tolerance(atol=8e-3, rtol=1.6e-2),
    torch.float16: Tolerance(atol=1e-3, rtol=2e-3),
    torch.float64: Tolerance(atol=1e-10, rtol=1e-10),
}

INFO = OpTestInfo(
    name="cross_entropy",
    op=_op.forward,
    public=public,
    reference=reference,
    samples=samples,
    sample_for_shape=sample_for_shape,
    error_samples=error_samples,
    strided_samples=strided_samples,
    backward_ops=(_op.backward, _op.backward_),  # the backward's out-of-place and in-place scaling
    backward_args=backward_args,
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
    tol=TOL,
    grad_tol=GRAD_TOL,
    grad_argnums=(0,),
    autocast_check=check_autocast,
    torch_equivalent=torch_equivalent,
    output_dtype_argnums=(0,),
    variant_ops=((_op.forward_, inplace_args),),
    public_variants=(PublicVariant("cross_entropy(inplace_grad=True)", public_inplace_grad, differentiable=True),),
    double_backward=False,
    large_input_check=check_large_input,
)
