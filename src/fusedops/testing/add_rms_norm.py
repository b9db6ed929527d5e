"""add_rms_norm samples for the generic suites (the in-place form add_rms_norm_ runs through
opcheck as a variant; tests/test_norm_options.py checks its in-place semantics)."""

import torch

import fusedops
from fusedops.ops import add_rms_norm as _op

from . import ErrorSample, OpTestInfo, PublicVariant, Sample
from . import _norm
from .rms_norm import reference as _rms_norm_reference


def reference(input, residual, weight=None, eps=1e-6, offset=0.0, cast_before_weight=False):
    """fp64 (output, residual_out)."""
    residual_out = input.double() + residual.double()
    return _rms_norm_reference(residual_out, weight, eps, offset), residual_out


def residual_dtypes(dtype):
    """The dtypes a residual may have with an input of `dtype`."""
    return _norm.param_dtypes(dtype)


def samples(device, dtype, requires_grad=False, edge=True):
    shapes = _norm.SHAPES + (_norm.EDGE_SHAPES if edge else [])
    for shape in shapes:
        n = shape[-1]
        for rdt in residual_dtypes(dtype):
            for wdt in (None,) + _norm.param_dtypes(dtype):
                x = torch.randn(shape, dtype=dtype, device=device).requires_grad_(requires_grad)
                r = torch.randn(shape, dtype=rdt, device=device).requires_grad_(requires_grad)
                w = None if wdt is None else _norm.param(n, wdt, device, requires_grad)
                wdesc = "none" if wdt is None else _norm.dtype_name(wdt)
                yield Sample((x, r, w, 1e-6), f"{list(shape)}-r_{_norm.dtype_name(rdt)}-w_{wdesc}")
    for shape in _norm.OPTION_SHAPES:
        for rdt in residual_dtypes(dtype):
            for offset, cast in ((1.0, False), (0.0, True), (1.0, True)):
                x = torch.randn(shape, dtype=dtype, device=device).requires_grad_(requires_grad)
                r = torch.randn(shape, dtype=rdt, device=device).requires_grad_(requires_grad)
                w = _norm.param(shape[-1], dtype, device, requires_grad)
                desc = f"{list(shape)}-r_{_norm.dtype_name(rdt)}-offset{offset:g}-cast{int(cast)}"
                yield Sample((x, r, w, 1e-6, offset, cast), desc)
    # Rows of very different scales, and a large eps.
    x = _norm.scaled_rows(dtype, device, requires_grad)
    r = _norm.scaled_rows(dtype, device, requires_grad)
    yield Sample((x, r, _norm.param(48, dtype, device, requires_grad), 0.5), "scales-eps0.5")


def sample_for_shape(device, dtype, shape, requires_grad=False):
    x = torch.randn(shape, dtype=dtype, device=device).requires_grad_(requires_grad)
    r = torch.randn(shape, dtype=dtype, device=device).requires_grad_(requires_grad)
    return Sample((x, r, _norm.param(shape[-1], dtype, device, requires_grad), 1e-6), f"{list(shape)}")


