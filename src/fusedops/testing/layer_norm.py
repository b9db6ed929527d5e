"""layer_norm samples for the generic suites."""

import torch

import fusedops
from fusedops.ops import layer_norm as _op

from . import ErrorSample, OpTestInfo, Sample
from . import _norm


def reference(input, weight=None, bias=None, eps=1e-5):
    """fp64 (or input-dtype) LayerNorm, as the formula says (biased variance)."""
    x = input.double()
    mu = x.mean(-1, keepdim=True)
    y = (x - mu) * torch.rsqrt((x - mu).pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.double()
    if bias is not None:
        y = y + bias.double()
    return y


def samples(device, dtype, requires_grad=False, edge=True):
    shapes = _norm.SHAPES + (_norm.EDGE_SHAPES if edge else [])
    for shape in shapes:
        n = shape[-1]
        for pdt in _norm.param_dtypes(dtype):
            for which in ("none", "weight", "bias", "both"):
                if which == "none" and pdt != dtype:
                    continue
                x = torch.randn(shape, dtype=dtype, device=device).requires_grad_(requires_grad)
                w = _norm.param(n, pdt, device, requires_grad, mean=1.0) if which in ("weight", "both") else None
                b = _norm.param(n, pdt, device, requires_grad) if which in ("bias", "both") else None
                yield Sample((x, w, b, 1e-5), f"{list(shape)}-{which}_{_norm.dtype_name(pdt)}")
    # Rows of very different scales around a mean far from zero, and a large eps.
    x = _norm.scaled_rows(dtype, device, requires_grad, offset=30.0)
    w, b = _norm.param(48, dtype, device, requires_grad), _norm.param(48, dtype, device, requires_grad)
    yield Sample((x, w, b, 1e-5), "scales-offset30")
    yield Sample((_norm.scaled_rows(dtype, device, requires_grad), w, b, 0.5), "scales-eps0.5")


def sample_for_shape(device, dtype, shape, requires_grad=False):
    x = torch.randn(shape, dtype=dtype, device=device).requires_grad_(requires_grad)
    n = shape[-1]
    w = _norm.param(n, dtype, device, requires_grad, mean=1.0)
    b = _norm.param(n, dtype, device, requires_grad)
    return Sample((x, w, b, 1e-5), f"{list(shape)}")


def error_samples(device):
    x = torch.randn(4, 8, device=device)
    w8 = torch.randn(8, device=device)

    def bad(args, match, desc):
        return ErrorSample(Sample(args, desc), ValueError, match)

    other = "meta" if device != "meta" else "cpu"
    yield bad((torch.randn((), device=device), None, None, 1e-5), r"layer_norm: input must have at least 1 dimension", "0-d")
    yield bad((x.to(torch.int64), None, None, 1e-5), r"layer_norm: input dtype must be .* got int64", "int input")
    yield bad((x, torch.randn(7, device=device), None, 1e-5),
              r"layer_norm: weight must be a 1-D tensor of size 8 .* got shape \[7\]", "weight size")
    yield bad((x, None, torch.randn(2, 8, device=device), 1e-5),
              r"layer_norm: bias must be a 1-D tensor of size 8 .* got shape \[2, 8\]", "bias 2-D")
    yield bad((x, None, torch.randn(8, device=device, dtype=torch.float16), 1e-5),
              r"layer_norm: bias dtype float16 does not go with input dtype float32", "bias dtype")
    yield bad((x.half(), w8, torch.randn(8, device=device, dtype=torch.float16), 1e-5),
              r"layer_norm: bias dtype float16 does not match weight dtype float32", "bias vs weight dtype")
    yield bad((x, w8, torch.randn(8, device=other), 1e-5), r"layer_norm: bias is on (meta|cpu) but input is on", "bias device")
    yield bad((x, torch.randn(8, device=other), None, 1e-5), r"layer_norm: weight is on (meta|cpu) but input is on",
              "weight device")
    yield bad((x, None, None, float("inf")), r"layer_norm: eps must be a finite number >= 0, got inf", "inf eps")
    # The backward op checks its arguments against each other.
    stat = torch.ones(4, device=device)
    bwd = _op.backward
    for args, match, desc in [
        ((torch.randn(4, 9, device=device), x, w8, None, stat, stat, True, False),
         r"layer_norm_backward: grad_output shape \[4, 9\] does not match input shape \[4, 8\]", "bwd grad shape"),
        ((x, x, w8, None, torch.ones(4, 1, device=device), stat, True, False),
         r"layer_norm_backward: mean must be a float32 tensor of input's leading shape \(as returned by layer_norm\), "
         r"got float32 of shape \[4, 1\]", "bwd mean shape"),
        ((x, x, w8, None, stat, stat.double(), True, False),
         r"layer_norm_backward: rstd must be a float32 tensor .* got float64", "bwd rstd dtype"),
        ((x, x, w8, torch.randn(3, device=device), stat, stat, True, True),
         r"layer_norm_backward: bias must be a 1-D tensor of size 8", "bwd bias size"),
    ]:
        yield ErrorSample(Sample(args, desc), ValueError, match, op=bwd)


def strided_samples(device, dtype):
    return _norm.strided_inputs(device, dtype, lambda x, params: (x, params["weight"], params["bias"], 1e-5))


def check_autocast(device):
    """The documented rule: nothing is cast, the output keeps input's dtype; a parameter whose
    dtype goes with neither input's nor float32 is cast to input's."""
    amp = torch.bfloat16 if device == "cpu" else torch.float16
    for xdt, pdt in [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                     (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)]:
        x = torch.randn(8, 64, dtype=xdt, device=device)
        w = torch.randn(64, dtype=pdt, device=device)
        b = torch.randn(64, dtype=pdt, device=device)
        with torch.autocast(device_type=device, dtype=amp):
            y = fusedops.layer_norm(x, w, b)
        assert y.dtype == xdt, (xdt, pdt, y.dtype)
        if pdt not in (xdt, torch.float32):
            w, b = w.to(xdt), b.to(xdt)
        torch.testing.assert_close(y, fusedops.layer_norm(x, w, b), atol=0, rtol=0)
    # A weight and bias of two dtypes stay as passed: the op's error names the user's dtypes.
    x = torch.randn(8, 64, dtype=torch.bfloat16, device=device)
    w, b = torch.randn(64, dtype=torch.float64, device=device), torch.randn(64, device=device)
    try:
        with torch.autocast(device_type=device, dtype=amp):
            fusedops.layer_norm(x, w, b)
    except ValueError as e:
        assert "layer_norm: weight dtype float64 does not go with input dtype bfloat16" in str(e), e
    else:
        raise AssertionError("a float64 weight with a float32 bias under autocast was not refused")


def backward_args(sample, outputs, grad_output):
    x, w, b = (None if t is None else t.detach() for t in sample.args[:3])
    _, mean, rstd = outputs
    return (grad_output, x, w, b, mean.detach(), rstd.detach(), w is not None, b is not None)


INFO = OpTestInfo(
    name="layer_norm",
    op=_op.forward,
    public=fusedops.layer_norm,
    reference=reference,
    samples=samples,
    sample_for_shape=sample_for_shape,
    error_samples=error_samples,
    strided_samples=strided_samples,
    backward_ops=(_op.backward,),
    backward_args=backward_args,
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
    tol=_norm.TOL,
    grad_tol=_norm.GRAD_TOL,
    grad_argnums=(0, 1, 2),
    autocast_check=check_autocast,
    torch_equivalent=lambda x, w, b, eps: torch.nn.functional.layer_norm(x, x.shape[-1:], w, b, eps),
)
