"""swiglu_packed(gate_up) = swiglu(gate_up[..., :n], gate_up[..., n:]), gate_up of last dimension 2n.

Schemas (csrc/registration.cpp):
    swiglu_packed(Tensor gate_up) -> Tensor
    swiglu_packed_backward(Tensor grad_output, Tensor gate_up) -> Tensor   (one (..., 2n) gradient)

Fake kernels, autograd (saved tensors, recomputation), autocast rule and Triton hook-up are the
gated family's, in ops/_gated.py.
"""

from . import _gated

_op = _gated.GatedOp("swiglu_packed")

forward = _op.forward
backward = _op.backward
check_forward = _op.check_forward
check_backward = _op.check_backward
direct = _op.direct
TRITON_IMPLS = _op.triton_impls()
