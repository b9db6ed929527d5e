"""Direct calls from the public functions into the registered ops, for small inputs.

A registered op is autograd-aware through ``torch.library.register_autograd``, which puts a
Python function at the dispatcher's Autograd key: every call, with or without gradients,
crosses from C++ back into Python and redispatches from there. On a 16x4096 input that round
trip costs more than the kernel. The public functions therefore call

* their op's ``torch.autograd.Function`` directly (``bind_apply``) when an input requires
  grad, and
* the op under ``BelowAutograd`` (``AutoDispatchBelowAutograd``) otherwise and inside that
  Function, which is exactly where the Autograd kernel would have redispatched to.

Both give the same values and gradients as the registered path. They are used only when
``direct_call_allowed()``: never while torch.compile traces (Dynamo sees the registered op),
under autocast (whose rule runs above autograd and may cast arguments the Function would then
save uncast), or inside functorch transforms (which need ``Function.apply``'s own handling).
"""

import contextlib

import torch
import torch.autograd.forward_ad as _forward_ad

# Entered around a call, sends it past the Autograd keys: where the Autograd kernel redispatches.
BelowAutograd = torch._C._AutoDispatchBelowAutograd
# Returns a tensor that outlived a functorch transform unwrapped (as Function.apply does), any
# other tensor as it is.
_functorch = torch._C._functorch
unwrap_if_dead = _functorch.unwrap_if_dead
_any_autocast = torch._C._is_any_autocast_enabled
_functorch_active = torch._C._are_functorch_transforms_active
_is_compiling = torch.compiler.is_compiling
_inference_mode_enabled = torch.is_inference_mode_enabled
_dispatch_modes = torch._C._len_torch_dispatch_stack


def records_grad(*tensors) -> bool:
    """Whether autograd records a call on `tensors` (None for an absent optional one)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def dispatch_mode_active() -> bool:
    """Whether a TorchDispatchMode (selective activation checkpointing, FlopCounterMode, a
    tracer) sees the ops this thread calls now."""
    return _dispatch_modes() > 0


# Function.apply without its Python prologue (argument binding for setup_context-style
# Functions, functorch dispatch, unwrap_if_dead on every argument): the C++ entry point.
_base_apply = torch._C._FunctionBase.__dict__["apply"]


def direct_call_allowed(*tensors) -> bool:
    """Whether the public function may call its op directly (above). Raises NotImplementedError
    for a call under forward-mode AD, which no route supports: the op's tangent would come out
    zero or missing, silently. `tensors`: the call's differentiable inputs (None for an absent
    optional one)."""
    if _forward_ad._current_level >= 0:
        _refuse_tangents(tensors)
    return not (_is_compiling() or _any_autocast() or _functorch_active())


def _refuse_tangents(tensors):
    # A forward-mode level is open somewhere: the level is process-wide, so it may be another
    # thread's. This call loses a tangent if it runs inside torch.func's jvp (jacfwd, hessian) in
    # this thread, or if an input carries one (torch.autograd.forward_ad.make_dual).
    stack = _functorch.get_interpreter_stack() or ()
    if any(layer.key() == _functorch.TransformType.Jvp for layer in stack) or any(
        t is not None and _forward_ad.unpack_dual(t).tangent is not None for t in tensors
    ):
        raise NotImplementedError(
            "fusedops ops have no forward-mode AD (torch.func.jvp, jacfwd, hessian, torch.autograd.forward_ad): "
            "the tangent through them would be lost; use reverse mode (backward, torch.autograd.grad)"
        )


def bind_apply(function):
    """``function.apply`` minus its Python prologue, for a Function whose forward takes
    (ctx, *args). The caller passes tensors through ``unwrap_if_dead``."""
    return _base_apply.__get__(None, function)


_NO_GUARD = contextlib.nullcontext()


def below_autograd_unless_grad():
    """A backward formula's context: ``BelowAutograd`` when grad mode is off (the usual
    backward), nothing when it is on (create_graph=True), so that the registered backward op's
    own autograd runs and reports that double backward is not supported. (A function handing
    out the C++ guard, rather than a Python context manager class: two Python frames less per
    backward.)"""
    return _NO_GUARD if torch.is_grad_enabled() else BelowAutograd()


def refuse_inference_tensor_update(op: str, **mutated) -> None:
    """An in-place form's check that torch's own in-place ops make: an inference tensor (made
    under torch.inference_mode(), with no version counter) may be written only inside it."""
    if _inference_mode_enabled():
        return
    for name, t in mutated.items():
        if isinstance(t, torch.Tensor) and t.is_inference():  # (not a tensor: the op's own error)
            raise RuntimeError(
                f"fusedops.{op}: {name} is an inference tensor, which cannot be updated in place outside "
                "torch.inference_mode() (as torch's in-place ops refuse); call it under inference_mode, or clone it"
            )


def register_no_double_backward(backward_op: str, public_name: str) -> None:
    """Registers autograd for a backward op that says clearly that double backward (a gradient
    through the backward, create_graph=True) is not supported."""

    def _double_backward(ctx, *grads):
        raise NotImplementedError(
            f"{public_name} does not support double backward (create_graph=True through its backward)"
        )

    def _setup_context(ctx, inputs, output):
        pass

    torch.library.register_autograd(backward_op, _double_backward, setup_context=_setup_context)
