"""fusedops.nn.LayerNorm: a drop-in for torch.nn.LayerNorm."""

import numbers
from typing import Sequence, Union

import torch
from torch import Tensor

from ..functional import layer_norm
from ._normalized_shape import apply_over_trailing


def _layer_norm_module(input, weight, bias, normalized_shape, eps):
    """LayerNorm.forward as a function of the module's state: what a torch.fx trace records (one
    call, torch.fx.wrap below), so that the module's checks run when the graph runs."""
    return apply_over_trailing(layer_norm, "LayerNorm", input, normalized_shape, (weight, bias), eps)


torch.fx.wrap("_layer_norm_module")


class LayerNorm(torch.nn.Module):
    """Same constructor, attributes and state_dict keys as :class:`torch.nn.LayerNorm`
    (``weight`` when ``elementwise_affine``, ``bias`` when also ``bias``), computed by
    :func:`fusedops.layer_norm`.

    A ``normalized_shape`` of several dimensions normalises over all of them (those trailing
    dimensions are flattened into one, which copies only if they cannot be viewed as one).
    """

    __constants__ = ["normalized_shape", "eps", "elementwise_affine"]

    def __init__(
        self,
        normalized_shape: Union[int, Sequence[int]],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        factory = {"device": device, "dtype": dtype}
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.empty(self.normalized_shape, **factory))
            if bias:
                self.bias = torch.nn.Parameter(torch.empty(self.normalized_shape, **factory))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.ones_(self.weight)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)

    def forward(self, input: Tensor) -> Tensor:
        return _layer_norm_module(input, self.weight, self.bias, self.normalized_shape, self.eps)

    def extra_repr(self) -> str:
        return (
            f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
            f"bias={self.bias is not None}"
        )
