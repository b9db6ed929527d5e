"""Benchmark entry of linear_cross_entropy (an LM head and its loss without the logits).

Cases are (N tokens, H hidden, V vocabulary) in bf16: Gemma-2-2B (8192, 2304, 256000) and
LLaMA-3-8B (8192, 4096, 128256), the issue's two goals, plus a small LLaMA-2-sized head. hidden
and weight require grad (weight: the lm_head, scaled so that the logits are a few units);
targets are uniform with one in ten set to ignore_index; reduction "mean"; incoming gradient 1.

The op is bound by its three matrix products (logits, and the two gradients), so besides the
usual bytes model the rows carry TFLOP/s: fwd = 2*N*H*V (the logits' product), fwd+bwd =
6*N*H*V. The fused providers (fusedops, Liger, cut-cross-entropy) compute the gradients in the
forward, so their "fwd" with inputs that require grad already does most of the fwd+bwd work;
fwd+bwd is the comparison that means something. Minimum bytes: read hidden and weight, and
for fwd+bwd also write their gradients (the logits are never stored by a perfect kernel).

Providers: "eager" (the materialised path as Hugging Face's causal-LM loss runs it: bf16 logits
from hidden @ weight.T, upcast to fp32, torch.nn.functional.cross_entropy); "torch.compile"
(the fp32 reference below compiled whole); "liger" (LigerFusedLinearCrossEntropyFunction);
"cut-cross-entropy" (cut_cross_entropy.linear_cross_entropy); the subject "fusedops-<backend>"
(``fusedops.linear_cross_entropy``, automatic chunk size: 1 GiB of logits on a GPU),
"fusedops-<backend>+chunk4096" (chunks of 4096 rows) and "fusedops-<backend>+low_memory"
(chunks of classes: four products instead of three, no float32 buffer of the weight's size).
Peak memory per call is recorded: the point of the op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks.harness import Case, Inputs, OpEntry, Probe, Provider
from benchmarks.ops import _common

BF16, FP32 = torch.bfloat16, torch.float32
IGNORE = -100


@dataclass(frozen=True)
class LCECase(Case):
    """shape = (N, H, V)."""

    @property
    def numel(self) -> int:
        N, H, V = self.shape
        return N * H + V * H


GPU_CASES = [
    LCECase((8192, 2304, 256000), BF16, "large"),
    LCECase((8192, 4096, 128256), BF16, "large"),
    LCECase((1024, 4096, 32000), BF16, "small"),
]
CPU_CASES = [
    LCECase((512, 256, 8192), FP32, "large"),
    LCECase((512, 256, 8192), BF16, "large"),
    LCECase((16, 128, 1024), FP32, "small"),
]


def make_inputs(case, device, seed) -> Inputs:
    N, H, V = case.shape
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1_000_003 + N * 31 + H * 961 + V)
    hidden = torch.randn(N, H, generator=gen, device=device, dtype=FP32).to(case.dtype).requires_grad_(True)
    weight = (torch.randn(V, H, generator=gen, device=device, dtype=FP32) * (2.0 / H**0.5)).to(case.dtype)
    weight.requires_grad_(True)
    target = torch.randint(0, V, (N,), generator=gen, device=device)
    target[::10] = IGNORE
    return Inputs(args=(hidden, weight, target), grad_argnums=(0, 1), grad_out=torch.ones((), device=device),
                  names=("hidden", "weight", "target"))


def reference(hidden, weight, target):
    """fp32 math on the materialised logits: the correctness reference."""
    # (target.long(): the harness upcasts every tensor argument)
    return F.cross_entropy(hidden.float() @ weight.float().t(), target.long(), ignore_index=IGNORE)


def _compiled_peer(hidden, weight, target):
    """What torch.compile compiles: the eager peer's program (products in the inputs' dtype, the
    loss in float32, as Hugging Face's). Not the float32 reference, whose float32 products ran at
    a tenth of bf16's rate on the H200 (494-556 ms against eager's 47-54)."""
    return F.cross_entropy((hidden @ weight.t()).float(), target, ignore_index=IGNORE)


def _eager(case, device):
    def run(hidden, weight, target):
        logits = hidden @ weight.t()
        return F.cross_entropy(logits.float(), target, ignore_index=IGNORE)

    return run


def _probe_eager(device):
    return Probe("eager", True)


_probe_liger = _common.cuda_import_probe(
    "liger", "liger_kernel.ops.fused_linear_cross_entropy", "LigerFusedLinearCrossEntropyFunction",
    ("liger-kernel", "liger_kernel"))
_probe_cce = _common.cuda_import_probe(
    "cut-cross-entropy", "cut_cross_entropy", "linear_cross_entropy", ("cut-cross-entropy", "cut_cross_entropy"))


def _liger(case, device):
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    apply = _common.autograd_apply_by_name(
        LigerFusedLinearCrossEntropyFunction,
        arg_names=("x", "w", "t"),
        aliases={"x": ("_input", "input", "x"), "w": ("weight", "lin_weight"), "t": ("target", "y")},
        wanted={"bias": None, "ce_weight": None, "ignore_index": IGNORE, "lse_square_scale": 0.0,
                "label_smoothing": 0.0, "reduction": "mean", "softcap": None, "return_z_loss": False},
        assumed=("_input", "weight", "target", "bias", "ce_weight", "ignore_index", "lse_square_scale",
                 "label_smoothing", "reduction", "softcap", "return_z_loss"),  # liger 0.8's order
    )

    def run(hidden, weight, target):
        out = apply(hidden, weight, target)
        return out[0] if isinstance(out, (tuple, list)) else out

    return run


def _cce(case, device):
    from cut_cross_entropy import linear_cross_entropy

    def run(hidden, weight, target):
        return linear_cross_entropy(hidden, weight, target, ignore_index=IGNORE, reduction="mean")

    return run


def _fusedops_factory(**mode):
    def factory(case, device):
        import fusedops

        f = fusedops.linear_cross_entropy

        def run(hidden, weight, target):
            return f(hidden, weight, target, ignore_index=IGNORE, **mode)

        return run

    return factory


def _fusedops_raw(case, device):
    op = torch.ops.fusedops.linear_cross_entropy.default

    def run(hidden, weight, target):
        return op(hidden, weight, target, None, None, IGNORE, "mean", 0.0, 0.0, None)[0]

    return run


def min_bytes(case, mode) -> int:
    return (1 if mode == "fwd" else 2) * case.numel * case.itemsize


def flops(case, mode) -> int:
    N, H, V = case.shape
    return (2 if mode == "fwd" else 6) * N * H * V


ENTRY = OpEntry(
    name="linear_cross_entropy",
    gpu_cases=GPU_CASES,
    cpu_cases=CPU_CASES,
    make_inputs=make_inputs,
    reference=reference,
    min_bytes=min_bytes,
    bytes_model=("N tokens, hidden H, vocabulary V, s bytes: fwd = (N*H + V*H)*s (read hidden and weight), fwd+bwd = "
                 "twice that (and write their gradients); targets ignored. Matrix-product bound: see TFLOP/s "
                 "(fwd 2*N*H*V, fwd+bwd 6*N*H*V FLOPs)."),
    providers=[
        Provider("eager", _probe_eager, _eager),
        _common.compiled_provider(_compiled_peer),
        Provider("liger", _probe_liger, _liger),
        Provider("cut-cross-entropy", _probe_cce, _cce),
        *_common.fusedops_providers("linear_cross_entropy", _fusedops_factory(), _fusedops_raw,
                                    variants={"chunk4096": _fusedops_factory(chunk_rows=4096),
                                              "low_memory": _fusedops_factory(low_memory=True)}),
    ],
    modes=("fwd", "fwd+bwd"),
    measure_memory=True,
    flops=flops,
)
