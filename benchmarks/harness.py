"""The one benchmark harness of fusedops.

Shared by every operator: the data model an operator entry fills in
(``Case``, ``Inputs``, ``Provider``, ``OpEntry``), the correctness gate, the
timers (GPU kernel time with ``triton.testing.do_bench``, GPU wall time per
call, CPU time with ``torch.utils.benchmark``), the copy-bandwidth yardstick,
and the reports (``results.csv``, ``meta.json``, ``results.md``, ``<op>.png``
and the summary printed on stdout).

Operator entries live in ``benchmarks/ops/<op>.py``; the command line is
``benchmarks/run.py``.  Only torch is required; triton is needed for GPU
timing, matplotlib only for the PNG plots.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import fnmatch
import gc
import importlib.metadata
import json
import math
import os
import platform
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

MODES = ("fwd", "bwd", "fwd+bwd")
SIZES = ("large", "wide", "small")
BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"

# Relative error (of the norm, against an fp32 reference) above which a
# provider is declared wrong and not timed.
DEFAULT_TOLERANCE = {
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 2e-2,
}

_DTYPE_NAMES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float64: "fp64",
}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


# --------------------------------------------------------------------------
# What an operator entry declares
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One benchmarked problem: a shape and a dtype.

    ``size`` is "large" (bandwidth decides), "wide" (bandwidth decides, on
    rows wide enough to need other kernels) or "small" (per-call overhead
    decides); ``--shapes small|large|wide`` filters on it.
    """

    shape: tuple
    dtype: torch.dtype
    size: str = "large"

    @property
    def shape_str(self) -> str:
        return "x".join(str(d) for d in self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


@dataclass
class Inputs:
    """Arguments of one call.

    ``args`` is passed unchanged to every provider callable and, upcast to
    fp32, to the entry's reference.  ``grad_argnums`` names the positions of
    ``args`` that the backward modes differentiate (they must require grad);
    ``grad_out`` is the upstream gradient (a tuple, one per output, for ops
    with several outputs).  ``names`` labels the arguments in messages.
    """

    args: tuple
    grad_argnums: tuple = ()
    grad_out: Any = None
    names: tuple = ()

    def arg_name(self, i: int) -> str:
        return self.names[i] if i < len(self.names) else f"arg{i}"


@dataclass
class Probe:
    """Availability of a provider on a device, found out before any timing."""

    label: str  # name in the results, e.g. "liger" or "fusedops-triton"
    ok: bool
    reason: str = ""  # why it is unavailable (or a remark when available)
    version: str = ""


@dataclass
class Provider:
    """One implementation of an operator.

    ``probe(device)`` says whether it can run and under which label;
    ``factory(case, device)`` returns the forward callable (called as
    ``fn(*inputs.args)``, autograd-enabled), built once per case (so compiled
    providers compile once per shape).  Role "subject" marks fusedops
    implementations, for which the reports compute speed ratios against every
    "peer".  A provider with ``default=False`` runs only when ``--providers``
    names its key or label exactly.  ``reference`` (fp32 math, as the
    entry's) is for a subject that computes a variant of the entry's function
    (an option no peer runs): its outputs are checked against that instead.
    """

    key: str
    probe: Callable[[str], Probe]
    factory: Callable[[Case, str], Callable[..., torch.Tensor]]
    role: str = "peer"
    modes: tuple = MODES
    default: bool = True
    supports: Optional[Callable[[Case, str], Optional[str]]] = None  # reason if a case is unsupported
    reference: Optional[Callable[..., torch.Tensor]] = None  # None: the entry's


@dataclass
class OpEntry:
    """Everything the harness needs to benchmark one operator."""

    name: str
    gpu_cases: list
    cpu_cases: list
    make_inputs: Callable[[Case, str, int], Inputs]  # (case, device, seed); fresh random data
    reference: Callable[..., torch.Tensor]  # fp32 math; gets the args upcast to fp32
    min_bytes: Callable[[Case, str], int]  # (case, mode) -> bytes a perfect kernel must move
    bytes_model: str  # one line for the report
    providers: list
    modes: tuple = MODES
    tolerance: dict = field(default_factory=lambda: dict(DEFAULT_TOLERANCE))
    # whether to record each call's peak memory (CUDA: bytes allocated above what was allocated
    # before the call, outputs and gradients included), as the peak_mib column
    measure_memory: bool = False
    # (case, mode) -> floating-point operations of one call, for ops bound by matrix products,
    # where bytes moved say little: their rows also get a tflops column (None: no FLOP model)
    flops: Optional[Callable[[Case, str], int]] = None

    def cases(self, device: str) -> list:
        return list(self.gpu_cases if device == "cuda" else self.cpu_cases)

    def tol(self, dtype: torch.dtype) -> float:
        return self.tolerance.get(dtype, 2e-2)


@dataclass
class Settings:
    device: str
    modes: tuple = MODES
    providers: Optional[list] = None  # --providers filter, None = every default provider
    shapes: str = "all"
    quick: bool = False
    seed: int = 0
    skip_roles: tuple = ()  # roles left out entirely (used by --fusedops-backends)


# --------------------------------------------------------------------------
# Provider selection
# --------------------------------------------------------------------------


def _maybe_selected(provider: Provider, filters: Optional[Sequence[str]]) -> bool:
    """Cheap pre-check on the key, so unwanted peers are never imported. fusedops' own providers
    are always probed: their labels put the backend inside the key ("fusedops+offset" runs as
    "fusedops-cuda+offset"), so only the label can tell whether a filter names them."""
    if filters is None:
        return provider.default
    if provider.role == "subject":
        return True
    for f in filters:
        if f == provider.key or provider.key.startswith(f) or f.startswith(provider.key):
            return True
        if any(ch in f for ch in "*?["):
            return True
    return False


def _selected(provider: Provider, label: str, filters: Optional[Sequence[str]]) -> bool:
    if filters is None:
        return provider.default
    for f in filters:
        if f in (provider.key, label):
            return True
        if provider.default and (label.startswith(f + "-") or fnmatch.fnmatchcase(label, f)):
            return True
    return False


def _probe(provider: Provider, device: str) -> Probe:
    try:
        return provider.probe(device)
    except Exception as exc:  # a probe must never take the run down
        return Probe(provider.key, False, f"probe failed: {describe_exception(exc)}")


def select_providers(entry: OpEntry, settings: Settings) -> list:
    """[(provider, probe)] of the providers this run covers, probed on the device."""
    chosen = []
    for provider in entry.providers:
        if provider.role in settings.skip_roles:
            continue
        if not _maybe_selected(provider, settings.providers):
            continue
        probe = _probe(provider, settings.device)
        if _selected(provider, probe.label, settings.providers):
            chosen.append((provider, probe))
    return chosen


@dataclass
class Plan:
    """What a run of ``settings`` over some entries would do, found out before anything runs."""

    rows: int  # result rows it would produce: one per (case, selected provider, mode)
    unmatched_providers: list  # --providers items that select no provider of any entry
    unmatched_modes: list  # --modes items that no selected provider of any entry runs
    offered: list  # keys and labels of the entries' providers (the skipped roles left out)


def plan_run(entries: Sequence[OpEntry], settings: Settings) -> Plan:
    """Which rows a run would produce and which filter items select nothing, so that a filter
    that matches nothing is reported before any result is written (run.py), rather than
    leaving an empty table in place of the results there."""
    filters = settings.providers
    rows = 0
    matched_filters, matched_modes, offered = set(), set(), []
    for entry in entries:
        cases = select_cases(entry, settings.device, settings.shapes)
        modes = [m for m in entry.modes if m in settings.modes]
        for provider in entry.providers:
            if provider.role in settings.skip_roles:
                continue
            if provider.key not in offered:
                offered.append(provider.key)
            if not _maybe_selected(provider, filters):
                continue  # (not probed: unwanted providers are never imported)
            label = _probe(provider, settings.device).label
            if label not in offered:
                offered.append(label)
            if not _selected(provider, label, filters):
                continue
            matched_filters.update(f for f in filters or () if _selected(provider, label, [f]))
            provider_modes = [m for m in modes if m in provider.modes]
            matched_modes.update(provider_modes)
            rows += len(cases) * len(provider_modes)
    return Plan(
        rows=rows,
        unmatched_providers=[f for f in filters or () if f not in matched_filters],
        unmatched_modes=[m for m in settings.modes if m not in matched_modes],
        offered=offered,
    )


def select_cases(entry: OpEntry, device: str, shapes: str) -> list:
    cases = entry.cases(device)
    if shapes != "all":
        cases = [c for c in cases if c.size == shapes]
    return cases


# --------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------


@dataclass
class Timing:
    ms: float  # median
    p20: float
    p80: float


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def time_gpu(fn: Callable[[], Any], quick: bool) -> Timing:
    """GPU time of one call in ms: do_bench (CUDA events, L2 flushed before each rep)."""
    from triton.testing import do_bench

    warmup, rep = (5, 20) if quick else (25, 100)
    median, p20, p80 = do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5, 0.2, 0.8])
    return Timing(median, p20, p80)


