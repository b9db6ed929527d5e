"""geglu(gate, up, approximate) = gelu(gate, approximate) * up.

Schemas (csrc/registration.cpp):
    geglu(Tensor gate, Tensor up, str approximate="none") -> Tensor
    geglu_backward(Tensor grad_output, Tensor gate, Tensor up, str approximate="none")
        -> (Tensor grad_gate, Tensor grad_up)

Fake kernels, autograd (saved tensors, recomputation), autocast rule and Triton hook-up are the
gated family's, in ops/_gated.py.
"""

from . import _gated

_op = _gated.GatedOp("geglu")

forward = _op.forward
backward = _op.backward
check_forward = _op.check_forward
check_backward = _op.check_backward
direct = _op.direct
TRITON_IMPLS = _op.triton_impls()
