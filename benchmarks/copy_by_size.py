"""Device-to-device copy bandwidth by size (on a GPU), timed as the harness times an op.

The harness reports every op against one copy of 1 GiB. A smaller op moves fewer bytes, and a
copy of its size does not reach that figure either (the ramp at the start, the drain at the
end and the write-back of the cache flush's dirty lines weigh more): this prints the copy's
TB/s (bytes read + written / do_bench median) for tensors of 64 MiB to 1 GiB, for comparison.

    python benchmarks/copy_by_size.py
"""

import torch
from triton.testing import do_bench


def main():
    for mib in (64, 128, 256, 512, 1024):
        src = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
        print(f"copy of {mib} MiB: {2 * src.numel() / (ms * 1e-3) / 1e12:.3f} TB/s ({ms * 1e3:.1f} us)")


if __name__ == "__main__":
    main()