def wall_gpu_us(fn: Callable[[], Any], quick: bool) -> float:
    """Steady-state wall time per call in us, host and dispatcher overhead included.

    After a warm-up, a loop of n back-to-back calls between two synchronisations
    is timed with perf_counter; n is chosen so that a loop takes about a third
    of the target (0.2 s, or 0.03 s with --quick) and the median of three
    loops is reported.
    """
    target = 0.03 if quick else 0.2
    sync = torch.cuda.synchronize
    for _ in range(3):
        fn()
    sync()
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        elapsed = time.perf_counter() - t0
        if elapsed >= target / 20 or n >= 1 << 14:
            break
        n *= 2
    n = max(3, min(1_000_000, int(n * (target / 3) / max(elapsed, 1e-9))))
    samples = []
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        samples.append((time.perf_counter() - t0) / n)
    samples.sort()
    return samples[1] * 1e6


def time_cpu(fn: Callable[[], Any], quick: bool) -> Timing:
    """CPU time of one call in ms: torch.utils.benchmark.Timer.blocked_autorange, median,
    run with the current torch thread count (Timer's own default would be 1).
    With --quick, a call that takes more than 50 ms is timed once."""
    from torch.utils.benchmark import Timer

    if quick:
        # The correctness gate has already run fn's forward and backward once:
        # a call slower than the whole --quick budget is timed once and taken.
        t0 = time.perf_counter()
        fn()
        elapsed = (time.perf_counter() - t0) * 1e3
        if elapsed > 50:
            return Timing(elapsed, elapsed, elapsed)
    else:
        fn()
    timer = Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    m = timer.blocked_autorange(min_run_time=0.05 if quick else 1.0)
    times = sorted(m.times)
    return Timing(m.median * 1e3, _quantile(times, 0.2) * 1e3, _quantile(times, 0.8) * 1e3)


