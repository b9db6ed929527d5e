"""The ops on DTensors (torch.distributed.tensor), as tensor and sequence parallelism run them:
two CPU processes over gloo, every case against the same op on the whole tensors, the
placements against torch's own ops where torch has one. On a GPU the same cases run over NCCL
on up to two GPUs (one GPU: a mesh of one, which still takes every op through DTensor's
dispatch and the CUDA kernels).

The processes start once for the module and device (about as long as the cases take) and run
every case; each test reports its own case's outcome. After a case fails on a rank, that rank
runs no more cases (they report "not run"): a failure on one rank alone would otherwise leave
the other waiting in a collective, and the run would hang."""

import faulthandler
import json
import os
import subprocess
import sys
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

import pytest
import torch
import torch.distributed as dist

import fusedops
from conftest import device_params

WORLD = 2  # on the CPU; on CUDA as many GPUs as there are, up to this
pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="this torch build has no torch.distributed with gloo",
)


_DEVICE = "cpu"  # (set by each worker process)


def _rand(*shape):
    return torch.randn(*shape, device=_DEVICE)


@dataclass
class Case:
    fn: Callable
    args: tuple  # the whole tensors (and None)
    kwargs: dict = field(default_factory=dict)
    sharded: tuple = (0,)  # the arguments placed as the case says; the others replicated
    differentiable: tuple = (0,)  # the arguments that require grad
    torch_fn: Optional[Callable] = None  # torch's own op on the same positional arguments
    placements: tuple = ("S0", "S1", "R")  # Shard(d) or Replicate


def _norm_cases():
    x, r, w, b = _rand(4, 6, 32), _rand(4, 6, 32), _rand(32), _rand(32)
    return {
        "rms_norm": Case(
            fusedops.rms_norm,
            (x, w),
            differentiable=(0, 1),
            torch_fn=lambda x, w: torch.nn.functional.rms_norm(x, (32,), w, 1e-6),
        ),
        "rms_norm-no-weight": Case(fusedops.rms_norm, (x,)),
        # (after "rms_norm" with the same specs: DTensor's cached rule, the weight's gradient unasked)
        "rms_norm-frozen-weight": Case(fusedops.rms_norm, (x, w)),
        "rms_norm-options": Case(
            fusedops.rms_norm,
            (x, w),
            dict(offset=1.0, cast_before_weight=True, save_output=True),
            differentiable=(0, 1),
        ),
        "add_rms_norm": Case(fusedops.add_rms_norm, (x, r, w), sharded=(0, 1), differentiable=(0, 1, 2)),
        "add_rms_norm-wide-residual": Case(
            fusedops.add_rms_norm, (x.bfloat16(), r, w), sharded=(0, 1), differentiable=(0, 1, 2)
        ),
        "layer_norm": Case(
            fusedops.layer_norm,
            (x, w, b),
            differentiable=(0, 1, 2),
            torch_fn=lambda x, w, b: torch.nn.functional.layer_norm(x, (32,), w, b, 1e-5),
        ),
        "layer_norm-weight-only": Case(fusedops.layer_norm, (x, w, None), differentiable=(0, 1)),
    }


def _gated_cases():
    g, u, gu = _rand(4, 6, 32), _rand(4, 6, 32), _rand(4, 6, 64)
    every = ("S0", "S1", "S2", "R")
    both = dict(sharded=(0, 1), differentiable=(0, 1), placements=every)
    return {
        "swiglu": Case(
            fusedops.swiglu, (g, u), torch_fn=lambda g, u: torch.nn.functional.silu(g) * u, **both
        ),
        "geglu-tanh": Case(
            fusedops.geglu,
            (g, u),
            dict(approximate="tanh"),
            torch_fn=lambda g, u: torch.nn.functional.gelu(g, approximate="tanh") * u,
            **both,
        ),
        # (sharded over its last dimension, the packed form's input is gathered first)
        "swiglu_packed": Case(fusedops.swiglu_packed, (gu,), placements=every),
        "geglu_packed": Case(fusedops.geglu_packed, (gu,), placements=every),
    }


