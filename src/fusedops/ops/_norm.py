"""Argument checks shared by the row normalisations (rms_norm, add_rms_norm, layer_norm): the same checks, in
the same words, as csrc/include/fusedops/norm.h, for the fake kernels, the Triton kernels and
the public functions' prechecks."""

import math

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
NARROW = (torch.bfloat16, torch.float16)


def dtype_name(dtype):
    return str(dtype).removeprefix("torch.")


def shape_str(t):
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _same_device(a, b):
    # (one comparison of device objects: 0.19 us on the H200 machine's torch 2.11, against 0.42
    # for comparing is_cuda, is_meta and get_device(); this runs on every eager call there)
    return a.device == b.device


def check_given(op, **tensors):
    """torch.ops passes None, given for a required Tensor, on to the fake and Triton kernels (as
    csrc/include/fusedops/checks.h's check_given receives an undefined tensor): name it."""
    for name, t in tensors.items():
        if t is None:
            raise ValueError(f"{op}: {name} must be a Tensor, got None")


def check_input(op, input, name="input"):
    check_given(op, **{name: input})
    if input.dim() < 1:
        raise ValueError(f"{op}: {name} must have at least 1 dimension, got a 0-dimensional tensor")
    if input.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"{op}: {name} dtype must be float32, bfloat16, float16 or float64, got {dtype_name(input.dtype)}"
        )


def check_like_input(op, name, t, input_name, input, dtype_ok, dtype_rule=""):
    """A tensor that goes with `input` element for element: same shape and device, `dtype_ok`."""
    if t.shape != input.shape:
        raise ValueError(f"{op}: {name} shape {shape_str(t)} does not match {input_name} shape {shape_str(input)}")
    if not dtype_ok:
        raise ValueError(
            f"{op}: {name} dtype {dtype_name(t.dtype)} does not go with {input_name} dtype "
            f"{dtype_name(input.dtype)}{dtype_rule}"
        )
    if not _same_device(t, input):
        raise ValueError(f"{op}: {name} is on {t.device} but {input_name} is on {input.device}")


def param_dtype_ok(input_dtype, dtype):
    """An affine parameter's dtype is the input's, or float32 with a 16-bit input."""
    return dtype == input_dtype or (input_dtype in NARROW and dtype == torch.float32)


def check_param(op, name, input, param, input_name="input"):
    """`input_name`: what stands for the input in a backward (norm.h's like_name)."""
    if param is None:
        return
    n = input.shape[-1]
    if param.dim() != 1 or param.shape[0] != n:
        raise ValueError(
            f"{op}: {name} must be a 1-D tensor of size {n} (the size of {input_name}'s last dimension), "
            f"got shape {shape_str(param)}"
        )
    if not param_dtype_ok(input.dtype, param.dtype):
        raise ValueError(
            f"{op}: {name} dtype {dtype_name(param.dtype)} does not go with {input_name} dtype "
            f"{dtype_name(input.dtype)}: use the {input_name}'s dtype, or float32 with bfloat16/float16 {input_name}"
        )
    if not _same_device(param, input):
        raise ValueError(f"{op}: {name} is on {param.device} but {input_name} is on {input.device}")


def check_params(op, input, weight, bias=None, input_name="input"):
    check_param(op, "weight", input, weight, input_name)
    check_param(op, "bias", input, bias, input_name)
    if weight is not None and bias is not None and weight.dtype != bias.dtype:
        raise ValueError(
            f"{op}: bias dtype {dtype_name(bias.dtype)} does not match weight dtype {dtype_name(weight.dtype)}"
        )


def check_eps(op, eps):
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"{op}: eps must be a finite number >= 0, got {eps:g}")


def check_offset(op, offset, weight):
    if not math.isfinite(offset):
        raise ValueError(f"{op}: offset must be a finite number, got {offset:g}")
    if offset != 0 and weight is None:
        raise ValueError(
            f"{op}: offset scales the weight (offset + weight), so it needs a weight; got offset {offset:g} without one"
        )


def check_forward(op, input, weight, bias, eps, offset=0.0):
    check_input(op, input)
    check_params(op, input, weight, bias)
    check_eps(op, eps)
    check_offset(op, offset, weight)


def residual_dtype_ok(residual_dtype, input_dtype):
    """add_rms_norm's residual: input's dtype, or float32 under a 16-bit input."""
    return residual_dtype == input_dtype or (input_dtype in NARROW and residual_dtype == torch.float32)


RESIDUAL_DTYPE_RULE = ": use the input's dtype, or float32 with bfloat16/float16 input"


def may_overlap(t):
    """Whether elements of `t` may share memory (an expanded view): sorted by stride, each
    dimension of size > 1 must step over everything inside it (tensors.h's may_overlap)."""
    extent = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s > 1):
        if stride < extent:
            return True
        extent += stride * (size - 1)
    return False


def non_overlapping_and_dense(t, shape=None, stride=None):
    """c10's is_non_overlapping_and_dense (tensors.h's copy of it), decided exactly, guarding on
    symbolic sizes where it must (torch's Python version answers False when unsure, which would
    give the fake kernel other strides than the real one). `shape` and `stride`: t's, if the
    caller has them."""
    shape = t.shape if shape is None else shape
    stride = t.stride() if stride is None else stride
    if len(shape) == 1:
        return shape[0] < 2 or stride[0] == 1
    small = [bool(n < 2) for n in shape]
    dims = sorted(range(len(shape)), key=lambda d: (small[d], 0 if small[d] else stride[d]))
    required = 1
    for d in dims:
        if small[d]:
            return True
        if stride[d] != required:
            return False
        required *= shape[d]
    return True


