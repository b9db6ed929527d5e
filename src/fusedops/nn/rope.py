"""fusedops.nn.RotaryEmbedding: the cos/sin tables of Hugging Face's LlamaRotaryEmbedding, to
feed fusedops.rope."""

import contextlib
import math
import operator
from collections.abc import Mapping
from typing import Optional

import torch
from torch import Tensor

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _default_inv_freq(dim: int, base: float, device) -> Tensor:
    # base^(-2i/dim), i = 0 .. dim/2 - 1, in float32 as Hugging Face forms it.
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(torch.float32) / dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(inv_freq: Tensor, scaling: dict) -> Tensor:
    """LLaMA-3.1's frequency scaling: frequencies whose wavelength exceeds the original context
    divided by low_freq_factor are slowed down by `factor`; those whose wavelength is below the
    context divided by high_freq_factor are kept; the band in between blends the two linearly
    in (context / wavelength)."""
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    context = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    slowed = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    blend = (context / wavelength - low) / (high - low)
    blended = (1 - blend) * slowed / factor + blend * slowed
    in_band = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(in_band, blended, slowed)


class RotaryEmbedding(torch.nn.Module):
    """The rotary tables of Hugging Face's ``LlamaRotaryEmbedding``: ``forward(x, position_ids)``
    returns ``(cos, sin)`` of shape ``(B, S, dim)`` in x's dtype (float32 math), the two halves
    of each row equal (the rotate-half convention of :func:`fusedops.rope`'s default).

    Args:
        dim: the rotary width R (the head dimension, or less for partial rotary); even.
        max_position_embeddings: the model's context length (kept as an attribute, as in HF).
        base: the frequency base (``rope_theta``).
        rope_scaling: None (or ``{"rope_type": "default"}``), or LLaMA-3's
            ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
            "original_max_position_embeddings"}`` (``"type"`` is accepted for ``"rope_type"``).
        device: where the ``inv_freq`` buffer lives.

    ``inv_freq`` is a non-persistent buffer (not in the state dict), as in HF. It stays float32
    through module casts (``.to(torch.bfloat16)``, ``.half()``) and is formed again after
    ``to_empty()``, so a model built on the meta device gets it right.
    """

    def __init__(
        self,
        dim: int,
        max_position_embeddings: int = 2048,
        base: float = 10000.0,
        rope_scaling: Optional[dict] = None,
        device=None,
    ) -> None:
        super().__init__()
        try:
            dim = operator.index(dim)  # (numpy and 0-d tensor integers too, as torch's modules take)
        except TypeError:
            raise TypeError(f"RotaryEmbedding: dim must be an integer, got {type(dim).__name__}") from None
        if not (dim > 0 and dim % 2 == 0):
            raise ValueError(f"RotaryEmbedding: dim must be a positive even number, got {dim}")
        self.dim = dim
        self.max_position_embeddings = max_position_embeddings
        self.base = float(base)
        if rope_scaling is not None and not isinstance(rope_scaling, Mapping):
            raise TypeError(
                f"RotaryEmbedding: rope_scaling must be a dict (a model config's rope_scaling) or None, "
                f"got {type(rope_scaling).__name__}"
            )
        scaling = dict(rope_scaling or {})
        if rope_scaling is None:
            self.rope_type = "default"
        else:
            # (Hugging Face's configs say "rope_type", older ones "type"; a dict with neither is
            # refused, as Hugging Face refuses it, rather than read as the default rotation)
            given = {scaling[key] for key in ("rope_type", "type") if key in scaling}
            if len(given) != 1:
                raise ValueError(
                    "RotaryEmbedding: rope_scaling must name its rotation with 'rope_type' (or 'type'), "
                    + (f"got {sorted(given)}" if given else f"got keys {sorted(scaling)}")
                )
            (self.rope_type,) = given
        # (a copy: a config edited later must not change the inv_freq that .to() forms again)
        self.rope_scaling = None if rope_scaling is None else scaling
        if self.rope_type == "llama3":
            missing = [key for key in _LLAMA3_KEYS if key not in scaling]
            if missing:
                raise ValueError(f"RotaryEmbedding: llama3 rope_scaling needs {', '.join(repr(m) for m in missing)}")
        elif self.rope_type != "default":
            raise ValueError(
                f"RotaryEmbedding: rope_type {self.rope_type!r} is not supported (supported: 'default', 'llama3')"
            )
        # Both rope types leave the amplitudes alone.
        self.attention_scaling = 1.0
        self.register_buffer("inv_freq", self._inv_freq(device), persistent=False)

    def _inv_freq(self, device) -> Tensor:
        inv_freq = _default_inv_freq(self.dim, self.base, device)
        if self.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, self.rope_scaling)
        return inv_freq

    def _apply(self, fn, recurse=True):
        # inv_freq is derived, not learned: after .to(), .half(), .cuda() or to_empty() it is
        # formed again, in float32, where the buffer now lives. A cast would round it
        # (bfloat16 keeps 8 bits: cos off by 1.5 at position 1000), to_empty would leave it
        # uninitialised, and, being outside the state dict, no load would repair either.
        super()._apply(fn, recurse)
        self.inv_freq = self._inv_freq(self.inv_freq.device)
        return self

    def forward(self, x: Tensor, position_ids: Tensor):
        """``(cos, sin)`` of shape ``(B, S, dim)`` in x's dtype for ``position_ids`` ``(B, S)``."""
        # (no autocast context where the device has none: "meta", where models are built for
        # shapes, or torch.fx's symbolic tracing, where the device type is a Proxy and the context
        # would not be recorded anyway)
        device_type = x.device.type
        no_autocast = (
            torch.autocast(device_type=device_type, enabled=False)
            if isinstance(device_type, str) and torch.amp.is_autocast_available(device_type)
            else contextlib.nullcontext()
        )
        with no_autocast:
            # (the table moves to x's device, as Hugging Face's rotary modules move it)
            angles = position_ids[..., None].to(torch.float32) * self.inv_freq.to(x.device, torch.float32)
            angles = torch.cat((angles, angles), dim=-1)
            cos = angles.cos() * self.attention_scaling
            sin = angles.sin() * self.attention_scaling
        return cos.to(x.dtype), sin.to(x.dtype)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base:g}, rope_type={self.rope_type!r}"
