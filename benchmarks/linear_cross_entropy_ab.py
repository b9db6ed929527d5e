"""linear_cross_entropy's chunk loop against an earlier version of it, alternating in one
process, at the issue's two LM heads (Gemma-2-2B and LLaMA-3-8B, 8192 tokens, bf16, a tenth of
the rows ignored): forward+backward time (do_bench medians, one per round), memory beyond the
inputs and the returned gradients, and how far the two versions' gradients are apart.

    git show REV:src/fusedops/ops/linear_cross_entropy.py > /tmp/old.py
    python benchmarks/linear_cross_entropy_ab.py /tmp/old.py [--functions compute,_accumulate_mm]

The named functions of the old file are run inside the current module's namespace (so they must
only call what still exists there) and swapped in for the current ones in turn.
"""

import argparse
import ast
import sys
from pathlib import Path

if __package__ in (None, ""):
    # Started as a script: make the repository root importable (benchmarks as a package).
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import fusedops  # noqa: E402
from benchmarks.linear_cross_entropy_goals import memory_beyond_gradients  # noqa: E402
from fusedops.ops import linear_cross_entropy as lce  # noqa: E402

GiB = 2**30
SHAPES = {"gemma-2-2b": (8192, 2304, 256000), "llama-3-8b": (8192, 4096, 128256)}


def old_functions(path, names):
    """The functions `names` of the file at `path`, defined against the current module's globals
    (a copy, in which they also see each other)."""
    namespace = dict(vars(lce))
    for node in ast.parse(open(path).read()).body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            exec(compile(ast.Module([node], []), path, "exec"), namespace)
    return {name: namespace[name] for name in names}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", help="an earlier src/fusedops/ops/linear_cross_entropy.py")
    parser.add_argument("--functions", default="compute,_accumulate_mm")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    names = args.functions.split(",")
    versions = {"old": old_functions(args.old, names), "new": {name: getattr(lce, name) for name in names}}
    for shape, (N, H, V) in SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        h = torch.randn(N, H, device="cuda", generator=gen).bfloat16().requires_grad_()
        w = (torch.randn(V, H, device="cuda", generator=gen) * (2.0 / H**0.5)).bfloat16().requires_grad_()
        t = torch.randint(0, V, (N,), device="cuda", generator=gen)
        t[::10] = -100

        def step():
            return torch.autograd.grad(fusedops.linear_cross_entropy(h, w, t), (h, w))

        times, grads = {}, {}
        for round_ in range(args.rounds):
            for label, functions in versions.items():
                for name, fn in functions.items():
                    setattr(lce, name, fn)
                times.setdefault(label, []).append(do_bench(step, warmup=100, rep=1000))
                if round_ == 0:
                    (gh, gw), extra = memory_beyond_gradients(step)
                    grads[label] = (gh.float(), gw.float())
                    print(f"{shape} {label}: memory beyond inputs and gradients {extra / GiB:.3f} GiB", flush=True)
        for name, fn in versions["new"].items():
            setattr(lce, name, fn)
        for label, ms in times.items():
            print(f"{shape} {label}: forward+backward " + " ".join(f"{m:.2f}" for m in ms) + " ms", flush=True)
        for (a, b), what in zip(zip(grads["new"], grads["old"]), ("grad_hidden", "grad_weight")):
            print(f"{shape} {what}: max |new - old| / max |old| = {((a - b).abs().max() / b.abs().max()).item():.2e}")
        del h, w, t, grads
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
