"""Triton row normalisations (RMSNorm and LayerNorm), forward and backward: one set of kernels.

What is computed
----------------
Rows are the last dimension of ``input`` (size ``N``); ``rows`` is the product of
the leading sizes.  Arithmetic is done in the accumulation type ``acc``
(float64 for float64 input, float32 otherwise).  The two ops differ only in
whether the row is centred first (``CENTERED``: layer_norm) and in the bias::

    mean[r]      = sum_j x[r, j] / N           (layer_norm; 0 for rms_norm)
    rstd[r]      = 1 / sqrt(sum_j (x[r, j] - mean[r])^2 / N + eps)
    xhat[r, j]   = (x[r, j] - mean[r]) * rstd[r]
    y[r, j]      = xhat[r, j] * w[j] + b[j]                          (-> input dtype)

    g            = dy * w
    dx[r, j]     = rstd[r] * (g[r, j] - mean_j(g)[r] - xhat[r, j] * mean_j(g * xhat)[r])
    dw[j]        = sum_r dy[r, j] * xhat[r, j]                       (-> parameter dtype)
    db[j]        = sum_r dy[r, j]

with ``w = 1`` without a weight and ``b = 0`` without a bias; rms_norm has no
``mean_j(g)`` term (its ``y`` does not depend on the row mean).  The variance is
the two-pass one (the mean first, then the squared deviations from it), never
``E[x^2] - mean^2``, which loses every digit when ``|mean| >> std``.  The
fused kernels keep the row in registers between the two passes; the looped
ones re-read it, mostly from L1/L2.  Every centred-only load, reduction and
store sits behind the ``CENTERED`` constexpr, so the rms_norm specialisations
do no work for layer_norm (they were checked to compile to the same sm_90a
machine code, instruction for instruction, as the rms_norm-only kernels that
these replace).

Options
-------
Each sits behind a constexpr of its own and is off for plain rms_norm and
layer_norm, whose specialisations therefore do none of this work (with the
options added, they were checked again to compile to the same sm_90a code as
before, modulo the offsets of the kernel parameters):

* ``offset`` (``W_OFFSET``): the weight applied is ``offset + w[j]``, formed in
  ``acc`` (offset 1 for weights stored as deviations from 1, Gemma style), so
  ``y = xhat * (offset + w) + b`` and ``g = dy * (offset + w)``; ``dw`` is
  unchanged.  Without a weight the offset must be 0.  Like ``eps``, it reaches
  the kernels as an fp32 (hi, lo) pair, so a float64 accumulator sees it
  unrounded.
* ``cast_before_weight`` (``CAST_XHAT``): ``xhat`` is rounded to the input dtype
  (and back to ``acc``) before the weight and bias are applied: normalise in
  fp32, cast to the activation dtype, then scale, as HF LLaMA does.  The
  backward treats that rounding as the identity (it has no such flag).  It is
  switched off where it cannot change the output: fp32 / fp64 input, or
  neither weight nor bias.
* a residual (``HAS_RESIDUAL``): the row normalised is
  ``h = round_R(x + residual)``, the sum taken in ``acc`` and rounded to the
  residual's dtype ``R`` (the input's, or float32 with 16-bit input), which is
  written to ``residual_out``.  The statistics are those of the rounded ``h``,
  so ``y`` is exactly the normalisation of ``residual_out``.  The backward
  takes ``residual_out`` as its saved row; ``grad_residual_out`` is added to
  ``dx`` (``ADD_GRAD_RESIDUAL``), which is stored in grad_output's dtype and,
  when ``R`` differs (``STORE_GRAD_RESIDUAL``), a second time in ``R``: ``dx`` is
  the gradient of both addends.
* a saved output (``SAVED_IS_OUTPUT``, rms_norm only): the backward is handed
  ``y`` in place of ``x`` (so that a caller need not keep ``x`` alive) and
  recovers ``xhat = y / (offset + w)`` (``y`` itself without a weight); ``rstd``
  is still read for ``dx``.  ``y`` has been rounded to the input dtype (and,
  with ``cast_before_weight``, ``xhat`` before it), so this ``xhat`` carries that
  rounding error; a zero ``offset + w[j]`` makes column ``j``'s gradients NaN.

Launch strategy
---------------
* Rows that fit in registers (``next_power_of_2(N)`` up to ``_FWD_FUSED_MAX_N`` /
  ``_BWD_FUSED_MAX_N`` elements, or ``_BWD_FUSED_MAX_N_WITH_DB`` for a backward
  that accumulates a bias gradient, halved for float64) are handled as one tile
  per program: ``BLOCK_M`` rows x ``BLOCK_N`` columns, where ``BLOCK_M > 1`` only for
  short rows so that each program still moves a useful amount of data.  ``x`` and
  ``dy`` are then read from global memory exactly once.
* Longer rows use looped kernels.  The forward runs one program per row and
  sweeps it in chunks, two sweeps for rms_norm (sum of squares, normalise) and
  three for layer_norm (sum, squared deviations, normalise), each in the
  opposite direction to the one before so that it starts on the chunks most
  likely to still be in L1/L2.  With a residual, the first sweep reads ``x``
  and the residual and writes ``h``; the later ones read ``h`` back from
  ``residual_out`` (after a barrier, since other threads of the program stored
  parts of it).  The backward first computes the row statistics
  ``mean_j(g * xhat)`` (and ``mean_j(g)``) in a small kernel, then a 2-D grid
  (row group x column chunk) computes ``dx`` and the parameter-gradient
  partials.
* The fused backward is persistent: a grid of roughly ``SMs * k`` programs, each
  looping over a fixed, strided set of row tiles and keeping its parameter-gradient
  partials in registers until the end.
* Every backward loop is software-pipelined (``tl.range`` stages, ``_BWD_STAGES``):
  the next steps' loads are in flight while the current one is reduced and stored.

The tuning knobs below are module globals read at each call, so tests can shrink
them (``fusedops.triton._norm._FWD_FUSED_MAX_N = 16``, say) to drive small shapes
down the looped paths.

Deterministic parameter gradients
---------------------------------
No atomics are used.  Every backward program owns one row of a
``(grads, num_programs, N)`` buffer in the accumulation type (one plane per
wanted gradient: weight first, then bias) and writes its partial sums there; the
rows it processes and the order it processes them in depend only on the shape
(and, on GPU, on the device's SM count).  A second kernel then sums each plane
over programs in a fixed order and casts to the parameter dtype.  The results
are therefore bitwise identical from run to run on the same device.

Copies
------
No copy is made for arbitrary strides on the leading dimensions as long as they
collapse (merging adjacent dimensions that are contiguous with respect to each
other and dropping size-1 dimensions) to at most two dimensions; the row offset is
then computed in the kernel with 64-bit arithmetic.  A contiguous copy of
``input`` / ``grad_output`` is made only when the last dimension is not unit-stride
(and N > 1) or when three or more leading dimensions remain after collapsing; the
same goes for ``residual`` and ``grad_residual_out``.  A non-contiguous ``weight``
or ``bias`` is copied (it is only N elements).  Outputs are freshly allocated and
contiguous, except ``residual_out``.

``residual_out`` is the caller's tensor, written through its own row layout, so
it may be strided and may be ``residual`` itself (in place): every lane loads
its residual elements before it stores ``h`` to the same addresses, and nothing
reads the residual afterwards (the fused kernel keeps ``h`` in registers; the
looped one re-reads ``h``).  When its layout cannot be addressed (the same two
cases as above), ``h`` goes to a contiguous temporary that is then copied into
it.
"""

