"""Triton cross-entropy: the loss, each row's log-sum-exp and the gradient of the loss (the
forward), and the backward's scaling of that gradient by grad_output.

What is computed is stated in csrc/include/fusedops/cross_entropy.h; every backend agrees.

Launches of the forward:
1. one program over the targets, in order: the "mean" denominators (the weights of the rows
   not ignored, and their count) and the first target outside [0, V) that is not ignore_index;
2. one program per row: an online-softmax sweep over the row (maximum, sum of exp and, for
   label smoothing, the weighted sum of the logits' differences from the target's), then, when a
   gradient is wanted, a second sweep that reads the row again (mostly from L2) and writes the
   gradient; ignored rows write zeros without reading;
3. for "mean"/"sum", one program adding the per-row losses in row order (deterministic).
A bad target is never used as an index: its row counts with weight NaN.

Rows are addressed through at most two leading dimensions with their own strides (the shifted
logits[:, :-1] of a (B, T, V) tensor is read in place); more leading dimensions that do not
collapse into two are copied first.
"""

from __future__ import annotations

import os
import struct
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._launch import Launcher, cdiv, next_power_of_2

__all__ = ["forward", "scale", "slice_stats", "slice_grad"]

# The interpreter (tests on a machine without a GPU) runs a block as numpy arrays: a small block
# there takes the multi-block loops on the small shapes those tests can afford.
_MAX_BLOCK = 64 if os.environ.get("TRITON_INTERPRET") == "1" else 4096


@triton.jit
def _targets_kernel(target_ptr, weight_ptr, stats_ptr, bad_ptr, R, V, ignore_index,
                    HAS_WEIGHT: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr, W_BLOCK: tl.constexpr):
    # stats: (sum of w_t over rows not ignored, their count, sum of all class weights).
    dw = tl.zeros([BLOCK], ACC)
    dn = tl.zeros([BLOCK], ACC)
    first = tl.full([BLOCK], 0, tl.int64) + R
    for start in range(0, R, BLOCK):
        offs = start + tl.arange(0, BLOCK).to(tl.int64)
        mask = offs < R
        t = tl.load(target_ptr + offs, mask=mask, other=ignore_index).to(tl.int64)
        valid = (t >= 0) & (t < V)
        counted = mask & (t != ignore_index)
        bad = counted & ~valid
        if HAS_WEIGHT:
            w = tl.load(weight_ptr + tl.where(valid, t, 0), mask=counted & valid, other=0.0).to(ACC)
        else:
            w = tl.full([BLOCK], 1.0, ACC)
        w = tl.where(bad, float("nan"), w)
        dw += tl.where(counted, w, 0.0)
        dn += tl.where(counted, 1.0, 0.0)
        first = tl.minimum(first, tl.where(bad, offs, R))
    ws = tl.zeros([W_BLOCK], ACC)
    if HAS_WEIGHT:
        for start in range(0, V, W_BLOCK):
            offs = start + tl.arange(0, W_BLOCK)
            ws += tl.load(weight_ptr + offs, mask=offs < V, other=0.0).to(ACC)
    tl.store(stats_ptr, tl.sum(dw, 0))
    tl.store(stats_ptr + 1, tl.sum(dn, 0))
    tl.store(stats_ptr + 2, tl.sum(ws, 0))
    f = tl.min(first, 0)
    tl.store(bad_ptr, tl.where(f == R, -1, f))


@triton.jit
def _softcapped(v, cap, SOFTCAP: tl.constexpr):
    if SOFTCAP:
        # tanh from exp, odd-symmetric so that large |v| saturates without overflow.
        u = v / cap
        e = tl.exp(-2.0 * tl.abs(u))
        th = (1.0 - e) / (1.0 + e)
        v = cap * tl.where(u < 0, -th, th)
    return v