def _rope_cases():
    B, S, Hq, Hk, D, R = 2, 6, 4, 2, 16, 12  # (partial rotary: R < D)
    q, k = _rand(B, Hq, S, D), _rand(B, Hk, S, D)
    cos, sin = _rand(B, S, R), _rand(B, S, R)
    one = dict(sharded=(0, 1), differentiable=(0, 1), placements=("S0", "S1", "S2", "R"))
    table_cos, table_sin = _rand(10, R), _rand(10, R)
    positions = torch.randint(0, 10, (B, S), device=_DEVICE)
    return {
        "rope-bhsd": Case(fusedops.rope, (q, k, cos, sin), **one),
        "rope-bhsd-shared-tables": Case(fusedops.rope, (q, k, cos[:1], sin[:1]), **one),
        "rope-bshd-interleaved": Case(
            fusedops.rope,
            (q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), cos, sin),
            dict(layout="bshd", interleaved=True),
            **one,
        ),
        "rope-thd": Case(
            fusedops.rope,
            (q[0].transpose(0, 1).contiguous(), k[0].transpose(0, 1).contiguous(), cos[0], sin[0]),
            dict(layout="thd"),
            sharded=(0, 1),
            differentiable=(0, 1),
            placements=("S0", "S1", "R"),
        ),
        # 6 q heads on 3 kv heads: split in two, the heads would not pair up on each rank (3 and
        # 2, 3 and 1), so the rule moves them; over the batch they stay
        "rope-gqa-uneven-heads": Case(
            fusedops.rope, (_rand(B, 6, S, D), _rand(B, 3, S, D), cos, sin), sharded=(0, 1),
            differentiable=(0, 1), placements=("S0", "S1"),
        ),
        # (with position_ids only the heads stay sharded: q and k sharded otherwise are moved)
        "rope-position-ids": Case(
            lambda q, k, c, s, p: fusedops.rope(q, k, c, s, position_ids=p),
            (q, k, table_cos, table_sin, positions),
            **one,
        ),
    }


def _cases():
    # The same tensors on every rank, without moving the caller's generator (the module builds
    # them once at import too, for the case names).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        built = {**_norm_cases(), **_gated_cases(), **_rope_cases()}
    cases = {}
    for name, case in built.items():
        for p in case.placements:
            cases[f"{name}-{p}"] = (case, p)
    return cases


CASES = sorted(_cases())
MODULE_CASES = ["RMSNorm-SequenceParallel", "LayerNorm-SequenceParallel", "SwiGLUMLP-tensor-parallel"]
# Ops without a rule (ops/_sharding.py says why): DTensor's own error, naming the op.
REFUSED = {  # (each given a function placing a whole tensor as Shard(0))
    "add_rms_norm_": lambda place: fusedops.add_rms_norm_(place(_rand(4, 32)), place(_rand(4, 32))),
    "rope_": lambda place: fusedops.rope_(
        place(_rand(4, 2, 6, 16)), place(_rand(4, 2, 6, 16)), place(_rand(4, 6, 16)), place(_rand(4, 6, 16))
    ),
    "cross_entropy": lambda place: fusedops.cross_entropy(
        place(_rand(4, 32)), place(torch.zeros(4, dtype=torch.long, device=_DEVICE))
    ),
}


COMPILED = "torch.compile-fullgraph"
BAD_POSITION = "rope-bad-position"
ALL_CASES = CASES + MODULE_CASES + list(REFUSED) + [COMPILED, BAD_POSITION]


def _placement(code):
    from torch.distributed.tensor import Replicate, Shard

    return Replicate() if code == "R" else Shard(int(code[1:]))


def _outputs(result):
    return list(result) if isinstance(result, (tuple, list)) else [result]


