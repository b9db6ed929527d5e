"""layer_norm: fake kernels, autograd, autocast rule and Triton hook-up.

Schemas (csrc/registration.cpp):
    layer_norm(Tensor input, Tensor? weight, Tensor? bias, float eps)
        -> (Tensor output, Tensor mean, Tensor rstd)
    layer_norm_backward(Tensor grad_output, Tensor input, Tensor? weight, Tensor? bias,
                        Tensor mean, Tensor rstd, bool weight_requires_grad, bool bias_requires_grad)
        -> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)

Saved for backward: input, weight, mean and rstd (two floats per row), no copies: backward
re-derives xhat = (input - mean) * rstd. For a (rows, n) bf16 input that is 2*rows*n + 8*rows
bytes, the input itself, which autograd usually holds anyway. The bias is not saved: its
gradient is the column sum of grad_output, and the backward op needs only its dtype.

Autocast rule (CPU and CUDA), as for rms_norm: no input is cast, the math is float32 whatever
the storage dtype, the output keeps the input's dtype; a weight or bias whose dtype goes with
neither the input's nor float32 is cast to the input's dtype.
"""

import torch

from . import _direct, _norm

forward = torch.ops.fusedops.layer_norm.default
backward = torch.ops.fusedops.layer_norm_backward.default
_backward_entry = backward._op  # (OpOverload.__call__ minus its Python frame)


def check_forward(input, weight, bias, eps):
    _norm.check_forward("layer_norm", input, weight, bias, eps)


def check_backward(grad_output, input, weight, bias, mean, rstd):
    _norm.check_given("layer_norm_backward", mean=mean)  # (optional to the shared check: rms_norm has none)
    _norm.check_backward("layer_norm_backward", "layer_norm", grad_output, input, weight, bias, mean, rstd)


@torch.library.register_fake("fusedops::layer_norm")
def _forward_fake(input, weight, bias, eps):
    check_forward(input, weight, bias, eps)
    return _norm.output_like(input), _norm.row_stat(input), _norm.row_stat(input)


@torch.library.register_fake("fusedops::layer_norm_backward")
def _backward_fake(grad_output, input, weight, bias, mean, rstd, weight_requires_grad, bias_requires_grad):
    check_backward(grad_output, input, weight, bias, mean, rstd)
    return (
        _norm.output_like(input),
        _norm.param_grad(input, weight, weight_requires_grad),
        _norm.param_grad(input, bias, bias_requires_grad),
    )


# ---- autograd ------------------------------------------------------------------------------


def _save(ctx, input, weight, bias, mean, rstd):
    ctx.save_for_backward(input, weight, mean, rstd)
    ctx.bias_dtype = None if bias is None else bias.dtype  # all the backward needs of the bias


def _setup_context(ctx, inputs, output):
    input, weight, bias, _eps = inputs
    _out, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    _save(ctx, input, weight, bias, mean, rstd)


def _backward(ctx, grad_output, _grad_mean=None, _grad_rstd=None):
    input, weight, mean, rstd = ctx.saved_tensors
    need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
    # The backward op takes the bias for its dtype: an uninitialised stand-in of n elements.
    bias = None if ctx.bias_dtype is None else input.new_empty(input.shape[-1:], dtype=ctx.bias_dtype)
    with _direct.below_autograd_unless_grad():  # create_graph=True: the op reports double backward
        grad_input, grad_weight, grad_bias = _backward_entry(
            grad_output, input, weight, bias, mean, rstd, need_weight, need_bias
        )
    return (
        grad_input if need_input else None,
        grad_weight if need_weight else None,
        grad_bias if need_bias else None,
        None,
    )


_forward_entry = forward._op


class _Function(torch.autograd.Function):
    """The public function's autograd path without the detour through the dispatcher (see
    ops/_direct.py)."""

    @staticmethod
    def forward(ctx, input, weight, bias, eps):
        with _direct.BelowAutograd():
            out, mean, rstd = _forward_entry(input, weight, bias, eps)
        _save(ctx, input, weight, bias, mean, rstd)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        return _backward(ctx, grad_output)


_apply_function = _direct.bind_apply(_Function)
_unwrap = _direct.unwrap_if_dead


def direct(input, weight, bias, eps):
    """``forward(input, weight, bias, eps)[0]`` with autograd, where ``direct_call_allowed()``."""
    if torch.is_grad_enabled() and (
        input.requires_grad
        or (weight is not None and weight.requires_grad)
        or (bias is not None and bias.requires_grad)
    ):
        return _apply_function(
            _unwrap(input),
            None if weight is None else _unwrap(weight),
            None if bias is None else _unwrap(bias),
            eps,
        )
    with _direct.BelowAutograd():
        return _forward_entry(input, weight, bias, eps)[0]


torch.library.register_autograd("fusedops::layer_norm", _backward, setup_context=_setup_context)
_direct.register_no_double_backward("fusedops::layer_norm_backward", "fusedops.layer_norm")


# ---- autocast ------------------------------------------------------------------------------

_lib = torch.library.Library("fusedops", "IMPL")


def _autocast(input, weight, bias, eps):
    # A weight and bias of two dtypes are refused by the op whatever the rule: left as the user
    # passed them, so that the error names their dtypes rather than a cast one's.
    if weight is None or bias is None or weight.dtype == bias.dtype:
        weight, bias = _norm.autocast_param(input, weight), _norm.autocast_param(input, bias)
    with torch._C._ExcludeDispatchKeyGuard(_norm.AUTOCAST_KEYS):
        return forward(input, weight, bias, eps)


_lib.impl("layer_norm", _autocast, "AutocastCPU")
_lib.impl("layer_norm", _autocast, "AutocastCUDA")


# ---- Triton, for CUDA tensors when the CUDA kernels do not serve them (ops/__init__.py) -------


def _triton_forward(input, weight, bias, eps):
    check_forward(input, weight, bias, eps)
    from ..triton import layer_norm as kernels

    return kernels.layer_norm_forward(input, weight, bias, eps)


def _triton_backward(grad_output, input, weight, bias, mean, rstd, weight_requires_grad, bias_requires_grad):
    check_backward(grad_output, input, weight, bias, mean, rstd)
    from ..triton import layer_norm as kernels

    return kernels.layer_norm_backward(
        grad_output, input, weight, bias, mean, rstd, weight_requires_grad, bias_requires_grad
    )


TRITON_IMPLS = {"layer_norm": _triton_forward, "layer_norm_backward": _triton_backward}
