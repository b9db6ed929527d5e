"""Benchmark entry of rope (rotary position embeddings of q and k).

Cases are LLaMA-3-8B attention (Hq = 32 query heads, Hk = 8 key heads, head_dim D = 128) in
bf16, in the variants users run: the Hugging Face layout (B, H, S, D) ("bhsd"), the
(B, S, H, D) layout straight out of the projections ("bshd"), partial rotary (R = 64 of
D = 128), interleaved pairs, packed variable-length sequences ("thd": T tokens of sequences of
512..4096 tokens, position ids into (P, R) tables), and decode steps (S = 1) where per-call
overhead decides. cos/sin are what HF's rotary module hands the attention: (B, S, R) in q's
dtype (thd: (P, R) tables).

Minimum-bytes model (E = B * S * (Hq + Hk) * D elements of s bytes, q and k together):

* fwd      2 * E * s   read q and k, write q_out and k_out
* bwd      2 * E * s   read dq_out and dk_out, write dq and dk
* fwd+bwd  4 * E * s   the sum of the two

cos/sin (B * S * R elements each, at most 1/10 of E here, and served from L2 when a kernel
reads them once per position rather than once per head) and position ids are left out; with
partial rotary the features past R still count (they are read and written).

Providers: "eager" (Hugging Face's apply_rotary_pos_emb formula in the input dtype, generalised
to the variants below), "torch.compile" (the fp32 reference below, compiled per case),
"liger" (Liger-Kernel's LigerRopeFunction: bhsd, full rotary, rotate-half only) and the
subject "fusedops-<backend>" (``fusedops.rope`` with the case's layout and options);
"fusedops-raw" (the op on the (B, H, S, D) views, forward only) runs when named in --providers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from benchmarks.harness import Case, Inputs, OpEntry, Probe, Provider
from benchmarks.ops import _common

BF16, FP32 = torch.bfloat16, torch.float32
PASSES = {"fwd": 2, "bwd": 2, "fwd+bwd": 4}


@dataclass(frozen=True)
class RopeCase(Case):
    """shape = (B, S, Hq, Hk, D); thd cases pack B * S tokens. `variant`: bhsd, bshd, partial
    (bhsd with R = D / 2), interleaved (bhsd) or thd."""

    variant: str = "bhsd"

    @property
    def shape_str(self) -> str:
        return f"{self.variant}:" + "x".join(str(d) for d in self.shape)

    @property
    def numel(self) -> int:
        B, S, Hq, Hk, D = self.shape
        return B * S * (Hq + Hk) * D


LLAMA3_8B = (8, 4096, 32, 8, 128)
GPU_CASES = [
    RopeCase(LLAMA3_8B, BF16, "large", "bhsd"),
    RopeCase(LLAMA3_8B, BF16, "large", "bshd"),
    RopeCase(LLAMA3_8B, BF16, "large", "partial"),
    RopeCase(LLAMA3_8B, BF16, "large", "interleaved"),
    RopeCase((1, 32768, 32, 8, 128), BF16, "large", "thd"),
    RopeCase((1, 1, 32, 8, 128), BF16, "small", "bhsd"),
    RopeCase((16, 1, 32, 8, 128), BF16, "small", "bhsd"),
]
CPU_CASES = [
    RopeCase((1, 2048, 32, 8, 128), FP32, "large", "bhsd"),
    RopeCase((1, 2048, 32, 8, 128), BF16, "large", "bhsd"),
    RopeCase((1, 2048, 32, 8, 128), BF16, "large", "bshd"),
    RopeCase((1, 1, 32, 8, 128), BF16, "small", "bhsd"),
]


def _rotary_dim(case) -> int:
    return case.shape[4] // 2 if case.variant == "partial" else case.shape[4]


def _packed_positions(T: int, device) -> torch.Tensor:
    """Positions of T packed tokens: sequences of 512, 1024, 2048, 4096, 512, ... tokens."""
    lengths, total, i = [], 0, 0
    while total < T:
        n = min(512 << (i % 4), T - total)
        lengths.append(n)
        total += n
        i += 1
    return torch.cat([torch.arange(n, device=device) for n in lengths])


def make_inputs(case, device, seed) -> Inputs:
    B, S, Hq, Hk, D = case.shape
    R = _rotary_dim(case)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1_000_003 + B * 7919 + S * 31 + D + sum(map(ord, case.variant)))
    interleaved = case.variant == "interleaved"

    def randn(*shape):
        return torch.randn(shape, generator=gen, device=device, dtype=case.dtype)

    if case.variant == "thd":
        T = B * S
        q, k, dq, dk = randn(T, Hq, D), randn(T, Hk, D), randn(T, Hq, D), randn(T, Hk, D)
        position_ids = _packed_positions(T, device)
        positions = torch.arange(4096, device=device, dtype=torch.float32)
        layout = "thd"
    else:
        layout = "bshd" if case.variant == "bshd" else "bhsd"
        qs, ks = ((B, S, Hq, D), (B, S, Hk, D)) if layout == "bshd" else ((B, Hq, S, D), (B, Hk, S, D))
        q, k, dq, dk = randn(*qs), randn(*ks), randn(*qs), randn(*ks)
        position_ids = None
        positions = torch.arange(S, device=device, dtype=torch.float32)[None].expand(B, S)
    # A real rotation (HF's default frequencies), duplicated per convention.
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, R, 2, device=device, dtype=torch.float32) / R))
    angles = positions[..., None] * inv_freq
    full = torch.repeat_interleave(angles, 2, dim=-1) if interleaved else torch.cat((angles, angles), dim=-1)
    cos, sin = full.cos().to(case.dtype), full.sin().to(case.dtype)
    q.requires_grad_(True)
    k.requires_grad_(True)
    return Inputs(args=(q, k, cos, sin, position_ids, layout, interleaved), grad_argnums=(0, 1), grad_out=(dq, dk),
                  names=("q", "k", "cos", "sin", "position_ids", "layout", "interleaved"))


def _rotate(x, interleaved):
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _apply(q, k, cos, sin, position_ids, layout, interleaved, upcast):
    """HF's apply_rotary_pos_emb generalised to the variants; in fp32 when `upcast`."""
    if position_ids is not None:
        index = position_ids.long()  # (the harness hands the reference every tensor as float32)
        cos, sin = cos[index], sin[index]  # (T, R)
    unsqueeze = {"bhsd": 1, "bshd": 2, "thd": 1}[layout]
    c, s = cos.unsqueeze(unsqueeze), sin.unsqueeze(unsqueeze)
    R = c.shape[-1]

    def one(x):
        xf = x.float() if upcast else x
        cf, sf = (c.float(), s.float()) if upcast else (c, s)
        xr = xf[..., :R]
        y = xr * cf + _rotate(xr, interleaved) * sf
        if R < x.shape[-1]:
            y = torch.cat((y, xf[..., R:]), dim=-1)
        return y.to(x.dtype)

    return one(q), one(k)


