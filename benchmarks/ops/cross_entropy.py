"""Benchmark entry of cross_entropy (the language-model loss over a vocabulary).

Cases are LM heads in bf16: LLaMA-3 (V = 128256) at 8192 tokens, a 256K vocabulary (Gemma's
256000) at 4096 tokens, LLaMA-2's 32000, the causal-LM shift as users write it: the
(B, T, V) logits of a batch, every position but the last against the labels shifted by one
(``logits[:, :-1]``, strided rows), and Gemma 2's head: 256000 classes with its final-logit
softcapping (``softcap=30``, every provider: ``30 tanh(x / 30)`` before the loss). Targets are
uniform class indices with one in ten set to ignore_index (padding); reduction "mean"; the
incoming gradient is 1 (``loss.backward()``).

Minimum-bytes model (N rows of V logits of s bytes):

* fwd      N * V * s       read the logits once
* fwd+bwd  2 * N * V * s   read the logits once, write their gradient once

Targets (8 bytes a row) and per-row statistics are left out. There is no "bwd" mode: the
gradient is made in the forward by the fused kernels (fusedops and Liger), so a backward
alone is a different amount of work for each provider (and the harness times it with
retain_graph=True, under which fusedops writes a new gradient rather than scaling the saved one
in place).

Providers: "eager" (torch.nn.functional.cross_entropy on the logits as given, viewed as
(N, V): torch's own bf16 kernels); "torch.compile" (the reference below, which upcasts the
logits to fp32 as Hugging Face's loss does, compiled per case); "liger" (Liger-Kernel's
LigerCrossEntropyFunction, which writes the gradient into the logits; it takes (N, V), so the
shifted case is made contiguous first, as users of it do); the subject "fusedops-<backend>"
(``fusedops.cross_entropy``, a separate gradient buffer) and "fusedops-<backend>+inplace"
(``inplace_grad=True``: the gradient written into the logits, like Liger), and
"fusedops-<backend>+smooth" (``label_smoothing=0.1``: what the option costs beside the plain
call, checked against a smoothed reference; no peer runs it), "fusedops-<backend>+wsmooth" (the
same with class weights, ``class_weights(V)``: the option set that loads the weights beside the
logits). The inputs require
grad, so a fused forward (fusedops, Liger) also writes the gradient in "fwd"; the forward alone
as inference runs it is "fusedops-<backend>+nograd" (under ``torch.no_grad()``, fwd only).
Peak memory is recorded per call (``peak MiB``): the gradient buffer shows there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks.harness import Case, Inputs, OpEntry, Probe, Provider
from benchmarks.ops import _common

BF16, FP32 = torch.bfloat16, torch.float32
IGNORE = -100
SMOOTHING = 0.1  # the "smooth" variant's label_smoothing
SOFTCAP = 30.0  # Gemma 2's final_logit_softcapping


@dataclass(frozen=True)
class CECase(Case):
    """shape = (N, V), or (B, T, V) for the shifted variant (logits (B, T + 1, V) sliced to
    their first T positions); the softcap variant caps the logits at SOFTCAP."""

    variant: str = "plain"

    @property
    def shape_str(self) -> str:
        return ("" if self.variant == "plain" else f"{self.variant}:") + "x".join(str(d) for d in self.shape)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


GPU_CASES = [
    CECase((8192, 128256), BF16, "large"),
    CECase((4096, 256000), BF16, "large"),
    CECase((4096, 32000), BF16, "large"),
    CECase((4, 2048, 128256), BF16, "large", "shifted"),
    CECase((4096, 256000), BF16, "large", "softcap"),
    CECase((16, 32000), BF16, "small"),
]
CPU_CASES = [
    CECase((4096, 32000), FP32, "large"),
    CECase((4096, 32000), BF16, "large"),
    CECase((2, 512, 32000), BF16, "large", "shifted"),
    CECase((4096, 32000), FP32, "large", "softcap"),
    CECase((16, 32000), FP32, "small"),
]


def make_inputs(case, device, seed) -> Inputs:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1_000_003 + sum(d * 31**i for i, d in enumerate(case.shape)))
    V = case.shape[-1]
    if case.variant == "shifted":
        B, T, _ = case.shape
        # (the logits are the whole (B, T + 1, V) tensor; providers take their [:, :-1] view)
        leaf = torch.randn(B, T + 1, V, generator=gen, device=device, dtype=FP32).mul_(2).to(case.dtype)
        leaf.requires_grad_(True)
        target = torch.randint(0, V, (B, T), generator=gen, device=device)
    else:
        leaf = torch.randn(case.shape, generator=gen, device=device, dtype=FP32).mul_(2).to(case.dtype)
        leaf.requires_grad_(True)
        target = torch.randint(0, V, case.shape[:-1], generator=gen, device=device)
    target.view(-1)[::10] = IGNORE
    # The logits as a model hands them over, made by an op (an lm_head): the in-place gradient mode
    # refuses to overwrite a leaf, which the user holds. Made once, outside the timed calls, which
    # differentiate with respect to these logits.
    logits = leaf.mul(1)
    softcap = SOFTCAP if case.variant == "softcap" else None
    return Inputs(args=(logits, target, case.variant == "shifted", softcap), grad_argnums=(0,),
                  grad_out=torch.ones((), device=device), names=("logits", "target", "shifted", "softcap"))


def _view(logits, shifted):
    return logits[:, :-1] if shifted else logits


def _capped(x, softcap):
    return x if softcap is None else softcap * torch.tanh(x / softcap)


def class_weights(V, device):
    """The wsmooth variant's class weights: 0.5, 0.625, ..., 1.25 in turn over the classes,
    exact in bf16, so that the subject (weights in the logits' dtype) and its fp32 reference
    use the same values."""
    return 0.5 + (torch.arange(V, device=device) % 7).float() / 8


def reference(logits, target, shifted, softcap, label_smoothing=0.0, weighted=False):
    """fp32 math (the logits upcast, as Hugging Face's loss does); torch.compile compiles this."""
    x = _capped(_view(logits, shifted).float(), softcap)
    V = x.shape[-1]
    weight = class_weights(V, x.device) if weighted else None
    return F.cross_entropy(x.reshape(-1, V), target.long().reshape(-1), weight=weight, ignore_index=IGNORE,
                           label_smoothing=label_smoothing)


def _reference_smoothed(logits, target, shifted, softcap):
    return reference(logits, target, shifted, softcap, label_smoothing=SMOOTHING)


def _reference_weighted_smoothed(logits, target, shifted, softcap):
    return reference(logits, target, shifted, softcap, label_smoothing=SMOOTHING, weighted=True)


def _eager(case, device):
    def run(logits, target, shifted, softcap):
        x = _capped(_view(logits, shifted), softcap)
        return F.cross_entropy(x.reshape(-1, x.shape[-1]), target.reshape(-1), ignore_index=IGNORE)

    return run


def _probe_eager(device):
    return Probe("eager", True)


_probe_liger = _common.cuda_import_probe(
    "liger", "liger_kernel.ops.cross_entropy", "LigerCrossEntropyFunction", ("liger-kernel", "liger_kernel"))


def _liger(case, device):
    from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction

    apply = _common.autograd_apply_by_name(
        LigerCrossEntropyFunction,
        arg_names=("x", "t"),
        aliases={"x": ("_input", "input", "x", "logits"), "t": ("target", "y")},
        wanted={"weight": None, "ignore_index": IGNORE, "reduction": "mean", "lse_square_scale": 0.0,
                "label_smoothing": 0.0, "softcap": SOFTCAP if case.variant == "softcap" else None,
                "return_z_loss": False},
        assumed=("_input", "target", "weight", "ignore_index", "lse_square_scale", "label_smoothing",
                 "reduction", "softcap", "return_z_loss"),  # liger 0.8's order
    )

    def run(logits, target, shifted, softcap):  # (softcap: in `wanted`)
        x = _view(logits, shifted)
        out = apply(x.reshape(-1, x.shape[-1]), target.reshape(-1))  # (a copy for the shifted rows)
        return out[0] if isinstance(out, (tuple, list)) else out

    return run


def _fusedops_factory(inplace_grad, label_smoothing=0.0, weighted=False):
    def factory(case, device):
        import fusedops

        f = fusedops.cross_entropy
        weight = class_weights(case.shape[-1], device).to(case.dtype) if weighted else None

        def run(logits, target, shifted, softcap):
            return f(_view(logits, shifted), target, weight=weight, ignore_index=IGNORE, inplace_grad=inplace_grad,
                     label_smoothing=label_smoothing, softcap=softcap)

        return run

    return factory


def _fusedops_no_grad(case, device):
    import fusedops

    f = fusedops.cross_entropy

    def run(logits, target, shifted, softcap):
        with torch.no_grad():
            return f(_view(logits, shifted), target, ignore_index=IGNORE, softcap=softcap)

    return run


def _fusedops_raw(case, device):
    op = torch.ops.fusedops.cross_entropy.default

    def run(logits, target, shifted, softcap):
        return op(_view(logits, shifted), target, None, IGNORE, "mean", 0.0, 0.0, softcap, False)[0].to(logits.dtype)

    return run


PASSES = {"fwd": 1, "fwd+bwd": 2}


def min_bytes(case, mode) -> int:
    return PASSES[mode] * case.numel * case.itemsize


ENTRY = OpEntry(
    name="cross_entropy",
    gpu_cases=GPU_CASES,
    cpu_cases=CPU_CASES,
    make_inputs=make_inputs,
    reference=reference,
    min_bytes=min_bytes,
    bytes_model=("N rows of V logits of s bytes: fwd = N*V*s (read the logits once), fwd+bwd = 2*N*V*s (read them "
                 "once, write their gradient once); targets and per-row statistics are ignored."),
    providers=[
        Provider("eager", _probe_eager, _eager),
        _common.compiled_provider(reference),
        Provider("liger", _probe_liger, _liger),
        *_common.fusedops_providers("cross_entropy", _fusedops_factory(False), _fusedops_raw,
                                    variants={"inplace": _fusedops_factory(True),
                                              "smooth": _fusedops_factory(False, label_smoothing=SMOOTHING),
                                              "wsmooth": _fusedops_factory(False, SMOOTHING, weighted=True)},
                                    variant_references={"smooth": _reference_smoothed,
                                                        "wsmooth": _reference_weighted_smoothed}),
        # The forward alone as inference runs it (no gradient wanted: one read of the logits);
        # with the logits requiring grad, fusedops' (and Liger's) forward also writes the gradient.
        Provider("fusedops+nograd", lambda device: _common.probe_fusedops("cross_entropy", device, variant="nograd"),
                 _fusedops_no_grad, role="subject", modes=("fwd",)),
    ],
    modes=("fwd", "fwd+bwd"),
    measure_memory=True,
)
