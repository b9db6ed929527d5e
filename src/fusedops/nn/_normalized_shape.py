"""What the norm modules share: applying a last-dimension norm over a trailing `normalized_shape`."""

import math
from typing import Callable, Optional, Sequence

from torch import Tensor


def require_tensor(module: str, name: str, value) -> None:
    """The TypeError torch's modules give for a forward argument that is not a tensor, before
    anything reads its attributes (which would fail naming none)."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{module}: {name} must be a Tensor, got {type(value).__name__}")


def apply_over_trailing(
    norm: Callable[..., Tensor],
    module: str,
    input: Tensor,
    normalized_shape: Sequence[int],
    params: Sequence[Optional[Tensor]],
    eps: float,
    options: Sequence = (),
) -> Tensor:
    """``norm(input, *params, eps, *options)`` over the trailing ``normalized_shape`` of ``input``: those
    dimensions are flattened into one (a copy only if they cannot be viewed as one), the
    parameters likewise, and the result is viewed back to ``input``'s shape."""
    require_tensor(module, "input", input)
    k = len(normalized_shape)
    if k == 0:  # (as torch's norms: at call time, not at construction)
        raise ValueError(f"{module}: normalized_shape must have at least one dimension, got []")
    if tuple(input.shape[-k:]) != tuple(normalized_shape):
        raise ValueError(
            f"{module}: input's trailing shape {list(input.shape[-k:])} does not match "
            f"normalized_shape {list(normalized_shape)}"
        )
    if k == 1:
        return norm(input, *params, eps, *options)
    # (the width spelled out: -1 cannot be inferred when a leading dimension is 0)
    flat = input.reshape(*input.shape[:-k], math.prod(normalized_shape))
    flat_params = [None if p is None else p.reshape(-1) for p in params]
    return norm(flat, *flat_params, eps, *options).view(input.shape)