def _run_op_case(mesh, case, code):
    """Forward and backward on DTensors (the case's sharded arguments placed by `code`, the
    others replicated) against the op on the whole tensors: values, and placements as torch's
    op gives them."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    def leaves(distributed):
        out = []
        for i, a in enumerate(case.args):
            if a is not None:
                if distributed:
                    a = distribute_tensor(a, mesh, [_placement(code) if i in case.sharded else Replicate()])
                a = a.clone().requires_grad_(i in case.differentiable)
            out.append(a)
        return out

    plain, sharded = leaves(False), leaves(True)
    expected = _outputs(case.fn(*plain, **case.kwargs))
    got = _outputs(case.fn(*sharded, **case.kwargs))
    grads = [torch.randn_like(e) for e in expected]
    torch.autograd.backward(expected, grads)
    torch.autograd.backward(got, [distribute_tensor(g, mesh, y.placements) for g, y in zip(grads, got)])
    for i, (y, e) in enumerate(zip(got, expected)):
        assert isinstance(y, DTensor), f"output {i} is a {type(y).__name__}"
        # each row computed as on one process: the same bits
        assert torch.equal(y.full_tensor(), e), f"output {i} differs"
    for i in case.differentiable:
        torch.testing.assert_close(
            sharded[i].grad.full_tensor(), plain[i].grad, msg=lambda m, i=i: f"gradient of argument {i}: {m}"
        )
    if case.torch_fn is not None:
        theirs = leaves(True)
        y_torch = case.torch_fn(*theirs)
        y_torch.backward(distribute_tensor(grads[0], mesh, y_torch.placements))
        assert got[0].placements == y_torch.placements, (got[0].placements, y_torch.placements)
        for i in case.differentiable:
            assert sharded[i].grad.placements == theirs[i].grad.placements, (
                i,
                sharded[i].grad.placements,
                theirs[i].grad.placements,
            )


def _run_refused_case(mesh, name):
    from torch.distributed.tensor import Shard, distribute_tensor

    with pytest.raises(
        NotImplementedError, match=rf"fusedops\.{name}\.default does not have a sharding strategy"
    ):
        REFUSED[name](lambda t: distribute_tensor(t, mesh, [Shard(0)]))


def _run_bad_position_case(mesh):
    """A position outside the tables raises its ValueError for DTensor arguments as for plain
    ones, naming the same entry on every rank (the positions are replicated): on the CPU in the
    call; on a GPU in the call with check_positions="sync", and by default in the next checked
    call once the GPU has finished (the flag each rank reads is its own copy)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(4)
    q, k, cos, sin = _rand(2, 4, 6, 16), _rand(2, 2, 6, 16), _rand(10, 16), _rand(10, 16)
    bad = torch.randint(0, 10, (2, 6), device=_DEVICE)
    bad[1, 3] = 10
    qd, kd = (distribute_tensor(t, mesh, [Shard(1)]) for t in (q, k))
    cd, sd, pd, good = (distribute_tensor(t, mesh, [Replicate()]) for t in (cos, sin, bad, bad % 10))
    message = r"rope: position_ids\[1, 3\] = 10 is outside the cos/sin tables' 10 rows"
    with pytest.raises(ValueError, match=message):
        fusedops.rope(qd, kd, cd, sd, position_ids=pd, check_positions="sync")
    if _DEVICE == "cuda":
        fusedops.rope(qd, kd, cd, sd, position_ids=pd)
        torch.cuda.synchronize()
        with pytest.raises(ValueError, match=message + r" \(found after that earlier call returned"):
            fusedops.rope(qd, kd, cd, sd, position_ids=good)
        fusedops.rope(qd, kd, cd, sd, position_ids=good)  # (reported once)


