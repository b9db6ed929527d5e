"""Command line of the fusedops benchmarks.

Run from the repository root, either way:

    python benchmarks/run.py [options]
    python -m benchmarks.run [options]

See ``benchmarks/README.md`` or ``--help``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    # Started as a script: make the repository root importable so that
    # ``benchmarks`` resolves as a package, exactly as under ``python -m``.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks import harness  # noqa: E402
from benchmarks.ops import load_entries  # noqa: E402


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return value


def _csv_list(text):
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError("empty list")
    return items


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python benchmarks/run.py",
        description="Benchmark fusedops operators against their peers (one harness for every op).",
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="default: cuda if available, else cpu")
    parser.add_argument("--ops", type=_csv_list, default=None,
                        help="comma-separated op names (default: every entry in benchmarks/ops)")
    parser.add_argument("--modes", type=_csv_list, default=None,
                        help="comma-separated subset of fwd,bwd,fwd+bwd (default: all)")
    parser.add_argument("--providers", type=_csv_list, default=None,
                        help="comma-separated provider filter: a key (eager, torch.compile, liger, quack, "
                             "fusedops, fusedops-raw, fusedops+offset), a label (fusedops-triton, "
                             "fusedops-cuda-raw, fusedops-cuda+offset) or a glob; "
                             "'fusedops' matches every fusedops-<backend> (default: all default providers)")
    parser.add_argument("--shapes", choices=("small", "large", "wide", "all"), default="all")
    parser.add_argument("--quick", action="store_true",
                        help="few repetitions, for smoke tests (numbers are not measurements)")
    parser.add_argument("--out", type=Path, default=None,
                        help="results directory (default: benchmarks/results/<machine>, "
                             "machine = GPU model such as h200, or cpu)")
    parser.add_argument("--append", action="store_true",
                        help="merge into the results already in --out (same op/device/mode/shape/dtype/"
                             "provider rows are replaced) instead of overwriting them")
    parser.add_argument("--fusedops-backends", type=_csv_list, default=None, metavar="LIST",
                        help="run the peers here, then fusedops once per backend in a child process with "
                             "FUSEDOPS_BACKEND=<backend> (the value 'default' leaves it unset), merging all "
                             "into one table; e.g. --fusedops-backends cuda,triton")
    parser.add_argument("--threads", type=_positive_int, default=None, help="torch.set_num_threads before running")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-plot", action="store_true", help="do not write the PNG plots")
    parser.add_argument("--merge", type=Path, action="append", default=[], metavar="DIR",
                        help="merge the results in DIR (results.csv, meta.json of a run made elsewhere) "
                             "into --out (required), as --append would, then rewrite the reports; repeatable")
    parser.add_argument("--report-only", action="store_true",
                        help="only rewrite results.md / plots / summary from the CSV in --out")
    parser.add_argument("--list", action="store_true",
                        help="list ops, cases and provider availability on the device, then exit")
    parser.add_argument("--no-summary", action="store_true", help=argparse.SUPPRESS)
    # Set for the per-backend children of --fusedops-backends: their filter is the parent's, and a
    # fusedops label it names may belong to another child's backend, so selecting nothing is fine.
    parser.add_argument("--allow-empty", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # Whether --modes was given: only a mode asked for by name must select something.
    args.modes_given = args.modes is not None
    if args.modes is None:
        args.modes = list(harness.MODES)
    bad = [m for m in args.modes if m not in harness.MODES]
    if bad:
        parser.error(f"unknown mode(s) {bad}; choose from {','.join(harness.MODES)}")
    # (FUSEDOPS_BACKEND's values, and "default" for leaving it unset; fusedops itself is not
    # imported here, so that a broken install still benchmarks the peers)
    backends = ("default", "auto", "cuda", "triton")
    bad = [b for b in args.fusedops_backends or () if b not in backends]
    if bad:
        parser.error(f"--fusedops-backends: unknown backend(s) {bad}; choose from {','.join(backends)}")
    if args.merge and args.out is None:
        # Merged rows come from another machine: the directory named after this one is never right.
        parser.error("--merge needs --out DIR, the results directory to merge into "
                     "(e.g. --merge gpu-out/bench --out benchmarks/results/h200)")
    return args


def command_line() -> str:
    prefix = ""
    backend = os.environ.get("FUSEDOPS_BACKEND")
    if backend is not None:
        prefix = f"FUSEDOPS_BACKEND={shlex.quote(backend)} "
    if __package__:
        program = f"python -m {__package__}.run"
    else:
        program = "python " + shlex.quote(os.path.relpath(sys.argv[0], harness.REPO_ROOT))
    return prefix + " ".join([program] + [shlex.quote(a) for a in sys.argv[1:]])


def _child_argv(args, device, out_dir, providers):
    argv = ["--device", device, "--modes", ",".join(args.modes), "--shapes", args.shapes,
            "--out", str(out_dir), "--seed", str(args.seed), "--append", "--no-summary", "--allow-empty",
            "--providers", ",".join(providers)]
    if args.ops:
        argv += ["--ops", ",".join(args.ops)]
    if args.quick:
        argv.append("--quick")
    if args.threads:
        argv += ["--threads", str(args.threads)]
    if args.no_plot:
        argv.append("--no-plot")
    return argv


def _subject_filter(args, entries):
    """The --providers items that concern fusedops, for the per-backend children."""
    subjects = [p for e in entries.values() for p in e.providers if p.role == "subject"]
    if args.providers is None:
        return sorted({p.key for p in subjects if p.default})
    return [f for f in args.providers
            if any(f.startswith(p.key) or p.key.startswith(f) or any(c in f for c in "*?[")
                   for p in subjects)]


def _selection_error(args, device, entries, plan, forwarded) -> str:
    """Why the filters select nothing to run (a message naming the filter), or ""."""
    ops = ",".join(entries)
    # Items handed to the --fusedops-backends children are theirs to match: the labels there
    # depend on the child's backend.
    unmatched = [f for f in plan.unmatched_providers if f not in forwarded]
    if unmatched:
        return (f"--providers {','.join(unmatched)} matches no provider of {ops} on {device} "
                f"(there: {', '.join(plan.offered)}; a key, a label or a glob)")
    if args.modes_given and not forwarded and plan.unmatched_modes:
        return (f"--modes {','.join(plan.unmatched_modes)}: no selected provider of {ops} runs "
                f"{'that mode' if len(plan.unmatched_modes) == 1 else 'those modes'}"
                + (f" (--providers {','.join(args.providers)})" if args.providers else ""))
    if plan.rows == 0 and not forwarded:
        return (f"nothing to run: --ops {ops} --shapes {args.shapes} --modes {','.join(args.modes)}"
                + (f" --providers {','.join(args.providers)}" if args.providers else "")
                + f" select no case, provider and mode on {device}")
    return ""


def _results_dir(args, device):
    """--out, or the directory named after this machine; None when that cannot be named."""
    if args.out is not None:
        return args.out.resolve()
    if device == "cuda" and not torch.cuda.is_available():
        return None  # (the name is the GPU's model, and there is no GPU to ask)
    return (harness.RESULTS_DIR / harness.machine_name(device)).resolve()


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available() and not (args.report_only or args.merge):
        print("error: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)

    all_entries = load_entries()
    if args.ops:
        unknown = [o for o in args.ops if o not in all_entries]
        if unknown:
            print(f"error: unknown op(s) {unknown}; known: {', '.join(all_entries)}", file=sys.stderr)
            return 2
        entries = {name: all_entries[name] for name in args.ops}
    else:
        entries = all_entries

    out_dir = _results_dir(args, device)
    if out_dir is None:
        print("error: --device cuda without a GPU here: pass --out DIR, the results directory "
              "(e.g. --out benchmarks/results/h200); its default is named after the GPU", file=sys.stderr)
        return 2

    if args.list:
        settings = harness.Settings(device=device, providers=args.providers)
        for entry in entries.values():
            print(f"{entry.name}: {entry.bytes_model}")
            for case in harness.select_cases(entry, device, args.shapes):
                print(f"  case {case.shape_str} {harness.dtype_name(case.dtype)} ({case.size})")
            for provider, probe in harness.select_providers(entry, settings):
                state = "available" if probe.ok else "unavailable"
                extra = f" [{probe.reason}]" if probe.reason else ""
                version = f" {probe.version}" if probe.version else ""
                print(f"  provider {probe.label}{version}: {state}{extra}")
        return 0

    # Every source is checked before the first is merged, so a bad one changes nothing.
    for src in args.merge:
        problem = harness.check_results_dir(src.resolve())
        if problem:
            print(f"error: --merge {src}: {problem}", file=sys.stderr)
            return 2
    for src in args.merge:
        harness.merge_results(out_dir, src.resolve())
    if not args.report_only and not args.merge:
        settings = harness.Settings(
            device=device,
            modes=tuple(args.modes),
            providers=args.providers,
            shapes=args.shapes,
            quick=args.quick,
            seed=args.seed,
            skip_roles=("subject",) if args.fusedops_backends else (),
        )
        forwarded = _subject_filter(args, entries) if args.fusedops_backends else []
        if not args.allow_empty:
            plan = harness.plan_run(list(entries.values()), settings)
            problem = _selection_error(args, device, entries, plan, forwarded)
            if problem:
                print(f"error: {problem}; nothing run, {out_dir} left as it was", file=sys.stderr)
                return 2
        run = harness.collect_run_info(device, command_line(), args.quick)
        print(f"fusedops benchmarks: {run['device_name']} [{device}], torch {run['torch']}, "
              f"{run['threads']} threads, out={out_dir}", flush=True)
        run.update(harness.copy_bandwidth(device))
        print(f"copy bandwidth: {run['copy_tbps']:.4g} TB/s "
              f"({run['copy_bytes'] / 2**20:.0f} MiB, read + write)", flush=True)
        rows = []
        for entry in entries.values():
            rows.extend(harness.run_entry(entry, settings, run))
        measured = any(r["status"] != "skipped" for r in rows)
        if rows and (measured or forwarded or args.allow_empty):
            harness.save_results(out_dir, rows, run, append=args.append)
        elif rows:
            # (skipped rows only say what could not run: alone, they never replace results)
            reasons = sorted({f"{r['provider']}: {r['note']}" for r in rows})
            print(f"error: every row was skipped ({'; '.join(reasons)}); nothing written, {out_dir} left as "
                  "it was", file=sys.stderr)
            return 1
        elif args.allow_empty:
            print(f"no result rows from this process; {out_dir} left as it was", flush=True)
            return 0
        elif forwarded:
            print("no peer rows from this process; the fusedops rows come from the backends' runs",
                  flush=True)
        else:
            # (an empty run would otherwise replace the results in --out with a bare header)
            print(f"error: the run produced no result rows; nothing written, {out_dir} left as it was",
                  file=sys.stderr)
            return 1

        if forwarded:
            for backend in args.fusedops_backends:
                env = dict(os.environ)
                env.pop("FUSEDOPS_BACKEND", None)
                if backend != "default":
                    env["FUSEDOPS_BACKEND"] = backend
                child = [sys.executable, "-m", "benchmarks.run",
                         *_child_argv(args, device, out_dir, forwarded)]
                print(f"\n--- fusedops with FUSEDOPS_BACKEND={env.get('FUSEDOPS_BACKEND', '(unset)')}: "
                      f"{' '.join(shlex.quote(c) for c in child)}", flush=True)
                done = subprocess.run(child, cwd=harness.REPO_ROOT, env=env)
                if done.returncode != 0:
                    print(f"warning: the FUSEDOPS_BACKEND={backend} run exited with "
                          f"{done.returncode}", flush=True)

    if not (out_dir / "results.csv").exists():
        print(f"error: no results.csv in {out_dir}", file=sys.stderr)
        return 2
    rows, summary = harness.write_reports(out_dir, load_entries(), plot=not args.no_plot)
    if not args.no_summary:
        print(summary)
    print(f"\nwrote {out_dir / 'results.csv'}, {out_dir / 'results.md'} "
          f"({len(rows)} rows) in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
