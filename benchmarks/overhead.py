"""Where an op's per-call time goes on a tiny input, layer by layer (host overhead, not
bandwidth). rms_norm: torch's own F.rms_norm, the public function, the registered op through
the dispatcher's Autograd kernel, the direct autograd path, the op alone below autograd, and
reference points (an allocation, an elementwise op); then the backward through
torch.autograd.grad beside the autograd engine's own floor and the backward op alone. rope (a
decode step): the public function, the direct autograd path, the op alone, and Hugging Face's
formula in eager torch ops. Steady-state loops, min and median of five.

    python benchmarks/overhead.py [--device cuda] [--shape 16x4096]
    python benchmarks/overhead.py --op rope [--shape 1x32x8x1x128]   (B x Hq x Hk x S x D)

--profile N adds a cProfile of the public call (rms_norm: forward without and with autograd,
then forward+backward; rope: the forward) and prints its N costliest functions by own time:
where a backend's Python launch path spends its time (FUSEDOPS_BACKEND=triton, say).

--launch (CUDA) times the op's Triton launcher function and, for each Triton kernel it launches,
Triton's own entry (kernel[grid]) against fusedops' Launcher (src/fusedops/triton/_launch.py),
whatever FUSEDOPS_BACKEND says, and checks that both write the same bytes.
"""

import argparse
import cProfile
import pstats
import time

import torch
import torch.nn.functional as F

import fusedops
from fusedops.ops import _direct
from fusedops.ops import rms_norm as op
from fusedops.ops import rope as rope_op


