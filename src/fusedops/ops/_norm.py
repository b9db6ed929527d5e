"""Argument checks shared by the row normalisations (rms_norm, layer_norm): the same checks, in
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
    # (no torch.device objects: cheaper on the per-call path)
    return a.is_cuda == b.is_cuda and a.is_meta == b.is_meta and a.get_device() == b.get_device()


def check_input(op, input):
    if input.dim() < 1:
        raise ValueError(f"{op}: input must have at least 1 dimension, got a 0-dimensional tensor")
    if input.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"{op}: input dtype must be float32, bfloat16, float16 or float64, got {dtype_name(input.dtype)}"
        )


def param_dtype_ok(input_dtype, dtype):
    """An affine parameter's dtype is the input's, or float32 with a 16-bit input."""
    return dtype == input_dtype or (input_dtype in NARROW and dtype == torch.float32)


def check_param(op, name, input, param):
    if param is None:
        return
    n = input.shape[-1]
    if param.dim() != 1 or param.shape[0] != n:
        raise ValueError(
            f"{op}: {name} must be a 1-D tensor of size {n} (the size of input's last dimension), "
            f"got shape {shape_str(param)}"
        )
    if not param_dtype_ok(input.dtype, param.dtype):
        raise ValueError(
            f"{op}: {name} dtype {dtype_name(param.dtype)} does not go with input dtype {dtype_name(input.dtype)}: "
            "use the input's dtype, or float32 with bfloat16/float16 input"
        )
    if not _same_device(param, input):
        raise ValueError(f"{op}: {name} is on {param.device} but input is on {input.device}")


def check_params(op, input, weight, bias=None):
    check_param(op, "weight", input, weight)
    check_param(op, "bias", input, bias)
    if weight is not None and bias is not None and weight.dtype != bias.dtype:
        raise ValueError(
            f"{op}: bias dtype {dtype_name(bias.dtype)} does not match weight dtype {dtype_name(weight.dtype)}"
        )


def check_eps(op, eps):
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"{op}: eps must be a finite number >= 0, got {eps:g}")


def check_forward(op, input, weight, bias, eps):
    check_input(op, input)
    check_params(op, input, weight, bias)
    check_eps(op, eps)


def check_stat(op, forward_op, name, input, stat):
    acc = acc_dtype(input.dtype)
    if stat.shape != input.shape[:-1] or stat.dtype != acc:
        raise ValueError(
            f"{op}: {name} must be a {dtype_name(acc)} tensor of input's leading shape (as returned by "
            f"{forward_op}), got {dtype_name(stat.dtype)} of shape {shape_str(stat)}"
        )
    if stat.device != input.device:
        raise ValueError(f"{op}: {name} is on {stat.device} but input is on {input.device}")


def check_backward(op, forward_op, grad_output, input, weight, bias, mean, rstd):
    check_input(op, input)
    check_params(op, input, weight, bias)
    if grad_output.shape != input.shape:
        raise ValueError(
            f"{op}: grad_output shape {shape_str(grad_output)} does not match input shape {shape_str(input)}"
        )
    if grad_output.dtype != input.dtype:
        raise ValueError(
            f"{op}: grad_output dtype {dtype_name(grad_output.dtype)} does not match input dtype "
            f"{dtype_name(input.dtype)}"
        )
    if grad_output.device != input.device:
        raise ValueError(f"{op}: grad_output is on {grad_output.device} but input is on {input.device}")
    if mean is not None:
        check_stat(op, forward_op, "mean", input, mean)
    check_stat(op, forward_op, "rstd", input, rstd)


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
