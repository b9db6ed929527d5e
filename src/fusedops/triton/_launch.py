"""Host-side helpers shared by the Triton launchers.

Launch shapes are integer arithmetic done in plain Python here: in Triton 3.6 and 3.8,
``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions whose call dispatch
costs about 5 us each on the host (Triton 3.8, measured on the CPU VM), and a launch computes
several of them, which matters for the small calls where the host decides.

Kernels are launched through :class:`Launcher`, which calls a compiled kernel's launcher
directly once Triton has compiled it for the arguments' specialization. ``kernel[grid](...)``
re-derives that specialization from every argument, builds a cache key and launch metadata
on each call: on the H200 machine's host (Triton 3.6, 2026-12-03) 43 us for rope's 46
arguments and 25 us for rms_norm's forward, against 7 and 6 us for the compiled launcher
called directly."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Sequence

import torch
from torch import Tensor

try:
    from triton import knobs as _knobs
except ImportError:  # (Triton before 3.4)
    _knobs = None

# "SMs" assumed when the tensors are not on a CUDA device (Triton's interpreter on the CPU).
_NON_CUDA_SM_COUNT = 4
_SM_COUNT: dict[int, int] = {}


def cdiv(a: int, b: int) -> int:
    """a / b rounded up (b > 0)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n, and 0 for 0 (as ``triton.next_power_of_2``)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _NON_CUDA_SM_COUNT
    index = device.index if device.index is not None else torch.cuda.current_device()
    count = _SM_COUNT.get(index)
    if count is None:
        count = torch.cuda.get_device_properties(index).multi_processor_count
        _SM_COUNT[index] = count
    return count


# Shared memory a program may use, assumed when the tensors are not on a CUDA device (the
# interpreter has no limit; this is an H100's / H200's opt-in limit).
_NON_CUDA_SHARED_MEMORY = 227 * 1024
_SHARED_MEMORY: dict[int, int] = {}


def shared_memory_per_block(device: torch.device) -> int:
    """The most shared memory one program may use on `device` (the opt-in limit, which Triton
    raises a kernel's allowance to), in bytes."""
    if device.type != "cuda":
        return _NON_CUDA_SHARED_MEMORY
    index = device.index if device.index is not None else torch.cuda.current_device()
    size = _SHARED_MEMORY.get(index)
    if size is None:
        props = torch.cuda.get_device_properties(index)
        size = getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block
        _SHARED_MEMORY[index] = size
    return size


def device_guard(device: torch.device):
    # Triton launches on the current CUDA device; make it the tensors' device.
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _launch_hooks_set() -> bool:
    """Whether someone (a Triton profiler, say) listens to Triton's launch hooks: launches then
    go through ``kernel[grid]``, which calls them. (A HookChain in Triton 3.8, a function or
    None in earlier versions; a Triton without ``knobs`` has another launcher interface, so it
    always takes ``kernel[grid]``.)"""
    if _knobs is None:
        return True
    hook = _knobs.runtime.launch_enter_hook
    return bool(getattr(hook, "calls", hook))


class Launcher:
    """Launches a ``@triton.jit`` kernel whose parameters are its tensors, then its runtime
    scalars, then its constexprs (``tensors``, ``scalars`` and keyword arguments here, the
    keywords also taking launch options such as ``num_warps``).

    The first launch of each specialization goes through ``kernel[grid](...)``, which compiles
    (or finds) the kernel; the compiled kernel is kept under a key that determines Triton's
    specialization and more: the device, the keywords, every scalar's value and type, every
    tensor's dtype and address modulo 16 (Triton specializes on 16-byte alignment and on
    integers equal to 1 or divisible by 16). Later launches with the same key call the compiled
    kernel's launcher directly on the device's current stream. Tensors not on a CUDA device
    (Triton's interpreter) and launches while launch hooks are set always take
    ``kernel[grid]``. The launch is on the tensors' device, whatever the current device."""

    # Keys hold exact shapes and strides; a process that meets more of them starts over.
    MAX_KEYS = 1024

    def __init__(self, kernel: Any):
        self.kernel = kernel
        self._compiled: dict = {}
        # The kernel's constexpr parameters in order, once a launch has shown where they start;
        # False when its parameters are not laid out as above (every launch takes kernel[grid]).
        self._constexprs: list | bool | None = None

    def __call__(self, grid: Sequence[int], tensors: Sequence[Tensor], scalars: Sequence[Any], **keywords: Any) -> None:
        device = tensors[0].get_device()
        if device < 0 or self._constexprs is False or _launch_hooks_set():
            with device_guard(tensors[0].device):
                self.kernel[grid](*tensors, *scalars, **keywords)
            return
        key = (
            device,
            tuple(keywords.items()),
            tuple(scalars),
            tuple(map(type, scalars)),
            tuple([t.dtype for t in tensors]),
            tuple([t.data_ptr() & 15 for t in tensors]),
        )
        if device == _current_device():
            self._launch(key, grid, tensors, scalars, keywords)
        else:
            with torch.cuda.device(device):
                self._launch(key, grid, tensors, scalars, keywords)

    def _launch(self, key, grid, tensors, scalars, keywords) -> None:
        entry = self._compiled.get(key)
        if entry is None:
            compiled = self.kernel[grid](*tensors, *scalars, **keywords)
            tail = self._constexpr_values(len(tensors) + len(scalars), keywords)
            metadata = getattr(compiled, "packed_metadata", None)
            if metadata is not None and tail is not None:
                if len(self._compiled) >= self.MAX_KEYS:
                    self._compiled.clear()
                self._compiled[key] = (compiled.run, compiled.function, metadata, tail)
            return
        run, function, metadata, tail = entry
        n = len(grid)
        run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _current_stream(key[0]), function, metadata,
            None, None, None, *tensors, *scalars, *tail)

    def _constexpr_values(self, n_runtime: int, keywords: dict) -> tuple | None:
        """The constexpr arguments in parameter order (the compiled launcher takes them after
        the runtime ones), or None if a parameter has neither a keyword nor a default."""
        if self._constexprs is None:
            params = self.kernel.params
            runtime, rest = params[:n_runtime], params[n_runtime:]
            layout_ok = not any(p.is_constexpr for p in runtime) and all(p.is_constexpr for p in rest)
            self._constexprs = list(rest) if layout_ok else False
        if self._constexprs is False:
            return None
        values = []
        for p in self._constexprs:
            if p.name in keywords:
                values.append(keywords[p.name])
            elif p.default is not inspect.Parameter.empty:
                values.append(p.default)
            else:
                return None
        return tuple(values)


# torch's own C entry points for the current device and raw stream (what Triton's driver calls
# too): torch.cuda.current_stream(i).cuda_stream costs 5-8 us a call on the H200 machine's
# host, this 0.1-0.2.
_current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(device: int) -> int:
    if _raw_stream is not None:
        return _raw_stream(device)
    return torch.cuda.current_stream(device).cuda_stream
