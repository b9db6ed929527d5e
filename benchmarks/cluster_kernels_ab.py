"""One line of TB/s through the thread-block-cluster kernels (on a GPU), for A/B.

The shapes whose rows are too wide for one block: add_rms_norm's register-caching cluster
forward (2048x32768, 4096x24576, 1024x65536), the wide rms_norm / layer_norm forward
(2048x32768, 1024x65536, 512x131072, 256x262144), the norms' forward+backward there (the cluster backward;
add_rms_norm also with a float32 residual stream), and cross_entropy's forward+backward
(8192x128256, 4096x256000: the row kernel in clusters). bf16, medians of
`triton.testing.do_bench`. Run it in turn under two builds, several rounds alternating
(benchmarks/ab_wheels.sh); the harness (benchmarks/run.py) is what measures a build beside its
peers.

    ROUNDS=2 bash benchmarks/ab_wheels.sh dist/old/*.whl dist/new/*.whl -- python3 benchmarks/cluster_kernels_ab.py
"""

import argparse

import torch
from triton.testing import do_bench

import fusedops

GROUPS = ("add-fwd", "staged-fwd", "norm-fwd+bwd", "ce-fwd+bwd")


def tbps(passes, numel, ms):
    return passes * numel * 2 / (ms * 1e-3) / 1e12  # passes of bf16: 2 bytes an element


def randn(*shape, grad=False):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=grad)


def add_forward(cells):
    for rows, n in ((2048, 32768), (4096, 24576), (1024, 65536)):
        x, r, w = randn(rows, n), randn(rows, n), randn(n)
        with torch.no_grad():
            ms = do_bench(lambda: fusedops.add_rms_norm(x, r, w, 1e-6), warmup=25, rep=300,
                          return_mode="median")
        cells.append(f"add {rows}x{n} {tbps(4, x.numel(), ms):.2f}")


def staged_forward(cells):
    for rows, n in ((2048, 32768), (1024, 65536), (512, 131072), (256, 262144)):
        x, w, b = randn(rows, n), randn(n), randn(n)
        calls = (
            ("rms", lambda: fusedops.rms_norm(x, w, 1e-6)),
            ("ln", lambda: fusedops.layer_norm(x, w, b, 1e-5)),
        )
        for name, f in calls:
            with torch.no_grad():
                ms = do_bench(f, warmup=25, rep=300, return_mode="median")
            cells.append(f"{name} {rows}x{n} {tbps(2, x.numel(), ms):.2f}")


def norm_forward_backward(cells):
    for rows, n in ((2048, 32768), (256, 262144)):
        x, r, g = randn(rows, n, grad=True), randn(rows, n, grad=True), randn(rows, n)
        w, b = randn(n, grad=True), randn(n, grad=True)
        # A float32 residual stream beside bf16 activations, and its gradient.
        r32, g32 = r.detach().float().requires_grad_(), g.float()

        def add(residual, grad_residual):
            out, h = fusedops.add_rms_norm(x, residual, w, 1e-6)
            torch.autograd.backward([out, h], [g, grad_residual])

        for name, f, passes in (
            ("rms-fb", lambda: fusedops.rms_norm(x, w, 1e-6).backward(g), 5),
            ("ln-fb", lambda: fusedops.layer_norm(x, w, b, 1e-5).backward(g), 5),
            ("add-fb", lambda: add(r, g), 8),
            # bytes an element: forward x 2, residual 4, out 2, h 4; backward the gradients of
            # out 2 and h 4, h 4, grad x 2, grad residual 4: 28, or 14 bf16 passes
            ("add32-fb", lambda: add(r32, g32), 14),
        ):
            ms = do_bench(f, warmup=10, rep=200, grad_to_none=[x, r, r32, w, b], return_mode="median")
            cells.append(f"{name} {rows}x{n} {tbps(passes, x.numel(), ms):.2f}")


def cross_entropy_forward_backward(cells):
    for rows, classes in ((8192, 128256), (4096, 256000)):
        x = randn(rows, classes, grad=True)
        t = torch.randint(0, classes, (rows,), device="cuda")
        ms = do_bench(lambda: fusedops.cross_entropy(x, t).backward(), warmup=10, rep=200,
                      grad_to_none=[x], return_mode="median")
        # one read of the logits, one write of the gradient
        cells.append(f"ce {rows}x{classes} {tbps(2, x.numel(), ms):.2f}")
        del x


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    groups = ",".join(GROUPS)
    parser.add_argument("--groups", default=groups, help="comma-separated subset of " + groups)
    args = parser.parse_args()
    torch.manual_seed(0)
    run = {
        "add-fwd": add_forward,
        "staged-fwd": staged_forward,
        "norm-fwd+bwd": norm_forward_backward,
        "ce-fwd+bwd": cross_entropy_forward_backward,
    }
    cells = []
    for group in args.groups.split(","):
        run[group](cells)
    print(" | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
