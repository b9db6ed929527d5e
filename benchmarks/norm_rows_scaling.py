"""How a norm's forward time grows with the number of rows, at a fixed width (on a GPU).

Times fusedops' forward (bf16, weight and, for layer_norm, bias) at several row counts of one
width and fits time = fixed + per_row * rows over them (least squares). The per-row slope gives
the bandwidth at the margin; the intercept is what a launch costs whatever its size (the first
loads before any write, the last writes after every load). A staged kernel whose time stepped
at multiples of its resident blocks would show it here as residuals. 2026-11-30 on the H200:

    python benchmarks/norm_rows_scaling.py --op rms_norm --n 32768   (8.1 us fixed + 0.0353 us a row)
    python benchmarks/norm_rows_scaling.py --op rms_norm --n 262144  (12.4 us fixed + 0.2829 us a row)
"""

import argparse

import torch
from triton.testing import do_bench

import fusedops

DEFAULT_ROWS = {32768: "396,792,1188,1584,1980,2048,2376", 131072: "396,495,512,594", 262144: "144,192,240,256,288"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=("rms_norm", "layer_norm"), default="rms_norm")
    parser.add_argument("--n", type=int, default=32768, help="row width")
    parser.add_argument("--rows", default=None, help="comma-separated row counts (defaults per width)")
    args = parser.parse_args()
    rows = [int(r) for r in (args.rows or DEFAULT_ROWS.get(args.n, "256,512,1024,2048")).split(",")]
    torch.manual_seed(0)
    x = torch.randn(max(rows), args.n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(args.n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(args.n, device="cuda", dtype=torch.bfloat16)
    copy_out = torch.empty_like(x)
    copy_us = do_bench(lambda: copy_out.copy_(x), warmup=25, rep=200, return_mode="median") * 1e3
    print(f"{args.op} forward, width {args.n}, bf16, {torch.cuda.get_device_name()}")
    print(f"copy of {max(rows)} rows: {4 * x.numel() / copy_us / 1e6:.2f} TB/s")
    times = []
    for r in rows:
        xr = x[:r]
        if args.op == "rms_norm":
            fn = lambda: fusedops.rms_norm(xr, w, 1e-6)  # noqa: E731
        else:
            fn = lambda: fusedops.layer_norm(xr, w, b, 1e-5)  # noqa: E731
        us = do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
        times.append(us)
        print(f"{r:7d} rows: {us:8.1f} us  {4 * xr.numel() / us / 1e6:.2f} TB/s")
    a = torch.tensor([[1.0, r] for r in rows], dtype=torch.float64)
    fixed, per_row = torch.linalg.lstsq(a, torch.tensor(times, dtype=torch.float64).unsqueeze(1)).solution.flatten()
    margin = 4 * args.n / per_row.item() / 1e6
    print(f"fit: {fixed.item():.1f} us fixed + {per_row.item():.4f} us a row ({margin:.2f} TB/s at the margin)")


if __name__ == "__main__":
    main()
