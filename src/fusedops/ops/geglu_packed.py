"""geglu_packed(gate_up, approximate) = geglu(gate_up[..., :n], gate_up[..., n:], approximate).

Schemas (csrc/registration.cpp):
    geglu_packed(Tensor gate_up, str approximate="none") -> Tensor
    geglu_packed_backward(Tensor grad_output, Tensor gate_up, str approximate="none") -> Tensor

Fake kernels, autograd (saved tensors, recomputation), autocast rule and Triton hook-up are the
gated family's, in ops/_gated.py.
"""

from . import _gated

_op = _gated.GatedOp("geglu_packed")

forward = _op.forward
backward = _op.backward
check_forward = _op.check_forward
check_backward = _op.check_backward
direct = _op.direct
TRITON_IMPLS = _op.triton_impls()
