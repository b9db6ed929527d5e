"""Triton residual add + RMSNorm, forward and backward: the row-normalisation
kernels of :mod:`fusedops.triton._norm` with a residual and without centring.

    h[r, j] = input[r, j] + residual[r, j]                       (-> residual's dtype: residual_out)
    y       = rms_norm(h)                                        (-> input's dtype)

The sum is written once and normalised from registers; the output is exactly
the RMSNorm of ``residual_out``.  The math, launch strategy, deterministic
weight gradient and copy rules are described in :mod:`fusedops.triton._norm`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _norm

__all__ = ["add_rms_norm_forward", "add_rms_norm_backward"]


def add_rms_norm_forward(
    input: Tensor,
    residual: Tensor,
    weight: Optional[Tensor],
    eps: float,
    offset: float,
    cast_before_weight: bool,
    residual_out: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Residual add + RMSNorm forward.  Returns ``(output, residual_out, rstd)``.

    ``residual_out`` receives ``input + residual`` in residual's dtype: a new
    contiguous tensor when None, else the given tensor (any strides; it may be
    ``residual`` itself), which is returned.
    """
    if residual_out is None:
        residual_out = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    output, _, rstd = _norm.forward(
        input, weight, None, eps, False,
        offset=offset, cast_before_weight=cast_before_weight,
        residual=residual, residual_out=residual_out,
    )
    return output, residual_out, rstd


def add_rms_norm_backward(
    grad_output: Tensor,
    grad_residual_out: Optional[Tensor],
    residual_out: Tensor,
    weight: Optional[Tensor],
    rstd: Tensor,
    offset: float,
    weight_requires_grad: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Residual add + RMSNorm backward.  Returns ``(grad_input, grad_residual, grad_weight)``.

    The gradient with respect to the sum (that of the normalisation, plus
    ``grad_residual_out`` when given) goes to both addends: ``grad_input`` holds
    it in grad_output's dtype, ``grad_residual`` in residual_out's dtype, or is
    an empty ``(0,)`` tensor when those dtypes are the same (``grad_input`` then
    serves both).  ``grad_weight`` is as for RMSNorm, except that without a
    weight its empty stand-in has residual_out's dtype.
    """
    want_dw = weight is not None and bool(weight_requires_grad)
    grad_weight = _norm.param_grad(residual_out, weight, want_dw)
    separate = residual_out.dtype != grad_output.dtype
    if separate:
        grad_residual = torch.empty(residual_out.shape, dtype=residual_out.dtype, device=residual_out.device)
    else:
        grad_residual = residual_out.new_empty((0,))
    grad_input = _norm.backward(
        grad_output, residual_out, weight, None, rstd, grad_weight if want_dw else None, None,
        offset=offset, grad_residual_out=grad_residual_out,
        grad_residual=grad_residual if separate else None,
    )
    return grad_input, grad_residual, grad_weight
