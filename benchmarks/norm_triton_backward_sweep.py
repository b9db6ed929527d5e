"""The Triton norms' backward kernels under launch configurations, the kernels alone
(fusedops.triton's backward functions, no autograd), on a GPU: TB/s on the minimum-bytes model
(rms_norm and layer_norm read x and grad_output and write grad_input: 3 passes; add_rms_norm
also reads grad_residual_out: 4), bf16, at the benchmark's three large shapes. A configuration is
STAGES/TILE/WARPS: tl.range's software-pipelining stages of the row loop (_BWD_STAGES), the
elements of a row tile (_BWD_TILE_ELEMS) and the warps launched per SM (_BWD_WARPS_PER_SM). The
first configuration's outputs are the reference the others are checked against. The wide shapes
(rows past 8192) take the looped kernels, which only STAGES changes.

    python benchmarks/norm_triton_backward_sweep.py [--configs 1/4096/16,3/4096/16,...] [--shapes wide]
"""

import argparse

import torch
from triton.testing import do_bench

from fusedops.triton import _norm
from fusedops.triton import add_rms_norm as triton_add_rms_norm
from fusedops.triton import layer_norm as triton_layer_norm
from fusedops.triton import rms_norm as triton_rms_norm

SHAPES = {"large": [(32768, 4096), (4096, 8192), (65536, 1024)], "wide": [(2048, 32768), (256, 262144)]}


def backward_calls(rows, n):
    g = torch.Generator(device="cuda").manual_seed(0)
    x, dy, gres = (torch.randn(rows, n, device="cuda", generator=g).bfloat16() for _ in range(3))
    w, b = (torch.randn(n, device="cuda", generator=g).bfloat16() for _ in range(2))
    _, rstd = triton_rms_norm.rms_norm_forward(x, w, 1e-6, 0.0, False)
    _, mean, ln_rstd = triton_layer_norm.layer_norm_forward(x, w, b, 1e-5)
    return {
        "rms_norm": (lambda: triton_rms_norm.rms_norm_backward(dy, x, w, rstd, 0.0, False, True), 3),
        "layer_norm": (lambda: triton_layer_norm.layer_norm_backward(dy, x, w, b, mean, ln_rstd, True, True), 3),
        "add_rms_norm": (lambda: triton_add_rms_norm.add_rms_norm_backward(dy, gres, x, w, rstd, 0.0, True), 4),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="1/4096/16,2/4096/16,3/4096/16,4/4096/16,1/4096/32,3/4096/32,1/2048/32")
    parser.add_argument("--shapes", default="large", choices=sorted(SHAPES))
    args = parser.parse_args()
    configs = [tuple(int(v) for v in c.split("/")) for c in args.configs.split(",")]
    for rows, n in SHAPES[args.shapes]:
        for name, (call, passes) in backward_calls(rows, n).items():
            reference, cells = None, []
            for stages, tile, warps in configs:
                _norm._BWD_STAGES, _norm._BWD_TILE_ELEMS, _norm._BWD_WARPS_PER_SM = stages, tile, warps
                out = call()
                reference = reference or out
                same = all(torch.allclose(a.float(), r.float(), rtol=1e-2, atol=1e-2)
                           for a, r in zip(out, reference) if a.numel())
                tbps = passes * rows * n * 2 / do_bench(call, warmup=25, rep=200) / 1e9
                cells.append(f"{stages}/{tile}/{warps}: {tbps:.2f}" + ("" if same else " MISMATCH"))
            print(f"{name} {rows}x{n} backward TB/s: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
