"""The gated activations (swiglu, geglu and their packed forms), written once: argument checks
in the same words as csrc/include/fusedops/gated.h, fake kernels, autograd, the direct call of
the public functions and the Triton hook-up. Each op's module (ops/<op>.py) is one ``GatedOp``.

Saved for backward: the forward's inputs only (gate and up, or gate_up), no copies; backward
recomputes the activation from gate. For a (rows, n) bf16 problem that is 4*rows*n bytes, which
autograd usually holds anyway (gate and up are the outputs of the projections' matmuls, whose
inputs are saved, not outputs: the gated op is what keeps them). Nothing of the output is saved.

Autocast rule (CPU and CUDA): none is registered, so autocast passes the inputs through
unchanged: the kernels compute in float32 whatever the storage dtype (upcasting bf16/fp16 would
only double the traffic), and the output has the inputs' dtype. gate and up must share a dtype
inside autocast as outside (under autocast both come from autocast's matmuls, which agree).
"""

import torch

from . import _direct
from ._norm import FLOAT_DTYPES, _same_device, check_given, dtype_name, shape_str

APPROXIMATE = ("none", "tanh")


def check_approximate(op, approximate):
    if approximate not in APPROXIMATE:
        raise ValueError(f'{op}: approximate must be "none" or "tanh", got "{approximate}"')


def check_input(op, t, name):
    if t.dim() < 1:
        raise ValueError(f"{op}: {name} must have at least 1 dimension, got a 0-dimensional tensor")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: {name} dtype must be float32, bfloat16, float16 or float64, got {dtype_name(t.dtype)}")


def check_like(op, t, name, ref, ref_name, shape):
    """`t` has shape `shape` (a list) and ref's dtype and device."""
    if list(t.shape) != list(shape):
        raise ValueError(f"{op}: {name} shape {shape_str(t)} does not match {ref_name} shape "
                         "[" + ", ".join(str(s) for s in shape) + "]")
    if t.dtype != ref.dtype:
        raise ValueError(f"{op}: {name} dtype {dtype_name(t.dtype)} does not match {ref_name} dtype {dtype_name(ref.dtype)}")
    if not _same_device(t, ref):
        raise ValueError(f"{op}: {name} is on {t.device} but {ref_name} is on {ref.device}")


def check_unpacked(op, gate, up, grad_output=None):
    check_input(op, gate, "gate")
    check_like(op, up, "up", gate, "gate", gate.shape)
    if grad_output is not None:
        check_like(op, grad_output, "grad_output", gate, "gate", gate.shape)


