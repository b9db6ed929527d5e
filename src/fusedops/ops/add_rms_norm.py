"""add_rms_norm and its in-place form add_rms_norm_: fake kernels, autograd, autocast rule and
Triton hook-up.

Schemas (csrc/registration.cpp):
    add_rms_norm(Tensor input, Tensor residual, Tensor? weight, float eps, float offset=0.,
                 bool cast_before_weight=False) -> (Tensor output, Tensor residual_out, Tensor rstd)
    add_rms_norm_(Tensor input, Tensor(a!) residual, Tensor? weight, float eps, float offset=0.,
                  bool cast_before_weight=False) -> (Tensor output, Tensor rstd)
    add_rms_norm_backward(Tensor grad_output, Tensor? grad_residual_out, Tensor residual_out,
                          Tensor? weight, Tensor rstd, float offset, bool weight_requires_grad)
        -> (Tensor grad_input, Tensor grad_residual, Tensor grad_weight)

residual_out = input + residual (rounded to residual's dtype, which may be float32 under bf16 or
fp16 activations: the residual stream kept wide), output = rms_norm(residual_out) in input's
dtype. Saved for backward: residual_out, weight and rstd, no copies: backward re-derives
xhat = residual_out * rstd. residual_out is the residual stream, which the model keeps for the
next block anyway, so the saved bytes are 4*rows beyond it. The gradient of input and of
residual is the same tensor (d residual_out, plus the norm's gradient): one kernel writes it
once per dtype.

add_rms_norm_ updates residual in place (its schema declares the mutation; torch.compile
functionalises it) and has no autograd: it is the inference form. It raises a clear error when
called on tensors that require grad with grad mode on.

Autocast rule (CPU and CUDA), as for rms_norm: nothing is cast but a weight whose dtype goes
with neither the input's nor float32 (cast to the input's dtype).
"""

import torch

from . import _direct, _norm

forward = torch.ops.fusedops.add_rms_norm.default
forward_ = torch.ops.fusedops.add_rms_norm_.default
backward = torch.ops.fusedops.add_rms_norm_backward.default
_backward_entry = backward._op  # (OpOverload.__call__ minus its Python frame)


def check_forward(input, residual, weight, eps, offset=0.0, op="add_rms_norm"):
    _norm.check_add_forward(op, input, residual, weight, eps, offset, in_place=op == "add_rms_norm_")


def check_backward(grad_output, grad_residual_out, residual_out, weight, rstd, offset):
    _norm.check_add_backward(
        "add_rms_norm_backward", grad_output, grad_residual_out, residual_out, weight, rstd, offset
    )


@torch.library.register_fake("fusedops::add_rms_norm")
def _forward_fake(input, residual, weight, eps, offset=0.0, cast_before_weight=False):
    check_forward(input, residual, weight, eps, offset)
    return _norm.output_like(input), _norm.output_like(residual), _norm.row_stat(input)


@torch.library.register_fake("fusedops::add_rms_norm_")
def _forward_inplace_fake(input, residual, weight, eps, offset=0.0, cast_before_weight=False):
    check_forward(input, residual, weight, eps, offset, op="add_rms_norm_")
    return _norm.output_like(input), _norm.row_stat(input)


def _grad_residual_like(grad_output, residual_out):
    # Empty when residual_out has grad_output's dtype: grad_input is then the gradient of both.
    if residual_out.dtype == grad_output.dtype:
        return residual_out.new_empty((0,))
    return _norm.output_like(residual_out)


@torch.library.register_fake("fusedops::add_rms_norm_backward")
def _backward_fake(grad_output, grad_residual_out, residual_out, weight, rstd, offset, weight_requires_grad):
    check_backward(grad_output, grad_residual_out, residual_out, weight, rstd, offset)
    return (
        torch.empty_like(residual_out, dtype=grad_output.dtype, memory_format=torch.contiguous_format),
        _grad_residual_like(grad_output, residual_out),
        _norm.param_grad(residual_out, weight, weight_requires_grad),
    )


# ---- autograd ------------------------------------------------------------------------------


def _save(ctx, weight, residual_out, rstd, offset):
    if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
        # x + residual does not depend on the weight: a trainable weight alone must not make the
        # residual stream look differentiable (an add_rms_norm_ on it would then be refused)
        ctx.mark_non_differentiable(residual_out)
    ctx.save_for_backward(residual_out, weight, rstd)
    ctx.offset = offset
    # An unused output's gradient stays None rather than a tensor of zeros the kernel would read.
    ctx.set_materialize_grads(False)


def _setup_context(ctx, inputs, output):
    _input, _residual, weight, _eps, offset, _cast = inputs
    _out, residual_out, rstd = output
    ctx.mark_non_differentiable(rstd)
    _save(ctx, weight, residual_out, rstd, offset)


def _backward(ctx, grad_output, grad_residual_out, _grad_rstd=None):
    residual_out, weight, rstd = ctx.saved_tensors
    need_input, need_residual, need_weight = ctx.needs_input_grad[:3]
    if grad_output is None and grad_residual_out is None:
        return None, None, None, None, None, None
    if grad_output is None:  # only residual_out was used: the norm contributes nothing
        grad_input = grad_residual_out.to(ctx.input_dtype) if need_input else None
        return grad_input, grad_residual_out if need_residual else None, None, None, None, None
    with _direct.below_autograd_unless_grad():  # create_graph=True: the op reports double backward
        grad_input, grad_residual, grad_weight = _backward_entry(
            grad_output, grad_residual_out, residual_out, weight, rstd, ctx.offset, need_weight
        )
    if residual_out.dtype == grad_output.dtype:
        grad_residual = grad_input
    return (
        grad_input if need_input else None,
        grad_residual if need_residual else None,
        grad_weight if need_weight else None,
        None,
        None,
        None,
    )


