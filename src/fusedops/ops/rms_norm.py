"""rms_norm: fake kernels, autograd, autocast rule and Triton hook-up.

Schemas (csrc/registration.cpp):
    rms_norm(Tensor input, Tensor? weight, float eps, float offset=0., bool cast_before_weight=False,
             bool save_output=False) -> (Tensor output, Tensor rstd)
    rms_norm_backward(Tensor grad_output, Tensor saved, Tensor? weight, Tensor rstd, float offset,
                      bool saved_is_output, bool weight_requires_grad)
        -> (Tensor grad_input, Tensor grad_weight)

Saved for backward, no copies, by default: input, weight and rstd (one float per row); backward
re-derives xhat = input * rstd. For a (rows, n) bf16 input that is 2*rows*n + 4*rows bytes, the
input itself. With ``save_output=True`` the output takes the input's place and backward
recovers xhat = output / (offset + weight): the same bytes, but they are bytes autograd
usually holds anyway (the next layer's matmul saves its input, our output), so the input can be
freed: in a transformer block that is one activation-sized tensor per norm. The price is
precision where (offset + weight) is tiny: xhat is then recovered from a rounded product.

``save_output`` only changes what autograd keeps; the kernels ignore it.

Autocast rule (CPU and CUDA): no input is cast. The kernels compute in float32 whatever the
storage dtype, so upcasting bf16/fp16 activations (torch's rule for its norms) would only
double the memory traffic; the output keeps the input's dtype. A weight whose dtype goes with
neither the input's nor float32 is cast to the input's dtype.
"""

import torch

from . import _direct, _norm

forward = torch.ops.fusedops.rms_norm.default
backward = torch.ops.fusedops.rms_norm_backward.default
_backward_entry = backward._op  # (OpOverload.__call__ minus its Python frame)


def check_forward(input, weight, eps, offset=0.0):
    _norm.check_forward("rms_norm", input, weight, None, eps, offset)


def check_backward(grad_output, saved, weight, rstd, offset, saved_is_output):
    _norm.check_given("rms_norm_backward", saved=saved)
    _norm.check_backward(
        "rms_norm_backward", "rms_norm", grad_output, saved, weight, None, None, rstd, offset, saved_is_output
    )


@torch.library.register_fake("fusedops::rms_norm")
def _forward_fake(input, weight, eps, offset=0.0, cast_before_weight=False, save_output=False):
    check_forward(input, weight, eps, offset)
    return _norm.output_like(input), _norm.row_stat(input)


@torch.library.register_fake("fusedops::rms_norm_backward")
def _backward_fake(grad_output, saved, weight, rstd, offset, saved_is_output, weight_requires_grad):
    check_backward(grad_output, saved, weight, rstd, offset, saved_is_output)
    return _norm.output_like(saved), _norm.param_grad(saved, weight, weight_requires_grad)


# ---- autograd ------------------------------------------------------------------------------


def _save(ctx, input, weight, out, rstd, offset, save_output):
    ctx.save_for_backward(out if save_output else input, weight, rstd)
    ctx.offset = offset
    ctx.saved_is_output = save_output


def _setup_context(ctx, inputs, output):
    input, weight, _eps, offset, _cast, save_output = inputs
    out, rstd = output
    ctx.mark_non_differentiable(rstd)
    _save(ctx, input, weight, out, rstd, offset, save_output)


def _backward(ctx, grad_output, _grad_rstd=None):
    saved, weight, rstd = ctx.saved_tensors
    need_input, need_weight = ctx.needs_input_grad[:2]
    with _direct.below_autograd_unless_grad():  # create_graph=True: the op reports double backward
        grad_input, grad_weight = _backward_entry(
            grad_output, saved, weight, rstd, ctx.offset, ctx.saved_is_output, need_weight
        )
    return (grad_input if need_input else None), (grad_weight if need_weight else None), None, None, None, None


# The op's pybind entry point: what OpOverload.__call__ forwards to, one Python frame less.
_forward_entry = forward._op


class _Function(torch.autograd.Function):
    """The public function's autograd path: the registered autograd (_setup_context, _backward)
    without the detour through the dispatcher (see ops/_direct.py)."""

    @staticmethod
    def forward(ctx, input, weight, eps, offset, cast_before_weight, save_output):
        with _direct.BelowAutograd():
            out, rstd = _forward_entry(input, weight, eps, offset, cast_before_weight, save_output)
        _save(ctx, input, weight, out, rstd, offset, save_output)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        return _backward(ctx, grad_output)


_apply_function = _direct.bind_apply(_Function)
_unwrap = _direct.unwrap_if_dead


def direct(input, weight, eps, offset=0.0, cast_before_weight=False, save_output=False):
    """``forward(...)[0]`` with autograd, where ``_direct.direct_call_allowed()``."""
    if torch.is_grad_enabled() and (input.requires_grad or (weight is not None and weight.requires_grad)):
        return _apply_function(
            _unwrap(input), None if weight is None else _unwrap(weight), eps, offset, cast_before_weight, save_output
        )
    with _direct.BelowAutograd():
        return _forward_entry(input, weight, eps, offset, cast_before_weight, save_output)[0]


torch.library.register_autograd("fusedops::rms_norm", _backward, setup_context=_setup_context)
_direct.register_no_double_backward("fusedops::rms_norm_backward", "fusedops.rms_norm")


# ---- autocast ------------------------------------------------------------------------------

_lib = torch.library.Library("fusedops", "IMPL")


def _autocast(input, weight, eps, offset=0.0, cast_before_weight=False, save_output=False):
    with torch._C._ExcludeDispatchKeyGuard(_norm.AUTOCAST_KEYS):
        return forward(input, _norm.autocast_param(input, weight), eps, offset, cast_before_weight, save_output)


_lib.impl("rms_norm", _autocast, "AutocastCPU")
_lib.impl("rms_norm", _autocast, "AutocastCUDA")


# ---- Triton, for CUDA tensors when the CUDA kernels do not serve them (ops/__init__.py) -------


def _triton_forward(input, weight, eps, offset=0.0, cast_before_weight=False, save_output=False):
    check_forward(input, weight, eps, offset)
    from ..triton import rms_norm as kernels  # (it sets the device for its launches)

    return kernels.rms_norm_forward(input, weight, eps, offset, cast_before_weight)


def _triton_backward(grad_output, saved, weight, rstd, offset, saved_is_output, weight_requires_grad):
    check_backward(grad_output, saved, weight, rstd, offset, saved_is_output)
    from ..triton import rms_norm as kernels

    return kernels.rms_norm_backward(grad_output, saved, weight, rstd, offset, saved_is_output, weight_requires_grad)


TRITON_IMPLS = {"rms_norm": _triton_forward, "rms_norm_backward": _triton_backward}
