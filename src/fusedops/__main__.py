"""`python -m fusedops`: what is installed, what serves each op here, does it compute the right
thing, and how fast. The first command to run, and the thing to paste into a bug report."""

import argparse
import platform
import sys

import torch
import torch.utils.benchmark

import fusedops
from fusedops.testing import OP_TESTS, check_against_reference, outputs_of


def _devices():
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _print_build():
    info = fusedops.build_info()
    print(f"fusedops {fusedops.__version__}")
    print(f"  python {platform.python_version()} on {platform.machine()}, torch {torch.__version__}"
          f" (CUDA {torch.version.cuda or 'none'})")
    # (build records written before the compiler's path was recorded have no cxx_compiler_path)
    compiler_path = info.get("cxx_compiler_path")
    compiler = info["cxx_compiler"] + (f" ({compiler_path})" if compiler_path else "")
    print(f"  built against torch {info['torch']} (stable ABI target {info['torch_target']}), "
          f"{info['build_type']}, {compiler}")
    if info["cuda_built"]:
        # (a wheel built with the CUDA kernels also installs beside a CPU torch, which never loads them)
        unused = "" if torch.version.cuda else "; unused here: this torch has no CUDA"
        print(f"  CUDA kernels: CUDA {info['torch_cuda']} (nvcc {info['cuda_compiler']}), "
              f"archs {info['cuda_archs']}{unused}")
    elif torch.version.cuda:
        print("  CUDA kernels: not built (CUDA tensors use the Triton kernels)")
    else:
        print("  CUDA kernels: not built; this torch has no CUDA, so only the CPU kernels apply")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print(f"  GPU: {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
              f"{p.total_memory / 2**30:.0f} GiB")


def _print_backends():
    print("\nbackends")
    for info in OP_TESTS:
        served = ", ".join(f"{d}: {fusedops.backend_for(info.name, d)}" for d in _devices())
        print(f"  {info.name:<24} {served}")


def _self_check():
    """Each op's samples, forward and backward, against its fp64 reference; its other public
    forms (in-place functions) too."""
    print("\nself-check (forward and backward against float64, every sample and dtype)")
    ok = True
    width = max(len(v.name) for info in OP_TESTS for v in (info, *info.public_variants))
    for info in OP_TESTS:
        for variant in (None, *info.public_variants):
            name = variant.name if variant else info.name
            needs_grad = variant is None or variant.differentiable
            for device in _devices():
                failures, count = [], 0
                for dtype in info.dtypes:
                    for sample in info.samples(device, dtype, requires_grad=needs_grad):
                        count += 1
                        try:
                            check_against_reference(info, sample, dtype, variant)
                        except Exception as e:  # report every failure, not only the first
                            failures.append(f"{dtype} {sample.desc}: {str(e).splitlines()[0]}")
                status = "ok" if not failures else f"FAILED {len(failures)}"
                print(f"  {name:<{width}} {device:<5} {count:>3} samples  {status}")
                for f in failures[:5]:
                    print(f"      {f}")
                ok = ok and not failures
    return ok


def _time_call(fn):
    """Median seconds per call (torch.utils.benchmark synchronises CUDA around its blocks)."""
    timer = torch.utils.benchmark.Timer(stmt="fn()", globals={"fn": fn})
    return timer.blocked_autorange(min_run_time=0.1).median


def _benchmark():
    """A glance, not a measurement: benchmarks/ has the harness and the peers. Returns False if a
    call raised (reported in its row; the other rows still run)."""
    print("\nquick benchmark (forward, median; full comparisons: benchmarks/run.py)")
    width = max(len(info.name) for info in OP_TESTS)
    print(f"  {'op':<{width}} {'device':<6} {'shape':<16} {'dtype':<9} {'fusedops':>10} {'eager':>10}  GB/s")
    shapes = {"cpu": (2048, 4096), "cuda": (32768, 4096)}
    ok = True
    for device in _devices():
        rows, n = shapes[device]
        for info in OP_TESTS:
            if info.torch_equivalent is None:
                continue
            for dtype in (torch.float32, torch.bfloat16):
                args = info.sample_for_shape(device, dtype, (rows, n)).args
                # The first tensor argument's own shape: an op's sample may build it around (rows, n)
                # (rope's q is (1, heads, rows, n)).
                first = next(t for t in args if isinstance(t, torch.Tensor))
                shape = "x".join(str(d) for d in first.shape)
                row = f"  {info.name:<{width}} {device:<6} {shape:<16} {str(dtype)[6:]:<9} "
                try:
                    with torch.no_grad():
                        t_ours = _time_call(lambda: info.public(*args))
                        t_eager = _time_call(lambda: info.torch_equivalent(*args))
                        outputs = outputs_of(info.public(*args))
                except Exception as e:  # a bug report wants every row, not a traceback at the first
                    print(f"{row}FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                    ok = False
                    continue
                # (the minimum bytes: every tensor argument read once, every output written once)
                moved = sum(t.nbytes for t in args if isinstance(t, torch.Tensor)) + sum(o.nbytes for o in outputs)
                print(f"{row}{t_ours * 1e3:>8.3f}ms {t_eager * 1e3:>8.3f}ms  {moved / t_ours / 1e9:.0f}")
    return ok


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m fusedops", description=__doc__)
    parser.add_argument("--no-bench", action="store_true", help="skip the quick benchmark")
    args = parser.parse_args(argv)
    _print_build()
    _print_backends()
    ok = _self_check()
    if not args.no_bench:
        ok = _benchmark() and ok
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
