"""rms_norm: fake kernels, autograd, autocast rule and Triton hook-up.

Schemas (csrc/registration.cpp):
    rms_norm(Tensor input, Tensor? weight, float eps) -> (Tensor output, Tensor rstd)
    rms_norm_backward(Tensor grad_output, Tensor input, Tensor? weight, Tensor rstd,
                      bool weight_requires_grad) -> (Tensor grad_input, Tensor grad_weight)

Saved for backward: input, weight and rstd (one float per row), no copies: backward re-derives
xhat = input * rstd instead of keeping the normalised output. For a (rows, n) bf16 input that
is 2*rows*n + 4*rows bytes, the input itself, which autograd usually holds anyway.

Autocast rule (CPU and CUDA): no input is cast. The kernels compute in float32 whatever the
storage dtype, so upcasting bf16/fp16 activations (torch's rule for its norms) would only
double the memory traffic; the output keeps the input's dtype. A weight whose dtype goes with
neither the input's nor float32 is cast to the input's dtype.
"""

import math

import torch

from .. import _native
from . import _direct

forward = torch.ops.fusedops.rms_norm.default
backward = torch.ops.fusedops.rms_norm_backward.default

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_NARROW = (torch.bfloat16, torch.float16)


def _name(dtype):
    return str(dtype).removeprefix("torch.")


def _shape(t):
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


# The same checks, in the same words, as csrc/include/fusedops/rms_norm.h.
def check_input(op, input):
    if input.dim() < 1:
        raise ValueError(f"{op}: input must have at least 1 dimension, got a 0-dimensional tensor")
    if input.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"{op}: input dtype must be float32, bfloat16, float16 or float64, got {_name(input.dtype)}"
        )


def check_weight(op, input, weight):
    if weight is None:
        return
    n = input.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != n:
        raise ValueError(
            f"{op}: weight must be a 1-D tensor of size {n} (the size of input's last dimension), "
            f"got shape {_shape(weight)}"
        )
    if not (weight.dtype == input.dtype or (input.dtype in _NARROW and weight.dtype == torch.float32)):
        raise ValueError(
            f"{op}: weight dtype {_name(weight.dtype)} does not go with input dtype {_name(input.dtype)}: "
            "use the input's dtype, or float32 with bfloat16/float16 input"
        )
    same_device = (weight.is_cuda == input.is_cuda and weight.is_meta == input.is_meta
                   and weight.get_device() == input.get_device())  # (no torch.device objects: cheaper)
    if not same_device:
        raise ValueError(f"{op}: weight is on {weight.device} but input is on {input.device}")


def check_forward(input, weight, eps):
    check_input("rms_norm", input)
    check_weight("rms_norm", input, weight)
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"rms_norm: eps must be a finite number >= 0, got {eps:g}")


def check_backward(grad_output, input, weight, rstd):
    op = "rms_norm_backward"
    check_input(op, input)
    check_weight(op, input, weight)
    if grad_output.shape != input.shape:
        raise ValueError(
            f"{op}: grad_output shape {_shape(grad_output)} does not match input shape {_shape(input)}"
        )
    if grad_output.dtype != input.dtype:
        raise ValueError(
            f"{op}: grad_output dtype {_name(grad_output.dtype)} does not match input dtype {_name(input.dtype)}"
        )
    acc = acc_dtype(input.dtype)
    if rstd.shape != input.shape[:-1] or rstd.dtype != acc:
        raise ValueError(
            f"{op}: rstd must be a {_name(acc)} tensor of input's leading shape (as returned by rms_norm), "
            f"got {_name(rstd.dtype)} of shape {_shape(rstd)}"
        )
    for arg, t in (("grad_output", grad_output), ("rstd", rstd)):
        if t.device != input.device:
            raise ValueError(f"{op}: {arg} is on {t.device} but input is on {input.device}")


def _empty_grad_weight(input, weight, weight_requires_grad):
    if weight is not None and weight_requires_grad:
        return weight.new_empty(weight.shape)
    return input.new_empty((0,), dtype=weight.dtype if weight is not None else input.dtype)


