"""linear_cross_entropy samples for the generic suites. A sample holds the op's arguments:
(hidden, weight, target, bias, class_weight, ignore_index, reduction, label_smoothing, z_loss,
softcap, chunk_rows, low_memory, chunk_classes, compute_grad); compute_grad is True so that
opcheck and the Triton comparison see the gradients the forward writes (the public function
decides it by itself). Small chunk_rows values put chunk boundaries inside every sample (N a
multiple of the chunk, not a multiple, smaller than one chunk); every sample also comes in the
low-memory mode, with chunks of about a third of the classes (boundaries inside the
vocabulary). The reference materialises the logits in float64 and applies cross_entropy's
reference (torch.nn.functional.cross_entropy plus the z-term).
tests/test_linear_cross_entropy.py covers the rest by name."""

import torch

import fusedops
from fusedops.ops import linear_cross_entropy as _op

from . import ErrorSample, OpTestInfo, Sample, Tolerance
from .cross_entropy import reference as _ce_reference


def logits_of(hidden, weight, bias=None):
    x = hidden @ weight.to(hidden.dtype).t()
    return x if bias is None else x + bias.to(hidden.dtype)


def reference(hidden, weight, target, bias=None, class_weight=None, ignore_index=-100, reduction="mean",
              label_smoothing=0.0, z_loss=0.0, softcap=None, chunk_rows=None, low_memory=False,
              chunk_classes=None, compute_grad=False):
    """cross_entropy's reference on the materialised logits hidden @ weight.T + bias."""
    return _ce_reference(logits_of(hidden, weight, bias), target, class_weight, ignore_index, reduction,
                         label_smoothing, z_loss, softcap)


def public(hidden, weight, target, bias=None, class_weight=None, ignore_index=-100, reduction="mean",
           label_smoothing=0.0, z_loss=0.0, softcap=None, chunk_rows=None, low_memory=False,
           chunk_classes=None, compute_grad=False):
    """fusedops.linear_cross_entropy with the op's argument order."""
    return fusedops.linear_cross_entropy(hidden, weight, target, bias, ignore_index=ignore_index,
                                         reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss,
                                         softcap=softcap, class_weight=class_weight, chunk_rows=chunk_rows,
                                         low_memory=low_memory, chunk_classes=chunk_classes)


def torch_equivalent(hidden, weight, target, bias=None, class_weight=None, ignore_index=-100, reduction="mean",
                     label_smoothing=0.0, z_loss=0.0, softcap=None, chunk_rows=None, low_memory=False,
                     chunk_classes=None, compute_grad=False):
    return reference(hidden, weight, target, bias, class_weight, ignore_index, reduction, label_smoothing, z_loss,
                     softcap)


def _hidden(shape, dtype, device, rg):
    return torch.randn(shape, device=device).to(dtype).requires_grad_(rg)


def _weight(V, H, dtype, device, rg, spread=1.0):
    # Logits of a few units: softmax with several large probabilities per row.
    return (spread * torch.randn(V, H, device=device) / H**0.5 * 2.5).to(dtype).requires_grad_(rg)


def _bias(V, dtype, device, rg):
    return (0.5 * torch.randn(V, device=device)).to(dtype).requires_grad_(rg)


def _targets(shape, V, device, ignore_every=0, ignore_index=-100, dtype=torch.int64):
    t = torch.randint(0, V, shape, device=device)
    if ignore_every:
        t.view(-1)[::ignore_every] = ignore_index
    return t.to(dtype)


def _class_weight(V, device):
    return 0.25 + 1.5 * torch.rand(V, device=device)


def _args(h, w, t, b, cw, ignore_index, reduction, ls, z, cap, chunk_rows):
    """The op's arguments in the default mode (chunks of rows)."""
    return (h, w, t, b, cw, ignore_index, reduction, ls, z, cap, chunk_rows, False, None, True)


def _low_memory(sample):
    """The sample in the low-memory mode, on fresh copies of its tensors: chunks of about a third
    of the classes (None, automatic, for a vocabulary under 20)."""
    a = [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
         for x in sample.args]
    V = a[1].shape[0]
    classes = V // 3 + 1 if V >= 20 else None
    a[10:13] = [None, True, classes]
    return Sample(tuple(a), f"{sample.desc} low_memory chunk_classes={classes}")


