"""Benchmark entry of add_rms_norm.

h = x + r (the residual stream, returned), y = h * rsqrt(mean(h^2) + eps) *
weight: the pre-norm transformer's residual step.  x and r have shape
(rows, hidden) in the case dtype; weight is a learnable parameter around 1;
eps = 1e-6.  The upstream gradient is a pair (dy, dh): in a transformer both
outputs are used (y by the next sublayer, h by the next residual add).

Minimum-bytes model (E = rows * hidden elements of s bytes each):

* fwd      4 * E * s   read x and r, write y and h
* bwd      4 * E * s   read dy, dh and h, write one gradient (dx = dr)
* fwd+bwd  8 * E * s   the sum of the two

Weight, dweight and rstd are left out (O(hidden) or O(rows)).  A provider
that materialises x + r and then normalises it moves 2 * E * s more in the
forward, and one that writes dx and dr separately E * s more in the
backward: both show as a lower TB/s.

Providers: "eager" (x + r, then torch.nn.functional.rms_norm),
"torch.compile" (the fp32 reference below, compiled per shape), "liger"
(Liger-Kernel's LigerFusedAddRMSNormFunction) and the subject
"fusedops-<backend>" (``fusedops.add_rms_norm``); "fusedops-raw" (the raw
op, forward only) runs when named in --providers.
"""

from __future__ import annotations

import torch

from benchmarks.harness import Inputs, Probe, Provider
from benchmarks.ops import _common

EPS = 1e-6
PASSES = {"fwd": 4, "bwd": 4, "fwd+bwd": 8}


def make_inputs(case, device, seed) -> Inputs:
    x, (w,), dy = _common.row_norm_tensors(case, device, seed, centres=(1.0,))
    gen = _common.case_generator(case, device, seed + 1)
    r = torch.randn(case.shape, generator=gen, device=device, dtype=case.dtype).requires_grad_(True)
    dh = torch.randn(case.shape, generator=gen, device=device, dtype=case.dtype)
    return Inputs(args=(x, r, w, EPS), grad_argnums=(0, 1, 2), grad_out=(dy, dh),
                  names=("x", "residual", "weight", "eps"))


def reference(x, r, w, eps):
    """(y, h): the sum rounded to the residual's dtype, normalised in fp32; the
    torch.compile provider compiles this same function."""
    h = x + r
    hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * w.float()
    return y.to(x.dtype), h


def _probe_eager(device):
    if not hasattr(torch.nn.functional, "rms_norm"):
        return Probe("eager", False, "torch.nn.functional.rms_norm needs torch >= 2.4")
    return Probe("eager", True)


def _eager(case, device):
    f = torch.nn.functional.rms_norm

    def run(x, r, w, eps):
        h = x + r
        return f(h, (h.shape[-1],), w, eps), h

    return run


_probe_liger = _common.cuda_import_probe(
    "liger", "liger_kernel.ops.fused_add_rms_norm", "LigerFusedAddRMSNormFunction", ("liger-kernel", "liger_kernel"))


def _liger(case, device):
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

    # in_place=False: Liger would otherwise overwrite dy with dx, and the
    # timed backward reuses dy on every call.
    return _common.autograd_apply_by_name(
        LigerFusedAddRMSNormFunction,
        arg_names=("x", "r", "w", "eps"),
        aliases={"x": ("x", "input", "hidden_states"), "r": ("r", "residual"), "w": ("w", "weight"),
                 "eps": ("eps", "epsilon", "variance_epsilon")},
        wanted={"offset": 0.0, "casting_mode": "llama", "in_place": False},
        assumed=("x", "r", "w", "eps", "offset", "casting_mode", "in_place"),  # liger 0.8's order
    )


def _fusedops(case, device):
    import fusedops

    f = fusedops.add_rms_norm
    return lambda x, r, w, eps: f(x, r, w, eps)


def _fusedops_raw(case, device):
    op = torch.ops.fusedops.add_rms_norm.default
    return lambda x, r, w, eps: op(x, r, w, eps)[:2]  # (out, residual_out, rstd)


ENTRY = _common.row_norm_entry(
    "add_rms_norm", make_inputs, reference,
    ignored="weight, dweight and rstd",
    eager=Provider("eager", _probe_eager, _eager),
    peers=[Provider("liger", _probe_liger, _liger)],
    fusedops=_fusedops,
    fusedops_raw=_fusedops_raw,
    passes=PASSES,
    passes_text="fwd = 4*E*s (read x and r, write y and h), bwd = 4*E*s (read dy, dh and h, write dx = dr), "
                "fwd+bwd = 8*E*s",
)
