"""Direct calls from the public functions into the registered ops, for small inputs.

A registered op is autograd-aware through ``torch.library.register_autograd``, which puts a
Python function at the dispatcher's Autograd key: every call, with or without gradients,
crosses from C++ back into Python and redispatches from there. On a 16x4096 input that round
trip costs more than the kernel. The public functions therefore call

* their op's ``torch.autograd.Function`` directly (``bind_apply``) when an input requires
  grad, and
* ``below_autograd(op, ...)``: the op under ``AutoDispatchBelowAutograd`` otherwise (and inside
  that Function), which is exactly where the Autograd kernel would have redispatched to.

Both give the same values and gradients as the registered path. They are used only when
``direct_call_allowed()``: never while torch.compile traces (Dynamo sees the registered op),
under autocast (whose rule runs above autograd and may cast arguments the Function would then
save uncast), or inside functorch transforms (which need ``Function.apply``'s own handling).
"""

import torch

_BelowAutograd = torch._C._AutoDispatchBelowAutograd
_any_autocast = torch._C._is_any_autocast_enabled
_functorch_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead
_is_compiling = torch.compiler.is_compiling
# Function.apply without its Python prologue (argument binding for setup_context-style
# Functions, functorch dispatch): the C++ autograd.Function entry point.
_base_apply = torch._C._FunctionBase.__dict__["apply"]


def direct_call_allowed() -> bool:
    return not (_is_compiling() or _any_autocast() or _functorch_active())


def below_autograd(op, *args):
    with _BelowAutograd():
        return op(*args)


def bind_apply(function):
    """A fast ``function.apply`` for a Function whose forward takes (ctx, *args)."""
    base = _base_apply.__get__(None, function)

    def apply(*args):
        # Tensors that outlived a functorch transform are unwrapped first, as Function.apply does.
        return base(*(_unwrap_if_dead(a) if isinstance(a, torch.Tensor) else a for a in args))

    return apply
