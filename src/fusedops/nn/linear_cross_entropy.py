"""fusedops.nn.LinearCrossEntropyLoss: an lm_head and its loss in one module."""

import math
from typing import Optional, Union

import torch
from torch import Tensor

from ..functional import _flag, _real_number, linear_cross_entropy
from ..ops.cross_entropy import check_target_mode


class LinearCrossEntropyLoss(torch.nn.Module):
    """``cross_entropy(lm_head(hidden), target)`` without the logits: holds the ``lm_head``
    weight ``(vocab_size, hidden_size)`` (and bias) under the names ``nn.Linear`` uses, so an
    ``lm_head``'s ``state_dict`` loads as it is, and computes the loss with
    :func:`fusedops.linear_cross_entropy`.

    ``forward(hidden, target)``: hidden ``(..., hidden_size)``, target ``(...)``; returns the loss.
    For a model whose ``lm_head`` is tied to its input embedding, use :meth:`from_linear`, which
    shares the existing parameter instead of making one. The loss options are those of
    :func:`fusedops.linear_cross_entropy`; ``class_weight`` is a buffer (it follows ``.to()``, as
    torch's ``CrossEntropyLoss.weight``, and is placed on ``device``) kept out of the
    ``state_dict``: it is a loss option given to the constructor, like the others, and an
    ``lm_head``'s ``state_dict`` loads strictly with it as without it. Since no load restores it,
    it keeps its values through ``to_empty()`` too (a model built on the meta device).
    """

    __constants__ = ["ignore_index", "reduction", "label_smoothing", "z_loss", "softcap", "chunk_rows",
                     "low_memory", "chunk_classes"]

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        bias: bool = False,
        *,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        softcap: Optional[float] = None,
        class_weight: Optional[Tensor] = None,
        chunk_rows: Optional[int] = None,
        low_memory: bool = False,
        chunk_classes: Optional[int] = None,
        check_target: Union[bool, str] = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.weight = torch.nn.Parameter(torch.empty(vocab_size, hidden_size, **factory))
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(vocab_size, **factory))
        else:
            self.register_parameter("bias", None)
        # Where class_weight's values come from when the buffer holds none (on the meta device).
        self._class_weight_given = class_weight
        if class_weight is not None and device is not None:
            class_weight = class_weight.to(device)
        self.register_buffer("class_weight", class_weight, persistent=False)
        self.ignore_index = int(ignore_index)
        self.reduction = reduction
        self.label_smoothing = _real_number("LinearCrossEntropyLoss", "label_smoothing", label_smoothing)
        self.z_loss = _real_number("LinearCrossEntropyLoss", "z_loss", z_loss)
        self.softcap = _real_number("LinearCrossEntropyLoss", "softcap", softcap, optional=True)
        self.chunk_rows = chunk_rows
        self.low_memory = _flag("LinearCrossEntropyLoss", "low_memory", low_memory)
        self.chunk_classes = chunk_classes
        self.check_target = check_target_mode(check_target, "LinearCrossEntropyLoss")
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's initialisation, so that a fresh module starts where an lm_head would.
        torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.hidden_size) if self.hidden_size > 0 else 0
            torch.nn.init.uniform_(self.bias, -bound, bound)

    def _apply(self, fn, recurse=True):
        # class_weight is not state a load restores: its values must outlive every conversion,
        # to_empty() (which leaves buffers uninitialised) included.
        values = self.class_weight
        if values is not None and values.is_meta:
            values = self._class_weight_given
        super()._apply(fn, recurse)
        converted = self.class_weight
        if values is not None and converted is not values and not values.is_meta:
            with torch.no_grad():
                converted.copy_(values)
        return self

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, **loss_options) -> "LinearCrossEntropyLoss":
        """A module that uses ``linear``'s parameters themselves (tied embeddings stay tied);
        ``loss_options`` are the constructor's loss options."""
        for name in ("hidden_size", "vocab_size", "bias", "device", "dtype"):
            if name in loss_options:
                raise TypeError(
                    f"LinearCrossEntropyLoss.from_linear: {name} is linear's (the module shares its parameters); "
                    "pass only loss options"
                )
        module = cls(1, 1, bias=False, device="meta", **loss_options)
        module.class_weight = module._class_weight_given  # (where it was given, not on meta)
        module.hidden_size, module.vocab_size = linear.in_features, linear.out_features
        module.weight = linear.weight
        module.bias = linear.bias
        return module

    def forward(self, hidden: Tensor, target: Tensor) -> Tensor:
        return linear_cross_entropy(
            hidden, self.weight, target, self.bias, ignore_index=self.ignore_index, reduction=self.reduction,
            label_smoothing=self.label_smoothing, z_loss=self.z_loss, softcap=self.softcap,
            class_weight=self.class_weight, chunk_rows=self.chunk_rows, low_memory=self.low_memory,
            chunk_classes=self.chunk_classes, check_target=self.check_target,
        )

    def extra_repr(self) -> str:
        parts = [f"hidden_size={self.hidden_size}", f"vocab_size={self.vocab_size}", f"bias={self.bias is not None}"]
        for name, default in (("ignore_index", -100), ("reduction", "mean"), ("label_smoothing", 0.0),
                              ("z_loss", 0.0), ("softcap", None), ("chunk_rows", None), ("low_memory", False),
                              ("chunk_classes", None)):
            if getattr(self, name) != default:
                parts.append(f"{name}={getattr(self, name)}")
        return ", ".join(parts)
