"""The Triton rope kernel's launch configurations side by side (on a GPU), for choosing
triton/rope.py's tile: forward and backward TB/s of the kernel alone (its outputs allocated
once) at the benchmark cases of benchmarks/ops/rope.py, for the default configuration and each
alternative in CONFIGS, with the copy bandwidth measured in the same run. `--old FILE` (repeat
it for more) adds an earlier triton/rope.py (say `git show REV:src/fusedops/triton/rope.py`,
its relative import made absolute) as a row, called with that file's signature when it has no
bad_position argument, with its own default tile when it has one.

    python benchmarks/rope_triton_tiles.py [--configs] [--old /tmp/rope_old.py ...] [--cases bhsd,thd]
"""

import argparse
import importlib.util

import torch
from triton.testing import do_bench

from benchmarks.ops import rope as entry
from fusedops.functional import _rope_views
from fusedops.ops.rope import output_like
from fusedops.triton import rope as kernels

# (block_p, block_hh, num_warps); heads_fast is each case's default, and flipped in one row.
CONFIGS = [(16, 8, 4), (16, 8, 8), (4, 8, 4), (8, 4, 4), (32, 4, 8), (8, 8, 8), (4, 8, 2), (32, 8, 8), (2, 8, 1)]


def _load(path):
    spec = importlib.util.spec_from_file_location("rope_old", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tbps(nbytes, ms):
    return nbytes / (ms * 1e-3) / 1e12


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", action="append", default=[], help="an earlier triton/rope.py to time beside")
    parser.add_argument("--configs", action="store_true", help="also time every tile in CONFIGS")
    parser.add_argument("--cases", default=None, help="variants to run (default: every GPU case)")
    parser.add_argument("--rep", type=int, default=100, help="do_bench's rep (ms)")
    args = parser.parse_args()
    olds = [(path.rsplit("/", 1)[-1], _load(path)) for path in args.old]
    wanted = args.cases.split(",") if args.cases else None
    copy_src = torch.empty(2**28, device="cuda", dtype=torch.bfloat16)
    copy_dst = torch.empty_like(copy_src)
    copy = _tbps(2 * copy_src.numel() * 2, do_bench(lambda: copy_dst.copy_(copy_src), rep=args.rep))
    print(f"copy {copy:.3f} TB/s ({torch.cuda.get_device_name()})")
    for case in entry.GPU_CASES:
        if wanted and case.variant not in wanted:
            continue
        inputs = entry.make_inputs(case, "cuda", 0)
        q, k, cos, sin, position_ids, layout, interleaved = inputs.args
        q4, k4, cos4, sin4, pos = _rope_views("rope", q.detach(), k.detach(), cos, sin, layout, position_ids)
        q_out, k_out = output_like(q4), output_like(k4)
        bad = torch.full((), -1, dtype=torch.int64, device="cuda")
        nbytes = 2 * case.numel * q.element_size()
        Hq, Hk, R = q4.shape[1], k4.shape[1], cos4.shape[-1]
        default = kernels.config(q4, Hq, Hk, R)
        rows = [("default " + "/".join(map(str, default)), default)]
        if args.configs:
            rows += [(f"{p}x{h} w{w}", kernels.Config(p, h, w, default.heads_fast)) for p, h, w in CONFIGS]
            rows.append(("heads_fast flipped", default._replace(heads_fast=not default.heads_fast)))
        line = []
        for backward in (False, True):
            record = None if backward else bad
            results = []
            for name, old in olds:
                if hasattr(old, "Config"):
                    call = lambda: old.rope(q4, k4, cos4, sin4, pos, interleaved, backward, q_out, k_out, record)  # noqa: E731
                else:
                    call = lambda: old.rope(q4, k4, cos4, sin4, pos, interleaved, backward, q_out, k_out)  # noqa: E731
                results.append((name, do_bench(call, rep=args.rep)))
            for name, tile in rows:
                ms = do_bench(lambda: kernels.rope(q4, k4, cos4, sin4, pos, interleaved, backward, q_out, k_out,
                                                   record, tile=tile), rep=args.rep)
                results.append((name, ms))
            best = min(results, key=lambda r: r[1])
            line.append(f"{'bwd' if backward else 'fwd'}: best {best[0]} {_tbps(nbytes, best[1]):.2f}")
            for name, ms in results:
                print(f"{case.shape_str} {'bwd' if backward else 'fwd'} {name:>24}: {ms * 1e3:9.1f} us "
                      f"{_tbps(nbytes, ms):.3f} TB/s {100 * _tbps(nbytes, ms) / copy:5.1f}% copy")
        print(f"== {case.shape_str}: " + "; ".join(line))


if __name__ == "__main__":
    main()
