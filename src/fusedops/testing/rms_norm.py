"""rms_norm samples for the generic suites."""

import torch

import fusedops
from fusedops.ops import rms_norm as _op

from . import ErrorSample, OpTestInfo, Sample
from . import _norm


def reference(input, weight=None, eps=1e-6, offset=0.0, cast_before_weight=False, save_output=False):
    """fp64 RMSNorm, as the formula says. The cast mode's rounding is below every tolerance of
    the fp64 comparison; tests/test_norm_options.py checks it bit for bit."""
    x = input.double()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (offset + weight.double())
    return y


def samples(device, dtype, requires_grad=False, edge=True):
    shapes = _norm.SHAPES + (_norm.EDGE_SHAPES if edge else [])
    for shape in shapes:
        for wdt in (None,) + _norm.param_dtypes(dtype):
            x = torch.randn(shape, dtype=dtype, device=device).requires_grad_(requires_grad)
            weight = None if wdt is None else _norm.param(shape[-1], wdt, device, requires_grad)
            wdesc = "none" if wdt is None else _norm.dtype_name(wdt)
            yield Sample((x, weight, 1e-6), f"{list(shape)}-w_{wdesc}")
    # A large eps, and rows of very different scales.
    x = _norm.scaled_rows(dtype, device, requires_grad)
    yield Sample((x, _norm.param(48, dtype, device, requires_grad), 0.5), "scales-eps0.5")
    # The options: Gemma's offset, LLaMA's casting, the memory-saving backward (with a weight
    # kept away from -offset, where recovering xhat from the output loses precision).
    for shape in _norm.OPTION_SHAPES:
        for wdt in _norm.param_dtypes(dtype):
            n = shape[-1]
            for offset, cast, save_output in ((1.0, False, False), (0.0, True, False), (0.0, False, True),
                                              (1.0, True, True)):
                x = torch.randn(shape, dtype=dtype, device=device).requires_grad_(requires_grad)
                w = _norm.param_away_from(n, wdt, device, requires_grad, -offset) if save_output else (
                    _norm.param(n, wdt, device, requires_grad))
                desc = f"{list(shape)}-w_{_norm.dtype_name(wdt)}-offset{offset:g}-cast{int(cast)}-saveout{int(save_output)}"
                yield Sample((x, w, 1e-6, offset, cast, save_output), desc)
        x = torch.randn(shape, dtype=dtype, device=device).requires_grad_(requires_grad)
        yield Sample((x, None, 1e-6, 0.0, False, True), f"{list(shape)}-w_none-saveout1")


def sample_for_shape(device, dtype, shape, requires_grad=False):
    x = torch.randn(shape, dtype=dtype, device=device).requires_grad_(requires_grad)
    return Sample((x, _norm.param(shape[-1], dtype, device, requires_grad), 1e-6), f"{list(shape)}")


