"""Triton RMSNorm, forward and backward.

What is computed
----------------
Rows are the last dimension of ``input`` (size ``N``); ``rows`` is the product of
the leading sizes.  Arithmetic is done in the accumulation type ``acc``
(float64 for float64 input, float32 otherwise)::

    rstd[r]      = 1 / sqrt(mean_j x[r, j]^2 + eps)                  (acc)
    y[r, j]      = x[r, j] * rstd[r] * w[j]                          (-> input dtype)

    g            = dy * w,  xhat = x * rstd
    dx[r, j]     = rstd[r] * (g[r, j] - xhat[r, j] * mean_j(g * xhat)[r])
    dw[j]        = sum_r dy[r, j] * xhat[r, j]                       (-> weight dtype)

with ``w = 1`` when there is no weight.

Launch strategy
---------------
* Rows that fit in registers (``next_power_of_2(N)`` up to ``_FWD_FUSED_MAX_N`` /
  ``_BWD_FUSED_MAX_N`` elements, halved for float64) are handled as one tile per
  program: ``BLOCK_M`` rows x ``BLOCK_N`` columns, where ``BLOCK_M > 1`` only for
  short rows so that each program still moves a useful amount of data.  ``x`` and
  ``dy`` are then read from global memory exactly once.
* Longer rows use looped kernels: the forward makes two passes over the row
  (sum of squares, then normalise; the second pass walks the row backwards so the
  most recently read chunks are still in cache).  The backward first computes
  ``mean_j(g * xhat)`` per row in a small kernel, then a 2-D grid (row group x
  column chunk) computes ``dx`` and the weight-gradient partials.
* The fused backward is persistent: a grid of roughly ``SMs * k`` programs, each
  looping over a fixed, strided set of row tiles and keeping its weight-gradient
  partial in registers until the end.

Deterministic weight gradient
-----------------------------
No atomics are used.  Every backward program owns one row of a
``(num_programs, N)`` buffer in the accumulation type and writes its partial sum
there; the rows it processes and the order it processes them in depend only on
the shape (and, on GPU, on the device's SM count).  A second kernel then sums the
buffer over programs in a fixed order and casts to the weight dtype.  The result
is therefore bitwise identical from run to run on the same device.

Copies
------
No copy is made for arbitrary strides on the leading dimensions as long as they
collapse (merging adjacent dimensions that are contiguous with respect to each
other and dropping size-1 dimensions) to at most two dimensions; the row offset is
then computed in the kernel with 64-bit arithmetic.  A contiguous copy of
``input`` / ``grad_output`` is made only when the last dimension is not unit-stride
(and N > 1) or when three or more leading dimensions remain after collapsing.  A
non-contiguous ``weight`` is copied (it is only N elements).  Outputs are always
freshly allocated and contiguous.
"""

from __future__ import annotations

import contextlib
import math
import struct
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["rms_norm_forward", "rms_norm_backward"]

# ---------------------------------------------------------------------------
# Tuning knobs.  Module-level so tests can shrink them to exercise the looped
# paths with small shapes.  All element counts are for a float32 accumulator;
# they are halved for float64.
# ---------------------------------------------------------------------------

# Largest power-of-two row width kept entirely in registers by the forward.
# Measured with ptxas for sm_90 (16 warps, so at most 128 registers/thread):
# 16384 needs ~127 registers and no spills, 32768 spills ~44 bytes/thread
# (negligible), 65536 spills ~600-1300 bytes/thread, so it is not fused.
_FWD_FUSED_MAX_N = 32768
# Same for the backward, which keeps x, dy, w and the dw accumulator live:
# 8192 fits in 128 registers without spilling, 16384 spills ~500 bytes/thread.
_BWD_FUSED_MAX_N = 8192
# Chunk width of the looped (long-row) kernels.
_LOOP_BLOCK_N = 4096
# Short rows are batched so that one forward tile holds about this many
# elements (several such programs are resident per SM).
_TILE_ELEMS = 2048
# Backward tile target.  Larger, because only ~2 persistent programs fit per SM
# (~100-128 registers/thread at 8 warps) and each loop iteration's loads of x
# and dy are what keeps memory busy (~16 KiB in flight per program for bf16).
_BWD_TILE_ELEMS = 4096
# Persistent backward: launch about this many warps per SM (2 programs of 8
# warps, matching the register-limited residency; more would only add a second
# wave and a bigger partial buffer).
_BWD_WARPS_PER_SM = 16
# Number of "SMs" assumed when the tensors are not on a CUDA device (Triton
# interpreter on CPU).
_NON_CUDA_SM_COUNT = 4
# Tile of the partial-sum reduction kernel.
_REDUCE_BLOCK_P = 32
_REDUCE_BLOCK_N = 64


