"""Loads the native libraries after checking that they fit the torch in this process.

fusedops/_C holds every schema and the CPU kernels; fusedops/_C_cuda the CUDA kernels. Both
target torch's stable ABI of 2.10, so they load on any torch from 2.10 on; _C_cuda also needs
the CUDA major version it was compiled with. FUSEDOPS_BACKEND chooses what serves CUDA tensors:
"auto" (the CUDA kernels when built, else Triton), "cuda" or "triton".
"""

import importlib
import os
import re

import torch

TORCH_TARGET = (2, 10)
BACKENDS = ("auto", "cuda", "triton")
# One item of a TORCH_CUDA_ARCH_LIST ("9.0", "9.0a", "9.0+PTX"): the forms setup.py accepts
# (its ARCH_ITEM, the same pattern) and records in the build record's cuda_archs.
ARCH_ITEM = re.compile(r"(\d+)\.(\d+)(a?)(\+PTX)?")

# What serves CUDA tensors once load() has run: "cuda", "triton", or None without CUDA torch.
cuda_backend = None


def _version_tuple(v):
    parts = v.split("+")[0].split(".")
    return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in parts[:2])


class IncompatibleBuildError(ImportError):
    """The installed fusedops binaries do not fit this torch."""


def build_info():
    """How this install's native libraries were built (torch, CUDA, archs, compilers)."""
    try:
        from ._build_info import BUILD_INFO
    except ImportError as e:
        raise IncompatibleBuildError(
            "fusedops: the native libraries are not built in this checkout; build them with "
            "`pip install --no-build-isolation -e .` (see README.md)"
        ) from e
    return dict(BUILD_INFO)


def archs_cover(arch_spec, capability):
    """Whether a build for `arch_spec` (TORCH_CUDA_ARCH_LIST: "8.0;9.0;12.0+PTX") has code a GPU
    of compute `capability` (major, minor) can run: a cubin for the same major and a minor no
    newer than the GPU's ("a" variants: the exact GPU only), or PTX for an older or equal
    architecture, which the driver compiles for the GPU."""
    for item in re.split(r"[;\s]+", arch_spec.strip()):
        m = ARCH_ITEM.fullmatch(item)
        if m is None:
            continue
        arch = (int(m.group(1)), int(m.group(2)))
        exact_only = bool(m.group(3))
        if arch == tuple(capability):
            return True
        if not exact_only and arch[0] == capability[0] and arch[1] <= capability[1]:
            return True
        if m.group(4) and not exact_only and arch <= tuple(capability):
            return True
    return False


def gpus_without_code():
    """The visible GPUs this install's CUDA kernels have no code for, as (index, name,
    capability). Initialises CUDA."""
    spec = build_info()["cuda_archs"]
    missing = []
    for i in range(torch.cuda.device_count()):
        cap = torch.cuda.get_device_capability(i)
        if not archs_cover(spec, cap):
            missing.append((i, torch.cuda.get_device_name(i), cap))
    return missing


def requested_backend():
    backend = os.environ.get("FUSEDOPS_BACKEND", "auto").strip().lower() or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"FUSEDOPS_BACKEND must be one of {', '.join(BACKENDS)}, got {backend!r}")
    return backend


def load():
    """Loads _C (and _C_cuda where it applies) and sets `cuda_backend`."""
    global cuda_backend
    cuda_backend = _load()
    return cuda_backend


def _load():
    info = build_info()
    if _version_tuple(torch.__version__) < TORCH_TARGET:
        raise IncompatibleBuildError(
            f"fusedops needs torch >= {TORCH_TARGET[0]}.{TORCH_TARGET[1]} (its binaries target that "
            f"stable ABI), found torch {torch.__version__}: upgrade torch"
        )
    _import_native("fusedops._C", "the schemas and CPU kernels", info)
    if not torch.version.cuda:
        return None
    backend = requested_backend()
    if backend == "triton":
        return "triton"
    if not info["cuda_built"]:
        if backend == "cuda":
            raise IncompatibleBuildError(
                "FUSEDOPS_BACKEND=cuda but this fusedops was built without CUDA kernels "
                f"(built against torch {info['torch']} with CUDA {info['torch_cuda'] or 'none'}); "
                "rebuild from source with a CUDA toolkit and a CUDA torch"
            )
        return "triton"
    built_major = info["torch_cuda"].split(".")[0]
    found_major = torch.version.cuda.split(".")[0]
    if built_major != found_major:
        raise IncompatibleBuildError(
            f"fusedops' CUDA kernels were built for CUDA {info['torch_cuda']} but torch "
            f"{torch.__version__} uses CUDA {torch.version.cuda}: install a fusedops built for CUDA "
            f"{found_major}, rebuild from source (`pip install --no-build-isolation .`), or set "
            "FUSEDOPS_BACKEND=triton"
        )
    _import_native("fusedops._C_cuda", "the CUDA kernels", info,
                   "; or set FUSEDOPS_BACKEND=triton to run CUDA tensors on the Triton kernels")
    return "cuda"


def _import_native(module, holds, info, alternative=""):
    """Imports one of the native libraries the build record lists; a missing or unloadable one
    (a partial install, a checkout whose build was cleaned, a library that fails to link) gets
    a message that says what to do instead of the loader's bare error."""
    try:
        importlib.import_module(module)
    except ImportError as e:
        built = f"built against torch {info['torch']}"
        if module.endswith("_cuda"):
            built += f" with CUDA {info['torch_cuda']} for archs {info['cuda_archs'] or '(default)'}"
        raise IncompatibleBuildError(
            f"fusedops: the build record says {module} ({holds}) was {built}, but it cannot be "
            f"loaded ({type(e).__name__}: {e}): reinstall fusedops, or rebuild it from source against "
            f"this torch ({torch.__version__}) with `pip install --no-build-isolation .` (`-e .` in a "
            f"checkout; see README.md){alternative}"
        ) from e
