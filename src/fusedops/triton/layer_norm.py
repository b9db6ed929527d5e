"""Triton LayerNorm, forward and backward: the row-normalisation kernels of
:mod:`fusedops.triton._norm` with centring and an optional bias.

    mean[r] = mean_j x[r, j],   rstd[r] = 1 / sqrt(mean_j (x[r, j] - mean[r])^2 + eps)
    y[r, j] = (x[r, j] - mean[r]) * rstd[r] * w[j] + b[j]

The math, launch strategy, deterministic parameter gradients and copy rules are
described there.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from . import _norm

__all__ = ["layer_norm_forward", "layer_norm_backward"]


def layer_norm_forward(
    input: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm forward.  Returns ``(output, mean, rstd)``."""
    return _norm.forward(input, weight, bias, eps, True)


def layer_norm_backward(
    grad_output: Tensor,
    input: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    mean: Tensor,
    rstd: Tensor,
    weight_requires_grad: bool,
    bias_requires_grad: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm backward.  Returns ``(grad_input, grad_weight, grad_bias)``.

    ``bias`` is only looked at for its dtype (the gradient of the bias does not
    depend on its value).  A parameter's gradient is an empty ``(0,)`` tensor (in
    that parameter's dtype, or input's without it) unless the parameter is given
    and its ``*_requires_grad`` is true.
    """
    want_dw = weight is not None and bool(weight_requires_grad)
    want_db = bias is not None and bool(bias_requires_grad)
    grad_weight = _norm.param_grad(input, weight, want_dw)
    grad_bias = _norm.param_grad(input, bias, want_db)
    grad_input = _norm.backward(
        grad_output, input, weight, mean, rstd,
        grad_weight if want_dw else None, grad_bias if want_db else None,
    )
    return grad_input, grad_weight, grad_bias
