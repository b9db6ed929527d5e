"""The matrix products of linear_cross_entropy's low-memory mode alone, on a GPU: the four bf16
products made one chunk of classes at a time (logits for the statistics; logits again, the
float32 grad_hidden accumulation and the weight gradient of the chunk), at several chunk widths,
against the three whole products of the materialised path. What the mode cannot beat, whatever
its kernels do; bf16 and float32 weights (the latter converted one chunk at a time), at
Gemma-2-2B's and LLaMA-3-8B's LM heads with 8192 tokens.

    python benchmarks/linear_cross_entropy_products.py [--classes 1024,2048,4096,8192]
"""

import argparse

import torch
from triton.testing import do_bench

SHAPES = {"gemma-2-2b": (8192, 2304, 256000), "llama-3-8b": (8192, 4096, 128256)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", default="1024,2048,4096,8192", help="comma-separated chunk widths")
    widths = [int(c) for c in parser.parse_args().classes.split(",")]
    dev = "cuda"
    for name, (N, H, V) in SHAPES.items():
        g = torch.Generator(device=dev).manual_seed(0)
        h = torch.randn(N, H, device=dev, generator=g).bfloat16()
        w = (torch.randn(V, H, device=dev, generator=g) * (2.0 / H**0.5)).bfloat16()
        flop = 2 * N * H * V

        def three():
            logits = h @ w.t()
            return logits @ w, logits.t() @ h

        t3 = do_bench(three, rep=500)
        print(f"{name}: the 3 whole products {t3:.2f} ms ({3 * flop / t3 / 1e9:.0f} TFLOP/s)", flush=True)
        for wdt in (torch.bfloat16, torch.float32):
            wx = w.to(wdt)
            for width in widths:
                buf = torch.empty(N * width, device=dev, dtype=torch.bfloat16)
                gh = torch.empty(N, H, device=dev, dtype=torch.float32)
                gw = torch.empty(V, H, device=dev, dtype=wdt)

                def chunked():
                    for v0 in range(0, V, width):
                        wb = wx[v0:v0 + width].to(torch.bfloat16)
                        torch.mm(h, wb.t(), out=buf[: N * wb.shape[0]].view(N, -1))
                    gh.zero_()
                    for v0 in range(0, V, width):
                        wb = wx[v0:v0 + width].to(torch.bfloat16)
                        logits = buf[: N * wb.shape[0]].view(N, -1)
                        torch.mm(h, wb.t(), out=logits)
                        torch.addmm(gh, logits, wb, out_dtype=torch.float32, out=gh)
                        out = gw[v0:v0 + width]
                        if wdt == torch.bfloat16:
                            torch.mm(logits.t(), h, out=out)
                        else:
                            torch.addmm(out, logits.t(), h, beta=0, out_dtype=torch.float32, out=out)
                    return gh.to(torch.bfloat16)

                t = do_bench(chunked, rep=500)
                print(f"{name}: weight {str(wdt)[6:]}, chunks of {width} classes: the 4 products {t:.2f} ms = "
                      f"{t / t3:.3f}x the 3 ({4 * flop / t / 1e9:.0f} TFLOP/s); logits chunk "
                      f"{N * width * 2 / 2**20:.0f} MiB", flush=True)
                del buf, gh, gw
            del wx
        del h, w
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
