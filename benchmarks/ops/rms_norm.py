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
--providers; it shows what the autograd wrapper costs per call.
"""

from __future__ import annotations

import importlib
import inspect
import os

import torch

from benchmarks.harness import Case, Inputs, OpEntry, Probe, Provider, dist_version

EPS = 1e-6
BF16, FP32 = torch.bfloat16, torch.float32

GPU_CASES = [
    Case((32768, 4096), BF16, "large"),
    Case((4096, 8192), BF16, "large"),
    Case((65536, 1024), BF16, "large"),
    Case((1, 4096), BF16, "small"),
    Case((16, 4096), BF16, "small"),
    Case((256, 4096), BF16, "small"),
]
CPU_CASES = [
    Case((8192, 4096), FP32, "large"),
    Case((8192, 4096), BF16, "large"),
    Case((16, 4096), BF16, "small"),
]


def make_inputs(case: Case, device: str, seed: int) -> Inputs:
    rows, hidden = case.shape
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1_000_003 + rows * 31 + hidden)
    x = torch.randn(case.shape, generator=gen, device=device, dtype=case.dtype)
    w = 1.0 + 0.1 * torch.randn(hidden, generator=gen, device=device, dtype=torch.float32)
    dy = torch.randn(case.shape, generator=gen, device=device, dtype=case.dtype)
    x.requires_grad_(True)
    w = torch.nn.Parameter(w.to(case.dtype))
    return Inputs(args=(x, w, EPS), grad_argnums=(0, 1), grad_out=dy, names=("x", "weight", "eps"))


def reference(x, w, eps):
    """LLaMA-style RMSNorm: statistics and scaling in fp32, result in x's dtype.

    The harness calls it with fp32 copies (the correctness reference); the
    torch.compile provider compiles this very function on the real inputs.
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * w.float()).to(x.dtype)


def min_bytes(case: Case, mode: str) -> int:
    factor = {"fwd": 2, "bwd": 3, "fwd+bwd": 5}[mode]
    return factor * case.numel * case.itemsize


# -- eager -------------------------------------------------------------------


def _probe_eager(device):
    if not hasattr(torch.nn.functional, "rms_norm"):
        return Probe("eager", False, "torch.nn.functional.rms_norm needs torch >= 2.4")
    return Probe("eager", True)


def _eager(case, device):
    f = torch.nn.functional.rms_norm
    return lambda x, w, eps: f(x, (x.shape[-1],), w, eps)


# -- torch.compile -----------------------------------------------------------


def _probe_compile(device):
    if device == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            return Probe("torch.compile", False, f"triton not importable ({exc})")
    return Probe("torch.compile", True)


def _compiled(case, device):
    # Each shape gets its own compile; raise dynamo's recompile limit so that
    # many shapes (several dtypes, grad/no-grad) never fall back to eager.
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), 64))
    # The "bwd" mode replays one backward with retain_graph=True, which AOT
    # autograd refuses when the backward donates (reuses) saved buffers.
    # Donation only saves memory; it does not change the kernels.
    functorch_config = getattr(getattr(torch, "_functorch", None), "config", None)
    if functorch_config is not None and hasattr(functorch_config, "donated_buffer"):
        functorch_config.donated_buffer = False
    return torch.compile(reference, dynamic=False, fullgraph=True)


# -- liger -------------------------------------------------------------------


def _probe_liger(device):
    if device != "cuda":
        return Probe("liger", False, "CUDA only")
    try:
        module = importlib.import_module("liger_kernel.ops.rms_norm")
        module.LigerRMSNormFunction  # noqa: B018
    except Exception as exc:
        return Probe("liger", False, f"liger_kernel not importable ({type(exc).__name__}: {exc})")
    return Probe("liger", True, version=dist_version("liger-kernel") or dist_version("liger_kernel"))


def _liger(case, device):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    # autograd.Function.apply takes positional arguments only: map the
    # forward's parameters by name, defaults for anything unknown.
    params = list(inspect.signature(LigerRMSNormFunction.forward).parameters.values())[1:]
    wanted = {"offset": 0.0, "casting_mode": "llama", "in_place": False}
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        # Hidden behind a decorator without functools.wraps: assume liger 0.8's order.
        def run(x, w, eps):
            return LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False)

        return run
    layout = []
    for p in params:
        name = p.name.lower()
        if name in ("x", "input", "hidden_states"):
            layout.append("x")
        elif name in ("w", "weight"):
            layout.append("w")
        elif name in ("eps", "epsilon", "variance_epsilon"):
            layout.append("eps")
        elif p.name in wanted:
            layout.append(("const", wanted[p.name]))
        elif p.default is not inspect.Parameter.empty:
            layout.append(("const", p.default))
        else:
            raise TypeError(f"unexpected LigerRMSNormFunction.forward parameter {p.name!r}")

    def run(x, w, eps):
        values = {"x": x, "w": w, "eps": eps}
        return LigerRMSNormFunction.apply(*(values[s] if isinstance(s, str) else s[1] for s in layout))

    return run