def samples(device, dtype, requires_grad=False, edge=True):
    for sample in _default_mode_samples(device, dtype, requires_grad, edge):
        yield sample
        yield _low_memory(sample)


def _default_mode_samples(device, dtype, requires_grad, edge):
    rg = requires_grad
    # (hidden shape, V, reduction, bias, class weight, ignore_every, label_smoothing, z_loss, softcap, chunk_rows, what)
    for shape, V, red, biased, weighted, ignore, ls, z, cap, chunk, what in [
        ((6, 16), 40, "sum", False, False, 0, 0.0, 0.0, None, None, "plain"),
        ((2, 5, 16), 33, "mean", True, False, 3, 0.0, 0.0, None, 4, "(B, T, H) bias ignore_index"),
        ((7, 8), 50, "mean", True, True, 3, 0.1, 0.05, 4.0, 3, "every option"),
        ((5, 8), 30, "none", True, True, 2, 0.2, 0.0, None, 2, "none weight smoothing"),
        ((9, 8), 20, "mean", False, True, 4, 0.0, 0.0, None, 4, "weighted mean"),
        ((8, 8), 24, "mean", False, False, 3, 0.0, 0.1, None, 4, "z_loss mean"),
        ((4, 8), 64, "sum", False, False, 0, 0.0, 0.1, None, 1, "z_loss sum, one row a chunk"),
        ((6, 8), 36, "none", False, False, 3, 0.0, 0.02, 3.0, 4, "none softcap z_loss"),
        ((3, 8), 17, "mean", True, False, 0, 0.0, 0.0, None, 8, "fewer rows than a chunk"),
        ((8,), 12, "sum", True, False, 0, 0.1, 0.0, None, None, "unbatched (H,)"),
    ]:
        H = shape[-1]
        h = _hidden(shape, dtype, device, rg)
        w = _weight(V, H, dtype, device, rg, spread=3.0 if cap else 1.0)
        b = _bias(V, dtype, device, rg) if biased else None
        t = _targets(shape[:-1], V, device, ignore)
        cw = _class_weight(V, device) if weighted else None
        yield Sample(_args(h, w, t, b, cw, -100, red, ls, z, cap, chunk), f"{what} {list(shape)} V={V} {red}")
    h = _hidden((6, 8), dtype, device, rg)
    t = _targets((6,), 20, device, 2, ignore_index=7, dtype=torch.int32)
    yield Sample(_args(h, _weight(20, 8, dtype, device, rg), t, None, None, 7, "mean", 0.0, 0.0, None, 4),
                 "ignore_index=7 (a class), int32 targets")
    if dtype in (torch.bfloat16, torch.float16):
        # Mixed precision as training has it: float32 parameters with narrow activations.
        h = _hidden((5, 16), dtype, device, rg)
        yield Sample(_args(h, _weight(30, 16, torch.float32, device, rg), _targets((5,), 30, device, 3),
                           _bias(30, torch.float32, device, rg), None, -100, "mean", 0.0, 0.0, None, 2),
                     "float32 weight and bias")
    if not edge:
        return
    for shape, red in [((0, 8), "sum"), ((0, 8), "none"), ((2, 0, 8), "none")]:
        h = _hidden(shape, dtype, device, rg)
        w, b = _weight(10, 8, dtype, device, rg), _bias(10, dtype, device, rg)
        yield Sample(_args(h, w, _targets(shape[:-1], 10, device), b, None, -100, red, 0.0, 0.0, None, 3),
                     f"empty {list(shape)} {red}")
    # Rows of width 0: every logit is the bias.
    h, w = _hidden((4, 0), dtype, device, rg), _weight(10, 0, dtype, device, rg)
    yield Sample(_args(h, w, _targets((4,), 10, device), _bias(10, dtype, device, rg), None, -100, "mean", 0.0, 0.0,
                       None, 3), "hidden width 0")
    # Every row ignored but one, in a chunk of its own.
    t = _targets((5,), 16, device)
    t[:4] = -100
    h, w = _hidden((5, 8), dtype, device, rg), _weight(16, 8, dtype, device, rg)
    yield Sample(_args(h, w, t, None, None, -100, "mean", 0.0, 0.0, None, 2), "one row not ignored")