def error_samples(device):
    x = torch.randn(4, 8, device=device)

    def bad(args, match, desc):
        return ErrorSample(Sample(args, desc), ValueError, match)

    yield bad((torch.randn((), device=device), None, 1e-6), r"rms_norm: input must have at least 1 dimension", "0-d")
    yield bad((x.to(torch.int32), None, 1e-6), r"rms_norm: input dtype must be .* got int32", "int input")
    for dtype in (torch.uint16, torch.float8_e4m3fn):  # (named in C++ too, not only the common ones)
        name = str(dtype).removeprefix("torch.")
        yield bad((torch.empty(2, 8, device=device, dtype=dtype), None, 1e-6),
                  rf"rms_norm: input dtype must be .* got {name}", f"{name} input")
    yield bad((x, torch.randn(7, device=device), 1e-6), r"rms_norm: weight must be a 1-D tensor of size 8 .* got shape \[7\]", "weight size")
    yield bad((x, torch.randn(2, 8, device=device), 1e-6), r"weight must be a 1-D tensor of size 8 .* got shape \[2, 8\]", "weight 2-D")
    yield bad((x, torch.randn(8, device=device, dtype=torch.float64), 1e-6),
              r"rms_norm: weight dtype float64 does not go with input dtype float32", "weight dtype")
    yield bad((x.bfloat16(), torch.randn(8, device=device, dtype=torch.float16), 1e-6),
              r"weight dtype float16 does not go with input dtype bfloat16", "weight fp16 with bf16")
    yield bad((x, torch.randn(8, device="meta" if device != "meta" else "cpu"), 1e-6),
              r"rms_norm: weight is on (meta|cpu) but input is on", "weight device")
    yield bad((x, None, -1.0), r"rms_norm: eps must be a finite number >= 0, got -1", "negative eps")
    yield bad((x, None, float("nan")), r"rms_norm: eps must be a finite number >= 0, got nan", "nan eps")
    yield bad((x, None, 1e-6, 1.0), r"rms_norm: offset scales the weight \(offset \+ weight\), so it needs a weight; "
              r"got offset 1 without one", "offset without weight")
    yield bad((x, torch.randn(8, device=device), 1e-6, float("inf")), r"rms_norm: offset must be a finite number, got inf",
              "inf offset")
    # The backward op checks its arguments against each other.
    rstd = torch.ones(4, device=device)
    bwd = _op.backward
    for args, match, desc in [
        ((torch.randn(4, 9, device=device), x, None, rstd, 0.0, False, False),
         r"rms_norm_backward: grad_output shape \[4, 9\] does not match input shape \[4, 8\]", "bwd grad shape"),
        ((x.double(), x, None, rstd, 0.0, False, False),
         r"rms_norm_backward: grad_output dtype float64 does not go with input dtype float32", "bwd grad dtype"),
        ((x.double(), x, None, rstd, 0.0, True, False),
         r"rms_norm_backward: grad_output dtype float64 does not go with output dtype float32", "bwd grad dtype (saved output)"),
        ((x, x, None, torch.ones(3, device=device), 0.0, False, False),
         r"rms_norm_backward: rstd must be a float32 tensor of input's leading shape .* got float32 of shape \[3\]",
         "bwd rstd shape"),
        ((x, x, None, rstd.double(), 0.0, False, False), r"rstd must be a float32 tensor .* got float64", "bwd rstd dtype"),
        ((x, x, None, rstd, 2.0, True, False), r"rms_norm_backward: offset scales the weight", "bwd offset without weight"),
    ]:
        yield ErrorSample(Sample(args, desc), ValueError, match, op=bwd)


def strided_samples(device, dtype):
    return _norm.strided_inputs(device, dtype, lambda x, params: (x, params["weight"], 1e-5))


def check_autocast(device):
    """The documented rule: nothing is cast, the output keeps input's dtype; a weight whose
    dtype goes with neither input's nor float32 is cast to input's."""
    amp = torch.bfloat16 if device == "cpu" else torch.float16
    cases = [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),  # would be rejected outside autocast
    ]
    for xdt, wdt in cases:
        x = torch.randn(8, 64, dtype=xdt, device=device)
        w = torch.randn(64, dtype=wdt, device=device)
        with torch.autocast(device_type=device, dtype=amp):
            y = fusedops.rms_norm(x, w)
        assert y.dtype == xdt, (xdt, wdt, y.dtype)
        w_used = w if (wdt == xdt or wdt == torch.float32) else w.to(xdt)
        expected = fusedops.rms_norm(x, w_used)
        torch.testing.assert_close(y, expected, atol=0, rtol=0)


def backward_args(sample, outputs, grad_output):
    x, w = sample.args[0].detach(), sample.args[1]
    w = w.detach() if w is not None else None
    options = dict(zip(("offset", "cast_before_weight", "save_output"), sample.args[3:]))
    offset, save_output = options.get("offset", 0.0), options.get("save_output", False)
    saved = outputs[0].detach() if save_output else x
    return (grad_output, saved, w, outputs[1].detach(), offset, save_output, w is not None)


INFO = OpTestInfo(
    name="rms_norm",
    op=_op.forward,
    public=fusedops.rms_norm,
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
    grad_argnums=(0, 1),
    autocast_check=check_autocast,
    torch_equivalent=lambda x, w, eps, *options: torch.nn.functional.rms_norm(x, x.shape[-1:], w, eps),
)