@triton.jit
def _row_kernel(
    x_ptr, target_ptr, weight_ptr, stats_ptr, lse_ptr, rowloss_ptr, grad_ptr,
    T1, xs0, xs1, G1, gs0, gs1, V, ignore_index,
    eps, eps_lo, z, z_lo, cap, cap_lo,
    MEAN: tl.constexpr, HAS_WEIGHT: tl.constexpr, SOFTCAP: tl.constexpr, SMOOTH: tl.constexpr,
    GRAD: tl.constexpr,
    ACC: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    # Float arguments arrive as float32: each option comes as a float32 pair (value, rest),
    # whose sum is the double to about 48 bits, for the float64 kernels.
    eps = tl.cast(eps, ACC) + tl.cast(eps_lo, ACC)
    z = tl.cast(z, ACC) + tl.cast(z_lo, ACC)
    cap = tl.cast(cap, ACC) + tl.cast(cap_lo, ACC)
    b = row // T1
    x_row = x_ptr + b * xs0 + (row - b * T1) * xs1
    bg = row // G1
    g_row = grad_ptr + bg * gs0 + (row - bg * G1) * gs1
    t = tl.load(target_ptr + row).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if t == ignore_index:
        tl.store(lse_ptr + row, 0.0)
        tl.store(rowloss_ptr + row, 0.0)
        if GRAD:
            for start in range(0, V, BLOCK):
                c = start + cols
                tl.store(g_row + c, tl.zeros([BLOCK], ACC).to(grad_ptr.dtype.element_ty), mask=c < V)
    else:
        valid = (t >= 0) & (t < V)
        ts = tl.where(valid, t, 0)
        m = tl.full([BLOCK], float("-inf"), ACC)
        s = tl.zeros([BLOCK], ACC)
        xt = _softcapped(tl.load(x_row + ts).to(ACC), cap, SOFTCAP)
        # Label smoothing's sum of w_j x_j is kept relative to c = shift, the target's logit (one
        # of the row's own values, 0 if it is not finite): sum of w_j (x_j - c). A plain sum of w_j x_j
        # loses float32's precision for logits far from 0 (at 1e7 its spacing is 512, where the
        # loss wants W lse - sum w_j x_j to 1e-6); differences from a value of the row do not,
        # and cost one subtraction a value, where keeping the sum relative to a moving maximum
        # cost a rebase of every lane at every step.
        shift = tl.where(tl.abs(xt) < float("inf"), xt, 0.0)
        wx = tl.zeros([BLOCK], ACC)
        for start in range(0, V, BLOCK):
            cc = start + cols
            mask = cc < V
            v = _softcapped(tl.load(x_row + cc, mask=mask, other=0.0).to(ACC), cap, SOFTCAP)
            v_m = tl.where(mask, v, float("-inf"))
            m_new = tl.maximum(m, v_m)
            # Lanes still at -inf (no element yet) keep a zero sum: exp(-inf - -inf) is NaN. A NaN
            # logit, which the maximum may skip, still makes the sum NaN, as torch's loss.
            alpha = tl.where(m == m_new, 1.0, tl.exp(m - m_new))
            s = s * alpha + tl.where(v_m == float("-inf"), 0.0, tl.exp(v_m - m_new))
            if SMOOTH:
                if HAS_WEIGHT:
                    w = tl.load(weight_ptr + cc, mask=mask, other=0.0).to(ACC)
                    wx += tl.where(mask, w * (v - shift), 0.0)
                else:
                    wx += tl.where(mask, v - shift, 0.0)
            m = m_new
        mx = tl.max(m, 0)
        scale = tl.where(m == float("-inf"), 0.0, tl.exp(m - mx))
        sum_s = tl.sum(s * scale, 0)
        # lse - x_t and W lse - sum w_j x_j are formed from differences to the maximum (ls = lse -
        # max), never from lse once rounded: float32's spacing at 1e4 is 1e-3.
        ls = tl.log(sum_s)
        lse = mx + ls
        if HAS_WEIGHT:
            wt = tl.load(weight_ptr + ts).to(ACC)
            w_sum = tl.load(stats_ptr + 2)
        else:
            wt = tl.full([], 1.0, ACC)
            w_sum = tl.full([], 1.0, ACC) * V
        wt = tl.where(valid, wt, float("nan"))
        inv_v = 1.0 / (V + tl.zeros([], ACC))  # (V == 1 arrives as a constant, not a tensor)
        ce = (1.0 - eps) * wt * (ls - (xt - mx))
        if SMOOTH:
            # W lse - sum w_j x_j = W ls + below, below = sum w_j (mx - x_j) = W (mx - c) - sum
            # w_j (x_j - c): the smoothing term, +inf where a logit is -inf (as torch's).
            below = w_sum * (mx - shift) - tl.sum(wx, 0)
            # Where the target's logit lies far below the row (masked: -1e30 leaves every x_j - c
            # near 1e30, whose roundings outweigh the term, or overflow at float32's lowest
            # value), the two sums cancel: such rows, and rows whose sum is not finite, read the
            # row once more and sum the differences from the maximum itself (never negative).
            if (tl.abs(w_sum * (mx - shift)) > 8.0 * below) | (below != below) | (below == float("inf")):
                acc = tl.zeros([BLOCK], ACC)
                for start in range(0, V, BLOCK):
                    cc = start + cols
                    mask = cc < V
                    v = _softcapped(tl.load(x_row + cc, mask=mask, other=0.0).to(ACC), cap, SOFTCAP)
                    d = tl.where(v == float("-inf"), float("inf"), mx - v)
                    if HAS_WEIGHT:
                        d *= tl.load(weight_ptr + cc, mask=mask, other=0.0).to(ACC)
                    acc += tl.where(mask, d, 0.0)
                below = tl.sum(acc, 0)
            ce += eps * inv_v * (w_sum * ls + below)
        zl = z * lse * lse
        if MEAN:
            # (kept targets whose weights add up to 0: 0 / 0 as torch's, NaN even with smoothing)
            dw = tl.load(stats_ptr).to(ACC)
            sw = tl.where(dw != 0.0, 1.0 / dw, float("nan"))
            sn = 1.0 / tl.load(stats_ptr + 1).to(ACC)
        else:
            sw = tl.full([], 1.0, ACC)
            sn = tl.full([], 1.0, ACC)
        tl.store(lse_ptr + row, lse)
        tl.store(rowloss_ptr + row, ce * sw + zl * sn)
        if GRAD:
            # In place the gradient overwrites the row, the target's logit included: every
            # thread's reads above come before any store below.
            tl.debug_barrier()
            # (w_sum only when smoothing: an inf weight for a class no row targets must not
            # reach the gradient)
            if SMOOTH:
                cp = ((1.0 - eps) * wt + eps * w_sum * inv_v) * sw + 2.0 * z * lse * sn
            else:
                cp = (1.0 - eps) * wt * sw + 2.0 * z * lse * sn
            scale_row = cp / sum_s
            ct = (1.0 - eps) * wt * sw
            cw = eps * inv_v * sw
            for start in range(0, V, BLOCK):
                c = start + cols
                mask = c < V
                v = _softcapped(tl.load(x_row + c, mask=mask, other=0.0).to(ACC), cap, SOFTCAP)
                d = tl.exp(v - mx) * scale_row
                if SMOOTH:  # (cw = 0 without: 0 * an inf weight would be NaN)
                    if HAS_WEIGHT:
                        d -= cw * tl.load(weight_ptr + c, mask=mask, other=0.0).to(ACC)
                    else:
                        d -= cw
                d -= tl.where(c == t, ct, 0.0)
                if SOFTCAP:
                    u = v / cap
                    d *= 1.0 - u * u
                tl.store(g_row + c, d.to(grad_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_kernel(rowloss_ptr, stats_ptr, loss_ptr, R, MEAN: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], ACC)
    for start in range(0, R, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(rowloss_ptr + offs, mask=offs < R, other=0.0)
    total = tl.sum(acc, 0)
    if MEAN:
        # Every row ignored: 0 / 0, as torch.
        total = tl.where(tl.load(stats_ptr + 1) == 0, float("nan"), total)
    tl.store(loss_ptr, total)


@triton.jit
def _scale_row(g_ptr, out_ptr, row, k, T1, gs0, gs1, O1, os0, os1, V, ACC: tl.constexpr, BLOCK: tl.constexpr):
    b = row // T1
    bo = row // O1
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < V
    g = tl.load(g_ptr + b * gs0 + (row - b * T1) * gs1 + c, mask=mask, other=0.0).to(ACC)
    tl.store(out_ptr + bo * os0 + (row - bo * O1) * os1 + c, (g * k).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scale_kernel(g_ptr, out_ptr, go_ptr, T1, gs0, gs1, O1, os0, os1, V,
                  PER_ROW: tl.constexpr, IN_PLACE: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if PER_ROW:
        k = tl.load(go_ptr + row).to(ACC)
    else:
        k = tl.load(go_ptr).to(ACC)
    if IN_PLACE:
        # A scale of exactly 1 leaves the row as it is (loss.backward() passes 1).
        if k != 1.0:
            _scale_row(g_ptr, out_ptr, row, k, T1, gs0, gs1, O1, os0, os1, V, ACC, BLOCK)
    else:
        _scale_row(g_ptr, out_ptr, row, k, T1, gs0, gs1, O1, os0, os1, V, ACC, BLOCK)


@triton.jit
def _slice_stats_kernel(x_ptr, target_ptr, weight_ptr, stats_ptr, xs, S, class_start, ignore_index, cap,
                        cap_lo, HAS_WEIGHT: tl.constexpr, SOFTCAP: tl.constexpr, SMOOTH: tl.constexpr,
                        ACC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cap = tl.cast(cap, ACC) + tl.cast(cap_lo, ACC)  # (as _row_kernel's options)
    t = tl.load(target_ptr + row).to(tl.int64)
    if t != ignore_index:
        x_row = x_ptr + row * xs
        cols = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), ACC)
        s = tl.zeros([BLOCK], ACC)
        wx = tl.zeros([BLOCK], ACC)
        for start in range(0, S, BLOCK):
            c = start + cols
            mask = c < S
            v = _softcapped(tl.load(x_row + c, mask=mask, other=0.0).to(ACC), cap, SOFTCAP)
            v_m = tl.where(mask, v, float("-inf"))
            m_new = tl.maximum(m, v_m)
            alpha = tl.where(m == m_new, 1.0, tl.exp(m - m_new))
            s = s * alpha + tl.where(v_m == float("-inf"), 0.0, tl.exp(v_m - m_new))  # (as _row_kernel's)
            m = m_new
            if SMOOTH:
                if HAS_WEIGHT:
                    w = tl.load(weight_ptr + class_start + c, mask=mask, other=0.0).to(ACC)
                    wx += tl.where(mask, w * v, 0.0)
                else:
                    wx += tl.where(mask, v, 0.0)
        mb = tl.max(m, 0)
        sb = tl.sum(s * tl.where(m == float("-inf"), 0.0, tl.exp(m - mb)), 0)
        # Merged into the row's running values (the slices of a row come one launch after another).
        r = stats_ptr + 4 * row
        m0 = tl.load(r).to(ACC)
        s0 = tl.load(r + 1).to(ACC)
        mx = tl.maximum(m0, mb)
        # (a sum of -inf logits is 0, one with a NaN NaN: the factors are 0 then, the sums kept)
        s0 = s0 * tl.where(m0 == float("-inf"), 0.0, tl.exp(m0 - mx))
        sb = sb * tl.where(mb == float("-inf"), 0.0, tl.exp(mb - mx))
        tl.store(r, mx)
        tl.store(r + 1, s0 + sb)
        if SMOOTH:
            tl.store(r + 2, tl.load(r + 2) + tl.sum(wx, 0))
        local = t - class_start
        if (local >= 0) & (local < S):
            tl.store(r + 3, _softcapped(tl.load(x_row + local).to(ACC), cap, SOFTCAP))


@triton.jit
def _slice_grad_kernel(x_ptr, target_ptr, weight_ptr, coefs_ptr, xs, S, class_start, ignore_index, cap,
                       cap_lo, HAS_WEIGHT: tl.constexpr, SOFTCAP: tl.constexpr, SMOOTH: tl.constexpr,
                       ACC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < S
    x_row = x_ptr + row * xs
    cap = tl.cast(cap, ACC) + tl.cast(cap_lo, ACC)
    t = tl.load(target_ptr + row).to(tl.int64)
    if t == ignore_index:
        tl.store(x_row + c, tl.zeros([BLOCK], ACC).to(x_ptr.dtype.element_ty), mask=mask)
    else:
        k = coefs_ptr + 4 * row
        base = tl.load(k).to(ACC)
        scale = tl.load(k + 1).to(ACC)
        ct = tl.load(k + 2).to(ACC)
        v = _softcapped(tl.load(x_row + c, mask=mask, other=0.0).to(ACC), cap, SOFTCAP)
        d = tl.exp(v - base) * scale
        if SMOOTH:
            cw = tl.load(k + 3).to(ACC)
            if HAS_WEIGHT:
                d -= cw * tl.load(weight_ptr + class_start + c, mask=mask, other=0.0).to(ACC)
            else:
                d -= cw
        d -= tl.where(c + class_start == t, ct, 0.0)
        if SOFTCAP:
            u = v / cap
            d *= 1.0 - u * u
        tl.store(x_row + c, d.to(x_ptr.dtype.element_ty), mask=mask)


_launch_targets = Launcher(_targets_kernel)
_launch_row = Launcher(_row_kernel)
_launch_sum = Launcher(_sum_kernel)
_launch_scale = Launcher(_scale_kernel)
_launch_slice_stats = Launcher(_slice_stats_kernel)
_launch_slice_grad = Launcher(_slice_grad_kernel)


def _two_level_rows(t: Tensor):
    """(T1, stride0, stride1) addressing t's rows as row = b * T1 + tt, or None when its leading
    dimensions do not collapse into two (fusedops/rows.h's rule: size-1 dims dropped,
    neighbours that are contiguous with each other merged)."""
    dims = []
    for size, stride in zip(t.shape[:-1], t.stride()[:-1]):
        if size == 1:
            continue
        if dims and dims[-1][1] == stride * size:
            dims[-1] = (dims[-1][0] * size, stride)
        else:
            dims.append((size, stride))
    if len(dims) > 2:
        return None
    if not dims:
        return 1, 0, 0
    if len(dims) == 1:
        return dims[0][0], 0, dims[0][1]
    return dims[1][0], dims[0][1], dims[1][1]


def _split(v: float):
    """v as a float32 value and the float32 rounding of what is left."""
    hi = _to_f32(v)
    return hi, _to_f32(v - hi)


def _to_f32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]


def _block(V: int) -> int:
    return min(next_power_of_2(max(V, 1)), _MAX_BLOCK)


def forward(logits: Tensor, target: Tensor, weight: Optional[Tensor], ignore_index: int, reduction: str,
            label_smoothing: float, z_loss: float, softcap: Optional[float], loss: Tensor, lse: Tensor,
            grad: Optional[Tensor], bad: Tensor) -> None:
    """Fills loss, lse, bad (and grad: a new contiguous tensor, or the logits themselves in
    place) as csrc/include/fusedops/cross_entropy.h states."""
    V = logits.shape[-1]
    R = target.numel()
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    tl_acc = tl.float64 if acc == torch.float64 else tl.float32
    in_place = grad is not None and grad.data_ptr() == logits.data_ptr() and grad.shape == logits.shape
    x = logits if V == 1 or logits.stride(-1) == 1 else logits.contiguous()
    rows = _two_level_rows(x)
    if rows is None:
        x = x.contiguous()
        rows = _two_level_rows(x)
    target = target.contiguous()
    weight = weight.contiguous() if weight is not None else None
    stats = torch.empty(3, dtype=acc, device=logits.device)
    if R == 0:
        bad.fill_(-1)
        loss.fill_(float("nan") if reduction == "mean" else 0.0)
        return
    block_t = min(next_power_of_2(R), 1024)
    _launch_targets((1,), (target, weight if weight is not None else stats, stats, bad), (R, V, ignore_index),
                    HAS_WEIGHT=weight is not None, ACC=tl_acc, BLOCK=block_t, W_BLOCK=min(next_power_of_2(V), 1024))
    g = grad
    if g is not None and in_place and x.data_ptr() != logits.data_ptr():
        g = x  # written into the copy the kernel reads, copied back below
    g_rows = _two_level_rows(g) if g is not None else (1, 0, 0)
    rowloss = loss if reduction == "none" else torch.empty(R, dtype=acc, device=logits.device)
    _launch_row(
        (R,),
        (x, target, weight if weight is not None else stats, stats, lse, rowloss, g if g is not None else stats),
        (
            rows[0], rows[1], rows[2], g_rows[0], g_rows[1], g_rows[2], V, ignore_index,
            *_split(label_smoothing), *_split(z_loss), *_split(softcap or 1.0),
        ),
        MEAN=reduction == "mean", HAS_WEIGHT=weight is not None, SOFTCAP=softcap is not None,
        SMOOTH=label_smoothing > 0, GRAD=g is not None, ACC=tl_acc, BLOCK=_block(V),
        num_warps=8 if V >= 4096 else 4,
    )
    if reduction != "none":
        _launch_sum((1,), (rowloss, stats, loss), (R,), MEAN=reduction == "mean", ACC=tl_acc,
                    BLOCK=min(next_power_of_2(R), 1024))
    if g is not None and g.data_ptr() != grad.data_ptr():
        grad.copy_(g)


def scale(grad_output: Tensor, grad: Tensor, out: Tensor, in_place: bool) -> None:
    """out = grad * grad_output (one scale, or one per row); in place, rows whose scale is 1 are
    not touched."""
    V = grad.shape[-1]
    R = grad.numel() // V if V else 0
    if R == 0 or V == 0:
        return
    acc = torch.float64 if grad.dtype == torch.float64 else torch.float32
    g = grad if V == 1 or grad.stride(-1) == 1 else grad.contiguous()
    rows = _two_level_rows(g)
    if rows is None:
        g = g.contiguous()
        rows = _two_level_rows(g)
    target = out if not in_place or g.data_ptr() == out.data_ptr() else g
    o_rows = _two_level_rows(target)
    go = grad_output.contiguous()
    block = _block(V)
    _launch_scale(
        (R, cdiv(V, block)), (g, target, go), (rows[0], rows[1], rows[2], o_rows[0], o_rows[1], o_rows[2], V),
        PER_ROW=grad_output.dim() > 0, IN_PLACE=in_place,
        ACC=tl.float64 if acc == torch.float64 else tl.float32, BLOCK=block,
    )
    if target is not out:
        out.copy_(target)


def _slice(launch, logits: Tensor, target: Tensor, weight: Optional[Tensor], class_start: int,
           ignore_index: int, softcap: Optional[float], smoothing: bool, state: Tensor,
           grid_columns: bool) -> None:
    R, S = logits.shape
    if R == 0 or S == 0:
        return
    acc = tl.float64 if logits.dtype == torch.float64 else tl.float32
    target = target.contiguous()
    weight = weight.contiguous() if weight is not None else None
    block = _block(S)
    grid = (R, cdiv(S, block)) if grid_columns else (R,)
    launch(grid, (logits, target, weight if weight is not None else state, state),
           (logits.stride(0), S, class_start, ignore_index, *_split(softcap or 1.0)), HAS_WEIGHT=weight is not None,
           SOFTCAP=softcap is not None, SMOOTH=smoothing, ACC=acc, BLOCK=block)


def slice_stats(logits: Tensor, target: Tensor, weight: Optional[Tensor], class_start: int, ignore_index: int,
                softcap: Optional[float], smoothing: bool, stats: Tensor) -> None:
    """Merges the slice of classes [class_start, class_start + S) held by logits (R, S) into each
    row's running statistics (R, 4), as csrc/include/fusedops/cross_entropy.h states."""
    _slice(_launch_slice_stats, logits, target, weight, class_start, ignore_index, softcap, smoothing, stats,
           False)


def slice_grad(logits: Tensor, target: Tensor, weight: Optional[Tensor], class_start: int, ignore_index: int,
               softcap: Optional[float], smoothing: bool, coefs: Tensor) -> None:
    """Overwrites the slice logits (R, S) with its gradient from each row's (base, scale, ct, cw)."""
    _slice(_launch_slice_grad, logits, target, weight, class_start, ignore_index, softcap, smoothing, coefs,
           True)