def packed_out_shape(gate_up):
    return list(gate_up.shape[:-1]) + [gate_up.shape[-1] // 2]


def check_packed(op, gate_up, grad_output=None):
    check_input(op, gate_up, "gate_up")
    if gate_up.shape[-1] % 2 != 0:
        raise ValueError(
            f"{op}: gate_up's last dimension must be even (it holds [gate | up]), got {gate_up.shape[-1]}"
        )
    if grad_output is not None:
        check_like(op, grad_output, "grad_output", gate_up, "the output", packed_out_shape(gate_up))


def _contiguous_like(t):
    return torch.empty_like(t, memory_format=torch.contiguous_format)


class GatedOp:
    """One gated op: `name` is swiglu, geglu, swiglu_packed or geglu_packed. Registers its fake
    kernels and autograd; ``direct`` is the public function's eager path (ops/_direct.py)."""

    def __init__(self, name):
        self.name = name
        self.packed = name.endswith("_packed")
        self.gelu = name.startswith("geglu")
        self._tensor_names = ("gate_up",) if self.packed else ("gate", "up")
        self.forward = getattr(torch.ops.fusedops, name).default
        self.backward = getattr(torch.ops.fusedops, name + "_backward").default
        self._forward_entry = self.forward._op
        self._register()

    # ---- checks (positional args as in the schema) ---------------------------------------------

    def check_forward(self, *args):
        op = self.name
        tensors, approximate = self._split(args)
        self._check_given(op, tensors)
        if self.gelu:
            check_approximate(op, approximate)
        if self.packed:
            check_packed(op, *tensors)
        else:
            check_unpacked(op, *tensors)

    def check_backward(self, grad_output, *args):
        op = self.name + "_backward"
        tensors, approximate = self._split(args)
        check_given(op, grad_output=grad_output)
        self._check_given(op, tensors)
        if self.gelu:
            check_approximate(op, approximate)
        if self.packed:
            check_packed(op, *tensors, grad_output=grad_output)
        else:
            check_unpacked(op, *tensors, grad_output=grad_output)

    def _check_given(self, op, tensors):
        check_given(op, **dict(zip(self._tensor_names, tensors)))

    def _split(self, args):
        """(the tensor arguments, approximate) of a forward's positional args."""
        k = 1 if self.packed else 2
        tensors = args[:k]
        approximate = args[k] if len(args) > k else "none"
        return tensors, approximate

    # ---- fake kernels, autograd ----------------------------------------------------------------

    def _register(self):
        name, packed = self.name, self.packed

        def forward_fake(*args, approximate="none"):
            args = args + ((approximate,) if self.gelu and len(args) < (2 if packed else 3) else ())
            self.check_forward(*args)
            if packed:
                (gate_up,) = args[:1]
                return gate_up.new_empty(packed_out_shape(gate_up))
            return _contiguous_like(args[0])

        def backward_fake(grad_output, *args, approximate="none"):
            args = args + ((approximate,) if self.gelu and len(args) < (2 if packed else 3) else ())
            self.check_backward(grad_output, *args)
            if packed:
                return _contiguous_like(args[0])
            return _contiguous_like(args[0]), _contiguous_like(args[0])

        torch.library.register_fake(f"fusedops::{name}", forward_fake)
        torch.library.register_fake(f"fusedops::{name}_backward", backward_fake)

        def setup_context(ctx, inputs, output):
            self._save(ctx, inputs)

        def backward(ctx, grad_output):
            return self._backward(ctx, grad_output)

        torch.library.register_autograd(f"fusedops::{name}", backward, setup_context=setup_context)
        _direct.register_no_double_backward(f"fusedops::{name}_backward", f"fusedops.{name}")

        gated_op = self

        class _Function(torch.autograd.Function):
            """The public function's autograd path: the registered autograd without the detour
            through the dispatcher (see ops/_direct.py)."""

            @staticmethod
            def forward(ctx, *args):
                with _direct.BelowAutograd():
                    out = gated_op._forward_entry(*args)
                gated_op._save(ctx, args)
                return out

            @staticmethod
            def backward(ctx, grad_output):
                return gated_op._backward(ctx, grad_output)

        _Function.__name__ = f"{name}_Function"
        self._apply_function = _direct.bind_apply(_Function)

    def _save(self, ctx, inputs):
        k = 1 if self.packed else 2
        ctx.save_for_backward(*inputs[:k])
        ctx.extra = tuple(inputs[k:])  # approximate, when given
        ctx.num_inputs = len(inputs)

    def _backward(self, ctx, grad_output):
        saved = ctx.saved_tensors
        with _direct.below_autograd_unless_grad():  # create_graph=True: the op reports double backward
            grads = self.backward(grad_output, *saved, *ctx.extra)
        nones = (None,) * (ctx.num_inputs - len(saved))
        if self.packed:
            return (grads if ctx.needs_input_grad[0] else None,) + nones
        grad_gate, grad_up = grads
        return (grad_gate if ctx.needs_input_grad[0] else None, grad_up if ctx.needs_input_grad[1] else None) + nones

    def direct(self, *args):
        """``forward(*args)`` with autograd, where ``_direct.direct_call_allowed()``."""
        k = 1 if self.packed else 2
        if _direct.records_grad(*args[:k]):
            unwrap = _direct.unwrap_if_dead
            return self._apply_function(*(unwrap(t) for t in args[:k]), *args[k:])
        with _direct.BelowAutograd():
            return self._forward_entry(*args)

    # ---- Triton, for CUDA tensors when the CUDA kernels do not serve them (ops/__init__.py) ---

    def triton_impls(self):
        def forward(*args, approximate="none"):
            args = args + ((approximate,) if self.gelu and len(args) < (2 if self.packed else 3) else ())
            self.check_forward(*args)
            from ..triton import _gated as kernels

            tensors, approximate = self._split(args)
            act = _act_name(self.gelu, approximate)
            if self.packed:
                return kernels.packed_forward(tensors[0], act)
            return kernels.forward(tensors[0], tensors[1], act)

        def backward(grad_output, *args, approximate="none"):
            args = args + ((approximate,) if self.gelu and len(args) < (2 if self.packed else 3) else ())
            self.check_backward(grad_output, *args)
            from ..triton import _gated as kernels

            tensors, approximate = self._split(args)
            act = _act_name(self.gelu, approximate)
            if self.packed:
                return kernels.packed_backward(grad_output, tensors[0], act)
            return kernels.backward(grad_output, tensors[0], tensors[1], act)

        return {self.name: forward, self.name + "_backward": backward}


def _act_name(gelu, approximate):
    return ("gelu_tanh" if approximate == "tanh" else "gelu") if gelu else "silu"