def per_call_us(fn, device, n):
    for _ in range(max(50, n // 40)):
        fn()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / n * 1e6)
    times.sort()
    return times[0], times[2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--op", choices=("rms_norm", "rope"), default="rms_norm")
    parser.add_argument("--shape", default=None, help="rms_norm: ROWSxN (16x4096); rope: BxHqxHkxSxD (1x32x8x1x128)")
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--launch", action="store_true",
                        help="time each Triton kernel's launch through kernel[grid] and through fusedops' Launcher")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also cProfile the public call and print its N costliest functions")
    args = parser.parse_args()
    if args.op == "rope":
        return rope(args)
    args.shape = args.shape or "16x4096"
    shape = tuple(int(s) for s in args.shape.split("x"))
    x = torch.randn(shape, device=args.device, dtype=torch.bfloat16)
    w = torch.randn(shape[-1], device=args.device, dtype=torch.bfloat16)
    eps, n = 1e-6, shape[-1:]
    print(f"rms_norm {args.shape} bf16 on {args.device}, torch {torch.__version__}: us per call (min, median)")

    show = _show(args)

    for requires_grad in (False, True):
        x.requires_grad_(requires_grad)
        w.requires_grad_(requires_grad)
        print(f"inputs requiring grad: {requires_grad}")
        show("F.rms_norm", lambda: F.rms_norm(x, n, w, eps))
        show("fusedops.rms_norm", lambda: fusedops.rms_norm(x, w, eps))
        show("torch.ops.fusedops.rms_norm (Autograd kernel)", lambda: torch.ops.fusedops.rms_norm(x, w, eps))
        show("ops.rms_norm.direct (the public function minus its branch)", lambda: op.direct(x, w, eps))
        show("x.mul(w)", lambda: x.mul(w))
    x.requires_grad_(False)
    w.requires_grad_(False)
    print("below autograd")
    with _direct.BelowAutograd():
        show("the op alone", lambda: op.forward(x, w, eps))
        show("torch.empty_like(x), torch.empty(rows)", lambda: (torch.empty_like(x), torch.empty(shape[0], device=args.device)))
        show("x.mul(w)", lambda: x.mul(w))
    backward(args, show, x, w, eps)
    if args.launch:
        from fusedops.triton import rms_norm as triton_rms_norm

        launches(show, "triton.rms_norm.rms_norm_forward", lambda: triton_rms_norm.rms_norm_forward(x, w, eps, 0.0, False))
    if args.profile:
        xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
        grad = torch.randn_like(x)
        with torch.no_grad():
            profile(args, "fusedops.rms_norm, no autograd", lambda: fusedops.rms_norm(x, w, eps))
        profile(args, "fusedops.rms_norm, inputs requiring grad", lambda: fusedops.rms_norm(xg, wg, eps))
        profile(args, "fusedops.rms_norm forward + torch.autograd.grad",
                lambda: torch.autograd.grad(fusedops.rms_norm(xg, wg, eps), (xg, wg), grad))


def launches(show, name, call):
    """`call` (a Triton launcher function of fusedops), then each Triton kernel it launches: through
    Triton's kernel[grid] and through fusedops' Launcher, with the same arguments, whose outputs
    must be the same bytes."""
    from fusedops.triton import _launch

    print(f"Triton launches of {name} (its kernels' outputs written twice and compared)")
    show(name, call)
    calls = []
    real = _launch.Launcher.__call__

    def spy(self, grid, tensors, scalars, **keywords):
        calls.append((self, grid, tensors, scalars, keywords))
        return real(self, grid, tensors, scalars, **keywords)

    _launch.Launcher.__call__ = spy
    try:
        call()
    finally:
        _launch.Launcher.__call__ = real
    for launcher, grid, tensors, scalars, keywords in calls:
        kernel = launcher.kernel.fn.__name__
        show(f"  {kernel}: kernel[grid](...)", lambda: launcher.kernel[grid](*tensors, *scalars, **keywords))
        show(f"  {kernel}: Launcher(grid, tensors, scalars, ...)", lambda: launcher(grid, tensors, scalars, **keywords))
        before = [t.clone() for t in tensors]
        launcher.kernel[grid](*tensors, *scalars, **keywords)
        by_triton = [t.clone() for t in tensors]
        for t, b in zip(tensors, before):
            t.copy_(b)
        launcher(grid, tensors, scalars, **keywords)
        def as_bytes(t):
            return t.contiguous().view(-1).view(torch.uint8)

        same = all(torch.equal(as_bytes(a), as_bytes(b)) for a, b in zip(tensors, by_triton))
        print(f"  {kernel}: same bytes written both ways: {same}")


def profile(args, name, fn):
    """cProfile of min(calls, 2000) steady-state calls of fn: the functions that cost most
    themselves (their own time, callees excluded)."""
    calls = min(args.calls, 2000)
    for _ in range(50):
        fn()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    if args.device == "cuda":
        torch.cuda.synchronize()
    profiler.disable()
    print(f"profile: {name}, {calls} calls; own time per call in us")
    stats = pstats.Stats(profiler).stats  # {(file, line, function): (cc, nc, own, cumulative, callers)}
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[: args.profile]
    for (file, line, function), (_cc, ncalls, own, cumulative, _callers) in top:
        where = f"{file.rsplit('/', 1)[-1]}:{line}({function})"
        print(f"  {own / calls * 1e6:7.2f} own {cumulative / calls * 1e6:7.2f} cum {ncalls / calls:5.1f}x  {where}")


class _PassThrough(torch.autograd.Function):
    """The least a Python autograd node costs: forward copies, backward returns its gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


def backward(args, show, x, w, eps):
    """A backward's host cost: torch.autograd.grad of one output (graph kept), against the
    engine's floor with a Python node and with a C++ node. On CUDA the engine runs nodes on its
    device thread, so each call also pays two thread hand-offs."""
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    grad = torch.randn_like(x)
    n = x.shape[-1:]
    print("backward: torch.autograd.grad(y, inputs, grad, retain_graph=True)")

    def grad_of(y, inputs):
        return lambda: torch.autograd.grad(y, inputs, grad, retain_graph=True)

    show("F.rms_norm's backward", grad_of(F.rms_norm(x, n, w, eps), (x, w)))
    show("fusedops.rms_norm's backward", grad_of(fusedops.rms_norm(x, w, eps), (x, w)))
    show("a Python node passing its gradient on", grad_of(_PassThrough.apply(x), (x,)))
    show("x * 2's backward (a C++ node, one kernel)", grad_of(x * 2, (x,)))
    print("below autograd")
    xd, wd = x.detach(), w.detach()
    with _direct.BelowAutograd():
        _, rstd = op.forward(xd, wd, eps)
        show("the backward op alone", lambda: op.backward(grad, xd, wd, rstd, 0.0, False, True))
        show("the backward op alone, no weight gradient",
             lambda: op.backward(grad, xd, wd, rstd, 0.0, False, False))


def _show(args):
    def show(name, fn):
        lo, med = per_call_us(fn, args.device, args.calls)
        print(f"  {name:52s} {lo:7.2f} {med:7.2f}")

    return show


def rope(args):
    args.shape = args.shape or "1x32x8x1x128"
    B, Hq, Hk, S, D = (int(s) for s in args.shape.split("x"))
    q = torch.randn(B, Hq, S, D, device=args.device, dtype=torch.bfloat16)
    k = torch.randn(B, Hk, S, D, device=args.device, dtype=torch.bfloat16)
    cos = torch.randn(B, S, D, device=args.device, dtype=torch.bfloat16)
    sin = torch.randn(B, S, D, device=args.device, dtype=torch.bfloat16)
    print(f"rope {args.shape} (B x Hq x Hk x S x D) bf16 on {args.device}, torch {torch.__version__}: "
          "us per call (min, median)")
    show = _show(args)

    def hugging_face(q, k):  # apply_rotary_pos_emb in eager torch ops
        c, s_ = cos.unsqueeze(1), sin.unsqueeze(1)

        def rotate_half(x):
            return torch.cat((-x[..., D // 2:], x[..., : D // 2]), dim=-1)

        return q * c + rotate_half(q) * s_, k * c + rotate_half(k) * s_

    for requires_grad in (False, True):
        q.requires_grad_(requires_grad)
        k.requires_grad_(requires_grad)
        print(f"inputs requiring grad: {requires_grad}")
        show("fusedops.rope", lambda: fusedops.rope(q, k, cos, sin))
        show("ops.rope.direct (the public function minus its views)", lambda: rope_op.direct(q, k, cos, sin))
        show("Hugging Face's formula (eager)", lambda: hugging_face(q, k))
    q.requires_grad_(False)
    k.requires_grad_(False)
    print("below autograd")
    with _direct.BelowAutograd():
        show("the op alone", lambda: rope_op.forward(q, k, cos, sin))
    if args.launch:
        from fusedops.triton import rope as triton_rope

        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        bad = torch.empty((), dtype=torch.int64, device=q.device)
        launches(show, "triton.rope.rope", lambda: triton_rope.rope(q, k, cos, sin, None, False, False, q_out, k_out, bad))
    if args.profile:
        with torch.no_grad():
            profile(args, "fusedops.rope, no autograd", lambda: fusedops.rope(q, k, cos, sin))


if __name__ == "__main__":
    main()