def error_samples(device):
    x = torch.randn(4, 8, device=device)
    w8 = torch.randn(8, device=device)
    other = "meta" if device != "meta" else "cpu"

    def bad(args, match, desc, op=None):
        return ErrorSample(Sample(args, desc), ValueError, match, op=op)

    yield bad((x, torch.randn(4, 9, device=device), w8, 1e-6),
              r"add_rms_norm: residual shape \[4, 9\] does not match input shape \[4, 8\]", "residual shape")
    yield bad((x, x.half(), w8, 1e-6),
              r"add_rms_norm: residual dtype float16 does not go with input dtype float32: use the input's dtype, "
              r"or float32 with bfloat16/float16 input", "residual dtype")
    yield bad((x.bfloat16(), x.half(), w8, 1e-6), r"add_rms_norm: residual dtype float16 does not go with input dtype bfloat16",
              "residual fp16 with bf16")
    yield bad((x, torch.randn(4, 8, device=other), w8, 1e-6), r"add_rms_norm: residual is on (meta|cpu) but input is on",
              "residual device")
    yield bad((x.int(), x, w8, 1e-6), r"add_rms_norm: input dtype must be .* got int32", "int input")
    yield bad((x, x, torch.randn(7, device=device), 1e-6), r"add_rms_norm: weight must be a 1-D tensor of size 8", "weight size")
    yield bad((x, x, None, 1e-6, 1.0), r"add_rms_norm: offset scales the weight", "offset without weight")
    yield bad((x, x, w8, -1.0), r"add_rms_norm: eps must be a finite number >= 0, got -1", "negative eps")
    # The in-place form checks the same way, under its own name.
    yield bad((x, torch.randn(4, 9, device=device), w8, 1e-6),
              r"add_rms_norm_: residual shape \[4, 9\] does not match input shape \[4, 8\]", "in-place residual shape",
              op=_op.forward_)
    yield bad((x.bfloat16(), x.bfloat16(), w8.double(), 1e-6),
              r"add_rms_norm_: weight dtype float64 does not go with input dtype bfloat16", "in-place weight dtype",
              op=_op.forward_)
    yield bad((x, torch.randn(1, 8, device=device).expand(4, 8), w8, 1e-6),
              r"add_rms_norm_: residual has rows that share memory \(an expanded tensor\?\), so it cannot be written in "
              r"place", "in-place expanded residual", op=_op.forward_)
    # Broadcast along the row: the kernels work on a copy, but the copy back cannot be made.
    for residual, input in ((torch.randn(4, 1, device=device).expand(4, 8), x),
                            (torch.randn(1, device=device).expand(8), x[0])):
        yield bad((input, residual, w8, 1e-6), r"add_rms_norm_: residual has rows that share memory",
                  f"in-place residual broadcast along its rows {list(residual.stride())}", op=_op.forward_)
    if device != "meta":  # (a fake tensor has no address: the fake kernel cannot tell these apart)
        buf = torch.randn(5, 8, device=device)
        yield bad((buf[:-1], buf[1:], w8, 1e-6),
                  r"add_rms_norm_: residual and input share part of their memory \(overlapping views of one "
                  r"buffer\?\), so residual cannot be updated in place", "in-place residual overlapping input",
                  op=_op.forward_)
        for weight, residual, what in ((buf[2], buf[:4], "a row of"), (buf[0], buf[0], "the same tensor as")):
            yield bad((torch.randn(residual.shape, device=device), residual, weight, 1e-6),
                      r"add_rms_norm_: weight shares memory with residual, which is updated in place; pass a weight "
                      r"that does not overlap residual \(a clone\)", f"in-place weight {what} residual",
                      op=_op.forward_)
    # The backward op checks its arguments against each other.
    rstd = torch.ones(4, device=device)
    bwd = _op.backward
    for args, match, desc in [
        ((x.bfloat16(), None, x.half(), None, rstd, 0.0, False),
         r"add_rms_norm_backward: grad_output dtype bfloat16 does not go with residual_out dtype float16: it must be "
         r"residual_out's dtype, or bfloat16/float16 under a float32 residual_out", "bwd grad dtype"),
        ((x.double(), None, x, None, rstd, 0.0, False),
         r"add_rms_norm_backward: grad_output dtype float64 does not go with residual_out dtype float32", "bwd grad fp64"),
        ((torch.randn(4, 9, device=device), None, x, None, rstd, 0.0, False),
         r"add_rms_norm_backward: grad_output shape \[4, 9\] does not match residual_out shape \[4, 8\]", "bwd grad shape"),
        ((x, x.double(), x, None, rstd, 0.0, False),
         r"add_rms_norm_backward: grad_residual_out dtype float64 does not go with residual_out dtype float32",
         "bwd grad_residual_out dtype"),
        ((x.bfloat16(), None, x, w8.double(), rstd, 0.0, True),
         r"add_rms_norm_backward: weight dtype float64 does not go with grad_output dtype bfloat16: use the "
         r"grad_output's dtype", "bwd weight dtype"),
        ((x, None, x, None, torch.ones(5, device=device), 0.0, False),
         r"add_rms_norm_backward: rstd must be a float32 tensor of input's leading shape \(as returned by add_rms_norm\)",
         "bwd rstd shape"),
    ]:
        yield ErrorSample(Sample(args, desc), ValueError, match, op=bwd)


def strided_samples(device, dtype):
    def make_args(x, params):
        # A residual sliced from a wider buffer at an odd offset: strided rows, unaligned base.
        n = x.shape[-1]
        r = torch.randn(*x.shape[:-1], n + 3, dtype=dtype, device=device)[..., 3:]
        return (x, r, params["weight"], 1e-5)

    return _norm.strided_inputs(device, dtype, make_args)


def check_autocast(device):
    """As rms_norm: nothing is cast, the outputs keep the input's and the residual's dtypes; a
    weight whose dtype goes with neither input's nor float32 is cast to input's."""
    amp = torch.bfloat16 if device == "cpu" else torch.float16
    for xdt, rdt, wdt in [(torch.float32, torch.float32, torch.float32), (torch.bfloat16, torch.float32, torch.float32),
                          (torch.bfloat16, torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32, torch.bfloat16)]:
        x = torch.randn(8, 64, dtype=xdt, device=device)
        r = torch.randn(8, 64, dtype=rdt, device=device)
        w = torch.randn(64, dtype=wdt, device=device)
        with torch.autocast(device_type=device, dtype=amp):
            y, h = fusedops.add_rms_norm(x, r, w)
        assert (y.dtype, h.dtype) == (xdt, rdt), (xdt, rdt, wdt, y.dtype, h.dtype)
        w_used = w if wdt in (xdt, torch.float32) else w.to(xdt)
        ey, eh = fusedops.add_rms_norm(x, r, w_used)
        torch.testing.assert_close(y, ey, atol=0, rtol=0)
        torch.testing.assert_close(h, eh, atol=0, rtol=0)


def backward_args(sample, outputs, grad_output):
    w = sample.args[2]
    w = w.detach() if w is not None else None
    offset = sample.args[4] if len(sample.args) > 4 else 0.0
    _out, residual_out, rstd = (t.detach() for t in outputs)
    grad_residual_out = torch.randn_like(residual_out)
    return (grad_output, grad_residual_out, residual_out, w, rstd, offset, w is not None)


def inplace_args(sample):
    """The in-place form's arguments for `sample`, on a copy of the residual."""
    args = [a.detach() if isinstance(a, torch.Tensor) else a for a in sample.args]
    args[1] = args[1].clone()
    return tuple(args)


def inplace_public(input, residual, *args):
    """fusedops.add_rms_norm_ with add_rms_norm's results, on a copy of the residual."""
    residual = residual.clone()
    return fusedops.add_rms_norm_(input, residual, *args), residual


INFO = OpTestInfo(
    name="add_rms_norm",
    op=_op.forward,
    public=fusedops.add_rms_norm,
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
    torch_equivalent=lambda x, r, w, eps, *options: (
        torch.nn.functional.rms_norm(x + r, x.shape[-1:], w, eps), x + r
    ),
    output_dtype_argnums=(0, 1),
    variant_ops=((_op.forward_, inplace_args),),
    public_variants=(PublicVariant("add_rms_norm_", inplace_public),),
)
