"""One line of forward TB/s for the row norms at the large benchmark shapes (on a GPU), for A/B.

Prints layer_norm, rms_norm and add_rms_norm forward TB/s (bf16, with weight, and bias for
layer_norm) at 32768x4096, 4096x8192 and 65536x1024, medians of `triton.testing.do_bench`, on
one line; with `--fwd-bwd`, forward+backward through autograd instead (5 passes, add_rms_norm
8). Run it in turn under two builds, several rounds alternating, to compare a kernel change in
one session on one machine (benchmarks/ab_wheels.sh does the installing and the rounds); the
harness (benchmarks/run.py) is what measures a build beside its peers.

    bash benchmarks/ab_wheels.sh dist/old/*.whl dist/new/*.whl -- python3 benchmarks/norm_forward_ab.py
"""

import argparse

import torch
from triton.testing import do_bench

import fusedops

SHAPES = ((32768, 4096), (4096, 8192), (65536, 1024))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="layer_norm,rms_norm,add_rms_norm")
    parser.add_argument("--fwd-bwd", action="store_true", help="time forward+backward instead of the forward")
    args = parser.parse_args()
    torch.manual_seed(0)
    elements = max(r * n for r, n in SHAPES)
    pool = torch.randn(3 * elements, device="cuda", dtype=torch.bfloat16)
    cells = []
    for op in args.ops.split(","):
        for rows, n in SHAPES:
            x = pool[: rows * n].view(rows, n).detach().requires_grad_(args.fwd_bwd)
            residual = pool[rows * n : 2 * rows * n].view(rows, n).detach().requires_grad_(args.fwd_bwd)
            grad = pool[2 * rows * n : 3 * rows * n].view(rows, n)
            w = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=args.fwd_bwd)
            b = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=args.fwd_bwd)
            calls = {
                "layer_norm": lambda: fusedops.layer_norm(x, w, b, 1e-5),
                "rms_norm": lambda: fusedops.rms_norm(x, w, 1e-6),
                "add_rms_norm": lambda: fusedops.add_rms_norm(x, residual, w, 1e-6),
            }
            if args.fwd_bwd:

                def step():
                    out = calls[op]()
                    out = out if isinstance(out, tuple) else (out,)
                    torch.autograd.backward(out, [grad] * len(out))

                ms = do_bench(step, warmup=10, rep=200, grad_to_none=[x, residual, w, b],
                              return_mode="median")
                passes = 8 if op == "add_rms_norm" else 5  # read x (and r), dy (and dh); write y (and h), dx
            else:
                ms = do_bench(calls[op], warmup=25, rep=300, return_mode="median")
                passes = 4 if op == "add_rms_norm" else 2  # tensors read or written, each rows x n bf16
            cells.append(f"{op} {rows}x{n} {passes * x.numel() * 2 / (ms * 1e-3) / 1e12:.2f}")
    print(" | ".join(cells))


if __name__ == "__main__":
    main()
