"""linear_cross_entropy against its issue's goals on a GPU, at Gemma-2-2B's and LLaMA-3-8B's
LM heads (8192 tokens, bf16): accuracy against the float32 materialised reference, the time of
the three bf16 products alone, forward+backward time and memory beyond the inputs and the
returned gradients per mode (chunks of rows of a given size; low_memory, chunks of classes), for
bf16 weights and float32 weights under bf16 autocast, and FSDP2 (one rank over NCCL) against the
unsharded op.

    python benchmarks/linear_cross_entropy_goals.py [--modes none,2048,low,low:4096]

Modes: "none" (chunks of rows, automatic size), a number (chunk_rows), "low" (low_memory,
automatic chunk_classes), "low:N" (low_memory, chunk_classes=N).
"""

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    # Started as a script: make the repository root importable (benchmarks as a package).
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import fusedops  # noqa: E402
from benchmarks import harness  # noqa: E402

GiB = 2**30


def memory_beyond_gradients(step):
    """Runs step() once (it returns gradients); returns them and the most it allocated on top of
    what was allocated before it, less the gradients' own bytes."""
    torch.cuda.empty_cache()
    grads, peak = harness.call_with_peak_memory(step)
    return grads, peak - sum(g.numel() * g.element_size() for g in grads)


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def parse_mode(text):
    text = text.strip().lower()
    if text == "none":
        return {"chunk_rows": None}
    if text == "low":
        return {"low_memory": True}
    if text.startswith("low:"):
        return {"low_memory": True, "chunk_classes": int(text[4:])}
    return {"chunk_rows": int(text)}


def shapes(modes):
    dev = "cuda"
    for name, (N, H, V) in {"gemma-2-2b": (8192, 2304, 256000), "llama-3-8b": (8192, 4096, 128256)}.items():
        g = torch.Generator(device=dev).manual_seed(0)
        h = torch.randn(N, H, device=dev, generator=g).bfloat16()
        w = (torch.randn(V, H, device=dev, generator=g) * (2.0 / H**0.5)).bfloat16()
        t = torch.randint(0, V, (N,), device=dev, generator=g)
        t[::10] = -100
        hr, wr = h.float().requires_grad_(), w.float().requires_grad_()
        ref = F.cross_entropy(hr @ wr.t(), t, ignore_index=-100)
        ref.backward()
        ref_gh, ref_gw = hr.grad, wr.grad
        del hr, wr
        for mode in modes:
            hb, wb = h.clone().requires_grad_(), w.clone().requires_grad_()
            loss = fusedops.linear_cross_entropy(hb, wb, t, **mode)
            loss.backward()
            print(f"{name} {mode}: loss {loss.item():.6f} ref {ref.item():.6f} "
                  f"rel {abs(loss.item() - ref.item()) / ref.item():.2e}; grad_hidden rel-to-max "
                  f"{rel(hb.grad, ref_gh):.2e}; grad_weight rel-to-max {rel(wb.grad, ref_gw):.2e}")
            del hb, wb, loss
        del ref_gh, ref_gw, ref
        torch.cuda.empty_cache()

        def products():
            logits = h @ w.t()
            return logits @ w, logits.t() @ h

        t_mm = do_bench(products)
        print(f"{name}: three bf16 products alone {t_mm:.2f} ms ({6 * N * H * V / t_mm / 1e9:.0f} TFLOP/s); "
              f"goal 1.15x = {1.15 * t_mm:.2f} ms")
        for wdtype in (torch.bfloat16, torch.float32):
            for mode in modes:
                hx, wx = h.clone().requires_grad_(), w.to(wdtype).requires_grad_()

                def step():
                    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=wdtype == torch.float32):
                        loss = fusedops.linear_cross_entropy(hx, wx, t, **mode)
                    return torch.autograd.grad(loss, (hx, wx))

                ms = do_bench(step)
                (gh, gw), extra = memory_beyond_gradients(step)
                print(f"{name}: weight {str(wdtype)[6:]} {mode}: {ms:.2f} ms = {ms / t_mm:.3f}x products "
                      f"({6 * N * H * V / ms / 1e9:.0f} TFLOP/s); memory beyond inputs+grads {extra / GiB:.3f} GiB")
                del gh, gw, hx, wx
                torch.cuda.empty_cache()
        del h, w, t
        torch.cuda.empty_cache()


def fsdp2():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dev = "cuda"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29581", rank=0, world_size=1)
    mesh = init_device_mesh("cuda", (1,))
    torch.manual_seed(0)
    ref = fusedops.nn.LinearCrossEntropyLoss(256, 1000, device=dev)
    mod = fusedops.nn.LinearCrossEntropyLoss(256, 1000, device=dev)
    mod.load_state_dict(ref.state_dict())
    fully_shard(mod, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    x = torch.randn(512, 256, device=dev)
    t = torch.randint(0, 1000, (512,), device=dev)
    loss = mod(x.bfloat16(), t)
    loss.backward()
    expected = fusedops.linear_cross_entropy(x.bfloat16(), ref.weight.bfloat16(), t)
    (g,) = torch.autograd.grad(expected, ref.weight)
    print(f"fsdp2: loss {loss.item():.5f} vs {expected.item():.5f}; grad rel-to-max "
          f"{rel(mod.weight.grad.full_tensor(), g):.2e}")
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="none,low",
                        help="comma-separated modes (see the module's docstring)")
    args = parser.parse_args()
    shapes([parse_mode(m) for m in args.modes.split(",")])
    fsdp2()


if __name__ == "__main__":
    main()
