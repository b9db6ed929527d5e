"""Benchmark entry of layer_norm.

y = (x - mean(x)) * rsqrt(var(x) + eps) * weight + bias over the last dim,
with the biased variance (as torch.nn.functional.layer_norm).  x has shape
(rows, hidden); weight and bias are learnable (requires_grad) parameters of
shape (hidden,) in x's dtype, drawn around 1 and around 0 respectively;
eps = 1e-5.  x and dy are fresh standard-normal data; nothing is zero.

Minimum-bytes model, E = rows * hidden elements of s bytes each; it is the
rms_norm model, because layer_norm streams the same big tensors:

* fwd      2 * E * s   x in, y out
* bwd      3 * E * s   x and dy in, dx out
* fwd+bwd  5 * E * s   both passes

The parameters, their gradients and the per-row mean and rstd are not
counted: each is O(hidden) or O(rows), a rounding error next to E at these
shapes.  Re-reading x for the second statistic, or spilling an fp32 copy of
it, is traffic this model does not count; it shows as a lower TB/s.

Providers: "eager" (torch.nn.functional.layer_norm, torch's native kernel),
"torch.compile" (the fp32 Python reference below, compiled per shape,
dynamic=False, fullgraph), "liger" (Liger-Kernel's LigerLayerNormFunction,
CUDA only), and the subject "fusedops-<backend>" (``fusedops.layer_norm``,
labelled with the backend serving it); "fusedops-raw" (the raw
``torch.ops.fusedops.layer_norm`` op, forward only) runs only when named in
--providers.  There is no "quack" peer: quack's LayerNorm has no bias and
takes only an fp32 weight, so it does not compute this op.
"""

from __future__ import annotations

import torch

from benchmarks.harness import Inputs, Probe, Provider
from benchmarks.ops import _common

EPS = 1e-5


def make_inputs(case, device, seed) -> Inputs:
    x, (w, b), dy = _common.row_norm_tensors(case, device, seed, centres=(1.0, 0.0))
    return Inputs(args=(x, w, b, EPS), grad_argnums=(0, 1, 2), grad_out=dy,
                  names=("x", "weight", "bias", "eps"))


def reference(x, w, b, eps):
    """Two-pass LayerNorm in fp32, result in x's dtype.

    Spelled out rather than calling F.layer_norm, so that the correctness
    reference does not share code with the eager peer it judges; the
    torch.compile provider compiles this same function on the real inputs.
    """
    xf = x.float()
    centred = xf - xf.mean(-1, keepdim=True)
    rstd = torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps)
    return (centred * rstd * w.float() + b.float()).to(x.dtype)


def _eager(case, device):
    f = torch.nn.functional.layer_norm
    return lambda x, w, b, eps: f(x, (x.shape[-1],), w, b, eps)


def _probe_eager(device):
    # Unlike F.rms_norm (torch >= 2.4), F.layer_norm exists in every torch
    # this project supports: nothing to check.
    return Probe("eager", True)


_probe_liger = _common.cuda_import_probe(
    "liger", "liger_kernel.ops.layer_norm", "LigerLayerNormFunction", ("liger-kernel", "liger_kernel"))


def _liger(case, device):
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction

    # Liger 0.8.5's forward is (ctx, X, W, B, eps) with no options; the
    # by-name mapping still guards against a release that adds some.
    return _common.autograd_apply_by_name(
        LigerLayerNormFunction,
        arg_names=("x", "w", "b", "eps"),
        aliases={"x": ("x", "input", "hidden_states"), "w": ("w", "weight"),
                 "b": ("b", "bias"), "eps": ("eps", "epsilon", "variance_epsilon")},
        wanted={},
        assumed=("x", "w", "b", "eps"),
    )


def _fusedops(case, device):
    import fusedops

    f = fusedops.layer_norm
    return lambda x, w, b, eps: f(x, w, b, eps=eps)


def _fusedops_raw(case, device):
    op = torch.ops.fusedops.layer_norm.default
    return lambda x, w, b, eps: op(x, w, b, eps)[0]  # (out, mean, rstd)


ENTRY = _common.row_norm_entry(
    "layer_norm", make_inputs, reference,
    ignored="weight, bias, their gradients, mean and rstd",
    eager=Provider("eager", _probe_eager, _eager),
    peers=[Provider("liger", _probe_liger, _liger)],
    fusedops=_fusedops,
    fusedops_raw=_fusedops_raw,
)
