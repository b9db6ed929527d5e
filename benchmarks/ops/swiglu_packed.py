"""Benchmark entry of swiglu_packed: y = silu(gate) * up, gate and up the halves of one (rows, 2n)
gate_up.

Cases, inputs, bytes model and providers: benchmarks/ops/_gated.py.
"""

from __future__ import annotations

import torch

from benchmarks.ops import _gated


def _act(g, u):
    return torch.nn.functional.silu(g) * u


ENTRY = _gated.entry(
    "swiglu_packed", True, _act, "liger_kernel.ops.swiglu", "LigerSiLUMulFunction",
    fusedops_call=lambda fusedops, gu: fusedops.swiglu_packed(gu),
    raw_call=lambda gu: torch.ops.fusedops.swiglu_packed.default(gu),
)
