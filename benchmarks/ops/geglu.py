"""Benchmark entry of geglu: y = gelu(gate, approximate="tanh") * up: the tanh form, which Gemma uses
and Liger implements (the erf form moves the same bytes).

Cases, inputs, bytes model and providers: benchmarks/ops/_gated.py.
"""

from __future__ import annotations

import torch

from benchmarks.ops import _gated


def _act(g, u):
    return torch.nn.functional.gelu(g, approximate="tanh") * u


ENTRY = _gated.entry(
    "geglu", False, _act, "liger_kernel.ops.geglu", "LigerGELUMulFunction",
    fusedops_call=lambda fusedops, g, u: fusedops.geglu(g, u, "tanh"),
    raw_call=lambda g, u: torch.ops.fusedops.geglu.default(g, u, "tanh"),
)
