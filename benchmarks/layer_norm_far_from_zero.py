"""layer_norm's error on float32 rows far from zero, beside torch's own kernel (on a GPU).

Rows of 1e5 + N(0, 1) values, the case `tests/test_norm_options.py::test_layer_norm_far_from_zero`
checks: prints, for each width, the worst |output - float64 reference| / max|w| over 30 seeds
(8 rows a seed), for fusedops and for `torch.nn.functional.layer_norm` on the same inputs. The
test allows 0.01. With `--time`, also the forward's TB/s (float32 and bf16, do_bench medians),
to see that the accuracy costs no speed. Run it under two builds to compare them (each output
line comes prefixed with its build's label):

    ROUNDS=1 bash benchmarks/ab_wheels.sh dist/old/*.whl dist/new/*.whl -- python3 benchmarks/layer_norm_far_from_zero.py
"""

import argparse

import torch
from triton.testing import do_bench

import fusedops

WIDTHS = (1024, 4096, 40960)
TIMED = (
    (torch.float32, ((32768, 4096), (65536, 1024), (2048, 40960))),
    (torch.bfloat16, ((32768, 4096), (65536, 1024), (2048, 32768))),
)


def worst_errors(n, seeds=30):
    worst = {"torch": 0.0, "fusedops": 0.0}
    for seed in range(seeds):
        torch.manual_seed(seed)
        x = 1e5 + torch.randn(8, n, device="cuda")
        w, b = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
        ref = torch.nn.functional.layer_norm(x.double(), (n,), w.double(), b.double(), 1e-5)
        outputs = {
            "torch": torch.nn.functional.layer_norm(x, (n,), w, b, 1e-5),
            "fusedops": fusedops.layer_norm(x, w, b, 1e-5),
        }
        for name, y in outputs.items():
            worst[name] = max(worst[name], ((y.double() - ref).abs().max() / w.abs().max()).item())
    return worst


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time", action="store_true", help="also time the forward")
    args = parser.parse_args()
    for n in WIDTHS:
        worst = {k: round(v, 4) for k, v in worst_errors(n).items()}
        print(f"n = {n}: worst |err| / max|w| over 30 seeds:", worst, flush=True)
    if not args.time:
        return
    for dtype, shapes in TIMED:
        for rows, n in shapes:
            x = torch.randn(rows, n, device="cuda", dtype=dtype)
            w, b = torch.randn(n, device="cuda", dtype=dtype), torch.randn(n, device="cuda", dtype=dtype)
            ms = do_bench(lambda x=x, w=w, b=b: fusedops.layer_norm(x, w, b), warmup=50, rep=300)
            tbs = 2 * x.numel() * x.element_size() / ms / 1e9
            print(f"forward {str(dtype)[6:]} {rows}x{n}: {ms * 1e3:.1f} us, {tbs:.3f} TB/s", flush=True)


if __name__ == "__main__":
    main()
