"""fusedops.nn.RMSNorm: a drop-in for torch.nn.RMSNorm."""

import numbers
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from ..functional import _flag, _real_number, rms_norm
from ._normalized_shape import apply_over_trailing, require_tensor


_FLOAT32_EPS = torch.finfo(torch.float32).eps
_FLOAT64_EPS = torch.finfo(torch.float64).eps


def _default_eps(dtype: torch.dtype) -> float:
    # The epsilon of the computation type (float32 for the 16-bit types), as torch.nn.RMSNorm.
    return _FLOAT64_EPS if dtype == torch.float64 else _FLOAT32_EPS


def _rms_norm_module(input, weight, normalized_shape, eps, offset, cast_before_weight, save_output):
    """RMSNorm.forward as a function of the module's state: what a torch.fx trace records (one
    call, torch.fx.wrap below), so that the module's checks run when the graph runs."""
    require_tensor("RMSNorm", "input", input)
    eps = _default_eps(input.dtype) if eps is None else eps
    options = (offset, cast_before_weight, save_output)
    return apply_over_trailing(rms_norm, "RMSNorm", input, normalized_shape, (weight,), eps, options)


torch.fx.wrap("_rms_norm_module")


class RMSNorm(torch.nn.Module):
    """Same constructor, attributes and state_dict keys as :class:`torch.nn.RMSNorm`
    (``weight`` when ``elementwise_affine``), computed by :func:`fusedops.rms_norm`.

    As in torch (2.7 and later), ``eps=None`` means the machine epsilon of the type the norm
    computes in: ``torch.finfo(torch.float32).eps`` for float32, bfloat16 and float16 input,
    ``torch.finfo(torch.float64).eps`` for float64. A ``normalized_shape`` of
    several dimensions normalises over all of them (those trailing dimensions are flattened into
    one, which copies only if they cannot be viewed as one).

    Beyond torch's arguments (keyword-only): ``offset`` (the weight scales as ``offset +
    weight``; Gemma uses 1.0, and the weight then starts at ``1 - offset`` so the initial scale
    is 1), ``cast_before_weight`` (LLaMA's casting) and ``save_output`` (the memory-saving
    backward); see :func:`fusedops.rms_norm`.
    """

    __constants__ = ["normalized_shape", "eps", "elementwise_affine", "offset", "cast_before_weight", "save_output"]

    def __init__(
        self,
        normalized_shape: Union[int, Sequence[int]],
        eps: Optional[float] = None,
        elementwise_affine: bool = True,
        device=None,
        dtype=None,
        *,
        offset: float = 0.0,
        cast_before_weight: bool = False,
        save_output: bool = False,
    ) -> None:
        super().__init__()
        self.offset = _real_number("RMSNorm", "offset", offset)
        if self.offset != 0.0 and not elementwise_affine:
            # (refused here, not at every forward: the op raises for an offset without a weight)
            raise ValueError(f"RMSNorm: offset scales the weight (offset + weight), so it needs "
                             f"elementwise_affine=True; got offset {self.offset:g} without a weight")
        self.cast_before_weight = _flag("RMSNorm", "cast_before_weight", cast_before_weight)
        self.save_output = _flag("RMSNorm", "save_output", save_output)
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.constant_(self.weight, 1.0 - self.offset)

    def forward(self, input: Tensor) -> Tensor:
        return _rms_norm_module(
            input, self.weight, self.normalized_shape, self.eps, self.offset, self.cast_before_weight, self.save_output
        )

    def extra_repr(self) -> str:
        extra = "".join(
            f", {name}={getattr(self, name)}"
            for name, default in (("offset", 0.0), ("cast_before_weight", False), ("save_output", False))
            if getattr(self, name) != default
        )
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}{extra}"