# ---------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------


@triton.jit
def _row_offsets(rows, s1, st0, st1, TWO_LEVEL: tl.constexpr):
    """Element offset of the start of each (logical, row-major) row.

    ``rows`` is int64.  The leading dims have been collapsed to at most two:
    (outer, inner) with inner size ``s1`` and strides ``st0`` / ``st1``; with a
    single leading dim only ``st1`` is used.
    """
    if TWO_LEVEL:
        outer = rows // s1
        inner = rows - outer * s1
        off = outer * st0 + inner * st1
    else:
        off = rows * st1
    return off


@triton.jit
def _eps_in(eps, eps_lo, ACC: tl.constexpr):
    # Scalar float kernel arguments are float32.  For a float64 accumulator eps is
    # passed as an fp32 (hi, lo) pair so that it is not rounded to fp32.
    # (tl.cast rather than .to(): the interpreter hands floats in as Python floats.)
    hi = tl.cast(eps, tl.float32)
    if ACC == tl.float64:
        e = hi.to(tl.float64) + tl.cast(eps_lo, tl.float32).to(tl.float64)
    else:
        e = hi.to(ACC)
    return e


@triton.jit
def _inv_sqrt(v, ACC: tl.constexpr):
    # Computed once per row, so use the correctly rounded sqrt and division
    # rather than the approximate rsqrt: the cost is invisible.
    if ACC == tl.float64:
        r = 1.0 / tl.sqrt(v)  # fp64 sqrt and division are IEEE
    else:
        r = tl.div_rn(1.0, tl.sqrt_rn(v))
    return r


