"""The bookkeeping of the deferred bad-value checks (src/fusedops/ops/_deferred.py), with the
CUDA pieces (pinned slots, events, streams) replaced by host stand-ins so that it runs anywhere.
The GPU behaviour (cross_entropy's targets, rope's positions) is tested in their own files."""

import re

import pytest
import torch

from fusedops.ops import _deferred


class _Event:
    def __init__(self):
        self.done = False

    def record(self, stream=None):
        self.done = False

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


class _Ring:
    def __init__(self, size):
        host = torch.empty(size, dtype=torch.int64)
        self.slots = host.unbind(0)
        self.values = host.numpy()
        self.events = [_Event() for _ in range(size)]
        self.free = list(range(size - 1, -1, -1))


@pytest.fixture
def checks(monkeypatch):
    monkeypatch.setattr(_deferred, "_Ring", _Ring)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    pending = _deferred.DeferredChecks()
    pending.SLOTS = 4
    return pending


def _finish_all(pending):
    for ring, slot, _ in pending.pending:
        ring.events[slot].done = True


def test_reports_the_first_bad_call_once_its_copy_is_done(checks):
    checks.add(torch.tensor(-1), lambda i: f"first: {i}")
    checks.add(torch.tensor(3), lambda i: f"second: {i}")
    checks.add(torch.tensor(5), lambda i: f"third: {i}")
    checks.raise_finished()  # nothing has completed: no error, nothing waited for
    assert len(checks.pending) == 3
    _finish_all(checks)
    with pytest.raises(ValueError, match=r"^second: 3$"):
        checks.raise_finished()
    # the later bad call is not reported, and its slot is freed once its copy completes
    checks.raise_finished()
    assert not checks.pending
    assert sorted(next(iter(checks.rings.values())).free) == [0, 1, 2, 3]


def test_waits_for_the_oldest_call_when_every_slot_is_in_flight(checks):
    for i in range(4):
        checks.add(torch.tensor(-1), lambda i: "unexpected")
    ring = next(iter(checks.rings.values()))
    assert not ring.free
    checks.add(torch.tensor(-1), lambda i: "unexpected")  # waits for the oldest, reuses its slot
    assert len(checks.pending) == 4


def test_no_query_while_capturing(checks, monkeypatch):
    checks.add(torch.tensor(2), lambda i: f"bad: {i}")
    _finish_all(checks)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    checks.raise_finished()  # (an event query is not allowed during capture)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with pytest.raises(ValueError, match="bad: 2"):
        checks.raise_finished()


@pytest.mark.parametrize("mode", ["later", 1, None, "True"])
def test_mode_must_be_true_false_or_sync(mode):
    with pytest.raises(ValueError, match=rf"op: check_x must be True, False or 'sync', got {re.escape(repr(mode))}$"):
        _deferred.check_mode(mode, "op", "check_x")


def test_first_index():
    assert int(_deferred.first_index(torch.tensor([False, False, True, True]))) == 2
    assert int(_deferred.first_index(torch.tensor([[False], [False]]))) == -1
    assert int(_deferred.first_index(torch.zeros(0, dtype=torch.bool))) == -1


@pytest.mark.parametrize("mode", [True, "sync"])
def test_under_vmap_every_problem_is_checked_in_the_call(mode):
    """Under torch.func.vmap the flag is a wrapped tensor of one index a problem: it is read in
    the call whatever the mode, and the error names the first bad problem's index."""
    check = _deferred.GpuCheck("cross_entropy", "check_target", "target", mode)

    def finish(flag):
        check.finish(flag, message=None)  # (a message would read wrapped values: not used)
        return flag

    assert torch.func.vmap(finish)(torch.tensor([-1, -1])).tolist() == [-1, -1]
    expected = (
        "cross_entropy: target is out of range at flat index 7 of a problem under torch.func transforms "
        "(2 of the 3 problems have such a value)"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        torch.func.vmap(finish)(torch.tensor([-1, 7, 2]))
    with pytest.raises(ValueError, match=r"at flat index 5 of a problem .* \(1 of the 4 problems"):
        torch.func.vmap(torch.func.vmap(finish))(torch.tensor([[-1, -1], [5, -1]]))
