"""fusedops.nn.AddRMSNorm: a pre-norm transformer's residual add and RMSNorm as one module."""

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..functional import _flag, _real_number, add_rms_norm, add_rms_norm_
from ..ops._direct import records_grad
from ._normalized_shape import require_tensor
from .rms_norm import _default_eps


def _add_rms_norm_module(input, residual, weight, hidden_size, eps, offset, cast_before_weight, inplace):
    """AddRMSNorm.forward as a function of the module's state: what a torch.fx trace records (one
    call, torch.fx.wrap below, kept by dead-code elimination: it may update residual), so that
    the module's checks run when the graph runs."""
    require_tensor("AddRMSNorm", "input", input)
    require_tensor("AddRMSNorm", "residual", residual)
    if input.shape[-1:] != (hidden_size,):
        # (the op would blame the weight, which is the module's and right)
        raise ValueError(
            f"AddRMSNorm: input's trailing shape {list(input.shape[-1:])} does not match hidden_size {hidden_size}"
        )
    eps = _default_eps(input.dtype) if eps is None else eps
    args = (input, residual, weight, eps, offset, cast_before_weight)
    if inplace and not records_grad(input, residual, weight):
        return add_rms_norm_(*args), residual
    return add_rms_norm(*args)


torch.fx.wrap("_add_rms_norm_module")
torch.fx.node.has_side_effect(_add_rms_norm_module)


class AddRMSNorm(torch.nn.Module):
    """``forward(input, residual) -> (output, residual_out)``: ``residual_out = input + residual``
    and ``output = RMSNorm(residual_out)``, by :func:`fusedops.add_rms_norm`. Its state is that
    of an :class:`RMSNorm` over the last dimension (``weight``), so a model's norm weights load
    as they are.

    ``eps=None`` means the machine epsilon of the computation type, as for
    :class:`fusedops.nn.RMSNorm`; ``offset`` and ``cast_before_weight`` are as there too. With
    ``inplace=True`` and no gradient wanted, the sum is written into ``residual`` (and returned
    as residual_out) instead of a new tensor: the inference form, :func:`fusedops.add_rms_norm_`.
    """

    __constants__ = ["hidden_size", "eps", "elementwise_affine", "offset", "cast_before_weight", "inplace"]

    def __init__(
        self,
        hidden_size: int,
        eps: Optional[float] = 1e-6,
        elementwise_affine: bool = True,
        device=None,
        dtype=None,
        *,
        offset: float = 0.0,
        cast_before_weight: bool = False,
        inplace: bool = False,
    ) -> None:
        super().__init__()
        self.hidden_size = int(hidden_size)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.offset = _real_number("AddRMSNorm", "offset", offset)
        if self.offset != 0.0 and not elementwise_affine:
            # (refused here, not at every forward: the op raises for an offset without a weight)
            raise ValueError(f"AddRMSNorm: offset scales the weight (offset + weight), so it needs "
                             f"elementwise_affine=True; got offset {self.offset:g} without a weight")
        self.cast_before_weight = _flag("AddRMSNorm", "cast_before_weight", cast_before_weight)
        self.inplace = _flag("AddRMSNorm", "inplace", inplace)
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.empty(self.hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.constant_(self.weight, 1.0 - self.offset)

    def forward(self, input: Tensor, residual: Tensor) -> Tuple[Tensor, Tensor]:
        return _add_rms_norm_module(
            input, residual, self.weight, self.hidden_size, self.eps, self.offset, self.cast_before_weight, self.inplace
        )

    def extra_repr(self) -> str:
        return (
            f"{self.hidden_size}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, offset={self.offset}, "
            f"cast_before_weight={self.cast_before_weight}, inplace={self.inplace}"
        )