def _setup_context_with_dtype(ctx, inputs, output):
    _setup_context(ctx, inputs, output)
    ctx.input_dtype = inputs[0].dtype


_forward_entry = forward._op
_forward_inplace_entry = forward_._op


class _Function(torch.autograd.Function):
    """The public function's autograd path without the detour through the dispatcher (see
    ops/_direct.py)."""

    @staticmethod
    def forward(ctx, input, residual, weight, eps, offset, cast_before_weight):
        with _direct.BelowAutograd():
            out, residual_out, rstd = _forward_entry(input, residual, weight, eps, offset, cast_before_weight)
        _save(ctx, weight, residual_out, rstd, offset)
        ctx.input_dtype = input.dtype
        return out, residual_out

    @staticmethod
    def backward(ctx, grad_output, grad_residual_out):
        return _backward(ctx, grad_output, grad_residual_out)


_apply_function = _direct.bind_apply(_Function)
_unwrap = _direct.unwrap_if_dead


def direct(input, residual, weight, eps, offset=0.0, cast_before_weight=False):
    """``forward(...)[:2]`` with autograd, where ``_direct.direct_call_allowed()``."""
    if _direct.records_grad(input, residual, weight):
        return _apply_function(
            _unwrap(input), _unwrap(residual), None if weight is None else _unwrap(weight), eps, offset,
            cast_before_weight,
        )
    with _direct.BelowAutograd():
        out, residual_out, _rstd = _forward_entry(input, residual, weight, eps, offset, cast_before_weight)
    return out, residual_out


def _inplace_no_grad_check(input, residual, weight):
    _direct.refuse_inference_tensor_update("add_rms_norm_", residual=residual)
    if _direct.records_grad(input, residual, weight):
        raise RuntimeError(
            "fusedops.add_rms_norm_ updates residual in place and has no gradient (it is the inference form); "
            "use fusedops.add_rms_norm when gradients are needed, or call it under torch.no_grad()"
        )


def direct_inplace(input, residual, weight, eps, offset=0.0, cast_before_weight=False):
    """``forward_(...)[0]``, where ``_direct.direct_call_allowed()``."""
    _inplace_no_grad_check(input, residual, weight)
    with _direct.BelowAutograd():
        out, _rstd = _forward_inplace_entry(input, residual, weight, eps, offset, cast_before_weight)
    torch.autograd.graph.increment_version(residual)
    return out


torch.library.register_autograd("fusedops::add_rms_norm", _backward, setup_context=_setup_context_with_dtype)
_direct.register_no_double_backward("fusedops::add_rms_norm_backward", "fusedops.add_rms_norm")

_lib = torch.library.Library("fusedops", "IMPL")


def _inplace_autograd(input, residual, weight, eps, offset=0.0, cast_before_weight=False):
    # The Autograd kernel of the in-place form: no gradient, but the mutation is recorded in
    # residual's version counter, so autograd notices if a saved copy of it is modified.
    _inplace_no_grad_check(input, residual, weight)
    with _direct.BelowAutograd():
        result = forward_(input, residual, weight, eps, offset, cast_before_weight)
    torch.autograd.graph.increment_version(residual)
    return result


_lib.impl("add_rms_norm_", _inplace_autograd, "Autograd")


# ---- autocast ------------------------------------------------------------------------------


def _autocast(input, residual, weight, eps, offset=0.0, cast_before_weight=False):
    with torch._C._ExcludeDispatchKeyGuard(_norm.AUTOCAST_KEYS):
        return forward(input, residual, _norm.autocast_param(input, weight), eps, offset, cast_before_weight)


def _autocast_inplace(input, residual, weight, eps, offset=0.0, cast_before_weight=False):
    with torch._C._ExcludeDispatchKeyGuard(_norm.AUTOCAST_KEYS):
        return forward_(input, residual, _norm.autocast_param(input, weight), eps, offset, cast_before_weight)


for _key in ("AutocastCPU", "AutocastCUDA"):
    _lib.impl("add_rms_norm", _autocast, _key)
    _lib.impl("add_rms_norm_", _autocast_inplace, _key)


# ---- Triton, for CUDA tensors when the CUDA kernels do not serve them (ops/__init__.py) -------


def _triton_forward(input, residual, weight, eps, offset=0.0, cast_before_weight=False):
    check_forward(input, residual, weight, eps, offset)
    from ..triton import add_rms_norm as kernels

    return kernels.add_rms_norm_forward(input, residual, weight, eps, offset, cast_before_weight)


def _triton_forward_inplace(input, residual, weight, eps, offset=0.0, cast_before_weight=False):
    check_forward(input, residual, weight, eps, offset, op="add_rms_norm_")
    from ..triton import add_rms_norm as kernels

    out, _residual_out, rstd = kernels.add_rms_norm_forward(
        input, residual, weight, eps, offset, cast_before_weight, residual_out=residual
    )
    return out, rstd


def _triton_backward(grad_output, grad_residual_out, residual_out, weight, rstd, offset, weight_requires_grad):
    check_backward(grad_output, grad_residual_out, residual_out, weight, rstd, offset)
    from ..triton import add_rms_norm as kernels

    return kernels.add_rms_norm_backward(
        grad_output, grad_residual_out, residual_out, weight, rstd, offset, weight_requires_grad
    )


TRITON_IMPLS = {
    "add_rms_norm": _triton_forward,
    "add_rms_norm_": _triton_forward_inplace,
    "add_rms_norm_backward": _triton_backward,
}