def sample_for_shape(device, dtype, shape, requires_grad=False):
    """hidden of `shape` ((rows, H) or more), V = 96, every tensor argument given; chunks of 3
    rows for the small shapes of the suites (chunk boundaries inside), automatic for large ones."""
    V = 96
    H = shape[-1]
    h = _hidden(shape, dtype, device, requires_grad)
    t = _targets(tuple(shape[:-1]), V, device, 3)
    chunk = 3 if h.numel() // max(H, 1) <= 64 else None
    w, b = _weight(V, H, dtype, device, requires_grad), _bias(V, dtype, device, requires_grad)
    return Sample(_args(h, w, t, b, _class_weight(V, device), -100, "mean", 0.1, 0.01, None, chunk),
                  f"hidden{list(shape)} V={V}")


def error_samples(device):
    other = "meta" if device != "meta" else "cpu"
    h = torch.randn(4, 8, device=device)
    w = torch.randn(10, 8, device=device)
    t = torch.randint(0, 10, (4,), device=device)
    opts = (-100, "mean", 0.0, 0.0, None, None)

    def bad(args, match, desc, op=None):
        return ErrorSample(Sample(args, desc), ValueError, match, op=op)

    yield bad((torch.tensor(1.0, device=device), w, t, None, None) + opts,
              r"linear_cross_entropy: hidden must have at least 1 dimension \(\.\.\., hidden_size\), got a "
              r"0-dimensional tensor", "0-d hidden")
    yield bad((h.int(), w, t, None, None) + opts,
              r"linear_cross_entropy: hidden dtype must be float32, bfloat16, float16 or float64, got int32",
              "int hidden")
    yield bad((h, torch.randn(10, 7, device=device), t, None, None) + opts,
              r"linear_cross_entropy: weight must be a 2-D \(vocab_size, hidden_size\) tensor with hidden_size = "
              r"hidden.size\(-1\) = 8, got shape \[10, 7\]", "weight hidden_size")
    yield bad((h, torch.randn(80, device=device), t, None, None) + opts,
              r"linear_cross_entropy: weight must be a 2-D .* got shape \[80\]", "1-D weight")
    yield bad((h, w.half(), t, None, None) + opts,
              r"linear_cross_entropy: weight dtype float16 does not go with hidden dtype float32: use hidden's "
              r"dtype$", "weight dtype")
    yield bad((h.double(), w, t, None, None) + opts,
              r"linear_cross_entropy: weight dtype float32 does not go with hidden dtype float64: use hidden's "
              r"dtype$", "fp32 weight for fp64 hidden")
    yield bad((h.bfloat16(), w.double(), t, None, None) + opts,
              r"linear_cross_entropy: weight dtype float64 does not go with hidden dtype bfloat16: use hidden's "
              r"dtype or float32$", "fp64 weight")
    yield bad((h, torch.randn(10, 8, device=other), t, None, None) + opts,
              r"linear_cross_entropy: weight is on (meta|cpu) but hidden is on", "weight device")
    yield bad((h, torch.randn(0, 8, device=device), t, None, None) + opts,
              r"linear_cross_entropy: weight must have at least one row \(vocab_size is 0\)", "empty vocabulary")
    yield bad((h, w, t.float(), None, None) + opts,
              r"linear_cross_entropy: target dtype must be int64 or int32 \(class indices\), got float32",
              "float target")
    yield bad((h, w, t.to(torch.uint8), None, None) + opts,
              r"linear_cross_entropy: target dtype must be int64 or int32 \(class indices\), got uint8", "uint8 target")
    yield bad((h, w, t[:3], None, None) + opts,
              r"linear_cross_entropy: target shape \[3\] does not match hidden shape \[4, 8\] without its last "
              r"dimension: expected \[4\]", "target shape")
    yield bad((h, w, torch.randint(0, 10, (4,), device=other), None, None) + opts,
              r"linear_cross_entropy: target is on (meta|cpu) but hidden is on", "target device")
    yield bad((h, w, t, torch.randn(9, device=device), None) + opts,
              r"linear_cross_entropy: bias must be a 1-D tensor of weight.size\(0\) = 10 elements, got shape \[9\]",
              "bias shape")
    yield bad((h, w, t, torch.randn(10, device=device, dtype=torch.float16), None) + opts,
              r"linear_cross_entropy: bias dtype float16 does not go with hidden dtype float32", "bias dtype")
    yield bad((h, w, t, torch.randn(10, device=other), None) + opts,
              r"linear_cross_entropy: bias is on (meta|cpu) but hidden is on", "bias device")
    yield bad((h, w, t, None, torch.ones(10, 1, device=device)) + opts,
              r"linear_cross_entropy: class_weight must be a 1-D tensor of weight.size\(0\) = 10 elements, got "
              r"shape \[10, 1\]", "class_weight shape")
    yield bad((h, w, t, None, torch.ones(10, device=other)) + opts,
              r"linear_cross_entropy: class_weight is on (meta|cpu) but hidden is on", "class_weight device")
    yield bad((h, w, t, None, None, -100, "avg", 0.0, 0.0, None, None),
              r"linear_cross_entropy: reduction must be 'mean', 'sum' or 'none', got 'avg'", "reduction")
    yield bad((h, w, t, None, None, -100, "mean", 1.5, 0.0, None, None),
              r"linear_cross_entropy: label_smoothing must be in \[0, 1\], got 1\.5", "label_smoothing")
    yield bad((h, w, t, None, None, -100, "mean", 0.0, -1.0, None, None),
              r"linear_cross_entropy: z_loss must be a finite number >= 0, got -1", "z_loss")
    yield bad((h, w, t, None, None, -100, "mean", 0.0, 0.0, 0.0, None),
              r"linear_cross_entropy: softcap must be a finite number > 0 \(or None\), got 0", "softcap")
    yield bad((h, w, t, None, None, -100, "mean", 0.0, 0.0, None, 0),
              r"linear_cross_entropy: chunk_rows must be >= 1 \(or None: automatic\), got 0", "chunk_rows")
    yield bad((h, w, t, None, None, -100, "mean", 0.0, 0.0, None, 4, True),
              r"linear_cross_entropy: chunk_rows does not apply with low_memory=True \(the vocabulary is "
              r"split into chunks instead\)", "chunk_rows with low_memory")
    yield bad((h, w, t, None, None, -100, "mean", 0.0, 0.0, None, None, False, 8),
              r"linear_cross_entropy: chunk_classes applies with low_memory=True only", "chunk_classes alone")
    yield bad((h, w, t, None, None, -100, "mean", 0.0, 0.0, None, None, True, 0),
              r"linear_cross_entropy: chunk_classes must be >= 1 \(or None: automatic\), got 0",
              "chunk_classes")
    if device == "cpu":  # values are read by the CPU kernel only (GPU: tests/test_linear_cross_entropy.py)
        yield bad((h, w, torch.tensor([1, 2, 10, 3], device=device), None, None) + opts,
                  r"linear_cross_entropy: target\[2\] = 10 is outside \[0, 10\) and is not ignore_index \(-100\)",
                  "target too large")
        yield bad((h.view(2, 2, 8), w, torch.tensor([[1, 2], [-1, 3]], device=device), None, None) + opts,
                  r"linear_cross_entropy: target\[1, 0\] = -1 is outside \[0, 10\)", "negative target")
    # The backward op checks grad_output against the reduction.
    bopts = (None, None, -100)
    for go, red, match, desc in [
        (torch.randn(3, device=device), "none",
         r"linear_cross_entropy_backward: grad_output must have shape \[4\] for reduction 'none', got shape \[3\]",
         "bwd grad_output shape none"),
        (torch.randn(4, device=device), "mean",
         r"linear_cross_entropy_backward: grad_output must have shape \[\] for reduction 'mean', got shape \[4\]",
         "bwd grad_output shape mean"),
        (torch.tensor(1, device=device), "sum",
         r"linear_cross_entropy_backward: grad_output dtype must be floating point, got int64", "bwd dtype"),
    ]:
        yield ErrorSample(Sample((go, h, w, t) + bopts + (red, 0.0, 0.0, None, None), desc), ValueError, match,
                          op=_op.backward)


