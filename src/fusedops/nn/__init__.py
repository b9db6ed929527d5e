"""Drop-in modules backed by fusedops ops."""

from .add_rms_norm import AddRMSNorm
from .cross_entropy import CrossEntropyLoss
from .layer_norm import LayerNorm
from .linear_cross_entropy import LinearCrossEntropyLoss
from .rms_norm import RMSNorm
from .rope import RotaryEmbedding
from .swiglu_mlp import SwiGLUMLP

__all__ = ["AddRMSNorm", "LayerNorm", "RMSNorm", "RotaryEmbedding", "SwiGLUMLP", "CrossEntropyLoss", "LinearCrossEntropyLoss"]
