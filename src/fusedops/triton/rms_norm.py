"""Triton RMSNorm, forward and backward: the row-normalisation kernels of
:mod:`fusedops.triton._norm` without centring and without a bias.

    rstd[r] = 1 / sqrt(mean_j x[r, j]^2 + eps),   y[r, j] = x[r, j] * rstd[r] * w[j]

The math, launch strategy, deterministic weight gradient and copy rules are
described there.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from . import _norm

__all__ = ["rms_norm_forward", "rms_norm_backward"]


def rms_norm_forward(input: Tensor, weight: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor]:
    """RMSNorm forward.  Returns ``(output, rstd)``."""
    output, _, rstd = _norm.forward(input, weight, None, eps, False)
    return output, rstd


def rms_norm_backward(
    grad_output: Tensor,
    input: Tensor,
    weight: Optional[Tensor],
    rstd: Tensor,
    weight_requires_grad: bool,
) -> tuple[Tensor, Tensor]:
    """RMSNorm backward.  Returns ``(grad_input, grad_weight)``.

    ``grad_weight`` is ``input.new_empty((0,))`` (in the weight's dtype when there
    is a weight) unless ``weight`` is given and ``weight_requires_grad``.
    """
    want_dw = weight is not None and bool(weight_requires_grad)
    grad_weight = _norm.param_grad(input, weight, want_dw)
    grad_input = _norm.backward(
        grad_output, input, weight, None, rstd, grad_weight if want_dw else None, None
    )
    return grad_input, grad_weight