def strided_samples(device, dtype):
    """hidden as slices and permutations of larger buffers, weight sometimes a transposed view
    (an (H, V) buffer), random options and chunk sizes."""
    from hypothesis import strategies as st

    @st.composite
    def strided(draw):
        ndim = draw(st.integers(1, 2))
        lead = draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim))
        H = draw(st.sampled_from([1, 4, 9]))
        V = draw(st.sampled_from([1, 7, 40]))
        steps = [draw(st.integers(1, 2)) for _ in range(ndim)] + [draw(st.sampled_from([1, 1, 2]))]
        order = draw(st.permutations(list(range(ndim))))
        logical = lead + [H]
        storage = [logical[i] * steps[i] for i in order] + [H * steps[-1]]
        base = _hidden(storage, dtype, device, False)
        inverse = [order.index(i) for i in range(ndim)] + [ndim]
        h = base.permute(*inverse)
        h = h[tuple(slice(None, logical[i] * steps[i], steps[i]) for i in range(ndim + 1))]
        assert list(h.shape) == logical
        w = _weight(V, H, dtype, device, False)
        if draw(st.booleans()):
            w = w.t().contiguous().t()
        b = _bias(V, dtype, device, False) if draw(st.booleans()) else None
        red = draw(st.sampled_from(["mean", "sum", "none"]))
        ignore = draw(st.sampled_from([0, 2]))
        if red == "mean" and h.numel() // H <= 2:
            ignore = 0
        t = _targets(tuple(lead), V, device, ignore)
        cw = _class_weight(V, device) if draw(st.booleans()) else None
        ls = draw(st.sampled_from([0.0, 0.15]))
        z = draw(st.sampled_from([0.0, 0.02]))
        chunk = draw(st.sampled_from([None, 1, 3]))
        low = draw(st.booleans())
        mode = (None, True, chunk) if low else (chunk, False, None)
        return Sample((h, w, t, b, cw, -100, red, ls, z, None, *mode, True),
                      f"hidden{logical} stride={list(h.stride())} weight stride={list(w.stride())} V={V} {red} "
                      f"bias={b is not None} class_weight={cw is not None} ls={ls} z={z} "
                      f"{'chunk_classes' if low else 'chunk_rows'}={chunk}")

    return strided()