# -- quack -------------------------------------------------------------------


def _probe_quack(device):
    if device != "cuda":
        return Probe("quack", False, "CUDA only")
    try:
        from quack.rmsnorm import rmsnorm  # noqa: F401
    except Exception as exc:
        return Probe("quack", False, f"quack not importable ({type(exc).__name__}: {exc})")
    return Probe("quack", True, version=dist_version("quack-kernels") or dist_version("quack"))


def _quack(case, device):
    from quack.rmsnorm import rmsnorm

    if "eps" in inspect.signature(rmsnorm).parameters:
        return lambda x, w, eps: rmsnorm(x, w, eps=eps)
    return lambda x, w, eps: rmsnorm(x, w)


# -- fusedops ----------------------------------------------------------------


def _fusedops_backend(fusedops, device):
    """(backend label, remark) for the kernel serving rms_norm on the device."""
    backend_for = getattr(fusedops, "backend_for", None)
    if backend_for is not None:
        try:
            backend = backend_for("rms_norm", torch.device(device))
        except TypeError:
            backend = backend_for("rms_norm", device)
        if not backend:
            raise RuntimeError(f"fusedops has no rms_norm kernel for {device}")
        return str(backend), ""
    guess = os.environ.get("FUSEDOPS_BACKEND") or device
    return guess, f"backend label guessed ({guess}): fusedops.backend_for is missing"


def _probe_fusedops(device, raw=False):
    suffix = "-raw" if raw else ""
    try:
        fusedops = importlib.import_module("fusedops")
    except Exception as exc:
        return Probe(f"fusedops{suffix}", False, f"fusedops not importable ({type(exc).__name__}: {exc})")
    version = getattr(fusedops, "__version__", "") or dist_version("fusedops")
    if raw:
        try:
            torch.ops.fusedops.rms_norm.default  # noqa: B018
        except Exception as exc:
            return Probe("fusedops-raw", False, f"no torch.ops.fusedops.rms_norm ({exc})")
    elif not hasattr(fusedops, "rms_norm"):
        return Probe("fusedops", False, "fusedops has no rms_norm", version)
    try:
        backend, remark = _fusedops_backend(fusedops, device)
    except Exception as exc:
        return Probe(f"fusedops{suffix}", False, f"backend_for failed ({type(exc).__name__}: {exc})", version)
    requested = os.environ.get("FUSEDOPS_BACKEND", "").strip().lower()
    if device == "cuda" and requested not in ("", "auto") and requested != backend:
        remark = f"FUSEDOPS_BACKEND={requested} but rms_norm is served by {backend}"
    return Probe(f"fusedops-{backend}{suffix}", True, remark, version)


def _fusedops(case, device):
    import fusedops

    f = fusedops.rms_norm
    return lambda x, w, eps: f(x, w, eps=eps)


def _fusedops_raw(case, device):
    op = torch.ops.fusedops.rms_norm.default
    return lambda x, w, eps: op(x, w, eps)[0]


ENTRY = OpEntry(
    name="rms_norm",
    gpu_cases=GPU_CASES,
    cpu_cases=CPU_CASES,
    make_inputs=make_inputs,
    reference=reference,
    min_bytes=min_bytes,
    bytes_model=(
        "E = rows x hidden elements of s bytes; fwd = 2*E*s (read x, write y), "
        "bwd = 3*E*s (read x, read dy, write dx), fwd+bwd = 5*E*s; weight, dweight "
        "and rstd are ignored (O(hidden) or O(rows))."
    ),
    providers=[
        Provider("eager", _probe_eager, _eager),
        Provider("torch.compile", _probe_compile, _compiled),
        Provider("liger", _probe_liger, _liger),
        Provider("quack", _probe_quack, _quack),
        Provider("fusedops", _probe_fusedops, _fusedops, role="subject"),
        Provider("fusedops-raw", lambda d: _probe_fusedops(d, raw=True), _fusedops_raw,
                 role="subject", modes=("fwd",), default=False),
    ],
)
