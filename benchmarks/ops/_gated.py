"""Glue shared by the gated-activation entries (swiglu, geglu, swiglu_packed, geglu_packed).

A case's shape is the output's, (rows, n): gate and up are (rows, n) each, or one (rows, 2n)
gate_up for the packed forms.  Inputs are fresh normal data (gate scaled by 2, so the
activation's curved part is exercised), never zeros.

Minimum-bytes model (E = rows * n elements of s bytes each), the same for both forms:

* fwd      3 * E * s   read gate and up, write y
* bwd      5 * E * s   read dy, gate and up, write dgate and dup
* fwd+bwd  8 * E * s   the sum of the two

A provider that materialises act(gate), or (packed) copies the halves apart or concatenates
two gradients, moves more and shows it as a lower TB/s.

Providers: "eager" (torch.nn.functional, the halves by ``chunk`` for the packed forms),
"torch.compile" (the fp32 reference below, compiled per shape, fullgraph), "liger"
(Liger-Kernel's LigerSiLUMulFunction / LigerGELUMulFunction, the packed forms through
``chunk``, whose halves Liger copies contiguous; Liger's backward writes its gradients into
the saved gate and up, which is why its timed backward may run on overwritten inputs) and the
subject "fusedops-<backend>"; "fusedops-raw" (the registered op, forward only) when named.
"""

from __future__ import annotations

import torch

from benchmarks.harness import Case, Inputs, OpEntry, Probe, Provider
from benchmarks.ops import _common

BF16, FP32 = torch.bfloat16, torch.float32

GPU_CASES = [
    Case((16384, 14336), BF16, "large"),  # LLaMA-3 8B's MLP at 16k tokens
    Case((4096, 28672), BF16, "large"),   # a wide MLP (LLaMA-3 70B's intermediate size)
    Case((8192, 11008), BF16, "large"),   # LLaMA-2 7B
    Case((1, 14336), BF16, "small"),
    Case((16, 14336), BF16, "small"),
]
CPU_CASES = [
    Case((4096, 14336), FP32, "large"),
    Case((4096, 14336), BF16, "large"),
    Case((16, 14336), BF16, "small"),
]
PASSES = {"fwd": 3, "bwd": 5, "fwd+bwd": 8}
BYTES_MODEL = ("E = rows x n output elements of s bytes; fwd = 3*E*s (read gate, up; write y), "
               "bwd = 5*E*s (read dy, gate, up; write dgate, dup), fwd+bwd = 8*E*s.")


def make_inputs(packed: bool):
    def make(case, device, seed) -> Inputs:
        gen = _common.case_generator(case, device, seed)
        rows, n = case.shape
        if packed:
            gu = torch.randn(rows, 2 * n, generator=gen, device=device, dtype=FP32)
            gu[:, :n] *= 2.0
            gu = gu.to(case.dtype).requires_grad_(True)
            dy = torch.randn(case.shape, generator=gen, device=device, dtype=case.dtype)
            return Inputs(args=(gu,), grad_argnums=(0,), grad_out=dy, names=("gate_up",))
        g = (2.0 * torch.randn(case.shape, generator=gen, device=device, dtype=FP32)).to(case.dtype)
        u = torch.randn(case.shape, generator=gen, device=device, dtype=case.dtype)
        dy = torch.randn(case.shape, generator=gen, device=device, dtype=case.dtype)
        return Inputs(args=(g.requires_grad_(True), u.requires_grad_(True)), grad_argnums=(0, 1), grad_out=dy,
                      names=("gate", "up"))

    return make


def halves(f):
    """f(gate, up) as a function of gate_up = [gate | up]."""

    def run(gate_up):
        g, u = gate_up.chunk(2, dim=-1)
        return f(g, u)

    return run


def entry(name: str, packed: bool, act_fp32, liger_module: str, liger_function: str, fusedops_call, raw_call):
    """The OpEntry of one gated op. ``act_fp32(gate, up)`` is the math in fp32 (the reference,
    and what torch.compile compiles); ``fusedops_call(fusedops, *args)`` and ``raw_call(*args)``
    call the public function and the registered op."""

    def reference2(g, u):
        return act_fp32(g.float(), u.float()).to(g.dtype)

    reference = halves(reference2) if packed else reference2

    def eager(case, device):
        f = lambda g, u: act_fp32(g, u)  # noqa: E731  (torch's ops in the input dtype)
        return halves(f) if packed else f

    probe_liger = _common.cuda_import_probe("liger", liger_module, liger_function, ("liger-kernel", "liger_kernel"))

    def liger(case, device):
        import importlib

        function = getattr(importlib.import_module(liger_module), liger_function)
        f = lambda g, u: function.apply(g, u)  # noqa: E731
        return halves(f) if packed else f

    def fusedops_provider(case, device):
        import fusedops

        return lambda *args: fusedops_call(fusedops, *args)

    def raw(case, device):
        return raw_call

    return OpEntry(
        name=name,
        gpu_cases=GPU_CASES,
        cpu_cases=CPU_CASES,
        make_inputs=make_inputs(packed),
        reference=reference,
        min_bytes=_common.min_bytes_of(PASSES),
        bytes_model=BYTES_MODEL,
        providers=[
            Provider("eager", lambda device: Probe("eager", True), eager),
            _common.compiled_provider(reference),
            Provider("liger", probe_liger, liger),
            *_common.fusedops_providers(name, fusedops_provider, raw),
        ],
    )