def copy_bandwidth(device: str, nbytes: Optional[int] = None) -> dict:
    """The yardstick: a large plain copy timed like the kernels.

    GPU: 2 GiB of bf16, ``dst.copy_(src)`` under do_bench.  CPU: 256 MiB of
    fp32 under torch.utils.benchmark.  Bytes moved = bytes read + bytes written.
    Every row is divided by it, so it gets full repetitions even with --quick
    (about a second on CPU, a fraction on GPU).  ``nbytes``: another copy size
    (benchmarks/copy_by_size.py).
    """
    if device == "cuda":
        nbytes = nbytes or 2 * 2**30
        src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
        dst = torch.empty_like(src)
        timing = time_gpu(lambda: dst.copy_(src), quick=False)
    else:
        nbytes = nbytes or 256 * 2**20
        src = torch.empty(nbytes // 4, dtype=torch.float32).uniform_(-1, 1)
        dst = torch.empty_like(src)
        dst.copy_(src)  # fault the pages in before timing
        timing = time_cpu(lambda: dst.copy_(src), quick=False)
    del src, dst
    free_memory(device)
    moved = 2 * nbytes
    return {
        "copy_bytes": nbytes,
        "copy_ms": timing.ms,
        "copy_tbps": moved / (timing.ms * 1e-3) / 1e12,
    }


def call_with_peak_memory(fn: Callable[[], Any]) -> tuple[Any, int]:
    """fn()'s result and the most GPU memory the call allocated on top of what was allocated
    before it, in bytes (what it returns included)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    return result, torch.cuda.max_memory_allocated() - base


def peak_memory_mib(fn: Callable[[], Any], device: str) -> Optional[float]:
    """Peak memory one call of `fn` allocates on top of what was allocated before it, in MiB
    (what it returns included); None off CUDA."""
    if device != "cuda":
        return None
    result, peak = call_with_peak_memory(fn)
    del result
    return peak / 2**20


def free_memory(device: str) -> None:
    """Collect garbage and return cached GPU memory; never raises (a failed
    kernel's CUDA error is reported where it happened, not here)."""
    gc.collect()
    if device == "cuda":
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception as exc:
            print(f"warning: CUDA error while freeing memory: {describe_exception(exc)}", flush=True)


# --------------------------------------------------------------------------
# Correctness gate
# --------------------------------------------------------------------------


def as_tuple(value) -> tuple:
    """An op's result (one tensor, or a tuple for ops with several outputs) as a tuple."""
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def rel_error(out, ref) -> float:
    """||out - ref|| / ||ref|| in fp32; inf for a missing, misshaped or non-finite result. For
    several outputs, the worst of them."""
    if isinstance(ref, (tuple, list)):
        outs = as_tuple(out) if out is not None else (None,) * len(ref)
        if len(outs) != len(ref):
            return math.inf
        return max(rel_error(o, r) for o, r in zip(outs, ref))
    if out is None or tuple(out.shape) != tuple(ref.shape):
        return math.inf
    diff = (out.detach().float() - ref.float()).norm().item()
    denom = ref.float().norm().item()
    err = diff / denom if denom > 0 else diff
    return err if math.isfinite(err) else math.inf


def reference_for(entry: OpEntry, inputs: Inputs, need_grad: bool):
    """fp32 reference output, and (if asked) fp32 reference gradients."""
    ref_args = []
    for i, arg in enumerate(inputs.args):
        if isinstance(arg, torch.Tensor):
            ref = arg.detach().float()
            if need_grad and i in inputs.grad_argnums:
                ref.requires_grad_(True)
            ref_args.append(ref)
        else:
            ref_args.append(arg)
    with torch.enable_grad():
        out = entry.reference(*ref_args)
    grads = None
    if need_grad:
        wrt = [ref_args[i] for i in inputs.grad_argnums]
        grad_out = tuple(g.float() for g in as_tuple(inputs.grad_out))
        grads = [g.detach() for g in torch.autograd.grad(as_tuple(out), wrt, grad_out)]
    if isinstance(out, (tuple, list)):
        return tuple(o.detach() for o in out), grads
    return out.detach(), grads


class _LazyReference:
    """Computed at most once per case, only if some provider gets that far."""

    def __init__(self, entry: OpEntry, case: Case, device: str, seed: int, need_grad: bool):
        self._args = (entry, case, device, seed, need_grad)
        self._value = None

    def get(self):
        if self._value is None:
            entry, case, device, seed, need_grad = self._args
            inputs = entry.make_inputs(case, device, seed)
            self._value = reference_for(entry, inputs, need_grad)
            del inputs
        return self._value


def grad_errors(out: torch.Tensor, inputs: Inputs, ref_grads) -> tuple:
    """(worst relative error over the differentiated args, per-arg text) of out's backward."""
    wrt = [inputs.args[i] for i in inputs.grad_argnums]
    grads = torch.autograd.grad(out, wrt, inputs.grad_out, allow_unused=True)
    errors = [rel_error(g, r) for g, r in zip(grads, ref_grads)]
    detail = ", ".join(
        f"d{inputs.arg_name(i)} " + ("missing" if g is None else f"{e:.3g}")
        for i, g, e in zip(inputs.grad_argnums, grads, errors)
    )
    return (max(errors) if errors else 0.0), detail


# --------------------------------------------------------------------------
# Running an entry
# --------------------------------------------------------------------------


def build_mode_fn(fn, inputs: Inputs, mode: str) -> Callable[[], Any]:
    """The timed closure of a mode.

    fwd: one forward (autograd recording, as in training).  bwd: the forward
    runs once here, outside the timed region; each call is
    ``torch.autograd.grad(out, wrt, grad_out, retain_graph=True)`` (grad, not
    ``.backward``, so no ``.grad`` accumulation kernel is timed).  fwd+bwd:
    forward then ``autograd.grad``.
    """
    args = inputs.args
    wrt = tuple(args[i] for i in inputs.grad_argnums)
    grad_out = inputs.grad_out
    if mode == "fwd":
        return lambda: fn(*args)
    if mode == "bwd":
        out = fn(*args)
        return lambda: torch.autograd.grad(out, wrt, grad_out, retain_graph=True)
    if mode == "fwd+bwd":
        return lambda: torch.autograd.grad(fn(*args), wrt, grad_out)
    raise ValueError(f"unknown mode {mode!r}")


def describe_exception(exc: BaseException, limit: int = 240) -> str:
    text = f"{type(exc).__name__}: {exc}"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _progress(case: Case, label: str, mode: str, text: str) -> None:
    print(f"  {case.shape_str:>12} {dtype_name(case.dtype):>4}  {mode:<7} {label:<18} {text}", flush=True)


def run_entry(entry: OpEntry, settings: Settings, run: dict) -> list:
    """Benchmark one operator; return result rows (dicts with CSV_COLUMNS keys)."""
    device = settings.device
    cases = select_cases(entry, device, settings.shapes)
    modes = [m for m in entry.modes if m in settings.modes]
    chosen = select_providers(entry, settings)
    for _, probe in chosen:
        if probe.ok and probe.version:
            run.setdefault("provider_versions", {})[probe.label] = probe.version
    print(
        f"[{entry.name}] device={device} cases={len(cases)} modes={','.join(modes)} "
        f"providers={','.join(p.label + ('' if p.ok else ' (unavailable)') for _, p in chosen)}",
        flush=True,
    )
    if not chosen:
        print(f"[{entry.name}] no provider matches --providers {','.join(settings.providers or [])}",
              flush=True)
    rows = []
    need_grad = any(m != "fwd" for m in modes)
    for case in cases:
        reference = _LazyReference(entry, case, device, settings.seed, need_grad)
        for provider, probe in chosen:
            pmodes = [m for m in modes if m in provider.modes]
            if pmodes:
                rows.extend(_run_case(entry, case, provider, probe, pmodes, settings, reference, run))
        del reference
    return rows


def _run_case(entry, case, provider, probe, modes, settings, reference, run) -> list:
    device = settings.device
    base = {
        "op": entry.name,
        "shape": case.shape_str,
        "dtype": dtype_name(case.dtype),
        "size": case.size,
        "provider": probe.label,
        "role": provider.role,
        "device": device,
        "device_name": run.get("device_name", ""),
        "threads": run.get("threads", ""),
        "copy_tbps": run.get("copy_tbps"),
        "run_id": run["run_id"],
    }

    def row(mode, status, note="", **values):
        r = dict(base, mode=mode, status=status, note=note)
        r.update(values)
        return r

    def all_modes(status, note, **values):
        for m in modes:
            _progress(case, probe.label, m, f"{status}: {note}" if note else status)
        return [row(m, status, note, **values) for m in modes]

    if not probe.ok:
        return [row(m, "skipped", probe.reason) for m in modes]
    if provider.supports is not None:
        reason = provider.supports(case, device)
        if reason:
            return [row(m, "skipped", reason) for m in modes]

    tol = entry.tol(case.dtype)
    notes = [probe.reason] if probe.reason else []
    if provider.reference is not None:
        need_grad = any(m != "fwd" for m in modes)
        reference = _LazyReference(dataclasses.replace(entry, reference=provider.reference), case, device,
                                   settings.seed, need_grad)
    try:
        ref_out, ref_grads = reference.get()
        inputs = entry.make_inputs(case, device, settings.seed)
        fn = provider.factory(case, device)
        out = fn(*inputs.args)
        err_fwd = rel_error(out, ref_out)
        if isinstance(out, torch.Tensor) and out.dtype != case.dtype:
            notes.append(f"output dtype {dtype_name(out.dtype)}")
        if not err_fwd < tol:
            return all_modes("wrong", f"forward rel. error {err_fwd:.3g} >= {tol:g}", err_fwd=err_fwd)
    except Exception as exc:
        fn = inputs = out = None
        free_memory(device)
        return all_modes("error", describe_exception(exc))
    # (a backward that raises fails the modes that run it, not the forward)
    err_grad, grad_detail, grad_failure = None, "", None
    if any(m != "fwd" for m in modes):
        try:
            err_grad, grad_detail = grad_errors(out, inputs, ref_grads)
        except Exception as exc:
            grad_failure = "backward: " + describe_exception(exc)
    del out

    copy_tbps = run.get("copy_tbps") or math.nan
    rows = []
    for mode in modes:
        if mode != "fwd" and grad_failure is not None:
            _progress(case, probe.label, mode, "error: " + grad_failure)
            rows.append(row(mode, "error", grad_failure, err_fwd=err_fwd))
            continue
        if mode != "fwd" and not err_grad < tol:
            note = f"gradient rel. error {grad_detail} (tolerance {tol:g})"
            _progress(case, probe.label, mode, "wrong: " + note)
            rows.append(row(mode, "wrong", note, err_fwd=err_fwd, err_grad=err_grad))
            continue
        timed = None
        try:
            timed = build_mode_fn(fn, inputs, mode)
            if device == "cuda":
                timing = time_gpu(timed, settings.quick)
                wall = wall_gpu_us(timed, settings.quick)
            else:
                timing = time_cpu(timed, settings.quick)
                wall = None
            peak = peak_memory_mib(timed, device) if entry.measure_memory else None
            nbytes = entry.min_bytes(case, mode)
            tbps = nbytes / (timing.ms * 1e-3) / 1e12
            pct = 100.0 * tbps / copy_tbps
            tflops = entry.flops(case, mode) / (timing.ms * 1e-3) / 1e12 if entry.flops else None
            rows.append(
                row(
                    mode, "ok", "; ".join(notes),
                    time_ms=timing.ms, time_ms_p20=timing.p20, time_ms_p80=timing.p80,
                    wall_us=wall, min_bytes=nbytes, tbps=tbps, pct_copy=pct,
                    err_fwd=err_fwd, err_grad=err_grad if mode != "fwd" else None, peak_mib=peak,
                    tflops=tflops,
                )
            )
            wall_text = f"  wall {wall:9.2f} us" if wall is not None else ""
            if tflops is not None:
                wall_text += f"  {tflops:8.2f} TFLOP/s"
            _progress(case, probe.label, mode,
                      f"{timing.ms:10.4f} ms  {tbps:8.4f} TB/s  {pct:5.1f}% copy{wall_text}")
        except Exception as exc:
            note = describe_exception(exc)
            _progress(case, probe.label, mode, "error: " + note)
            rows.append(row(mode, "error", note, err_fwd=err_fwd, err_grad=err_grad))
        finally:
            del timed
    del fn, inputs
    free_memory(device)
    return rows


# --------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------


def machine_name(device: str) -> str:
    """Directory name of a machine's results: "cpu", or the GPU model, e.g. "h200"."""
    if device != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name()
    vendor = {"nvidia", "geforce", "tesla", "quadro", "amd", "radeon", "instinct"}
    picked = []
    for token in re.split(r"[\s_\-]+", name.lower()):
        if not token or token in vendor:
            continue
        picked.append(token)
        if any(ch.isdigit() for ch in token):
            break
    return re.sub(r"[^a-z0-9]+", "", "".join(picked)) or "gpu"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _git_state() -> str:
    def git(*args):
        return subprocess.run(
            ["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, timeout=10
        )

    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode != 0:
            return "no commit"
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
        return head.stdout.strip() + (" (dirty)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def collect_run_info(device: str, command: str, quick: bool) -> dict:
    now = datetime.datetime.now().astimezone()
    info = {
        "run_id": now.strftime("%Y%m%dT%H%M%S") + f"-{os.getpid()}",
        "date": now.isoformat(timespec="seconds"),
        "command": command,
        "device": device,
        "machine": machine_name(device),
        "quick": quick,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "triton": dist_version("triton"),
        "cuda": torch.version.cuda or "",
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "fusedops_backend_env": os.environ.get("FUSEDOPS_BACKEND", ""),
        "git": _git_state(),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info.update(
            device_name=props.name,
            capability=f"{props.major}.{props.minor}",
            sm_count=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
        )
    else:
        info["device_name"] = info["cpu_model"]
    return info


# --------------------------------------------------------------------------
# Results files
# --------------------------------------------------------------------------

CSV_COLUMNS = [
    "op", "mode", "shape", "dtype", "size", "provider", "role", "status",
    "time_ms", "time_ms_p20", "time_ms_p80", "wall_us", "min_bytes", "tbps", "pct_copy",
    "err_fwd", "err_grad", "note",
    "device", "device_name", "threads", "copy_tbps", "run_id",
    "peak_mib", "tflops",
]
OPTIONAL_COLUMNS = ("peak_mib", "tflops")
ROW_KEY = ("op", "device", "mode", "shape", "dtype", "provider")


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if math.isnan(value):
            return ""
        return "inf" if math.isinf(value) else f"{value:.6g}"
    return str(value)


def fnum(value) -> Optional[float]:
    if value in (None, ""):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def read_rows(path: Path) -> list:
    if not path.exists():
        return []
    with open(path, newline="", encoding="utf-8") as fh:
        return [dict(r) for r in csv.DictReader(fh)]


def read_runs(path: Path) -> list:
    if not path.exists():
        return []
    with open(path, encoding="utf-8") as fh:
        return json.load(fh).get("runs", [])


def save_results(out_dir: Path, rows: list, run: dict, append: bool) -> Optional[Path]:
    """Write results.csv and meta.json; with append, merge into what is there.

    Merging replaces rows with the same (op, device, mode, shape, dtype,
    provider) and keeps the rest, so runs of different fusedops backends (or
    of a subset of providers) accumulate into one table.  A run without rows
    writes nothing (returns None): an empty run must never replace results.
    """
    if not rows:
        return None
    return _write_merged(out_dir, rows, [run], append)


def check_results_dir(src_dir: Path) -> Optional[str]:
    """Why ``src_dir`` cannot be merged (no such directory, no results.csv, no rows), or None."""
    if not src_dir.is_dir():
        return f"{src_dir} is not a directory"
    if not (src_dir / "results.csv").is_file():
        return f"{src_dir} has no results.csv"
    if not read_rows(src_dir / "results.csv"):
        return f"{src_dir / 'results.csv'} has no rows"
    return None


def merge_results(out_dir: Path, src_dir: Path) -> Path:
    """Merge the results.csv and meta.json of another results directory (a run made elsewhere,
    say on the GPU machine) into ``out_dir``, with save_results' append rule."""
    problem = check_results_dir(src_dir)
    if problem:
        raise ValueError(f"cannot merge: {problem}")
    return _write_merged(out_dir, read_rows(src_dir / "results.csv"), read_runs(src_dir / "meta.json"), True)


def _write_merged(out_dir: Path, rows: list, new_runs: list, append: bool) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, meta_path = out_dir / "results.csv", out_dir / "meta.json"
    new_rows = [{k: _cell(r.get(k)) for k in CSV_COLUMNS} for r in rows]
    old_rows = read_rows(csv_path) if append else []
    runs = read_runs(meta_path) if append else []

    def key(r):
        return tuple(r.get(k, "") for k in ROW_KEY)

    position = {key(r): i for i, r in enumerate(old_rows)}
    merged = list(old_rows)
    for r in new_rows:
        if key(r) in position:
            merged[position[key(r)]] = r
        else:
            position[key(r)] = len(merged)
            merged.append(r)
    # Optional columns (peak_mib) are written only when some row has a value, so that results
    # without them keep their file format.
    columns = [k for k in CSV_COLUMNS if k not in OPTIONAL_COLUMNS or any(r.get(k) not in (None, "") for r in merged)]
    with open(csv_path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(merged)
    used = {r.get("run_id") for r in merged}
    new_ids = {r.get("run_id") for r in new_runs}
    runs = [r for r in runs if r.get("run_id") in used and r.get("run_id") not in new_ids]
    runs.extend(r for r in new_runs if r.get("run_id") in used)
    with open(meta_path, "w", encoding="utf-8") as fh:
        json.dump({"runs": runs}, fh, indent=2, sort_keys=True)
        fh.write("\n")
    return csv_path


# --------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------


def _provider_order(labels, entry: Optional[OpEntry]) -> list:
    def rank(label):
        if entry is not None:
            for i, p in enumerate(entry.providers):
                if label == p.key or label.startswith(p.key + "-"):
                    return (i, label)
        return (len(entry.providers) if entry else 0, label)

    return sorted(set(labels), key=rank)


def _case_order(rows, entry: Optional[OpEntry], device: str) -> list:
    """[(shape, dtype, size)] in the entry's declared order, unknown cases last."""
    declared = []
    if entry is not None:
        declared = [(c.shape_str, dtype_name(c.dtype)) for c in entry.cases(device)]
    seen = {}
    for r in rows:
        seen.setdefault((r["shape"], r["dtype"]), r.get("size", ""))

    def rank(item):
        (shape, dtype), size = item
        if (shape, dtype) in declared:
            return (0, declared.index((shape, dtype)), "")
        return (1, SIZES.index(size) if size in SIZES else len(SIZES), shape + dtype)

    return [(s, d, z) for (s, d), z in sorted(seen.items(), key=rank)]


def _groups(rows) -> dict:
    """{(op, device): rows}, ops in name order."""
    groups = {}
    for r in sorted(rows, key=lambda r: (r["op"], r["device"] != "cuda", r["device"])):
        groups.setdefault((r["op"], r["device"]), []).append(r)
    return groups


def _index(rows) -> dict:
    return {(r["mode"], r["shape"], r["dtype"], r["provider"]): r for r in rows}


def _ratio(peer: Optional[dict], subject: dict, column: str) -> Optional[float]:
    if peer is None or peer.get("status") != "ok":
        return None
    a, b = fnum(peer.get(column)), fnum(subject.get(column))
    if a is None or b is None or b <= 0:
        return None
    return a / b


def _fmt(value: Optional[float], spec: str, missing: str = "") -> str:
    return missing if value is None else format(value, spec)


def _md_table(headers, body) -> list:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
    return lines


def _text_table(headers, body) -> list:
    widths = [len(h) for h in headers]
    for row in body:
        widths = [max(w, len(str(c))) for w, c in zip(widths, row)]
    fmt = lambda row: "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()
    return [fmt(headers), fmt(["-" * w for w in widths])] + [fmt(r) for r in body]


def _not_timed(rows, n_cases) -> list:
    """Lines describing skipped / wrong / failed results, grouped by reason."""
    grouped = {}
    for r in rows:
        if r["status"] == "ok":
            continue
        k = (r["provider"], r["status"], r["note"])
        grouped.setdefault(k, [])
        case = f"{r['shape']} {r['dtype']}"
        if case not in grouped[k]:
            grouped[k].append(case)
    lines = []
    for (provider, status, note), cases in grouped.items():
        where = "all shapes" if len(cases) >= n_cases else ", ".join(cases)
        label = status.upper() if status in ("wrong", "error") else status
        lines.append(f"{provider} ({where}): {label}: {note}")
    return lines


def _copy_of(rows) -> Optional[float]:
    values = [fnum(r.get("copy_tbps")) for r in rows]
    values = [v for v in values if v]
    return max(values) if values else None


# p80 / p20 of a GPU time's repetitions above which the table marks it as host-bound: a
# kernel's own repetitions, L2 flushed before each, spread by a few percent at most.
HOST_BOUND_SPREAD = 1.10


def _host_bound(r) -> bool:
    p20, p80 = fnum(r.get("time_ms_p20")), fnum(r.get("time_ms_p80"))
    return p20 is not None and p80 is not None and p20 > 0 and p80 / p20 > HOST_BOUND_SPREAD


# Rows whose runs started further apart than this, or on other machines, are not from one
# session: their ratio is marked (the same code moves by 2-40% between sessions).
SESSION_SECONDS = 3600


def _sessions(runs: list):
    """(run_id -> "r<n>", the numbering of the Runs table; same_session(a, b) for two rows)."""
    label = {run.get("run_id"): f"r{i}" for i, run in enumerate(runs, 1)}
    by_id = {run.get("run_id"): run for run in runs}

    def started(run):
        try:
            return datetime.datetime.fromisoformat(run.get("date", ""))
        except (TypeError, ValueError):
            return None

    def same_session(a: dict, b: dict) -> bool:
        ra, rb = by_id.get(a.get("run_id")), by_id.get(b.get("run_id"))
        if ra is None or rb is None or ra is rb:
            return True  # (unknown runs: nothing to say)
        if a.get("device_name") != b.get("device_name"):
            return False
        ta, tb = started(ra), started(rb)
        return ta is None or tb is None or abs((ta - tb).total_seconds()) <= SESSION_SECONDS

    return label, same_session


def render_markdown(rows: list, runs: list, entries: dict) -> str:
    out = ["# fusedops benchmark results", ""]
    devices = sorted({r["device"] for r in rows})
    names = sorted({r["device_name"] for r in rows if r.get("device_name")})
    out.append(f"Device: {', '.join(names) or '?'} ({', '.join(devices)}).  Results of "
               f"{len(runs)} run(s), merged into one table.")
    out += ["", "## Runs", ""]
    run_label, same_session = _sessions(runs)
    body = []
    for run in runs:
        body.append([
            run_label[run.get("run_id")], f"`{run.get('run_id', '')}`", run.get("date", ""),
            f"`{run.get('command', '')}`", _fmt(run.get("copy_tbps"), ".4g"), str(run.get("threads", "")),
        ])
    out += _md_table(["", "run", "date", "command", "copy TB/s", "torch threads"], body)
    out += [""]
    for run in runs:
        parts = [
            f"device {run.get('device_name', '?')}"
            + (f" (sm {run['capability']}, {run.get('sm_count')} SMs, {run.get('memory_gib')} GiB)"
               if run.get("capability") else ""),
            f"CPU {run.get('cpu_model', '?')} ({run.get('cpu_count')} logical cpus)",
            f"python {run.get('python', '?')}",
            f"torch {run.get('torch', '?')}",
            f"triton {run.get('triton') or 'n/a'}",
            f"CUDA {run.get('cuda') or 'n/a'}",
            f"FUSEDOPS_BACKEND={run.get('fusedops_backend_env') or '(unset)'}",
            f"git {run.get('git', '?')}",
        ]
        versions = run.get("provider_versions") or {}
        if versions:
            parts.append("versions: " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())))
        if run.get("copy_tbps"):
            parts.append(f"copy {run['copy_tbps']:.4g} TB/s ({run.get('copy_bytes', 0) / 2**20:.0f} MiB "
                         f"copied, read + write counted)")
        if run.get("quick"):
            parts.append("**--quick (few repetitions: smoke test, not a measurement)**")
        out.append(f"- `{run.get('run_id', '')}`: " + "; ".join(parts))
    out += [
        "",
        "Columns: *GPU ms* is the median kernel time from `triton.testing.do_bench` (CUDA events, "
        "L2 flushed between repetitions); *wall us* is the steady-state wall time per call "
        "(back-to-back calls between two synchronisations: includes host and dispatcher overhead); "
        "*CPU ms* is the median of `torch.utils.benchmark` (wall time).  *TB/s* = minimum bytes / time; "
        "*% copy* = TB/s relative to the copy bandwidth of the same run.  *vs P* = P's time / "
        "fusedops' time (> 1: fusedops faster); on GPU the cell reads `kernel ratio (wall ratio)`.  "
        "*peak MiB* (entries that measure memory, CUDA): the most one call allocates on top of what "
        "was allocated before it, its outputs and gradients included.  *‡* after a GPU time: its "
        f"repetitions spread by more than {HOST_BOUND_SPREAD - 1:.0%} (p80 / p20), the sign that in "
        "some of them the GPU waited for the host (a call whose host side outlasts do_bench's L2 "
        "flush): that time partly measures the host, and the wall column is the figure to compare.  "
        "*run*: the row's run in the Runs table.  *†* after a ratio: the two rows come from runs "
        f"on other machines or started more than {SESSION_SECONDS // 60} minutes apart, not one "
        "session: a comparison across sessions, which the same code's timings can move by several "
        "percent (more for host-bound rows).",
    ]
    for (op, device), group in _groups(rows).items():
        entry = entries.get(op)
        title = f"## {op}" + (f" ({device})" if len(devices) > 1 else "")
        out += ["", title, ""]
        if entry is not None:
            out.append(f"Minimum-bytes model: {entry.bytes_model}")
            out.append("")
        providers = _provider_order([r["provider"] for r in group], entry)
        index = _index(group)
        cases = _case_order(group, entry, device)
        gpu = device == "cuda"
        for mode in MODES:
            mode_rows = [r for r in group if r["mode"] == mode]
            if not mode_rows:
                continue
            has_subject = any(r["role"] == "subject" and r["status"] == "ok" for r in mode_rows)
            peers = [p for p in providers
                     if has_subject and any(r["provider"] == p and r["role"] == "peer" and r["status"] == "ok"
                                            for r in mode_rows)]
            headers = ["shape", "dtype", "provider", "run"]
            headers += ["GPU ms", "wall us"] if gpu else ["CPU ms"]
            headers += ["TB/s", "% copy"]
            memory = any(fnum(r.get("peak_mib")) is not None for r in mode_rows)
            if memory:
                headers.append("peak MiB")
            flops = any(fnum(r.get("tflops")) is not None for r in mode_rows)
            if flops:
                headers.append("TFLOP/s")
            headers += [f"vs {p}" for p in peers]
            body = []
            for shape, dtype, _ in cases:
                for p in providers:
                    r = index.get((mode, shape, dtype, p))
                    if r is None or r["status"] != "ok":
                        continue
                    cells = [shape, dtype, f"**{p}**" if r["role"] == "subject" else p,
                             run_label.get(r.get("run_id"), "?")]
                    cells.append(_fmt(fnum(r["time_ms"]), ".4g") + (" ‡" if gpu and _host_bound(r) else ""))
                    if gpu:
                        cells.append(_fmt(fnum(r["wall_us"]), ".1f"))
                    cells += [_fmt(fnum(r["tbps"]), ".4g"), _fmt(fnum(r["pct_copy"]), ".1f")]
                    if memory:
                        cells.append(_fmt(fnum(r.get("peak_mib")), ".0f"))
                    if flops:
                        cells.append(_fmt(fnum(r.get("tflops")), ".4g"))
                    for peer in peers:
                        if r["role"] != "subject":
                            cells.append("")
                            continue
                        peer_row = index.get((mode, shape, dtype, peer))
                        k = _ratio(peer_row, r, "time_ms")
                        mark = "" if k is None or same_session(peer_row, r) else " †"
                        if gpu:
                            w = _ratio(peer_row, r, "wall_us")
                            wall = f" ({w:.2f})" if w else ""
                            cells.append("n/a" if k is None else f"{k:.2f}{wall}{mark}")
                        else:
                            cells.append("n/a" if k is None else f"{k:.2f}" + mark)
                    body.append(cells)
            out += [f"### {op} {mode}", ""]
            out += _md_table(headers, body) if body else ["(nothing timed)"]
            missing = _not_timed(mode_rows, len(cases))
            if missing:
                out += ["", "Not timed:", ""] + [f"- {line}" for line in missing]
            out.append("")
        plot = f"{op}.png" if len(devices) == 1 else f"{op}-{device}.png"
        out.append(f"Plot: [{plot}]({plot}) (written only when matplotlib is installed).")
    return "\n".join(out).rstrip() + "\n"


def render_plots(out_dir: Path, rows: list, entries: dict) -> list:
    """One PNG per op and device: grouped bars per case and provider, a row of panels per mode.

    Large shapes: achieved TB/s (higher is better; dashed line: copy bandwidth).
    Small shapes, where bandwidth means little: time per call in us (lower is
    better), the wall time on GPU.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the PNG plots (pip install matplotlib)")
        return []
    written = []
    devices = {r["device"] for r in rows}
    for (op, device), group in _groups(rows).items():
        ok = [r for r in group if r["status"] == "ok" and fnum(r["tbps"]) is not None]
        if not ok:
            continue
        entry = entries.get(op)
        providers = _provider_order([r["provider"] for r in ok], entry)
        cases = _case_order(ok, entry, device)
        index = _index(ok)
        modes = [m for m in MODES if any(r["mode"] == m for r in ok)]
        sizes = [s for s in SIZES if any(r["size"] == s for r in ok)] or [""]
        fig, axes = plt.subplots(len(modes), len(sizes), squeeze=False,
                                 figsize=(6.5 * len(sizes), 3.4 * len(modes)))
        copy = _copy_of(ok)
        colors = plt.rcParams["axes.prop_cycle"].by_key().get("color", [None])
        if len(providers) > len(colors):  # past the default ten, their lighter shades (tab20's odd)
            tab20 = plt.get_cmap("tab20").colors
            colors = list(tab20[0::2]) + list(tab20[1::2])
        handles = {}
        for i, mode in enumerate(modes):
            for j, size in enumerate(sizes):
                ax = axes[i][j]
                panel = [(s, d) for s, d, z in cases if z == size or not size]
                width = 0.8 / max(1, len(providers))
                per_call = size == "small"
                for k, p in enumerate(providers):
                    xs, ys = [], []
                    for n, (shape, dtype) in enumerate(panel):
                        r = index.get((mode, shape, dtype, p))
                        if r is None:
                            continue
                        if per_call:
                            y = fnum(r["wall_us"]) if device == "cuda" else fnum(r["time_ms"]) * 1e3
                        else:
                            y = fnum(r["tbps"])
                        if y is not None:
                            xs.append(n - 0.4 + width * (k + 0.5))
                            ys.append(y)
                    if xs:
                        bars = ax.bar(xs, ys, width, label=p, color=colors[k % len(colors)])
                        handles.setdefault(p, bars)
                if copy and size != "small":
                    line = ax.axhline(copy, color="gray", linestyle="--", linewidth=1)
                    handles.setdefault(f"copy ({copy:.3g} TB/s)", line)
                ax.set_xticks(range(len(panel)))
                ax.set_xticklabels([_tick_label(s, d) for s, d in panel], fontsize=8)
                if per_call:
                    ax.set_ylabel(("wall " if device == "cuda" else "") + "us / call")
                    what = "time per call, lower is better"
                else:
                    ax.set_ylabel("TB/s")
                    what = "TB/s, higher is better"
                ax.set_title(f"{mode}" + (f" - {size} shapes" if size else "") + f" ({what})", fontsize=10)
                ax.grid(axis="y", alpha=0.3)
        name = group[0].get("device_name") or device
        fig.suptitle(f"{op} on {name}: TB/s = minimum bytes / time", fontsize=11)
        fig.legend(list(handles.values()), list(handles.keys()), loc="lower center",
                   ncol=min(len(handles), 7), fontsize=8, frameon=False)
        fig.tight_layout(rect=(0, 0.06, 1, 0.96))
        path = out_dir / (f"{op}.png" if len(devices) == 1 else f"{op}-{device}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _tick_label(shape, dtype):
    """A case's label under its bars: a variant ("interleaved:8x4096x32x8x128") on a line of its
    own, so that long names do not run into their neighbours."""
    return shape.replace(":", ":\n") + "\n" + dtype


def _strongest_peer(index, key, subject_row, peers, column):
    """(ratio, peer) against the peer with the best time in column, or (None, "")."""
    best, best_peer = None, ""
    for peer in peers:
        k = _ratio(index.get(key + (peer,)), subject_row, column)
        if k is not None and (best is None or k < best):
            best, best_peer = k, peer
    return best, best_peer


def render_summary(rows: list, entries: dict) -> str:
    """Compact text for stdout: one line per mode and case, one column per provider.

    GPU cells read ``kernel ms/wall us``; CPU cells ``ms``.  fusedops cells
    add TB/s, % of copy and x = the strongest peer's time / fusedops' time
    (kernel, then wall on GPU), naming that peer.
    """
    out = []
    for (op, device), group in _groups(rows).items():
        entry = entries.get(op)
        gpu = device == "cuda"
        providers = _provider_order([r["provider"] for r in group], entry)
        subjects = [p for p in providers if any(r["provider"] == p and r["role"] == "subject" for r in group)]
        peers = [p for p in providers if p not in subjects]
        index = _index(group)
        cases = _case_order(group, entry, device)
        name = group[0].get("device_name") or device
        if gpu:
            cells = "cells: kernel ms (do_bench median)/wall us per call"
        else:
            cells = f"cells: ms (median, {group[0].get('threads', '?')} threads)"
        out += ["", f"== {op} on {name} [{device}], copy {_fmt(_copy_of(group), '.4g', '?')} TB/s; {cells}; "
                    f"fusedops: + TB/s, % copy, x = strongest peer's time / fusedops time =="]
        body = []
        for mode in MODES:
            for shape, dtype, _ in cases:
                line, present = [mode, shape, dtype], False
                for p in providers:
                    r = index.get((mode, shape, dtype, p))
                    if r is None:
                        line.append("-")
                        continue
                    present = True
                    if r["status"] != "ok":
                        line.append({"skipped": "skip", "wrong": "WRONG", "error": "ERR"}.get(r["status"], r["status"]))
                        continue
                    text = _fmt(fnum(r["time_ms"]), ".4g", "?")
                    if gpu:
                        text += "/" + _fmt(fnum(r["wall_us"]), ".4g", "?")
                    if p in subjects:
                        text += f" {_fmt(fnum(r['tbps']), '.3g', '?')}TB/s {_fmt(fnum(r['pct_copy']), '.0f', '?')}%"
                        k, kp = _strongest_peer(index, (mode, shape, dtype), r, peers, "time_ms")
                        w, wp = (_strongest_peer(index, (mode, shape, dtype), r, peers, "wall_us")
                                 if gpu else (None, ""))
                        if k is not None and w is not None and kp == wp:
                            text += f" x{k:.2f}/x{w:.2f}({kp})"
                        else:
                            if k is not None:
                                text += f" x{k:.2f}({kp})"
                            if w is not None:
                                text += f"/x{w:.2f}({wp})"
                    line.append(text)
                if present:
                    body.append(line)
        out += _text_table(["mode", "shape", "dtype"] + providers, body)
        for line in _not_timed(group, len(cases)):
            out.append(f"  not timed: {line}")
    return "\n".join(out)


def write_reports(out_dir: Path, entries: dict, plot: bool = True) -> tuple:
    """(Re)write results.md and the plots from results.csv + meta.json; return (rows, summary)."""
    rows = read_rows(out_dir / "results.csv")
    runs = read_runs(out_dir / "meta.json")
    (out_dir / "results.md").write_text(render_markdown(rows, runs, entries), encoding="utf-8")
    if plot:
        for path in render_plots(out_dir, rows, entries):
            print(f"wrote {path}")
    return rows, render_summary(rows, entries)
