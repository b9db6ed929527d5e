"""Glue shared by the row-normalisation entries (rms_norm, layer_norm).

Everything here is parameterised by the op name or by the op's own
callables, so an entry keeps only what is specific to its math: inputs,
reference, eager call and the argument layout of its peers.  The loader
skips this module (leading underscore): it defines no ``ENTRY``.
"""

from __future__ import annotations

import importlib
import inspect
import os

import torch

from benchmarks.harness import Case, OpEntry, Probe, Provider, dist_version

BF16, FP32 = torch.bfloat16, torch.float32

# Both norms are benchmarked on the same problems so their tables can be read
# side by side: three bandwidth-bound shapes of 64-256 MiB per tensor, three
# of 128 MiB whose rows are too wide to keep in registers (up to the 262144
# the norms promise), and three that only per-call overhead decides.
ROW_NORM_GPU_CASES = [
    Case((32768, 4096), BF16, "large"),
    Case((4096, 8192), BF16, "large"),
    Case((65536, 1024), BF16, "large"),
    Case((2048, 32768), BF16, "wide"),
    Case((512, 131072), BF16, "wide"),
    Case((256, 262144), BF16, "wide"),
    Case((1, 4096), BF16, "small"),
    Case((16, 4096), BF16, "small"),
    Case((256, 4096), BF16, "small"),
]
ROW_NORM_CPU_CASES = [
    Case((8192, 4096), FP32, "large"),
    Case((8192, 4096), BF16, "large"),
    Case((16, 4096), BF16, "small"),
]

# Tensor passes of E elements each mode must make at least (x, y; x, dy, dx).
ROW_NORM_PASSES = {"fwd": 2, "bwd": 3, "fwd+bwd": 5}


def case_generator(case: Case, device: str, seed: int) -> torch.Generator:
    """A generator seeded from the run seed and the shape, so each case gets
    its own data and a rerun with the same --seed gets the same data."""
    rows, hidden = case.shape
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1_000_003 + rows * 31 + hidden)
    return gen


def row_norm_tensors(case: Case, device: str, seed: int, centres: tuple):
    """(x, [parameters], dy) of a row norm: x requires grad; one learnable
    ``nn.Parameter`` of shape (hidden,) in x's dtype per entry of ``centres``,
    drawn as centre + 0.1 N(0, 1) (so a weight is never all ones and a bias
    never all zeros, which would hide a kernel that skips it).

    The draw order (x, parameters, dy) is part of the data: changing it
    changes every case's inputs.
    """
    gen = case_generator(case, device, seed)
    x = torch.randn(case.shape, generator=gen, device=device, dtype=case.dtype)
    params = []
    for centre in centres:
        p = centre + 0.1 * torch.randn(case.shape[-1], generator=gen, device=device, dtype=torch.float32)
        params.append(p)
    dy = torch.randn(case.shape, generator=gen, device=device, dtype=case.dtype)
    x.requires_grad_(True)
    return x, [torch.nn.Parameter(p.to(case.dtype)) for p in params], dy


def min_bytes_of(passes: dict):
    """min_bytes(case, mode): element-wise traffic only, ``passes[mode]`` tensors of E elements."""

    def min_bytes(case: Case, mode: str) -> int:
        return passes[mode] * case.numel * case.itemsize

    return min_bytes


def row_norm_bytes_model(ignored: str, passes_text: str = "") -> str:
    """The report line of the bytes model; ``ignored`` names the small tensors
    the op also touches, which the model leaves out."""
    passes_text = passes_text or (
        "fwd = 2*E*s (read x, write y), bwd = 3*E*s (read x, read dy, write dx), fwd+bwd = 5*E*s"
    )
    return f"E = rows x hidden elements of s bytes; {passes_text}; {ignored} are ignored (O(hidden) or O(rows))."


# -- third-party peers ---------------------------------------------------------


def cuda_import_probe(label: str, module: str, attr: str, dists: tuple):
    """probe(device) for a CUDA-only peer: available iff ``module.attr`` imports.

    The import happens inside the probe, never at entry import time, so a
    missing or broken peer package costs a "skipped" row, not the run.
    """
    package = module.split(".")[0]

    def probe(device):
        if device != "cuda":
            return Probe(label, False, "CUDA only")
        try:
            getattr(importlib.import_module(module), attr)
        except Exception as exc:
            return Probe(label, False, f"{package} not importable ({type(exc).__name__}: {exc})")
        version = ""
        for dist in dists:
            version = version or dist_version(dist)
        return Probe(label, True, version=version)

    return probe


def autograd_apply_by_name(function, arg_names: tuple, aliases: dict, wanted: dict, assumed: tuple):
    """fn(*args) calling ``function.apply`` with ``args`` placed by parameter name.

    ``autograd.Function.apply`` is positional only, and peers insert options
    between releases, so the layout is read from ``function.forward``'s
    signature.  ``arg_names`` is the entry's argument order; ``aliases`` maps
    each to the parameter names it may go by; ``wanted`` pins options
    (matched by exact name); any other parameter takes its default.
    ``assumed`` is the parameter list to fall back on when a decorator without
    ``functools.wraps`` hides the signature.
    """
    params = list(inspect.signature(function.forward).parameters.values())[1:]
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        names = assumed
        defaults = {}
    else:
        names = [p.name for p in params]
        defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    alias_of = {alias: arg for arg, spellings in aliases.items() for alias in spellings}
    layout = []
    for name in names:
        if name.lower() in alias_of:
            layout.append(alias_of[name.lower()])
        elif name in wanted:
            layout.append(("const", wanted[name]))
        elif name in defaults:
            layout.append(("const", defaults[name]))
        else:
            raise TypeError(f"unexpected {function.__name__}.forward parameter {name!r}")
    apply = function.apply

    def run(*args):
        values = dict(zip(arg_names, args))
        return apply(*(values[s] if isinstance(s, str) else s[1] for s in layout))

    return run


