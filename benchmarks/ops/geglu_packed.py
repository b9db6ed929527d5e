"""Benchmark entry of geglu_packed: y = gelu(gate, approximate="tanh") * up: the tanh form, which
Gemma uses and Liger implements (the erf form moves the same bytes), gate and up the halves of one
(rows, 2n) gate_up.

Cases, inputs, bytes model and providers: benchmarks/ops/_gated.py.
"""

from __future__ import annotations

import torch

from benchmarks.ops import _gated


def _act(g, u):
    return torch.nn.functional.gelu(g, approximate="tanh") * u


ENTRY = _gated.entry(
    "geglu_packed", True, _act, "liger_kernel.ops.geglu", "LigerGELUMulFunction",
    fusedops_call=lambda fusedops, gu: fusedops.geglu_packed(gu, "tanh"),
    raw_call=lambda gu: torch.ops.fusedops.geglu_packed.default(gu, "tanh"),
)
