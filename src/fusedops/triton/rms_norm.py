"""Triton RMSNorm, forward and backward: the row-normalisation kernels of
:mod:`fusedops.triton._norm` without centring and without a bias.

    rstd[r] = 1 / sqrt(mean_j x[r, j]^2 + eps),   y[r, j] = x[r, j] * rstd[r] * (offset + w[j])

with ``x * rstd`` optionally rounded to the input's dtype before the weight is
applied.  The math, launch strategy, deterministic weight gradient and copy
rules are described there.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from . import _norm

__all__ = ["rms_norm_forward", "rms_norm_backward"]


def rms_norm_forward(
    input: Tensor, weight: Optional[Tensor], eps: float, offset: float, cast_before_weight: bool
) -> tuple[Tensor, Tensor]:
    """RMSNorm forward.  Returns ``(output, rstd)``.

    ``offset`` is added to the weight (0 without one); with
    ``cast_before_weight``, the normalised row is rounded to the input's dtype
    before it is multiplied by the weight.
    """
    output, _, rstd = _norm.forward(
        input, weight, None, eps, False, offset=offset, cast_before_weight=cast_before_weight
    )
    return output, rstd


def rms_norm_backward(
    grad_output: Tensor,
    saved: Tensor,
    weight: Optional[Tensor],
    rstd: Tensor,
    offset: float,
    saved_is_output: bool,
    weight_requires_grad: bool,
) -> tuple[Tensor, Tensor]:
    """RMSNorm backward.  Returns ``(grad_input, grad_weight)``.

    ``saved`` is the forward's input, or its output when ``saved_is_output``
    (the normalised row is then recovered as ``output / (offset + weight)``).
    ``grad_weight`` is an empty ``(0,)`` tensor (in the weight's dtype when there
    is a weight) unless ``weight`` is given and ``weight_requires_grad``.
    """
    want_dw = weight is not None and bool(weight_requires_grad)
    grad_weight = _norm.param_grad(grad_output, weight, want_dw)
    grad_input = _norm.backward(
        grad_output, saved, weight, None, rstd, grad_weight if want_dw else None, None,
        offset=offset, saved_is_output=saved_is_output,
    )
    return grad_input, grad_weight