# -- torch.compile -------------------------------------------------------------


def probe_compile(device):
    if device == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            return Probe("torch.compile", False, f"triton not importable ({exc})")
    return Probe("torch.compile", True)


def _configure_compile():
    # Each shape gets its own compile; raise dynamo's recompile limit so that
    # many shapes (several dtypes, grad/no-grad, several ops) never fall back
    # to eager.
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


def compiled_provider(reference) -> Provider:
    """The "torch.compile" peer: ``reference`` compiled once per case, whole graph."""

    def factory(case, device):
        _configure_compile()
        return torch.compile(reference, dynamic=False, fullgraph=True)

    return Provider("torch.compile", probe_compile, factory)


# -- fusedops ------------------------------------------------------------------


def fusedops_backend(fusedops, op: str, device: str):
    """(backend label, remark) for the kernel serving ``op`` on the device."""
    backend_for = getattr(fusedops, "backend_for", None)
    if backend_for is not None:
        try:
            backend = backend_for(op, torch.device(device))
        except TypeError:
            backend = backend_for(op, device)
        if not backend:
            raise RuntimeError(f"fusedops has no {op} kernel for {device}")
        return str(backend), ""
    guess = os.environ.get("FUSEDOPS_BACKEND") or device
    return guess, f"backend label guessed ({guess}): fusedops.backend_for is missing"


def probe_fusedops(op: str, device: str, raw: bool = False, variant: str = "") -> Probe:
    """Availability and label ("fusedops-<backend>[-raw]", or "fusedops-<backend>+<variant>" for
    an option variant) of fusedops' ``op``."""
    suffix = "-raw" if raw else f"+{variant}" if variant else ""
    try:
        fusedops = importlib.import_module("fusedops")
    except Exception as exc:
        return Probe(f"fusedops{suffix}", False, f"fusedops not importable ({type(exc).__name__}: {exc})")
    version = getattr(fusedops, "__version__", "") or dist_version("fusedops")
    if raw:
        try:
            getattr(torch.ops.fusedops, op).default  # noqa: B018
        except Exception as exc:
            return Probe("fusedops-raw", False, f"no torch.ops.fusedops.{op} ({exc})")
    elif not hasattr(fusedops, op):
        return Probe("fusedops", False, f"fusedops has no {op}", version)
    try:
        backend, remark = fusedops_backend(fusedops, op, device)
    except Exception as exc:
        return Probe(f"fusedops{suffix}", False, f"backend_for failed ({type(exc).__name__}: {exc})", version)
    requested = os.environ.get("FUSEDOPS_BACKEND", "").strip().lower()
    if device == "cuda" and requested not in ("", "auto") and requested != backend:
        remark = f"FUSEDOPS_BACKEND={requested} but {op} is served by {backend}"
    return Probe(f"fusedops-{backend}{suffix}", True, remark, version)


def _large_only(case: Case, device: str):
    return None if case.size == "large" else "option variants run on the large shapes only"


def fusedops_providers(op: str, factory, raw_factory, variants: dict = None,
                       variant_references: dict = None) -> list:
    """The subject providers of ``op``: the public function, the raw
    ``torch.ops`` op (forward only, opt-in) that shows what the autograd
    wrapper costs per call, and one provider per option variant
    (``variants``: name -> factory computing the same function with that
    option on, or, given ``variant_references[name]``, the function that
    reference computes; large shapes only).  The factories stay with the entry
    because the call signature is the op's."""
    providers = [
        Provider("fusedops", lambda device: probe_fusedops(op, device), factory, role="subject"),
        Provider("fusedops-raw", lambda device: probe_fusedops(op, device, raw=True), raw_factory,
                 role="subject", modes=("fwd",), default=False),
    ]
    for name, variant_factory in (variants or {}).items():
        providers.append(Provider(f"fusedops+{name}", lambda device, name=name: probe_fusedops(op, device, variant=name),
                                  variant_factory, role="subject", supports=_large_only,
                                  reference=(variant_references or {}).get(name)))
    return providers


# -- the entry ---------------------------------------------------------------


def row_norm_entry(name: str, make_inputs, reference, ignored: str, eager: Provider,
                   peers: list, fusedops, fusedops_raw, passes: dict = ROW_NORM_PASSES,
                   passes_text: str = "", variants: dict = None) -> OpEntry:
    """The ``OpEntry`` of a row norm: the shared cases and bytes model, and the
    providers in the order the reports show them: eager, torch.compile of
    ``reference``, the op's third-party ``peers``, then fusedops (public
    function from the ``fusedops`` factory, raw op from ``fusedops_raw``).
    ``ignored`` names the small tensors left out of the bytes model; ``passes``
    (with its description ``passes_text``) overrides the x/y/dy/dx model."""
    return OpEntry(
        name=name,
        gpu_cases=ROW_NORM_GPU_CASES,
        cpu_cases=ROW_NORM_CPU_CASES,
        make_inputs=make_inputs,
        reference=reference,
        min_bytes=min_bytes_of(passes),
        bytes_model=row_norm_bytes_model(ignored, passes_text),
        providers=[eager, compiled_provider(reference), *peers,
                   *fusedops_providers(name, fusedops, fusedops_raw, variants)],
    )
