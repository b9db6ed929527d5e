# (scratch) layer_norm on float32 rows far from zero, torch's CUDA kernel beside ours; and timings
import sys, torch, fusedops
from triton.testing import do_bench
tag = sys.argv[1]
for n in ((1024, 4096, 40960) if len(sys.argv) == 2 else ()):
    worst = {"torch": 0.0, "fusedops": 0.0}
    for seed in range(30):
        torch.manual_seed(seed)
        x = 1e5 + torch.randn(8, n, device="cuda")
        w, b = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
        ref = torch.nn.functional.layer_norm(x.double(), (n,), w.double(), b.double(), 1e-5)
        for name, y in (("torch", torch.nn.functional.layer_norm(x, (n,), w, b, 1e-5)), ("fusedops", fusedops.layer_norm(x, w, b, 1e-5))):
            worst[name] = max(worst[name], ((y.double() - ref).abs().max() / w.abs().max()).item())
    print(tag, "far-from-zero n =", n, "worst |err| / max|w| over 30 seeds:", {k: round(v, 4) for k, v in worst.items()}, flush=True)
if len(sys.argv) > 2:
    for dtype, shapes in ((torch.float32, [(32768, 4096), (65536, 1024), (2048, 40960)]), (torch.bfloat16, [(32768, 4096), (65536, 1024), (2048, 32768)])):
        for r, n in shapes:
            x = torch.randn(r, n, device="cuda", dtype=dtype)
            w, b = torch.randn(n, device="cuda", dtype=dtype), torch.randn(n, device="cuda", dtype=dtype)
            ms = do_bench(lambda: fusedops.layer_norm(x, w, b), warmup=50, rep=300)
            print(tag, f"time {str(dtype)[6:]} {r}x{n}: {ms*1e3:.1f} us, {2*x.numel()*x.element_size()/ms/1e9:.3f} TB/s", flush=True)
