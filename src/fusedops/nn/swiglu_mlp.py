"""fusedops.nn.SwiGLUMLP: the gated MLP of LLaMA-style models, with fusedops.swiglu as its gate."""

import torch
from torch import Tensor

from ..functional import swiglu


class SwiGLUMLP(torch.nn.Module):
    """``down_proj(swiglu(gate_proj(x), up_proj(x)))``, the MLP block of LLaMA, Mistral and Qwen.

    The submodules and their state_dict keys (``gate_proj.weight``, ``up_proj.weight``,
    ``down_proj.weight``, and ``.bias`` with ``bias=True``) are those of Hugging Face's
    ``LlamaMLP``, so its weights load unchanged. The three projections are plain
    :class:`torch.nn.Linear` layers; only the gate between them is fused (one pass over the
    activations instead of silu's and the product's, and a backward that saves only the two
    projections' outputs).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        factory = {"device": device, "dtype": dtype}
        self.gate_proj = torch.nn.Linear(hidden_size, intermediate_size, bias=bias, **factory)
        self.up_proj = torch.nn.Linear(hidden_size, intermediate_size, bias=bias, **factory)
        self.down_proj = torch.nn.Linear(intermediate_size, hidden_size, bias=bias, **factory)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}"
