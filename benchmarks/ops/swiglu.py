"""Benchmark entry of swiglu: y = silu(gate) * up.

Cases, inputs, bytes model and providers: benchmarks/ops/_gated.py.
"""

from __future__ import annotations

import torch

from benchmarks.ops import _gated


def _act(g, u):
    return torch.nn.functional.silu(g) * u


ENTRY = _gated.entry(
    "swiglu", False, _act, "liger_kernel.ops.swiglu", "LigerSiLUMulFunction",
    fusedops_call=lambda fusedops, g, u: fusedops.swiglu(g, u),
    raw_call=lambda g, u: torch.ops.fusedops.swiglu.default(g, u),
)
