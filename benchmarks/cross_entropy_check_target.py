"""What cross_entropy's eager bad-target check costs on a GPU: forward+backward and the no-grad
forward, timed with triton's do_bench, for each check_target mode (True: deferred, no
synchronisation; "sync": one synchronisation a call; False: no check). bf16 LM-head shapes, one
target in ten ignored.

    python benchmarks/cross_entropy_check_target.py
"""

import torch
from triton.testing import do_bench

import fusedops


def main():
    for n, v in ((8192, 128256), (4096, 256000)):
        x = (2 * torch.randn(n, v, device="cuda")).to(torch.bfloat16).requires_grad_()
        t = torch.randint(0, v, (n,), device="cuda")
        t[::10] = -100
        for check in (True, "sync", False):
            def train():
                return torch.autograd.grad(fusedops.cross_entropy(x, t, check_target=check), (x,))

            def infer():
                with torch.no_grad():
                    return fusedops.cross_entropy(x, t, check_target=check)

            for mode, fn, passes in (("fwd+bwd", train, 2), ("fwd, no grad", infer, 1)):
                ms = do_bench(fn, warmup=25, rep=200)
                print(f"{n}x{v} {mode:13} check_target={check!s:5}: {ms:.3f} ms, "
                      f"{passes * n * v * 2 / ms / 1e9:.2f} TB/s")


if __name__ == "__main__":
    main()
