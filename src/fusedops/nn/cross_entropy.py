"""fusedops.nn.CrossEntropyLoss: a drop-in for torch.nn.CrossEntropyLoss."""

from typing import Optional, Union

import torch
from torch import Tensor

from ..functional import _flag, _real_number, cross_entropy
from ..ops.cross_entropy import check_target_mode


class CrossEntropyLoss(torch.nn.CrossEntropyLoss):
    """torch.nn.CrossEntropyLoss computed by :func:`fusedops.cross_entropy`: it is torch's class
    (same constructor, including the legacy ``size_average``/``reduce``, the ``weight`` buffer,
    ``state_dict`` and ``repr``) with another forward.

    One difference: the class dimension is **last**. ``(N, C)`` logits with ``(N,)`` targets (the
    usual ``logits.view(-1, V)``) mean the same as in torch; for more dimensions this module
    takes ``(..., C)`` logits with ``(...)`` targets (``(B, T, V)`` language-model logits as they
    come), where torch takes ``(N, C, d1, ...)``. Probability (float) targets are not supported.

    Beyond torch's arguments (keyword-only): ``z_loss``, ``softcap``, ``inplace_grad`` and
    ``check_target``, as for :func:`fusedops.cross_entropy`.
    """

    __constants__ = ["ignore_index", "reduction", "label_smoothing", "z_loss", "softcap", "inplace_grad"]

    def __init__(
        self,
        weight: Optional[Tensor] = None,
        size_average=None,
        ignore_index: int = -100,
        reduce=None,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        *,
        z_loss: float = 0.0,
        softcap: Optional[float] = None,
        inplace_grad: bool = False,
        check_target: Union[bool, str] = True,
    ) -> None:
        super().__init__(weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        self.z_loss = _real_number("CrossEntropyLoss", "z_loss", z_loss)
        self.softcap = _real_number("CrossEntropyLoss", "softcap", softcap, optional=True)
        self.inplace_grad = _flag("CrossEntropyLoss", "inplace_grad", inplace_grad)
        self.check_target = check_target_mode(check_target, "CrossEntropyLoss")

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return cross_entropy(
            input, target, weight=self.weight, ignore_index=self.ignore_index, reduction=self.reduction,
            label_smoothing=self.label_smoothing, z_loss=self.z_loss, softcap=self.softcap,
            inplace_grad=self.inplace_grad, check_target=self.check_target,
        )

    def extra_repr(self) -> str:
        parts = [
            f"{name}={getattr(self, name)}"
            for name, default in (("z_loss", 0.0), ("softcap", None), ("inplace_grad", False))
            if getattr(self, name) != default
        ]
        return ", ".join(parts)
