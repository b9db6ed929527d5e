"""Drop-in modules backed by fusedops ops."""

from .rms_norm import RMSNorm

__all__ = ["RMSNorm"]
