"""A norm's forward kernel beside torch.compile's, one launch each, for a profiler (on a GPU).

Runs fusedops' forward and torch.compile's forward of the same function (F.rms_norm or
F.layer_norm) a few times on one bf16 input, then, with --trace, prints each CUDA kernel of one
more call of each as the profiler saw it: duration, grid, block, registers. Under ncu, pick the
kernel by name, for example (2026-11-30, 2048x32768: 73.8 against 73.4 µs):

    ncu --clock-control none -k regex:forward_staged -s 2 -c 1 --section SpeedOfLight \\
        --section WarpStateStats python benchmarks/norm_kernels_side_by_side.py
    ncu ... -k regex:triton_red ... (torch.compile's kernel)
    python benchmarks/norm_kernels_side_by_side.py --trace
    TORCH_LOGS=output_code python benchmarks/norm_kernels_side_by_side.py   (compile's source)
"""

import argparse
import functools
import json
import os
import tempfile

import torch
import torch.nn.functional as F

import fusedops


def kernels_of(fn) -> list[dict]:
    """The CUDA kernels one call of fn launches, from the profiler's trace."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return [e for e in events if e.get("cat") == "kernel"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", choices=["rms_norm", "layer_norm"], default="rms_norm")
    p.add_argument("--shape", default="2048x32768", help="rows x n")
    p.add_argument("--trace", action="store_true", help="print the kernels of one call of each")
    args = p.parse_args()
    rows, n = (int(v) for v in args.shape.split("x"))
    x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    if args.op == "rms_norm":
        ours = functools.partial(fusedops.rms_norm, x, w, 1e-6)
        theirs = functools.partial(torch.compile(lambda x, w: F.rms_norm(x, (n,), w, 1e-6)), x, w)
    else:
        ours = functools.partial(fusedops.layer_norm, x, w, b, 1e-5)
        theirs = functools.partial(torch.compile(lambda x, w, b: F.layer_norm(x, (n,), w, b, 1e-5)), x, w, b)
    with torch.no_grad():
        for _ in range(3):
            ours()
            theirs()
        torch.cuda.synchronize()
        if args.trace:
            for who, fn in (("fusedops", ours), ("torch.compile", theirs)):
                for e in kernels_of(fn):
                    a = e["args"]
                    print(f"{who:14s} {e['name'][:60]:60s} {e['dur']:8.1f} us  grid {a.get('grid')} "
                          f"block {a.get('block')} registers {a.get('registers per thread')}")


if __name__ == "__main__":
    main()