from __future__ import annotations

import functools
import math
import struct
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._launch import Launcher, cdiv, next_power_of_2, shared_memory_per_block, sm_count

# ---------------------------------------------------------------------------
# Tuning knobs.  All element counts are for a float32 accumulator; they are
# halved for float64.
# ---------------------------------------------------------------------------

# Largest power-of-two row width kept entirely in registers by the forward.
# Measured with ptxas for sm_90 (16 warps, so at most 128 registers/thread):
# 16384 needs ~127 registers and no spills, 32768 spills ~44 bytes/thread
# (negligible), 65536 spills ~600-1300 bytes/thread, so it is not fused.
# layer_norm's centring and bias fit under the same limit: at 32768 with weight
# and bias, 128 registers and no spills (Triton 3.6), and on an H200 the fused
# kernel beat the three looped sweeps (104 vs 121 us, bf16 2048x32768).
# With a residual (rms_norm, 32768, Triton 3.8's ptxas for sm_90a), the spills
# grow to 48 bytes/thread (bf16 residual) and 96 (fp32 residual with bf16
# input); not timed yet.
_FWD_FUSED_MAX_N = 32768
# Same for the backward, which keeps x, dy, w and the dw accumulator live:
# 8192 fits in 128 registers without spilling, 16384 spills ~500 bytes/thread.
_BWD_FUSED_MAX_N = 8192
# The backward's limit when a bias gradient is accumulated too, i.e. with one
# more tile-sized array (db) live across the persistent loop.  It is not lower
# because 8192 still fits: ptxas 12.9 for sm_90a gives 120-128 registers and no
# spills for bf16, fp16 and fp32 input (234 and no spills at the float64 limit,
# 4096 with 8 warps), and on an H200 (Triton 3.6) the fused kernel ran a bf16
# 4096x8192 layer_norm backward with dw and db in 79 us against 96 us for the
# looped kernels, which read x and dy twice (276 vs 342 us at 16384x8192).  It
# is a knob of its own because that kernel sits at the 128-register cap: it is
# the first one to spill with another compiler, and then wants 4096 here.
_BWD_FUSED_MAX_N_WITH_DB = 8192
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
# Software-pipelining stages of the persistent backward's row loop (tl.range's
# num_stages: the next tiles' loads are issued before the current one is reduced;
# without it, each program's loads wait for its reductions and stores, with two
# programs an SM, one at rows of 8192).  H200, Triton 3.6, bf16, the kernels
# alone (benchmarks/norm_triton_backward_sweep.py), 1 -> 3 stages, TB/s at
# 32768x4096 / 4096x8192 / 65536x1024: rms_norm 3.36 / 2.15-2.59 / 3.11 ->
# 3.85 / 2.94-3.25 / 3.54, layer_norm 3.14 / 1.13-2.39 / 2.90 -> 3.88 /
# 2.35-2.87 / 3.45, add_rms_norm 3.06 / 2.33-2.59 / 3.22 -> 3.99 / 3.33-3.42 /
# 3.69 (two runs).  Two stages were slower than one at most shapes, four a
# little slower than three (layer_norm at 4096x8192 excepted: 3.04 against 2.87).
# The stages hold a tile of each row input (x, grad_output, grad_residual_out) in
# shared memory; a loop whose stages would take more than _BWD_STAGES_SHARE of
# the GPU's per-program shared memory is not pipelined (on an H200: float32 rows
# of 8192, or add_rms_norm's float32 residual at 8192; the largest pipelined
# configuration run there is bf16 add_rms_norm at 8192, 144 KiB of 227).
# The long rows' two backward loops (row statistics over a row's chunks, and the
# (row group, chunk) grid's rows) are pipelined the same way, under the same
# guard, chunks of _LOOP_BLOCK_N for a stage: H200, bf16, 1 -> 3 stages, TB/s at
# 2048x32768 / 256x262144 (the same script, --shapes wide, 2026-12-03):
# rms_norm 2.13 / 2.01 -> 2.23 / 2.23, layer_norm 2.16 / 1.93 -> 2.17 / 2.14,
# add_rms_norm 2.36 / 2.22 -> 2.55 / 2.55.
_BWD_STAGES = 3
_BWD_STAGES_SHARE = 0.65
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
def _scalar_in(hi, lo, ACC: tl.constexpr):
    # Scalar float kernel arguments are float32.  For a float64 accumulator a
    # scalar (eps, offset) is passed as an fp32 (hi, lo) pair so that it is not
    # rounded to fp32.
    # (tl.cast rather than .to(): the interpreter hands floats in as Python floats.)
    hi32 = tl.cast(hi, tl.float32)
    if ACC == tl.float64:
        v = hi32.to(tl.float64) + tl.cast(lo, tl.float32).to(tl.float64)
    else:
        v = hi32.to(ACC)
    return v


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
def _load_weight(
    W, c, m, offset, offset_lo,
    W_OFFSET: tl.constexpr, DIVISOR: tl.constexpr, ACC: tl.constexpr,
):
    # The effective weight offset + w[j], in the accumulation type.
    w = tl.load(W + c, mask=m, other=0.0).to(ACC)
    if W_OFFSET:
        w = w + _scalar_in(offset, offset_lo, ACC)
    if DIVISOR:
        # The output is divided by it to recover xhat: padding lanes (where
        # the output is 0) must not turn into 0/0 and poison the row sums.
        w = tl.where(m, w, 1.0)
    return w


