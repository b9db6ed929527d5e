"""Each open forward-speed goal's shape beside a same-size copy in the same process: the share of
the copy each op reaches on whatever GPU this runs on (issue 3: the norms at 65536x1024 and
256x262144; issue 4: rope at LLaMA-3-8B's q and k). do_bench medians, bf16, CUDA backend.

    python benchmarks/goal_shapes_vs_copy.py
"""

import torch
from triton.testing import do_bench

import fusedops


def share(name, nbytes, copy_src, copy_dst, op, rounds=2):
    for _ in range(rounds):
        t_copy = do_bench(lambda: copy_dst.copy_(copy_src), rep=300)
        t_op = do_bench(op, rep=300)
        print(f"{name:<36} copy {nbytes / t_copy / 1e9:.3f} TB/s  op {nbytes / t_op / 1e9:.3f} TB/s  "
              f"({t_copy / t_op:.3f} of the copy)", flush=True)


def main():
    print(torch.cuda.get_device_name(), flush=True)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    for rows, n in ((65536, 1024), (256, 262144)):
        x, r = torch.randn(rows, n, **bf16), torch.randn(rows, n, **bf16)
        w, b = torch.randn(n, **bf16), torch.randn(n, **bf16)
        y = torch.empty_like(x)
        two = 2 * x.numel() * 2  # read x, write y
        share(f"rms_norm {rows}x{n}", two, x, y, lambda: torch.ops.fusedops.rms_norm(x, w, 1e-6))
        share(f"layer_norm {rows}x{n}", two, x, y, lambda: torch.ops.fusedops.layer_norm(x, w, b, 1e-5))
        xr, yr = torch.cat([x, r]), torch.empty(2 * rows, n, **bf16)  # four passes: the same bytes
        share(f"add_rms_norm {rows}x{n}", 2 * two, xr, yr, lambda: fusedops.add_rms_norm(x, r, w))
    B, S, Hq, Hk, D = 8, 4096, 32, 8, 128
    for layout in ("bhsd", "bshd"):
        shape = (lambda h: (B, h, S, D)) if layout == "bhsd" else (lambda h: (B, S, h, D))
        q, k = torch.randn(shape(Hq), **bf16), torch.randn(shape(Hk), **bf16)
        cos, sin = torch.randn(B, S, D, **bf16), torch.randn(B, S, D, **bf16)
        src = torch.randn(q.numel() + k.numel(), **bf16)
        dst = torch.empty_like(src)
        kw = {} if layout == "bhsd" else {"layout": "bshd"}
        share(f"rope {layout} 8x4096x32x8x128", 2 * src.numel() * 2, src, dst, lambda: fusedops.rope(q, k, cos, sin, **kw))


if __name__ == "__main__":
    main()