def check_autocast(device):
    """Under autocast hidden runs in the autocast dtype; float32 parameters stay float32 (the op
    casts the weight for the products itself) and get float32 gradients; the loss is float32."""
    for mode in ({"chunk_rows": 5}, {"low_memory": True, "chunk_classes": 30}):
        _check_autocast(device, mode)


def _check_autocast(device, mode):
    amp = torch.bfloat16 if device == "cpu" else torch.float16
    h = torch.randn(4, 6, 32, device=device, requires_grad=True)
    w = _weight(80, 32, torch.float32, device, True)
    b = _bias(80, torch.float32, device, True)
    t = _targets((4, 6), 80, device, 3)
    with torch.autocast(device_type=device, dtype=amp):
        loss = fusedops.linear_cross_entropy(h, w, t, b, label_smoothing=0.1, **mode)
    assert loss.dtype == torch.float32, loss.dtype
    expected = _op.forward(h.detach().to(amp), w.detach(), t, b.detach(), None, -100, "mean", 0.1, 0.0, None,
                           **mode)[0]
    torch.testing.assert_close(loss, expected, atol=0, rtol=0)
    loss.backward()
    assert h.grad.dtype == w.grad.dtype == b.grad.dtype == torch.float32
    h64 = h.detach().to(amp).double().requires_grad_()
    w64, b64 = w.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    ref = reference(h64, w64.to(amp).double(), t, b64.to(amp).double(), label_smoothing=0.1)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, atol=2e-2, rtol=2e-2)
    for g, r in ((h.grad, h64.grad), (w.grad, w64.grad), (b.grad, b64.grad)):
        scale = r.abs().max().item()
        torch.testing.assert_close(g.double() / scale, r / scale, atol=2e-2, rtol=2e-2)
    outside = fusedops.linear_cross_entropy(h.detach(), w.detach(), t)
    assert outside.dtype == torch.float32