@triton.jit
def _fwd_fused_kernel(
    X, W, Y, RSTD,
    n_rows, N,
    x_s1, x_st0, x_st1,
    eps, eps_lo,
    X_TWO_LEVEL: tl.constexpr,
    HAS_W: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]

    x_off = _row_offsets(rows, x_s1, x_st0, x_st1, X_TWO_LEVEL)
    x = tl.load(X + x_off[:, None] + cols[None, :], mask=mask, other=0.0).to(ACC)

    mean_sq = tl.sum(x * x, axis=1) / N
    rstd = _inv_sqrt(mean_sq + _eps_in(eps, eps_lo, ACC), ACC)

    y = x * rstd[:, None]
    if HAS_W:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(ACC)
        y = y * w[None, :]

    tl.store(Y + rows[:, None] * N + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit
def _fwd_looped_kernel(
    X, W, Y, RSTD,
    N,
    x_s1, x_st0, x_st1,
    eps, eps_lo,
    X_TWO_LEVEL: tl.constexpr,
    HAS_W: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # One program per (long) row.
    row = tl.program_id(0).to(tl.int64)
    x_row = X + _row_offsets(row, x_s1, x_st0, x_st1, X_TWO_LEVEL)
    y_row = Y + row * N
    cols = tl.arange(0, BLOCK_N)

    sq = tl.zeros([BLOCK_N], dtype=ACC)
    for start in range(0, N, BLOCK_N):
        c = start + cols
        x = tl.load(x_row + c, mask=c < N, other=0.0).to(ACC)
        sq += x * x
    rstd = _inv_sqrt(tl.sum(sq, axis=0) / N + _eps_in(eps, eps_lo, ACC), ACC)
    tl.store(RSTD + row, rstd)

    # Second pass in reverse chunk order: the chunks read last by the first
    # pass are the likeliest to still be in L1/L2.
    n_chunks = tl.cdiv(N, BLOCK_N)
    for i in range(0, n_chunks):
        c = (n_chunks - 1 - i) * BLOCK_N + cols
        m = c < N
        x = tl.load(x_row + c, mask=m, other=0.0).to(ACC)
        y = x * rstd
        if HAS_W:
            w = tl.load(W + c, mask=m, other=0.0).to(ACC)
            y = y * w
        tl.store(y_row + c, y.to(Y.dtype.element_ty), mask=m)


@triton.jit
def _bwd_fused_kernel(
    DY, X, W, RSTD, DX, DW_PARTIAL,
    n_rows, N,
    x_s1, x_st0, x_st1,
    dy_s1, dy_st0, dy_st1,
    X_TWO_LEVEL: tl.constexpr,
    DY_TWO_LEVEL: tl.constexpr,
    HAS_W: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Persistent: program `pid` handles row tiles pid, pid + P, pid + 2P, ...
    # (P = number of programs), so its dw partial has a fixed summation order.
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(ACC)
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)

    n_tiles = tl.cdiv(n_rows, BLOCK_M)
    for tile in range(pid, n_tiles, num_progs):
        # tl.cast, not .to(): the interpreter's loop variable is a Python int.
        rows = tl.cast(tile, tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]

        x_off = _row_offsets(rows, x_s1, x_st0, x_st1, X_TWO_LEVEL)
        dy_off = _row_offsets(rows, dy_s1, dy_st0, dy_st1, DY_TWO_LEVEL)
        x = tl.load(X + x_off[:, None] + cols[None, :], mask=mask, other=0.0).to(ACC)
        dy = tl.load(DY + dy_off[:, None] + cols[None, :], mask=mask, other=0.0).to(ACC)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0).to(ACC)

        xhat = x * rstd[:, None]
        if HAS_W:
            g = dy * w[None, :]
        else:
            g = dy
        c = tl.sum(g * xhat, axis=1) / N
        dx = rstd[:, None] * (g - xhat * c[:, None])
        tl.store(DX + rows[:, None] * N + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            # Masked lanes loaded as 0, so they contribute nothing.
            dw_acc += dy * xhat

    if COMPUTE_DW:
        tl.store(DW_PARTIAL + pid.to(tl.int64) * N + cols, tl.sum(dw_acc, axis=0), mask=col_mask)


@triton.jit
def _bwd_row_dot_kernel(
    DY, X, W, RSTD, C,
    N,
    x_s1, x_st0, x_st1,
    dy_s1, dy_st0, dy_st1,
    X_TWO_LEVEL: tl.constexpr,
    DY_TWO_LEVEL: tl.constexpr,
    HAS_W: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Long rows, step 1: C[r] = mean_j(g * xhat) = rstd * sum_j(dy * w * x) / N.
    row = tl.program_id(0).to(tl.int64)
    x_row = X + _row_offsets(row, x_s1, x_st0, x_st1, X_TWO_LEVEL)
    dy_row = DY + _row_offsets(row, dy_s1, dy_st0, dy_st1, DY_TWO_LEVEL)
    cols = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=ACC)
    for start in range(0, N, BLOCK_N):
        c = start + cols
        m = c < N
        x = tl.load(x_row + c, mask=m, other=0.0).to(ACC)
        g = tl.load(dy_row + c, mask=m, other=0.0).to(ACC)
        if HAS_W:
            g = g * tl.load(W + c, mask=m, other=0.0).to(ACC)
        acc += g * x
    rstd = tl.load(RSTD + row).to(ACC)
    tl.store(C + row, tl.sum(acc, axis=0) * rstd / N)


@triton.jit
def _bwd_looped_kernel(
    DY, X, W, RSTD, C, DX, DW_PARTIAL,
    n_rows, N, rows_per_group,
    x_s1, x_st0, x_st1,
    dy_s1, dy_st0, dy_st1,
    X_TWO_LEVEL: tl.constexpr,
    DY_TWO_LEVEL: tl.constexpr,
    HAS_W: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Long rows, step 2: program (group, chunk) handles the contiguous block of
    # rows [group * rows_per_group, ...) restricted to one column chunk, and
    # writes that chunk of its group's dw partial row.
    group = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(ACC)
    dw_acc = tl.zeros([BLOCK_N], dtype=ACC)

    row_start = group.to(tl.int64) * rows_per_group
    row_end = tl.minimum(row_start + rows_per_group, n_rows)
    for row in range(row_start, row_end):
        x_off = _row_offsets(row, x_s1, x_st0, x_st1, X_TWO_LEVEL)
        dy_off = _row_offsets(row, dy_s1, dy_st0, dy_st1, DY_TWO_LEVEL)
        x = tl.load(X + x_off + cols, mask=col_mask, other=0.0).to(ACC)
        dy = tl.load(DY + dy_off + cols, mask=col_mask, other=0.0).to(ACC)
        rstd = tl.load(RSTD + row).to(ACC)
        c = tl.load(C + row)

        xhat = x * rstd
        if HAS_W:
            g = dy * w
        else:
            g = dy
        dx = rstd * (g - xhat * c)
        tl.store(DX + row * N + cols, dx.to(DX.dtype.element_ty), mask=col_mask)
        if COMPUTE_DW:
            dw_acc += dy * xhat

    if COMPUTE_DW:
        tl.store(DW_PARTIAL + group.to(tl.int64) * N + cols, dw_acc, mask=col_mask)


@triton.jit
def _sum_partials_kernel(
    P, OUT,
    n_parts, N,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # OUT[j] = sum_p P[p, j], in a fixed order (deterministic), cast to OUT's dtype.
    pid = tl.program_id(0)
    cols = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=P.dtype.element_ty)
    for start in range(0, n_parts, BLOCK_P):
        parts = start + tl.arange(0, BLOCK_P)
        mask = (parts < n_parts)[:, None] & col_mask[None, :]
        acc += tl.load(P + parts.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0)
    tl.store(OUT + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=col_mask)


# ---------------------------------------------------------------------------
# Host-side helpers
# ---------------------------------------------------------------------------

_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _NON_CUDA_SM_COUNT
    index = device.index if device.index is not None else torch.cuda.current_device()
    count = _SM_COUNT.get(index)
    if count is None:
        count = torch.cuda.get_device_properties(index).multi_processor_count
        _SM_COUNT[index] = count
    return count


def _device_guard(device: torch.device):
    # Triton launches on the current CUDA device; make it the tensors' device.
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tl_acc(acc: torch.dtype) -> tl.dtype:
    return tl.float64 if acc == torch.float64 else tl.float32


def _split_eps(eps: float) -> tuple[float, float]:
    """Return fp32-representable (hi, lo) with hi + lo ~= eps to ~48 bits."""
    try:
        hi = struct.unpack("f", struct.pack("f", eps))[0]
    except OverflowError:
        hi = float("inf")
    if not math.isfinite(hi):  # |eps| beyond fp32 range (or inf/nan): no low part
        return eps, 0.0
    return hi, eps - hi


def _num_warps(tile_elems: int) -> int:
    if tile_elems <= 1024:
        return 4
    if tile_elems <= 4096:
        return 8
    return 16


def _collapse_rows(t: Tensor):
    """Describe ``t`` as rows of ``t.size(-1)`` unit-stride elements.

    Returns ``(t, s1, st0, st1, two_level)``: the (possibly copied) tensor and
    the description of its row start offsets used by ``_row_offsets``.
    """
    n = t.size(-1)
    if n > 1 and t.stride(-1) != 1:
        # Non-unit stride along the normalised dim: loads would not coalesce;
        # make a contiguous copy.
        t = t.contiguous()
    # Innermost first; size-1 dims do not affect addressing.
    dims = [(s, st) for s, st in zip(reversed(t.shape[:-1]), reversed(t.stride()[:-1])) if s != 1]
    merged: list[list[int]] = []
    for size, stride in dims:
        if merged and stride == merged[-1][0] * merged[-1][1]:
            merged[-1][0] *= size  # contiguous w.r.t. the inner dim: merge
        else:
            merged.append([size, stride])
    if len(merged) > 2:
        # Three or more independent leading strides: fall back to a
        # contiguous copy rather than doing 3+ level index arithmetic.
        t = t.contiguous()
        return t, 1, 0, n, False
    if len(merged) == 2:
        (s1, st1), (_, st0) = merged
        return t, s1, st0, st1, True
    if len(merged) == 1:
        return t, 1, 0, merged[0][1], False
    return t, 1, 0, n, False  # a single row


def _weight_arg(weight: Optional[Tensor], dummy: Tensor) -> Tensor:
    # A dummy pointer is passed when there is no weight; HAS_W=False means it is
    # never dereferenced.
    return dummy if weight is None else weight.contiguous()


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------


def rms_norm_forward(input: Tensor, weight: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor]:
    """RMSNorm forward.  Returns ``(output, rstd)``; see the module docstring."""
    acc = _acc_dtype(input.dtype)
    n = input.size(-1)
    lead_shape = input.shape[:-1]
    output = torch.empty(input.shape, dtype=input.dtype, device=input.device)
    n_rows = output.numel() // n if n > 0 else lead_shape.numel()

    if n_rows == 0:
        return output, torch.empty(lead_shape, dtype=acc, device=input.device)
    if n == 0:
        # mean over an empty row is taken as 0: rstd = 1/sqrt(eps).
        rstd = torch.full(lead_shape, float(eps), dtype=acc, device=input.device).rsqrt_()
        return output, rstd

    rstd = torch.empty(lead_shape, dtype=acc, device=input.device)
    x, x_s1, x_st0, x_st1, x_two = _collapse_rows(input)
    w = _weight_arg(weight, x)
    eps_hi, eps_lo = _split_eps(float(eps))
    tl_acc = _tl_acc(acc)
    scale = 2 if acc == torch.float64 else 1
    block_n = triton.next_power_of_2(n)

    with _device_guard(input.device):
        if block_n <= _FWD_FUSED_MAX_N // scale:
            block_m = max(1, min(_TILE_ELEMS // block_n, triton.next_power_of_2(n_rows)))
            grid = (triton.cdiv(n_rows, block_m),)
            _fwd_fused_kernel[grid](
                x, w, output, rstd,
                n_rows, n,
                x_s1, x_st0, x_st1,
                eps_hi, eps_lo,
                X_TWO_LEVEL=x_two,
                HAS_W=weight is not None,
                ACC=tl_acc,
                BLOCK_M=block_m,
                BLOCK_N=block_n,
                num_warps=_num_warps(block_m * block_n),
            )
        else:
            block_n = _LOOP_BLOCK_N // scale
            _fwd_looped_kernel[(n_rows,)](
                x, w, output, rstd,
                n,
                x_s1, x_st0, x_st1,
                eps_hi, eps_lo,
                X_TWO_LEVEL=x_two,
                HAS_W=weight is not None,
                ACC=tl_acc,
                BLOCK_N=block_n,
                num_warps=_num_warps(block_n),
            )
    return output, rstd


def rms_norm_backward(
    grad_output: Tensor,
    input: Tensor,
    weight: Optional[Tensor],
    rstd: Tensor,
    weight_requires_grad: bool,
) -> tuple[Tensor, Tensor]:
    """RMSNorm backward.  Returns ``(grad_input, grad_weight)``.

    ``grad_weight`` is ``input.new_empty((0,))`` (in the weight's dtype when there
    is a weight) unless ``weight`` is given and ``weight_requires_grad``.
    """
    acc = _acc_dtype(input.dtype)
    n = input.size(-1)
    device = input.device
    compute_dw = weight is not None and bool(weight_requires_grad)
    grad_input = torch.empty(input.shape, dtype=input.dtype, device=device)
    n_rows = grad_input.numel() // n if n > 0 else input.shape[:-1].numel()

    if compute_dw:
        grad_weight = torch.empty((n,), dtype=weight.dtype, device=device)
    else:
        grad_weight = input.new_empty((0,), dtype=weight.dtype if weight is not None else input.dtype)
    if n_rows == 0 or n == 0:
        if compute_dw:
            grad_weight.zero_()  # sum over no rows
        return grad_input, grad_weight

    x, x_s1, x_st0, x_st1, x_two = _collapse_rows(input)
    dy, dy_s1, dy_st0, dy_st1, dy_two = _collapse_rows(grad_output)
    rstd_flat = rstd.reshape(-1)  # normally contiguous already: a view
    w = _weight_arg(weight, x)
    tl_acc = _tl_acc(acc)
    scale = 2 if acc == torch.float64 else 1
    block_n = triton.next_power_of_2(n)
    sms = _sm_count(device)

    with _device_guard(device):
        if block_n <= _BWD_FUSED_MAX_N // scale:
            block_m = max(1, min(_BWD_TILE_ELEMS // scale // block_n, triton.next_power_of_2(n_rows)))
            num_warps = _num_warps(block_m * block_n)
            n_tiles = triton.cdiv(n_rows, block_m)
            num_progs = min(n_tiles, sms * max(1, _BWD_WARPS_PER_SM // num_warps))
            # rstd_flat doubles as the (never written) dummy when dw is skipped.
            partial = (torch.empty((num_progs, n), dtype=acc, device=device) if compute_dw else rstd_flat)
            _bwd_fused_kernel[(num_progs,)](
                dy, x, w, rstd_flat, grad_input, partial,
                n_rows, n,
                x_s1, x_st0, x_st1,
                dy_s1, dy_st0, dy_st1,
                X_TWO_LEVEL=x_two,
                DY_TWO_LEVEL=dy_two,
                HAS_W=weight is not None,
                COMPUTE_DW=compute_dw,
                ACC=tl_acc,
                BLOCK_M=block_m,
                BLOCK_N=block_n,
                num_warps=num_warps,
            )
        else:
            block_n = _LOOP_BLOCK_N // scale
            num_warps = _num_warps(block_n)
            row_dot = torch.empty((n_rows,), dtype=acc, device=device)
            _bwd_row_dot_kernel[(n_rows,)](
                dy, x, w, rstd_flat, row_dot,
                n,
                x_s1, x_st0, x_st1,
                dy_s1, dy_st0, dy_st1,
                X_TWO_LEVEL=x_two,
                DY_TWO_LEVEL=dy_two,
                HAS_W=weight is not None,
                ACC=tl_acc,
                BLOCK_N=block_n,
                num_warps=num_warps,
            )
            n_chunks = triton.cdiv(n, block_n)
            target = sms * max(1, _BWD_WARPS_PER_SM // num_warps)
            n_groups = min(n_rows, max(1, target // n_chunks))
            rows_per_group = triton.cdiv(n_rows, n_groups)
            n_groups = triton.cdiv(n_rows, rows_per_group)  # no empty groups
            num_progs = n_groups
            partial = (torch.empty((n_groups, n), dtype=acc, device=device) if compute_dw else rstd_flat)
            _bwd_looped_kernel[(n_groups, n_chunks)](
                dy, x, w, rstd_flat, row_dot, grad_input, partial,
                n_rows, n, rows_per_group,
                x_s1, x_st0, x_st1,
                dy_s1, dy_st0, dy_st1,
                X_TWO_LEVEL=x_two,
                DY_TWO_LEVEL=dy_two,
                HAS_W=weight is not None,
                COMPUTE_DW=compute_dw,
                ACC=tl_acc,
                BLOCK_N=block_n,
                num_warps=num_warps,
            )

        if compute_dw:
            _sum_partials_kernel[(triton.cdiv(n, _REDUCE_BLOCK_N),)](
                partial, grad_weight,
                num_progs, n,
                BLOCK_P=_REDUCE_BLOCK_P,
                BLOCK_N=_REDUCE_BLOCK_N,
                num_warps=4,
            )
    return grad_input, grad_weight
