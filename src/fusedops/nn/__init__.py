"""Drop-in modules backed by fusedops ops."""

from .layer_norm import LayerNorm
from .rms_norm import RMSNorm

__all__ = ["LayerNorm", "RMSNorm"]