def reference(q, k, cos, sin, position_ids, layout, interleaved):
    """fp32 math, outputs in q's dtype; the torch.compile provider compiles this function."""
    return _apply(q, k, cos, sin, position_ids, layout, interleaved, upcast=True)


def _eager(case, device):
    return lambda *args: _apply(*args, upcast=False)


def _probe_eager(device):
    return Probe("eager", True)


_probe_liger_import = _common.cuda_import_probe(
    "liger", "liger_kernel.ops.rope", "LigerRopeFunction", ("liger-kernel", "liger_kernel"))


def _liger_supports(case, device):
    if case.variant not in ("bhsd",):
        return "Liger's rope takes (B, H, S, D), full rotary, rotate-half only"
    return None


def _liger(case, device):
    from liger_kernel.ops.rope import LigerRopeFunction

    def run(q, k, cos, sin, position_ids, layout, interleaved):
        return LigerRopeFunction.apply(q, k, cos, sin)

    return run


def _fusedops(case, device):
    import fusedops

    f = fusedops.rope

    def run(q, k, cos, sin, position_ids, layout, interleaved):
        return f(q, k, cos, sin, layout=layout, interleaved=interleaved, position_ids=position_ids)

    return run


def _fusedops_raw(case, device):
    op = torch.ops.fusedops.rope.default

    # (the op takes and returns (B, H, S, D) views; the outputs are viewed back in the layout)
    def run(q, k, cos, sin, position_ids, layout, interleaved):
        if layout == "bshd":
            q_out, k_out, _bad = op(q.transpose(1, 2), k.transpose(1, 2), cos, sin, None, interleaved)
            return q_out.transpose(1, 2), k_out.transpose(1, 2)
        if layout == "thd":
            q_out, k_out, _bad = op(q.unsqueeze(0).transpose(1, 2), k.unsqueeze(0).transpose(1, 2), cos, sin,
                                    position_ids[None], interleaved)
            return q_out.transpose(1, 2)[0], k_out.transpose(1, 2)[0]
        return op(q, k, cos, sin, None, interleaved)[:2]

    return run


def min_bytes(case, mode) -> int:
    return PASSES[mode] * case.numel * case.itemsize


ENTRY = OpEntry(
    name="rope",
    gpu_cases=GPU_CASES,
    cpu_cases=CPU_CASES,
    make_inputs=make_inputs,
    reference=reference,
    min_bytes=min_bytes,
    bytes_model=("E = B*S*(Hq+Hk)*D elements of s bytes (q and k); fwd = 2*E*s (read q, k; write q_out, k_out), "
                 "bwd = 2*E*s (read dq_out, dk_out; write dq, dk), fwd+bwd = 4*E*s; cos/sin (B*S*R each, or "
                 "(P, R) tables) and position ids are ignored."),
    providers=[
        Provider("eager", _probe_eager, _eager),
        _common.compiled_provider(reference),
        Provider("liger", _probe_liger_import, _liger, supports=_liger_supports),
        *_common.fusedops_providers("rope", _fusedops, _fusedops_raw),
    ],
)