def backward_args(sample, outputs, grad_output):
    a = [x.detach() if isinstance(x, torch.Tensor) else x for x in sample.args]
    # (grad_output, hidden, weight, target, bias, class_weight, ignore_index, reduction, ls, z, softcap,
    #  chunk_rows, low_memory, chunk_classes)
    return (grad_output, *a[:13])


def check_large_input(device):
    """64-bit offsets: hidden (and its gradient) of more than 2^31 elements; the last rows'
    losses and gradients are right."""
    H, V = 4096, 64
    rows = 2**31 // H + 8
    try:
        h = torch.randn(rows, H, dtype=torch.bfloat16, device=device)
    except torch.OutOfMemoryError:
        import pytest

        pytest.skip("not enough GPU memory for a 2^31-element tensor")
    w = _weight(V, H, torch.bfloat16, device, False)
    t = _targets((rows,), V, device)
    loss = fusedops.linear_cross_entropy(h, w, t, reduction="none")
    for part in (slice(rows - 16, rows), slice(0, 16)):
        expected = reference(h[part].double(), w.double(), t[part], reduction="none")
        torch.testing.assert_close(loss[part].double(), expected, atol=3e-2, rtol=3e-2)
    del loss
    h.requires_grad_()
    (g,) = torch.autograd.grad(fusedops.linear_cross_entropy(h, w, t, reduction="sum"), h)
    part = slice(rows - 4, rows)
    hp = h[part].detach().double().requires_grad_()
    (eg,) = torch.autograd.grad(reference(hp, w.double(), t[part], reduction="sum"), hp)
    torch.testing.assert_close(g[part].double(), eg, atol=3e-2, rtol=3e-2)


# float32: the products round once per element (H-term sums) against fp64. bfloat16/float16:
# the logits are rounded to the input dtype before the loss (as the materialised path rounds
# them), then the gradient of the logits is rounded again, then the products; gradients are
# compared relative to their largest element. A bf16 logit of a few units is off by up to 3e-2
# (half an ulp at 8), which moves its probability, and so the gradient, by up to 3%: over 2000
# seeds the worst bf16 weight gradient ("z_loss sum, one row a chunk") reached 1.07x an atol of
# 2e-2, hence 3e-2, as for the loss.
TOL = {
    torch.float32: Tolerance(atol=2e-5, rtol=2e-5),
    torch.bfloat16: Tolerance(atol=3e-2, rtol=2e-2),
    torch.float16: Tolerance(atol=4e-3, rtol=4e-3),
    torch.float64: Tolerance(atol=1e-10, rtol=1e-10),
}
GRAD_TOL = {
    torch.float32: Tolerance(atol=2e-5, rtol=2e-5),
    torch.bfloat16: Tolerance(atol=3e-2, rtol=3e-2),
    torch.float16: Tolerance(atol=3e-3, rtol=4e-3),
    torch.float64: Tolerance(atol=1e-10, rtol=1e-10),
}

INFO = OpTestInfo(
    name="linear_cross_entropy",
    op=_op.forward,
    public=public,
    reference=reference,
    samples=samples,
    sample_for_shape=sample_for_shape,
    error_samples=error_samples,
    strided_samples=strided_samples,
    backward_ops=(_op.backward,),
    backward_args=backward_args,
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
    tol=TOL,
    grad_tol=GRAD_TOL,
    grad_argnums=(0, 1, 3),
    autocast_check=check_autocast,
    torch_equivalent=torch_equivalent,
    output_dtype_argnums=(0,),
    # (the op asked for the hidden and bias gradients only, as for a frozen lm_head)
    variant_ops=((_op.forward, lambda sample: (*sample.args, [True, False, True])),),
    double_backward=False,
    large_input_check=check_large_input,
)