def _run_compiled_case(mesh):
    """torch.compile(fullgraph=True) over ops on DTensors: one graph, the eager values."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(3)
    x, w = _rand(4, 8, 32), _rand(32)

    def block(x, w):
        return fusedops.swiglu(fusedops.rms_norm(x, w), x)

    def leaves():
        return (
            distribute_tensor(x, mesh, [Shard(1)]).requires_grad_(),
            distribute_tensor(w, mesh, [Replicate()]).requires_grad_(),
        )

    (xc, wc), (xe, we) = leaves(), leaves()
    y = torch.compile(block, fullgraph=True)(xc, wc)
    y_eager = block(xe, we)
    assert y.placements == y_eager.placements
    torch.testing.assert_close(y.full_tensor(), y_eager.full_tensor())
    y.sum().backward()
    y_eager.sum().backward()
    for compiled, eager in ((xc, xe), (wc, we)):
        assert compiled.grad.placements == eager.grad.placements
        torch.testing.assert_close(compiled.grad.full_tensor(), eager.grad.full_tensor())


def _run_module_case(mesh, name):
    """A module parallelised as torchtitan-style training does, against torch's own module
    parallelised the same way: outputs and parameter gradients."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    torch.manual_seed(1)
    x = _rand(2, 8, 32)
    if name == "SwiGLUMLP-tensor-parallel":
        ours = fusedops.nn.SwiGLUMLP(32, 64, device=_DEVICE)

        class TorchMLP(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.gate_proj = torch.nn.Linear(32, 64, bias=False, device=_DEVICE)
                self.up_proj = torch.nn.Linear(32, 64, bias=False, device=_DEVICE)
                self.down_proj = torch.nn.Linear(64, 32, bias=False, device=_DEVICE)

            def forward(self, x):
                return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

        theirs = TorchMLP()
        plan = {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
    else:
        cls = name.split("-")[0]
        ours, theirs = getattr(fusedops.nn, cls)(32, device=_DEVICE), getattr(torch.nn, cls)(32, device=_DEVICE)
        plan = SequenceParallel()  # (each rank's x is its shard of the sequence)
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # (not ones and zeros)
    theirs.load_state_dict(ours.state_dict())
    results = []
    for module in (ours, theirs):
        module = parallelize_module(module, mesh, plan)
        y = module(x)
        y = y.full_tensor() if hasattr(y, "full_tensor") else y
        torch.manual_seed(2)
        y.backward(torch.randn_like(y))
        # (the gradients' placements too: what the optimizer and gradient clipping see)
        grads = {n: (p.grad.placements, p.grad.full_tensor()) for n, p in module.named_parameters()}
        results.append((y.detach(), grads))
    (y_ours, g_ours), (y_theirs, g_theirs) = results
    torch.testing.assert_close(y_ours, y_theirs, rtol=2e-5, atol=2e-5)
    assert g_ours.keys() == g_theirs.keys()
    for n, (placements, grad) in g_ours.items():
        assert placements == g_theirs[n][0], (n, placements, g_theirs[n][0])
        torch.testing.assert_close(
            grad, g_theirs[n][1], rtol=2e-5, atol=2e-5, msg=lambda m, n=n: f"grad of {n}: {m}"
        )


def _worker(rank, device, world, port, out_dir):
    global _DEVICE
    _DEVICE = device
    faulthandler.enable()  # (a worker that crashes prints where, into the fixture's captured output)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device, (world,))
    cases = _cases()
    outcome = {}
    first_failure = None
    for index, name in enumerate(ALL_CASES):
        if first_failure is not None:
            # A case that failed on one rank alone (an error in one rank's shard) leaves the
            # other rank waiting in a collective that never comes: rather than go on and hang,
            # this rank stops, and leaving the group ends the other's wait with an error.
            outcome[name] = f"not run: {first_failure} failed before it on rank {rank}"
            continue
        # Every rank draws the same numbers in a case (its gradients, say), whatever ran before.
        torch.manual_seed(index)
        try:
            if name in cases:
                _run_op_case(mesh, *cases[name])
            elif name in REFUSED:
                _run_refused_case(mesh, name)
            elif name == COMPILED:
                _run_compiled_case(mesh)
            elif name == BAD_POSITION:
                _run_bad_position_case(mesh)
            else:
                _run_module_case(mesh, name)
            dist.barrier()
            outcome[name] = None
        except Exception:  # (each case reports its own failure)
            outcome[name] = traceback.format_exc(limit=6)
            first_failure = name
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(outcome, f)
    # Now, rather than through the interpreter's teardown: there, about one run in twenty, a
    # gloo thread still alive aborts the process ("terminate called without an active
    # exception", no Python frame), after all the work is done.
    os._exit(0)


@pytest.fixture(scope="module", params=device_params())
def outcomes(request, tmp_path_factory):
    import torch.multiprocessing as mp

    device = request.param
    if device == "cuda" and not dist.is_nccl_available():
        pytest.skip("this torch build has no NCCL")
    world = WORLD if device == "cpu" else min(WORLD, torch.cuda.device_count())
    out_dir = tmp_path_factory.mktemp(f"dtensor-{device}")
    # (the store lives here, on a port the system picks: no port to collide, no file to race on)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mp.spawn(_worker, args=(device, world, store.port, str(out_dir)), nprocs=world, join=True)
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]
    return {name: [o[name] for o in ranks if o[name] is not None] for name in ranks[0]}


@pytest.mark.parametrize("case", ALL_CASES)
def test_on_dtensors(outcomes, case):
    failures = outcomes[case]
    assert not failures, failures[0]


def test_rules_wait_for_dtensor_import():
    """`import fusedops` does not import torch.distributed.tensor (0.4 s); the rules are there
    once it is imported, whichever comes first, and also when its spec was looked up before the
    import without running it (importlib.util.find_spec; torch._logging.set_logs does that)."""
    probe = (
        "import importlib.util, sys, torch\n"
        "{first}\n"
        "imported = 'torch.distributed.tensor' in sys.modules\n"
        "assert not imported or {dtensor_first}, 'fusedops imported DTensor'\n"
        "{second}\n"
        "from torch.distributed.tensor import DTensor\n"
        "funcs = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs\n"
        "ops = torch.ops.fusedops\n"
        "assert ops.rms_norm.default in funcs and ops.rope_backward.default in funcs\n"
    )
    look_up = "importlib.util.find_spec('torch.distributed.tensor'); importlib.util.find_spec('torch.distributed.tensor')"
    orders = [
        (False, "import fusedops", "import torch.distributed.tensor"),
        (True, "import torch.distributed.tensor", "import fusedops"),
        (False, "import fusedops", look_up + "; import torch.distributed.tensor"),
    ]
    for dtensor_first, first, second in orders:
        code = probe.format(first=first, second=second, dtensor_first=dtensor_first)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
        assert done.returncode == 0, (second, done.stderr[-2000:])


def test_a_failed_registration_warns(monkeypatch):
    """register_sharding is experimental: if it changes under a future torch, importing
    torch.distributed.tensor must still work, with a warning saying what fusedops lost."""
    from fusedops.ops import _sharding

    monkeypatch.setattr(_sharding, "RULES", {"not an op": None})
    with pytest.warns(UserWarning, match="fusedops: its DTensor sharding rules could not be registered"):
        _sharding.register_all()
