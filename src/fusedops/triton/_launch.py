"""Host-side helpers shared by the Triton launchers.

Launch shapes are integer arithmetic done in plain Python here: in Triton 3.6 and 3.8,
``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions whose call dispatch
costs about 5 us each on the host (Triton 3.8, measured on the CPU VM), and a launch computes
several of them, which matters for the small calls where the host decides."""

from __future__ import annotations

import contextlib

import torch

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


def device_guard(device: torch.device):
    # Triton launches on the current CUDA device; make it the tensors' device.
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()
