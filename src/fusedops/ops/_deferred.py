"""Eager errors for bad values that only the GPU sees, without a host synchronisation.

Some arguments are valid only if their *values* are (cross_entropy's targets must lie in
[0, V), rope's positions in the cos/sin tables). The GPU kernels never read out of bounds for a
bad value (they write NaN for it) and record the first one in a 0-d int64 flag: its flat
index, or -1. Reading that flag right after the launch would make the host wait for the GPU on
every call, so the public functions hand it to ``pending`` instead:

* ``pending.add`` copies the flag into pinned host memory with a non-blocking copy and records
  an event;
* ``pending.raise_finished``, called by the next checked call or backward, looks at the copies
  whose events have completed (a query, not a wait) and raises the first bad one's ValueError.

So the error comes from the first such call that starts after the GPU has finished the bad
one, usually the next training step's, and says so. Mode "sync" of a check waits and raises in
the call itself (one synchronisation per call); False does not check. Nothing is checked while
torch.compile traces or a CUDA graph is being captured (the NaN remains). Under torch.func
transforms (vmap) the flag holds one index per problem and is checked in the call, as "sync"
would: a deferred record of a wrapped tensor would outlive its transform.
"""

import collections
import sys

import torch

_functorch = torch._C._functorch

MODES = (True, False, "sync")


def check_mode(mode, op, option):
    """`mode` if it is one of MODES (numpy's bools as Python's, as the bool options take them),
    else a ValueError naming `option`."""
    np = sys.modules.get("numpy")
    if np is not None and isinstance(mode, np.bool_):
        mode = bool(mode)
    if not any(mode is m or (isinstance(m, str) and mode == m) for m in MODES):
        raise ValueError(f"{op}: {option} must be True, False or 'sync', got {mode!r}")
    return mode


def first_index(bad):
    """The flat index of the first True of the boolean tensor `bad`, or -1: a 0-d int64 tensor on
    its device, computed there (no synchronisation)."""
    bad = bad.reshape(-1)
    if bad.numel() == 0:
        return torch.full((), -1, dtype=torch.int64, device=bad.device)
    first = bad.to(torch.int8).argmax()
    return torch.where(bad.any(), first, torch.full_like(first, -1))


class _Ring:
    """One device's pinned slots for the flags' host copies, with an event each (reused)."""

    def __init__(self, size):
        host = torch.empty(size, dtype=torch.int64, pin_memory=True)
        self.slots = host.unbind(0)
        self.values = host.numpy()  # (read without a tensor op)
        self.events = [torch.cuda.Event() for _ in range(size)]
        self.free = list(range(size - 1, -1, -1))


class DeferredChecks:
    """The flags of calls whose checks are still running on the GPU, oldest first. Their host
    copies go to slots of a pinned buffer allocated once per device, each with a reused event:
    a pinned allocation and a new event per call cost more host time than the op itself."""

    SLOTS = 1024  # calls in flight; past this (a host very far ahead of its GPU) the oldest is waited for

    def __init__(self):
        self.pending = collections.deque()  # (ring, slot, message or None: not reported)
        self.rings = {}

    def add(self, flag, message):
        """`flag`: the device's 0-d int64 record; `message(index)` builds the error (it may read
        the call's tensors: it runs only for a bad value)."""
        ring = self.rings.get(flag.device.index)
        if ring is None:
            ring = self.rings[flag.device.index] = _Ring(self.SLOTS)
        while not ring.free:
            oldest, slot, _ = self.pending[0]
            oldest.events[slot].synchronize()
            self._raise_completed()
        slot = ring.free.pop()
        ring.slots[slot].copy_(flag, non_blocking=True)
        ring.events[slot].record(torch.cuda.current_stream(flag.device))  # (where the copy runs)
        self.pending.append((ring, slot, message))

    def raise_finished(self):
        """Raises for the first completed bad call; nothing while a CUDA graph is being captured
        (no event may be queried then)."""
        if self.pending and not torch.cuda.is_current_stream_capturing():
            self._raise_completed()

    def _raise_completed(self):
        while self.pending and self.pending[0][0].events[self.pending[0][1]].query():
            ring, slot, message = self.pending.popleft()
            ring.free.append(slot)
            index = int(ring.values[slot])
            if index >= 0 and message is not None:
                # One error: the calls after this one are not reported (their slots are freed
                # as their copies complete).
                self.pending = collections.deque((r, s, None) for r, s, _ in self.pending)
                raise ValueError(message(index))


pending = DeferredChecks()


class GpuCheck:
    """One public call's check. ``start``, before the launch, validates the mode and raises for
    an earlier call's bad value; it returns None when there is nothing to check (CPU, False,
    compiling, CUDA-graph capture). ``finish``, after the launch, takes the kernel's flag."""

    __slots__ = ("op", "option", "argument", "mode")

    def __init__(self, op, option, argument, mode):
        self.op, self.option, self.argument, self.mode = op, option, argument, mode

    @classmethod
    def start(cls, op, option, argument, mode, tensor, compiling):
        check_mode(mode, op, option)
        if mode is False or not tensor.is_cuda or compiling or torch.cuda.is_current_stream_capturing():
            return None
        pending._raise_completed()  # (not capturing: checked just above)
        return cls(op, option, argument, mode)

    def finish(self, flag, message):
        # A DTensor's flag (replicated: the positions are, ops/_sharding.py) as this rank's tensor
        to_local = getattr(flag, "to_local", None)
        if to_local is not None:
            flag = to_local()
        if _functorch.is_functorch_wrapped_tensor(flag):
            self._finish_transformed(flag)
            return
        if self.mode == "sync":
            index = int(flag)  # the one synchronisation
            if index >= 0:
                raise ValueError(message(index))
            return
        option = self.option
        pending.add(
            flag,
            lambda index: message(index)
            + f" (found after that earlier call returned: {option}=True checks without waiting for the GPU; "
            f"{option}='sync' raises in the call itself)",
        )

    def _finish_transformed(self, flag):
        """The check under torch.func transforms: one flag a problem, read now (one
        synchronisation). The argument's values are wrapped too, so the error names the index
        without the value."""
        while _functorch.is_functorch_wrapped_tensor(flag):
            flag = _functorch.get_unwrapped(flag)
        flags = flag.reshape(-1).tolist()
        bad = [i for i in flags if i >= 0]
        if bad:
            raise ValueError(
                f"{self.op}: {self.argument} is out of range at flat index {bad[0]} of a problem under "
                f"torch.func transforms ({len(bad)} of the {len(flags)} problems have such a value)"
            )