@triton.jit
def _add_residual(x, R, r_offs, H, h_offs, mask, ACC: tl.constexpr):
    # h = x + residual, rounded to residual_out's dtype and stored; the rounded
    # value is returned so that the statistics (and so the output) are those of
    # residual_out exactly.  Each lane loads its residual element before it
    # stores h to the same place, so residual_out may be residual itself.
    r = tl.load(R + r_offs, mask=mask, other=0.0).to(ACC)
    h = (x + r).to(H.dtype.element_ty)
    tl.store(H + h_offs, h, mask=mask)
    return h.to(ACC)


@triton.jit
def _fwd_fused_kernel(
    X, R, W, B, Y, H, MEAN, RSTD,
    n_rows, N,
    x_s1, x_st0, x_st1,
    r_s1, r_st0, r_st1,
    h_s1, h_st0, h_st1,
    eps, eps_lo, offset, offset_lo,
    X_TWO_LEVEL: tl.constexpr,
    R_TWO_LEVEL: tl.constexpr,
    H_TWO_LEVEL: tl.constexpr,
    CENTERED: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    W_OFFSET: tl.constexpr,
    CAST_XHAT: tl.constexpr,
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
    if HAS_RESIDUAL:
        r_off = _row_offsets(rows, r_s1, r_st0, r_st1, R_TWO_LEVEL)
        h_off = _row_offsets(rows, h_s1, h_st0, h_st1, H_TWO_LEVEL)
        x = _add_residual(x, R, r_off[:, None] + cols[None, :], H, h_off[:, None] + cols[None, :], mask, ACC)

    if CENTERED:
        if X.dtype.element_ty.primitive_bitwidth >= 32:
            # Summed from the row's first value (csrc's sum_origin says why; not 16-bit rows)
            x0 = tl.load(X + x_off, mask=row_mask, other=0.0).to(ACC)
            mean = x0 + tl.sum(tl.where(mask, x - x0[:, None], 0.0), axis=1) / N
        else:
            mean = tl.sum(x, axis=1) / N
        # Padding lanes would hold -mean: keep them at 0 so that they add nothing
        # to the variance.
        x = tl.where(mask, x - mean[:, None], 0.0)
    var = tl.sum(x * x, axis=1) / N
    rstd = _inv_sqrt(var + _scalar_in(eps, eps_lo, ACC), ACC)

    y = x * rstd[:, None]
    if CAST_XHAT:
        y = y.to(Y.dtype.element_ty).to(ACC)
    if HAS_W:
        w = _load_weight(W, cols, col_mask, offset, offset_lo, W_OFFSET, False, ACC)
        y = y * w[None, :]
    if HAS_B:
        b = tl.load(B + cols, mask=col_mask, other=0.0).to(ACC)
        y = y + b[None, :]

    tl.store(Y + rows[:, None] * N + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    if CENTERED:
        tl.store(MEAN + rows, mean, mask=row_mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit
def _sq_dev_chunk(x_row, c, N, mean, CENTERED: tl.constexpr, ACC: tl.constexpr):
    # Squared deviations of one chunk of a long row (from the mean when centred).
    m = c < N
    x = tl.load(x_row + c, mask=m, other=0.0).to(ACC)
    if CENTERED:
        x = tl.where(m, x - mean, 0.0)  # keep padding lanes at 0
    return x * x


@triton.jit
def _normalise_chunk(
    x_row, y_row, W, B, c, N, mean, rstd, offset, offset_lo,
    CENTERED: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    W_OFFSET: tl.constexpr, CAST_XHAT: tl.constexpr, ACC: tl.constexpr,
):
    m = c < N
    x = tl.load(x_row + c, mask=m, other=0.0).to(ACC)
    if CENTERED:
        x = x - mean
    y = x * rstd
    if CAST_XHAT:
        y = y.to(y_row.dtype.element_ty).to(ACC)
    if HAS_W:
        w = _load_weight(W, c, m, offset, offset_lo, W_OFFSET, False, ACC)
        y = y * w
    if HAS_B:
        b = tl.load(B + c, mask=m, other=0.0).to(ACC)
        y = y + b
    tl.store(y_row + c, y.to(y_row.dtype.element_ty), mask=m)


@triton.jit
def _fwd_looped_kernel(
    X, R, W, B, Y, H, MEAN, RSTD,
    N,
    x_s1, x_st0, x_st1,
    r_s1, r_st0, r_st1,
    h_s1, h_st0, h_st1,
    eps, eps_lo, offset, offset_lo,
    X_TWO_LEVEL: tl.constexpr,
    R_TWO_LEVEL: tl.constexpr,
    H_TWO_LEVEL: tl.constexpr,
    CENTERED: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    W_OFFSET: tl.constexpr,
    CAST_XHAT: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # One program per (long) row.  Consecutive sweeps run in opposite
    # directions: the chunks read last by one sweep are the likeliest to still
    # be in L1/L2 when the next one starts.  rms_norm: sum of squares forwards,
    # normalise backwards.  layer_norm: sum forwards, squared deviations
    # backwards, normalise forwards.  (Each direction is spelt as its own loop
    # rather than through a direction flag so that rms_norm keeps exactly the
    # loop code it had before layer_norm shared these kernels.)
    # With a residual, the first sweep reads input and residual and writes h to
    # residual_out; the later sweeps read h back from there (the residual may
    # already be overwritten by then, when residual_out is residual).
    row = tl.program_id(0).to(tl.int64)
    x_row = X + _row_offsets(row, x_s1, x_st0, x_st1, X_TWO_LEVEL)
    y_row = Y + row * N
    cols = tl.arange(0, BLOCK_N)
    if HAS_RESIDUAL:
        r_off = _row_offsets(row, r_s1, r_st0, r_st1, R_TWO_LEVEL)
        h_off = _row_offsets(row, h_s1, h_st0, h_st1, H_TWO_LEVEL)
        src_row = H + h_off
    else:
        src_row = x_row

    sq = tl.zeros([BLOCK_N], dtype=ACC)
    if CENTERED:
        # Summed from the row's first value (csrc's sum_origin says why; not 16-bit rows)
        if X.dtype.element_ty.primitive_bitwidth >= 32:
            x0 = tl.load(x_row).to(ACC)
        else:
            x0 = tl.zeros([], dtype=ACC)
        s = tl.zeros([BLOCK_N], dtype=ACC)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            m = c < N
            x = tl.load(x_row + c, mask=m, other=0.0).to(ACC)
            if HAS_RESIDUAL:
                x = _add_residual(x, R, r_off + c, H, h_off + c, m, ACC)
            if X.dtype.element_ty.primitive_bitwidth >= 32:
                x = tl.where(m, x - x0, 0.0)
            s += x
        mean = x0 + tl.sum(s, axis=0) / N
        tl.store(MEAN + row, mean)
        if HAS_RESIDUAL:
            # The next sweep reads h, possibly stored by other threads.
            tl.debug_barrier()
        n_chunks = tl.cdiv(N, BLOCK_N)
        for i in range(0, n_chunks):
            sq += _sq_dev_chunk(src_row, (n_chunks - 1 - i) * BLOCK_N + cols, N, mean, CENTERED, ACC)
    else:
        for start in range(0, N, BLOCK_N):
            if HAS_RESIDUAL:
                c = start + cols
                m = c < N
                x = tl.load(x_row + c, mask=m, other=0.0).to(ACC)
                x = _add_residual(x, R, r_off + c, H, h_off + c, m, ACC)
                sq += x * x
            else:
                sq += _sq_dev_chunk(x_row, start + cols, N, 0.0, CENTERED, ACC)
        if HAS_RESIDUAL:
            tl.debug_barrier()  # as above
    rstd = _inv_sqrt(tl.sum(sq, axis=0) / N + _scalar_in(eps, eps_lo, ACC), ACC)
    tl.store(RSTD + row, rstd)

    if CENTERED:
        for start in range(0, N, BLOCK_N):
            _normalise_chunk(
                src_row, y_row, W, B, start + cols, N, mean, rstd, offset, offset_lo,
                CENTERED, HAS_W, HAS_B, W_OFFSET, CAST_XHAT, ACC,
            )
    else:
        n_chunks = tl.cdiv(N, BLOCK_N)
        for i in range(0, n_chunks):
            c = (n_chunks - 1 - i) * BLOCK_N + cols
            _normalise_chunk(
                src_row, y_row, W, B, c, N, 0.0, rstd, offset, offset_lo,
                CENTERED, HAS_W, HAS_B, W_OFFSET, CAST_XHAT, ACC,
            )


@triton.jit
def _xhat(x, w, mean, rstd, CENTERED: tl.constexpr, HAS_W: tl.constexpr, SAVED_IS_OUTPUT: tl.constexpr):
    # The normalised row, from the saved input or from the saved output
    # (y = xhat * w: divide the weight back out; per element rather than by a
    # precomputed reciprocal, which would be one more row-sized array live in
    # the persistent kernel's registers).
    if SAVED_IS_OUTPUT:
        if HAS_W:
            xhat = x / w
        else:
            xhat = x
    elif CENTERED:
        xhat = (x - mean) * rstd
    else:
        xhat = x * rstd
    return xhat


@triton.jit
def _bwd_fused_kernel(
    DY, X, W, MEAN, RSTD, GRES, DX, DRES, PARTIAL,
    n_rows, N,
    x_s1, x_st0, x_st1,
    dy_s1, dy_st0, dy_st1,
    gres_s1, gres_st0, gres_st1,
    offset, offset_lo,
    X_TWO_LEVEL: tl.constexpr,
    DY_TWO_LEVEL: tl.constexpr,
    GRES_TWO_LEVEL: tl.constexpr,
    CENTERED: tl.constexpr,
    HAS_W: tl.constexpr,
    W_OFFSET: tl.constexpr,
    SAVED_IS_OUTPUT: tl.constexpr,
    ADD_GRAD_RESIDUAL: tl.constexpr,
    STORE_GRAD_RESIDUAL: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    # Persistent: program `pid` handles row tiles pid, pid + P, pid + 2P, ...
    # (P = number of programs), so its partial sums have a fixed order.
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_W:
        w = _load_weight(W, cols, col_mask, offset, offset_lo, W_OFFSET, SAVED_IS_OUTPUT, ACC)
    else:
        w = 1.0
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)

    n_tiles = tl.cdiv(n_rows, BLOCK_M)
    for tile in tl.range(pid, n_tiles, num_progs, num_stages=NUM_STAGES):
        # tl.cast, not .to(): the interpreter's loop variable is a Python int.
        rows = tl.cast(tile, tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]

        x_off = _row_offsets(rows, x_s1, x_st0, x_st1, X_TWO_LEVEL)
        dy_off = _row_offsets(rows, dy_s1, dy_st0, dy_st1, DY_TWO_LEVEL)
        x = tl.load(X + x_off[:, None] + cols[None, :], mask=mask, other=0.0).to(ACC)
        dy = tl.load(DY + dy_off[:, None] + cols[None, :], mask=mask, other=0.0).to(ACC)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0).to(ACC)

        # Padding lanes of xhat are -mean * rstd rather than 0, but every use
        # of xhat is multiplied by dy (or g), which is 0 there.
        if CENTERED:
            mean = tl.load(MEAN + rows, mask=row_mask, other=0.0).to(ACC)[:, None]
        else:
            mean = 0.0
        if HAS_W:
            xhat = _xhat(x, w[None, :], mean, rstd[:, None], CENTERED, HAS_W, SAVED_IS_OUTPUT)
            g = dy * w[None, :]
        else:
            xhat = _xhat(x, w, mean, rstd[:, None], CENTERED, HAS_W, SAVED_IS_OUTPUT)
            g = dy
        if SAVED_IS_OUTPUT:
            # g * xhat = dy * y: no division, so a column where offset + w is 0 (y = 0 there)
            # adds 0 rather than 0 * inf, and only its own gradients are NaN.
            c1 = tl.sum(dy * x, axis=1) / N
        else:
            c1 = tl.sum(g * xhat, axis=1) / N
        if CENTERED:
            c0 = tl.sum(g, axis=1) / N
            dx = rstd[:, None] * (g - c0[:, None] - xhat * c1[:, None])
        else:
            dx = rstd[:, None] * (g - xhat * c1[:, None])
        if ADD_GRAD_RESIDUAL:
            gres_off = _row_offsets(rows, gres_s1, gres_st0, gres_st1, GRES_TWO_LEVEL)
            dx += tl.load(GRES + gres_off[:, None] + cols[None, :], mask=mask, other=0.0).to(ACC)
        out_off = rows[:, None] * N + cols[None, :]
        tl.store(DX + out_off, dx.to(DX.dtype.element_ty), mask=mask)
        if STORE_GRAD_RESIDUAL:
            tl.store(DRES + out_off, dx.to(DRES.dtype.element_ty), mask=mask)
        # Masked lanes loaded as 0, so they contribute nothing.
        if COMPUTE_DW:
            dw_acc += dy * xhat
        if COMPUTE_DB:
            db_acc += dy

    if COMPUTE_DW:
        tl.store(PARTIAL + pid.to(tl.int64) * N + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    if COMPUTE_DB:
        # The bias plane follows the weight plane when both are wanted.
        plane = pid.to(tl.int64) + (num_progs if COMPUTE_DW else 0)
        tl.store(PARTIAL + plane * N + cols, tl.sum(db_acc, axis=0), mask=col_mask)


@triton.jit
def _bwd_row_stats_kernel(
    DY, X, W, MEAN, RSTD, C1, C0,
    N,
    x_s1, x_st0, x_st1,
    dy_s1, dy_st0, dy_st1,
    offset, offset_lo,
    X_TWO_LEVEL: tl.constexpr,
    DY_TWO_LEVEL: tl.constexpr,
    CENTERED: tl.constexpr,
    HAS_W: tl.constexpr,
    W_OFFSET: tl.constexpr,
    SAVED_IS_OUTPUT: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    # Long rows, step 1: C1[r] = mean_j(g * xhat) = rstd * sum_j(g * (x - mean)) / N
    # and, centred, C0[r] = mean_j(g).  From a saved output, xhat is y / w and
    # rstd is not factored out.
    row = tl.program_id(0).to(tl.int64)
    x_row = X + _row_offsets(row, x_s1, x_st0, x_st1, X_TWO_LEVEL)
    dy_row = DY + _row_offsets(row, dy_s1, dy_st0, dy_st1, DY_TWO_LEVEL)
    cols = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=ACC)
    if CENTERED:
        mean = tl.load(MEAN + row).to(ACC)
        acc_g = tl.zeros([BLOCK_N], dtype=ACC)
    for start in tl.range(0, N, BLOCK_N, num_stages=NUM_STAGES):
        c = start + cols
        m = c < N
        x = tl.load(x_row + c, mask=m, other=0.0).to(ACC)
        g = tl.load(dy_row + c, mask=m, other=0.0).to(ACC)
        if SAVED_IS_OUTPUT:
            # g * xhat = dy * y: see _bwd_fused_kernel.
            acc += g * x
        else:
            if HAS_W:
                g = g * _load_weight(W, c, m, offset, offset_lo, W_OFFSET, False, ACC)
            if CENTERED:
                # Padding lanes have g = 0, so x - mean needs no masking.
                acc += g * (x - mean)
                acc_g += g
            else:
                acc += g * x
    if SAVED_IS_OUTPUT:
        tl.store(C1 + row, tl.sum(acc, axis=0) / N)
    else:
        rstd = tl.load(RSTD + row).to(ACC)
        tl.store(C1 + row, tl.sum(acc, axis=0) * rstd / N)
    if CENTERED:
        tl.store(C0 + row, tl.sum(acc_g, axis=0) / N)


@triton.jit
def _bwd_looped_kernel(
    DY, X, W, MEAN, RSTD, C1, C0, GRES, DX, DRES, PARTIAL,
    n_rows, N, rows_per_group,
    x_s1, x_st0, x_st1,
    dy_s1, dy_st0, dy_st1,
    gres_s1, gres_st0, gres_st1,
    offset, offset_lo,
    X_TWO_LEVEL: tl.constexpr,
    DY_TWO_LEVEL: tl.constexpr,
    GRES_TWO_LEVEL: tl.constexpr,
    CENTERED: tl.constexpr,
    HAS_W: tl.constexpr,
    W_OFFSET: tl.constexpr,
    SAVED_IS_OUTPUT: tl.constexpr,
    ADD_GRAD_RESIDUAL: tl.constexpr,
    STORE_GRAD_RESIDUAL: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    # Long rows, step 2: program (group, chunk) handles the contiguous block of
    # rows [group * rows_per_group, ...) restricted to one column chunk, and
    # writes that chunk of its group's partial rows.
    group = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_W:
        w = _load_weight(W, cols, col_mask, offset, offset_lo, W_OFFSET, SAVED_IS_OUTPUT, ACC)
    else:
        w = 1.0
    dw_acc = tl.zeros([BLOCK_N], dtype=ACC)
    db_acc = tl.zeros([BLOCK_N], dtype=ACC)

    row_start = group.to(tl.int64) * rows_per_group
    row_end = tl.minimum(row_start + rows_per_group, n_rows)
    for row in tl.range(row_start, row_end, num_stages=NUM_STAGES):
        x_off = _row_offsets(row, x_s1, x_st0, x_st1, X_TWO_LEVEL)
        dy_off = _row_offsets(row, dy_s1, dy_st0, dy_st1, DY_TWO_LEVEL)
        x = tl.load(X + x_off + cols, mask=col_mask, other=0.0).to(ACC)
        dy = tl.load(DY + dy_off + cols, mask=col_mask, other=0.0).to(ACC)
        rstd = tl.load(RSTD + row).to(ACC)
        c1 = tl.load(C1 + row)

        if CENTERED:
            mean = tl.load(MEAN + row).to(ACC)
        else:
            mean = 0.0
        xhat = _xhat(x, w, mean, rstd, CENTERED, HAS_W, SAVED_IS_OUTPUT)
        if HAS_W:
            g = dy * w
        else:
            g = dy
        if CENTERED:
            c0 = tl.load(C0 + row)
            dx = rstd * (g - c0 - xhat * c1)
        else:
            dx = rstd * (g - xhat * c1)
        if ADD_GRAD_RESIDUAL:
            gres_off = _row_offsets(row, gres_s1, gres_st0, gres_st1, GRES_TWO_LEVEL)
            dx += tl.load(GRES + gres_off + cols, mask=col_mask, other=0.0).to(ACC)
        tl.store(DX + row * N + cols, dx.to(DX.dtype.element_ty), mask=col_mask)
        if STORE_GRAD_RESIDUAL:
            tl.store(DRES + row * N + cols, dx.to(DRES.dtype.element_ty), mask=col_mask)
        if COMPUTE_DW:
            dw_acc += dy * xhat
        if COMPUTE_DB:
            db_acc += dy

    if COMPUTE_DW:
        tl.store(PARTIAL + group.to(tl.int64) * N + cols, dw_acc, mask=col_mask)
    if COMPUTE_DB:
        plane = group.to(tl.int64) + (tl.num_programs(0) if COMPUTE_DW else 0)
        tl.store(PARTIAL + plane * N + cols, db_acc, mask=col_mask)


@triton.jit
def _sum_partials_kernel(
    P, OUT0, OUT1,
    n_parts, N,
    TWO_OUTPUTS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # OUT[j] = sum_p P[p, j], in a fixed order (deterministic), cast to OUT's
    # dtype.  With two outputs, program_id(1) picks the plane of P and the
    # output (weight, then bias), so both sums take one launch.
    pid = tl.program_id(0)
    cols = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if TWO_OUTPUTS:
        which = tl.program_id(1)
        P = P + which.to(tl.int64) * n_parts * N
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=P.dtype.element_ty)
    for start in range(0, n_parts, BLOCK_P):
        parts = start + tl.arange(0, BLOCK_P)
        mask = (parts < n_parts)[:, None] & col_mask[None, :]
        acc += tl.load(P + parts.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, axis=0).to(OUT0.dtype.element_ty)
    if TWO_OUTPUTS:
        if which == 0:
            tl.store(OUT0 + cols, total, mask=col_mask)
        else:
            tl.store(OUT1 + cols, total, mask=col_mask)
    else:
        tl.store(OUT0 + cols, total, mask=col_mask)


# ---------------------------------------------------------------------------
# Host-side helpers
# ---------------------------------------------------------------------------

def bwd_stages(stage_bytes: int, shared_memory: int) -> int:
    """Pipelining stages of a backward loop whose step loads `stage_bytes` (a tile
    or chunk of every row input) on a GPU whose programs may use `shared_memory`
    bytes: _BWD_STAGES where they fit _BWD_STAGES_SHARE of it, else 1."""
    return _BWD_STAGES if _BWD_STAGES * stage_bytes <= _BWD_STAGES_SHARE * shared_memory else 1


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tl_acc(acc: torch.dtype) -> tl.dtype:
    return tl.float64 if acc == torch.float64 else tl.float32


@functools.lru_cache(maxsize=64)  # (a model passes the same few eps and offsets on every call)
def _split_scalar(value: float) -> tuple[float, float]:
    """Return fp32-representable (hi, lo) with hi + lo ~= value to ~48 bits
    (eps and offset reach the kernels as fp32 scalar arguments). Outside float32's
    range the pair cannot carry the value: below its smallest subnormal (1.4e-45) it
    arrives as 0, beyond 3.4e38 as inf; only a float64 call could notice, and no norm
    uses such an eps or offset."""
    try:
        hi = struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        hi = float("inf")
    if not math.isfinite(hi):  # |value| beyond fp32 range (or inf/nan): no low part
        return value, 0.0
    return hi, value - hi


def _num_warps(tile_elems: int) -> int:
    if tile_elems <= 1024:
        return 4
    if tile_elems <= 4096:
        return 8
    return 16


# Layout passed for an absent tensor's rows (its kernel flag is off, so it is
# never addressed).
_NO_ROWS = (1, 0, 0, False)


def _row_layout(t: Tensor) -> Optional[tuple[int, int, int, bool]]:
    """``(s1, st0, st1, two_level)``, the description of the row start offsets of
    ``t`` used by ``_row_offsets``, or None when the kernels cannot address ``t``'s
    rows as they are laid out."""
    n = t.size(-1)
    if t.is_contiguous():  # (what the loop below finds for it, without the loop's host time)
        return 1, 0, n, False
    if n > 1 and t.stride(-1) != 1:
        # Non-unit stride along the normalised dim: accesses would not coalesce.
        return None
    # Innermost first; size-1 dims do not affect addressing.
    dims = [(s, st) for s, st in zip(reversed(t.shape[:-1]), reversed(t.stride()[:-1])) if s != 1]
    merged: list[list[int]] = []
    for size, stride in dims:
        if merged and stride == merged[-1][0] * merged[-1][1]:
            merged[-1][0] *= size  # contiguous w.r.t. the inner dim: merge
        else:
            merged.append([size, stride])
    if len(merged) > 2:
        # Three or more independent leading strides: not worth 3+ level index
        # arithmetic in the kernels.
        return None
    if len(merged) == 2:
        (s1, st1), (_, st0) = merged
        return s1, st0, st1, True
    if len(merged) == 1:
        return 1, 0, merged[0][1], False
    return 1, 0, n, False  # a single row


def _collapse_rows(t: Tensor):
    """Describe ``t`` as rows of ``t.size(-1)`` unit-stride elements.

    Returns ``(t, s1, st0, st1, two_level)``: ``t``, or a contiguous copy of it
    when its layout cannot be addressed, and the description of its row start
    offsets used by ``_row_offsets``.
    """
    layout = _row_layout(t)
    if layout is None:
        t = t.contiguous()
        layout = (1, 0, t.size(-1), False)
    return (t, *layout)


def _param_arg(param: Optional[Tensor], dummy: Tensor) -> Tensor:
    # A dummy pointer is passed for a missing parameter; its HAS_* flag is False,
    # so it is never dereferenced.
    return dummy if param is None else param.contiguous()


def param_grad(input: Tensor, param: Optional[Tensor], wanted: bool) -> Tensor:
    """The gradient tensor of an affine parameter, uninitialised: ``(N,)`` in the
    parameter's dtype when ``param`` is given and ``wanted``, else an empty
    ``(0,)`` tensor in the parameter's dtype (input's without a parameter)."""
    if param is not None and wanted:
        return torch.empty((input.size(-1),), dtype=param.dtype, device=input.device)
    return input.new_empty((0,), dtype=param.dtype if param is not None else input.dtype)


# ---------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------

_launch_fwd_fused = Launcher(_fwd_fused_kernel)
_launch_fwd_looped = Launcher(_fwd_looped_kernel)
_launch_bwd_fused = Launcher(_bwd_fused_kernel)
_launch_bwd_row_stats = Launcher(_bwd_row_stats_kernel)
_launch_bwd_looped = Launcher(_bwd_looped_kernel)
_launch_sum_partials = Launcher(_sum_partials_kernel)


def forward(
    input: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    eps: float,
    centered: bool,
    *,
    offset: float = 0.0,
    cast_before_weight: bool = False,
    residual: Optional[Tensor] = None,
    residual_out: Optional[Tensor] = None,
) -> tuple[Tensor, Optional[Tensor], Tensor]:
    """``(output, mean, rstd)``; ``mean`` is None unless ``centered``.

    ``offset`` is added to the weight (it must be 0 without one).  With
    ``cast_before_weight``, xhat is rounded to input's dtype before the weight
    is applied.  With ``residual``, the row normalised is ``input + residual``,
    rounded to residual's dtype and written to ``residual_out`` (required then:
    residual's shape and dtype, any strides, possibly ``residual`` itself).
    """
    acc = _acc_dtype(input.dtype)
    n = input.size(-1)
    lead_shape = input.shape[:-1]
    device = input.device
    output = torch.empty(input.shape, dtype=input.dtype, device=device)
    n_rows = output.numel() // n if n > 0 else lead_shape.numel()

    if n_rows == 0:
        mean = torch.empty(lead_shape, dtype=acc, device=device) if centered else None
        return output, mean, torch.empty(lead_shape, dtype=acc, device=device)
    if n == 0:
        # An empty row has mean 0 and variance 0: rstd = 1/sqrt(eps).
        mean = torch.zeros(lead_shape, dtype=acc, device=device) if centered else None
        rstd = torch.full(lead_shape, float(eps), dtype=acc, device=device).rsqrt_()
        return output, mean, rstd

    rstd = torch.empty(lead_shape, dtype=acc, device=device)
    mean = torch.empty(lead_shape, dtype=acc, device=device) if centered else None
    # rstd doubles as the (never written) dummy for rms_norm's mean.
    mean_arg = rstd if mean is None else mean
    x, x_s1, x_st0, x_st1, x_two = _collapse_rows(input)
    has_residual = residual is not None
    if has_residual:
        r, *r_layout = _collapse_rows(residual)
        h = residual_out
        h_layout = _row_layout(residual_out)
        if h_layout is None:
            # residual_out's rows cannot be addressed where they are: write a
            # contiguous temporary and copy it over afterwards.
            h = torch.empty(residual_out.shape, dtype=residual_out.dtype, device=device)
            h_layout = (1, 0, n, False)
    else:
        # x doubles as the (never accessed) dummy for both.
        r, r_layout, h, h_layout = x, _NO_ROWS, x, _NO_ROWS
    w = _param_arg(weight, x)
    b = _param_arg(bias, x)
    eps_hi, eps_lo = _split_scalar(float(eps))
    offset_hi, offset_lo = _split_scalar(float(offset))
    flags = {
        "X_TWO_LEVEL": x_two,
        "R_TWO_LEVEL": r_layout[3],
        "H_TWO_LEVEL": h_layout[3],
        "CENTERED": centered,
        "HAS_RESIDUAL": has_residual,
        "HAS_W": weight is not None,
        "HAS_B": bias is not None,
        "W_OFFSET": weight is not None and offset != 0.0,
        # Rounding xhat to a dtype as wide as the accumulator, or just before
        # the output's own rounding, changes nothing: skip it then.
        "CAST_XHAT": cast_before_weight and (weight is not None or bias is not None) and input.dtype != acc,
        "ACC": _tl_acc(acc),
    }
    scale = 2 if acc == torch.float64 else 1
    block_n = next_power_of_2(n)

    tensors = (x, r, w, b, output, h, mean_arg, rstd)
    if block_n <= _FWD_FUSED_MAX_N // scale:
        block_m = max(1, min(_TILE_ELEMS // block_n, next_power_of_2(n_rows)))
        _launch_fwd_fused(
            (cdiv(n_rows, block_m),),
            tensors,
            (n_rows, n, x_s1, x_st0, x_st1, *r_layout[:3], *h_layout[:3], eps_hi, eps_lo, offset_hi, offset_lo),
            **flags,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=_num_warps(block_m * block_n),
        )
    else:
        block_n = _LOOP_BLOCK_N // scale
        _launch_fwd_looped(
            (n_rows,),
            tensors,
            (n, x_s1, x_st0, x_st1, *r_layout[:3], *h_layout[:3], eps_hi, eps_lo, offset_hi, offset_lo),
            **flags,
            BLOCK_N=block_n,
            num_warps=_num_warps(block_n),
        )
    if has_residual and h is not residual_out:
        residual_out.copy_(h)
    return output, mean, rstd


def backward(
    grad_output: Tensor,
    input: Tensor,
    weight: Optional[Tensor],
    mean: Optional[Tensor],
    rstd: Tensor,
    grad_weight: Optional[Tensor],
    grad_bias: Optional[Tensor],
    *,
    offset: float = 0.0,
    saved_is_output: bool = False,
    grad_residual_out: Optional[Tensor] = None,
    grad_residual: Optional[Tensor] = None,
) -> Tensor:
    """Returns ``grad_input`` (contiguous, in grad_output's dtype); fills
    ``grad_weight`` / ``grad_bias`` (``(N,)`` tensors from :func:`param_grad`, or
    None when not wanted).  The row is centred (layer_norm) when ``mean`` is given.

    ``input`` is the row the forward normalised (with a residual, residual_out)
    or, with ``saved_is_output`` (not centred), the forward's output.  ``offset``
    is the forward's.  ``grad_residual_out`` (input's shape, any strides) is
    added to the gradient; ``grad_residual``, a contiguous tensor of input's
    shape, receives that same gradient in its own dtype.
    """
    acc = _acc_dtype(input.dtype)
    n = input.size(-1)
    device = input.device
    centered = mean is not None
    compute_dw = grad_weight is not None
    compute_db = grad_bias is not None
    grad_input = torch.empty(input.shape, dtype=grad_output.dtype, device=device)
    n_rows = grad_input.numel() // n if n > 0 else input.shape[:-1].numel()

    if n_rows == 0 or n == 0:
        # Sums over no rows.
        if compute_dw:
            grad_weight.zero_()
        if compute_db:
            grad_bias.zero_()
        return grad_input

    x, x_s1, x_st0, x_st1, x_two = _collapse_rows(input)
    dy, dy_s1, dy_st0, dy_st1, dy_two = _collapse_rows(grad_output)
    if grad_residual_out is not None:
        gres, *gres_layout = _collapse_rows(grad_residual_out)
    else:
        gres, gres_layout = x, _NO_ROWS  # never read
    # grad_input doubles as the (never written) dummy.
    dres = grad_input if grad_residual is None else grad_residual
    # The kernels index the statistics by row: contiguous ones (what the forward returns, a view
    # then), or a copy of any other (a strided rstd passed to the backward op by hand).
    rstd_flat = rstd.reshape(-1).contiguous()
    # rstd_flat doubles as the (never read) dummy for rms_norm's mean.
    mean_flat = rstd_flat if mean is None else mean.reshape(-1).contiguous()
    w = _param_arg(weight, x)
    offset_hi, offset_lo = _split_scalar(float(offset))
    flags = {
        "X_TWO_LEVEL": x_two,
        "DY_TWO_LEVEL": dy_two,
        "CENTERED": centered,
        "HAS_W": weight is not None,
        "W_OFFSET": weight is not None and offset != 0.0,
        "SAVED_IS_OUTPUT": saved_is_output,
        "ACC": _tl_acc(acc),
    }
    step_flags = {
        "GRES_TWO_LEVEL": gres_layout[3],
        "ADD_GRAD_RESIDUAL": grad_residual_out is not None,
        "STORE_GRAD_RESIDUAL": grad_residual is not None,
        "COMPUTE_DW": compute_dw,
        "COMPUTE_DB": compute_db,
    }
    scale = 2 if acc == torch.float64 else 1
    block_n = next_power_of_2(n)
    sms = sm_count(device)
    n_grads = int(compute_dw) + int(compute_db)
    fused_max = (_BWD_FUSED_MAX_N_WITH_DB if compute_db else _BWD_FUSED_MAX_N) // scale

    strides = (x_s1, x_st0, x_st1, dy_s1, dy_st0, dy_st1)
    # Bytes of one element of every row input (x, grad_output, grad_residual_out).
    row_bytes = x.element_size() + dy.element_size()
    if grad_residual_out is not None:
        row_bytes += gres.element_size()
    if block_n <= fused_max:
        block_m = max(1, min(_BWD_TILE_ELEMS // scale // block_n, next_power_of_2(n_rows)))
        num_warps = _num_warps(block_m * block_n)
        n_tiles = cdiv(n_rows, block_m)
        num_progs = min(n_tiles, sms * max(1, _BWD_WARPS_PER_SM // num_warps))
        # rstd_flat doubles as the (never written) dummy without gradients.
        partial = torch.empty((n_grads, num_progs, n), dtype=acc, device=device) if n_grads else rstd_flat
        _launch_bwd_fused(
            (num_progs,),
            (dy, x, w, mean_flat, rstd_flat, gres, grad_input, dres, partial),
            (n_rows, n, *strides, *gres_layout[:3], offset_hi, offset_lo),
            **flags,
            **step_flags,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            NUM_STAGES=bwd_stages(block_m * block_n * row_bytes, shared_memory_per_block(device)),
            num_warps=num_warps,
        )
    else:
        block_n = _LOOP_BLOCK_N // scale
        num_warps = _num_warps(block_n)
        # (the row statistics' loop reads no grad_residual_out: the guard counts it anyway)
        loop_stages = bwd_stages(block_n * row_bytes, shared_memory_per_block(device))
        c1 = torch.empty((n_rows,), dtype=acc, device=device)
        c0 = torch.empty((n_rows,), dtype=acc, device=device) if centered else c1
        _launch_bwd_row_stats(
            (n_rows,),
            (dy, x, w, mean_flat, rstd_flat, c1, c0),
            (n, *strides, offset_hi, offset_lo),
            **flags,
            BLOCK_N=block_n,
            NUM_STAGES=loop_stages,
            num_warps=num_warps,
        )
        n_chunks = cdiv(n, block_n)
        target = sms * max(1, _BWD_WARPS_PER_SM // num_warps)
        n_groups = min(n_rows, max(1, target // n_chunks))
        rows_per_group = cdiv(n_rows, n_groups)
        n_groups = cdiv(n_rows, rows_per_group)  # no empty groups
        num_progs = n_groups
        partial = torch.empty((n_grads, n_groups, n), dtype=acc, device=device) if n_grads else rstd_flat
        _launch_bwd_looped(
            (n_groups, n_chunks),
            (dy, x, w, mean_flat, rstd_flat, c1, c0, gres, grad_input, dres, partial),
            (n_rows, n, rows_per_group, *strides, *gres_layout[:3], offset_hi, offset_lo),
            **flags,
            **step_flags,
            BLOCK_N=block_n,
            NUM_STAGES=loop_stages,
            num_warps=num_warps,
        )

    if n_grads:
        out0 = grad_weight if compute_dw else grad_bias
        out1 = grad_bias if compute_dw and compute_db else out0
        _launch_sum_partials(
            (cdiv(n, _REDUCE_BLOCK_N), n_grads),
            (partial, out0, out1),
            (num_progs, n),
            TWO_OUTPUTS=n_grads == 2,
            BLOCK_P=_REDUCE_BLOCK_P,
            BLOCK_N=_REDUCE_BLOCK_N,
            num_warps=4,
        )
    return grad_input