def overlap(a, b):
    """How the memory of two tensors relates, as tensors.h's overlap decides it: "same" (the same
    elements in the same layout), "partial" (some shared, decided only between non-overlapping
    and dense tensors) or
    None. None too where there are no addresses to compare: fake and meta tensors (the fake
    kernels, under tracing) and other tensor subclasses."""
    if a.numel() == 0 or b.numel() == 0:
        return None
    if not (_has_addresses(a) and _has_addresses(b)):
        return None
    if (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride()):
        return "same"

    if not (non_overlapping_and_dense(a) and non_overlapping_and_dense(b)):
        return None
    # Dense: the elements fill numel() slots from the first one.
    a_end, b_end = (t.data_ptr() + t.numel() * t.element_size() for t in (a, b))
    return "partial" if a.data_ptr() < b_end and b.data_ptr() < a_end else None


def _has_addresses(t):
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type != "meta"


def check_add_forward(op, input, residual, weight, eps, offset, in_place=False):
    check_forward(op, input, weight, None, eps, offset)
    check_given(op, residual=residual)
    check_like_input(
        op, "residual", residual, "input", input, residual_dtype_ok(residual.dtype, input.dtype), RESIDUAL_DTYPE_RULE
    )
    if in_place and residual.numel() > 0 and may_overlap(residual):
        raise ValueError(
            f"{op}: residual has rows that share memory (an expanded tensor?), so it cannot be written in place; "
            "pass a contiguous residual"
        )
    if in_place and overlap(input, residual) == "partial":
        raise ValueError(
            f"{op}: residual and input share part of their memory (overlapping views of one buffer?), so residual "
            "cannot be updated in place; pass tensors that do not overlap"
        )
    if in_place and weight is not None and overlap(weight, residual) is not None:
        # Rows written before later rows read the weight: eager and compiled (functionalised)
        # calls would disagree.
        raise ValueError(
            f"{op}: weight shares memory with residual, which is updated in place; pass a weight that does not "
            "overlap residual (a clone)"
        )


def check_stat(op, forward_op, name, input, stat):
    acc = acc_dtype(input.dtype)
    if stat.shape != input.shape[:-1] or stat.dtype != acc:
        raise ValueError(
            f"{op}: {name} must be a {dtype_name(acc)} tensor of input's leading shape (as returned by "
            f"{forward_op}), got {dtype_name(stat.dtype)} of shape {shape_str(stat)}"
        )
    if stat.device != input.device:
        raise ValueError(f"{op}: {name} is on {stat.device} but input is on {input.device}")


def check_backward(op, forward_op, grad_output, input, weight, bias, mean, rstd, offset=0.0, saved_is_output=False):
    """`input` is what the forward saved: its input or, with saved_is_output, its output."""
    saved_name = "output" if saved_is_output else "input"
    check_given(op, grad_output=grad_output, rstd=rstd)
    check_input(op, input, saved_name)
    check_params(op, input, weight, bias, saved_name)
    check_offset(op, offset, weight)
    check_like_input(op, "grad_output", grad_output, saved_name, input, grad_output.dtype == input.dtype)
    if mean is not None:
        check_stat(op, forward_op, "mean", input, mean)
    check_stat(op, forward_op, "rstd", input, rstd)


def check_add_backward(op, grad_output, grad_residual_out, residual_out, weight, rstd, offset):
    check_given(op, grad_output=grad_output, rstd=rstd)
    check_input(op, residual_out, "residual_out")
    if grad_output.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"{op}: grad_output dtype must be float32, bfloat16, float16 or float64, got {dtype_name(grad_output.dtype)}"
        )
    check_like_input(
        op, "grad_output", grad_output, "residual_out", residual_out,
        residual_dtype_ok(residual_out.dtype, grad_output.dtype),
        ": it must be residual_out's dtype, or bfloat16/float16 under a float32 residual_out",
    )
    if grad_residual_out is not None:
        check_like_input(
            op, "grad_residual_out", grad_residual_out, "residual_out", residual_out,
            grad_residual_out.dtype == residual_out.dtype,
        )
    check_params(op, grad_output, weight, input_name="grad_output")
    check_offset(op, offset, weight)
    check_stat(op, "add_rms_norm", "rstd", residual_out, rstd)


# ---- fake outputs ----------------------------------------------------------------------------


def output_like(input):
    return torch.empty_like(input, memory_format=torch.contiguous_format)


def row_stat(input):
    return input.new_empty(input.shape[:-1], dtype=acc_dtype(input.dtype))


def param_grad(input, param, wanted):
    """(n,) in the parameter's dtype when wanted, else an empty tensor (as the kernels return)."""
    if param is not None and wanted:
        return param.new_empty(param.shape)
    return input.new_empty((0,), dtype=param.dtype if param is not None else input.dtype)


def autocast_param(input, param):
    """Autocast rule of the norms' parameters: one whose dtype goes with neither the input's
    nor float32 is cast to the input's."""
    if param is not None and not param_dtype_ok(input.dtype, param.dtype):
        return param.to(input.dtype)
    return param


AUTOCAST_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.AutocastCUDA
)
