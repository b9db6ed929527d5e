"""Benchmark entry of rms_norm.

y = x * rsqrt(mean(x^2, last dim) + eps) * weight, x of shape (rows, hidden),
weight a learnable (requires_grad) parameter of shape (hidden,) in x's dtype,
eps = 1e-6.  Inputs are fresh standard-normal data (weight around 1), never
zeros.

Minimum-bytes model (E = rows * hidden elements of s bytes each):

* fwd      2 * E * s   read x, write y
* bwd      3 * E * s   read x, read dy, write dx
* fwd+bwd  5 * E * s   the sum of the two

Weight, dweight and the per-row rstd are left out: they are O(hidden) or
O(rows), negligible next to E for every shape benchmarked here.  A kernel that
re-reads x, or materialises an fp32 copy, moves more than this model counts
and shows it as a lower TB/s.

Providers: "eager" (torch.nn.functional.rms_norm, torch's native kernel),
"torch.compile" (the LLaMA-style Python reference below, compiled once per
shape, dynamic=False, fullgraph), "liger" (Liger-Kernel), "quack" (quack's
CuTe-DSL kernel) and the subject "fusedops-<backend>" (``fusedops.rms_norm``,
labelled with the backend serving it).  "fusedops-raw" (the raw
``torch.ops.fusedops.rms_norm`` op, forward only) runs only when named in
--providers; it shows what the autograd wrapper costs per call.  The option
variants "fusedops-<backend>+offset", "+cast" and "+save-output" run the
same function with Gemma's offset, LLaMA's casting and the memory-saving
backward on (large shapes only).
"""

from __future__ import annotations

import inspect

import torch

from benchmarks.harness import Inputs, Probe, Provider
from benchmarks.ops import _common

EPS = 1e-6


def make_inputs(case, device, seed) -> Inputs:
    x, (w,), dy = _common.row_norm_tensors(case, device, seed, centres=(1.0,))
    return Inputs(args=(x, w, EPS), grad_argnums=(0, 1), grad_out=dy, names=("x", "weight", "eps"))


def reference(x, w, eps):
    """LLaMA-style RMSNorm: statistics and scaling in fp32, result in x's dtype.

    The harness calls it with fp32 copies (the correctness reference); the
    torch.compile provider compiles this very function on the real inputs.
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * w.float()).to(x.dtype)


# -- eager -------------------------------------------------------------------


def _probe_eager(device):
    if not hasattr(torch.nn.functional, "rms_norm"):
        return Probe("eager", False, "torch.nn.functional.rms_norm needs torch >= 2.4")
    return Probe("eager", True)


def _eager(case, device):
    f = torch.nn.functional.rms_norm
    return lambda x, w, eps: f(x, (x.shape[-1],), w, eps)


# -- liger -------------------------------------------------------------------


_probe_liger = _common.cuda_import_probe(
    "liger", "liger_kernel.ops.rms_norm", "LigerRMSNormFunction", ("liger-kernel", "liger_kernel"))


def _liger(case, device):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    # in_place=False: liger would otherwise overwrite dy with dx, and the
    # timed backward reuses dy on every call.
    return _common.autograd_apply_by_name(
        LigerRMSNormFunction,
        arg_names=("x", "w", "eps"),
        aliases={"x": ("x", "input", "hidden_states"), "w": ("w", "weight"),
                 "eps": ("eps", "epsilon", "variance_epsilon")},
        wanted={"offset": 0.0, "casting_mode": "llama", "in_place": False},
        assumed=("x", "w", "eps", "offset", "casting_mode", "in_place"),  # liger 0.8's order
    )


# -- quack -------------------------------------------------------------------


_probe_quack = _common.cuda_import_probe("quack", "quack.rmsnorm", "rmsnorm", ("quack-kernels", "quack"))


def _quack(case, device):
    from quack.rmsnorm import rmsnorm

    if "eps" in inspect.signature(rmsnorm).parameters:
        return lambda x, w, eps: rmsnorm(x, w, eps=eps)
    return lambda x, w, eps: rmsnorm(x, w)


# -- fusedops ----------------------------------------------------------------


def _fusedops(case, device):
    import fusedops

    f = fusedops.rms_norm
    return lambda x, w, eps: f(x, w, eps=eps)


# The options, each computing the same function so that the harness's correctness check holds:
# Gemma's offset on a weight stored as w - 1 (that subtraction, O(hidden), is in the timed
# region), LLaMA's casting (one extra rounding: within tolerance), the memory-saving backward.
def _fusedops_offset(case, device):
    import fusedops

    return lambda x, w, eps: fusedops.rms_norm(x, w - 1.0, eps, offset=1.0)


def _fusedops_cast(case, device):
    import fusedops

    return lambda x, w, eps: fusedops.rms_norm(x, w, eps, cast_before_weight=True)


def _fusedops_save_output(case, device):
    import fusedops

    return lambda x, w, eps: fusedops.rms_norm(x, w, eps, save_output=True)


def _fusedops_raw(case, device):
    op = torch.ops.fusedops.rms_norm.default
    return lambda x, w, eps: op(x, w, eps)[0]


ENTRY = _common.row_norm_entry(
    "rms_norm", make_inputs, reference,
    ignored="weight, dweight and rstd",
    eager=Provider("eager", _probe_eager, _eager),
    peers=[Provider("liger", _probe_liger, _liger), Provider("quack", _probe_quack, _quack)],
    fusedops=_fusedops,
    fusedops_raw=_fusedops_raw,
    variants={"offset": _fusedops_offset, "cast": _fusedops_cast, "save-output": _fusedops_save_output},
)
