"""The public functional API: defaults, documentation, and the outputs users want.

Each function is a thin call into the registered op (torch.ops.fusedops.<op>), so autograd,
autocast, torch.compile and the fake kernels all come from the op's registration. In eager mode
outside autocast the call skips the dispatcher's round trip through Python (ops/_direct.py)."""

from typing import Optional

import torch
from torch import Tensor

from ._native import PRECHECK_ARGUMENTS
from .ops import layer_norm as _layer_norm
from .ops import rms_norm as _rms_norm
from .ops._direct import direct_call_allowed

_rms_norm_op = _rms_norm.forward
_layer_norm_op = _layer_norm.forward


def rms_norm(input: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6) -> Tensor:
    r"""Root-mean-square normalisation over the last dimension.

    .. math:: y = \frac{x}{\sqrt{\operatorname{mean}(x^2) + \epsilon}} \cdot w

    Args:
        input: ``(..., n)`` tensor, float32, bfloat16, float16 or float64; any strides on the
            leading dimensions (no copy is made unless the last dimension is strided).
        weight: optional ``(n,)`` scale, in input's dtype or float32 (with bf16/fp16 input).
        eps: added to the mean square before the square root.

    Returns:
        A contiguous tensor of input's shape and dtype. The math is float32 (float64 for
        float64 input) whatever the storage dtype.
    """
    if direct_call_allowed():
        if PRECHECK_ARGUMENTS:
            _rms_norm.check_forward(input, weight, eps)
        return _rms_norm.direct(input, weight, eps)
    if PRECHECK_ARGUMENTS and not torch.compiler.is_compiling() and not torch.is_autocast_enabled(input.device.type):
        _rms_norm.check_forward(input, weight, eps)  # (autocast may still cast the weight)
    return _rms_norm_op(input, weight, eps)[0]


def layer_norm(
    input: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, eps: float = 1e-5
) -> Tensor:
    r"""Layer normalisation over the last dimension.

    .. math:: y = \frac{x - \operatorname{mean}(x)}{\sqrt{\operatorname{var}(x) + \epsilon}} \cdot w + b

    with the biased variance, as :func:`torch.nn.functional.layer_norm`.

    Args:
        input: ``(..., n)`` tensor, float32, bfloat16, float16 or float64; any strides on the
            leading dimensions (no copy is made unless the last dimension is strided).
        weight: optional ``(n,)`` scale, in input's dtype or float32 (with bf16/fp16 input).
        bias: optional ``(n,)`` shift, in weight's dtype (the same rule when there is no weight).
        eps: added to the variance before the square root.

    Returns:
        A contiguous tensor of input's shape and dtype. The math is float32 (float64 for
        float64 input) whatever the storage dtype.
    """
    if direct_call_allowed():
        if PRECHECK_ARGUMENTS:
            _layer_norm.check_forward(input, weight, bias, eps)
        return _layer_norm.direct(input, weight, bias, eps)
    if PRECHECK_ARGUMENTS and not torch.compiler.is_compiling() and not torch.is_autocast_enabled(input.device.type):
        _layer_norm.check_forward(input, weight, bias, eps)
    return _layer_norm_op(input, weight, bias, eps)[0]