@torch.library.register_fake("fusedops::rms_norm")
def _forward_fake(input, weight, eps):
    check_forward(input, weight, eps)
    out = torch.empty_like(input, memory_format=torch.contiguous_format)
    return out, input.new_empty(input.shape[:-1], dtype=acc_dtype(input.dtype))


@torch.library.register_fake("fusedops::rms_norm_backward")
def _backward_fake(grad_output, input, weight, rstd, weight_requires_grad):
    check_backward(grad_output, input, weight, rstd)
    grad_input = torch.empty_like(input, memory_format=torch.contiguous_format)
    return grad_input, _empty_grad_weight(input, weight, weight_requires_grad)


# ---- autograd ------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output):
    input, weight, _eps = inputs
    _out, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(input, weight, rstd)


def _backward(ctx, grad_output, _grad_rstd=None):
    input, weight, rstd = ctx.saved_tensors
    need_input, need_weight = ctx.needs_input_grad[:2]
    args = (grad_output, input, weight, rstd, need_weight)
    if torch.is_grad_enabled():  # create_graph=True: the registered op reports double backward
        grad_input, grad_weight = backward(*args)
    else:
        with _direct.BelowAutograd():
            grad_input, grad_weight = backward(*args)
    return (grad_input if need_input else None), (grad_weight if need_weight else None), None


# The op's pybind entry point: what OpOverload.__call__ forwards to, one Python frame less.
_forward_entry = forward._op


class _Function(torch.autograd.Function):
    """The public function's autograd path: the registered autograd (_setup_context, _backward)
    without the detour through the dispatcher (see ops/_direct.py)."""

    @staticmethod
    def forward(ctx, input, weight, eps):
        with _direct.BelowAutograd():
            out, rstd = _forward_entry(input, weight, eps)
        ctx.save_for_backward(input, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        return _backward(ctx, grad_output)


_apply_function = _direct.bind_apply(_Function)
_unwrap = _direct.unwrap_if_dead


def direct(input, weight, eps):
    """``forward(input, weight, eps)[0]`` with autograd, where ``_direct.direct_call_allowed()``."""
    if torch.is_grad_enabled() and (input.requires_grad or (weight is not None and weight.requires_grad)):
        return _apply_function(_unwrap(input), None if weight is None else _unwrap(weight), eps)
    with _direct.BelowAutograd():
        return _forward_entry(input, weight, eps)[0]


def _double_backward(ctx, *grads):
    raise NotImplementedError(
        "fusedops.rms_norm does not support double backward (create_graph=True through its backward)"
    )


def _backward_setup_context(ctx, inputs, output):
    pass


torch.library.register_autograd("fusedops::rms_norm", _backward, setup_context=_setup_context)
torch.library.register_autograd(
    "fusedops::rms_norm_backward", _double_backward, setup_context=_backward_setup_context
)


# ---- autocast ------------------------------------------------------------------------------

_lib = torch.library.Library("fusedops", "IMPL")
_AUTOCAST_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.AutocastCUDA
)


def _autocast(input, weight, eps):
    if weight is not None and not (
        weight.dtype == input.dtype or (input.dtype in _NARROW and weight.dtype == torch.float32)
    ):
        weight = weight.to(input.dtype)
    with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS):
        return forward(input, weight, eps)


_lib.impl("rms_norm", _autocast, "AutocastCPU")
_lib.impl("rms_norm", _autocast, "AutocastCUDA")


# ---- Triton for CUDA tensors, when the CUDA kernels are not loaded ---------------------------


def _triton_forward(input, weight, eps):
    check_forward(input, weight, eps)
    from ..triton import rms_norm as kernels  # (it sets the device for its launches)

    return kernels.rms_norm_forward(input, weight, eps)


def _triton_backward(grad_output, input, weight, rstd, weight_requires_grad):
    check_backward(grad_output, input, weight, rstd)
    from ..triton import rms_norm as kernels

    return kernels.rms_norm_backward(grad_output, input, weight, rstd, weight_requires_grad)


if _native.cuda_backend == "triton":
    _lib.impl("rms_norm", _triton_forward, "CUDA")
    _lib.impl("rms_norm_backward", _triton_backward, "CUDA")
