"""Triton rotary position embeddings: the forward rotation and its transpose (the backward),
for q and k in one launch.

What is computed (the same as csrc/include/fusedops/rope.h): q (B, Hq, S, D) and k (B, Hk, S, D)
with any strides (last dimension unit stride); R = cos.size(-1), h = R / 2. For each row x at
(b, s), with c, n the cos/sin row of (b, s) (or of position_ids[b, s] in (P, R) tables):

    rotate-half   y[j]     = x[j] * c[j]         - x[j + h] * n[j]          j < h
                  y[j + h] = x[j + h] * c[j + h] + x[j] * n[j + h]
    interleaved   y[2i]    = x[2i] * c[2i]       - x[2i + 1] * n[2i]
                  y[2i+1]  = x[2i+1] * c[2i+1]   + x[2i] * n[2i+1]
    y[j] = x[j] for R <= j < D (written only when the output is not the input)

and the backward the transpose (n[j] and the sign exchanged between partners). The signed sines
are formed once per position tile, so both directions share one loop body.

Launch: one program per tile of BLOCK_P positions (and, when that leaves the GPU short of
programs, per group of heads); the program loads its tile of cos/sin once and walks every
head of q and then of k for those positions, so cos/sin are read once per launch. A position
outside [0, P) never reads out of bounds: its rotated features come out NaN (the public
function checks positions before launching in eager mode; see docs/ops/rope.md).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._norm import _device_guard, _sm_count

__all__ = ["rope"]


@triton.jit
def _rotate_heads(
    x_ptr, y_ptr, h_begin, h_end,
    xsb, xsh, xss, ysb, ysh, yss,
    b, s, mask_p, j, mask_j, c_a, c_b, s_a, s_b,
    HALF, REST,
    INTERLEAVED: tl.constexpr, COPY_REST: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_REST: tl.constexpr,
    BLOCK_P: tl.constexpr, ACC: tl.constexpr,
):
    mask = mask_p[:, None] & mask_j[None, :]
    for h in range(h_begin, h_end):
        h64 = tl.full([], 0, tl.int64) + h  # (head * head stride passes 2**31 in large tensors)
        x_row = x_ptr + (b * xsb + h64 * xsh + s * xss)[:, None]
        y_row = y_ptr + (b * ysb + h64 * ysh + s * yss)[:, None]
        if INTERLEAVED:
            # Pairs are adjacent: load the rotary part whole and split it into even and odd.
            jj = tl.arange(0, 2 * BLOCK_H)
            mask2 = mask_p[:, None] & (jj < 2 * HALF)[None, :]
            x = tl.load(x_row + jj[None, :], mask=mask2, other=0.0).to(ACC)
            x_a, x_b = tl.split(tl.reshape(x, (BLOCK_P, BLOCK_H, 2)))
            y_a = x_a * c_a + x_b * s_a
            y_b = x_b * c_b + x_a * s_b
            y = tl.reshape(tl.join(y_a, y_b), (BLOCK_P, 2 * BLOCK_H))
            tl.store(y_row + jj[None, :], y.to(y_ptr.dtype.element_ty), mask=mask2)
        else:
            x_a = tl.load(x_row + j[None, :], mask=mask, other=0.0).to(ACC)
            x_b = tl.load(x_row + HALF + j[None, :], mask=mask, other=0.0).to(ACC)
            y_a = x_a * c_a + x_b * s_a
            y_b = x_b * c_b + x_a * s_b
            tl.store(y_row + j[None, :], y_a.to(y_ptr.dtype.element_ty), mask=mask)
            tl.store(y_row + HALF + j[None, :], y_b.to(y_ptr.dtype.element_ty), mask=mask)
        if COPY_REST:
            for r0 in range(0, REST, BLOCK_REST):
                r = 2 * HALF + r0 + tl.arange(0, BLOCK_REST)
                mask_r = mask_p[:, None] & (r < 2 * HALF + REST)[None, :]
                v = tl.load(x_row + r[None, :], mask=mask_r)
                tl.store(y_row + r[None, :], v, mask=mask_r)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, pos_ptr,
    n_pos, S, Hq, Hk, P, heads_per_program,
    qsb, qsh, qss, ksb, ksh, kss,
    qosb, qosh, qoss, kosb, kosh, koss,
    cos_b, cos_s, sin_b, sin_s, pos_b, pos_s,
    HALF, REST,
    INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr, HAS_POS: tl.constexpr, COPY_REST: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_REST: tl.constexpr, ACC: tl.constexpr,
):
    tile = tl.program_id(0)
    group = tl.program_id(1)
    p = tile.to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_p = p < n_pos
    b = p // S
    s = p % S
    if HAS_POS:
        row = tl.load(pos_ptr + b * pos_b + s * pos_s, mask=mask_p, other=0).to(tl.int64)
        valid = (row >= 0) & (row < P)
        row = tl.where(valid, row, 0)
        cos_off = row * cos_s
        sin_off = row * sin_s
    else:
        cos_off = b * cos_b + s * cos_s
        sin_off = b * sin_b + s * sin_s
    j = tl.arange(0, BLOCK_H)
    mask_j = j < HALF
    mask = mask_p[:, None] & mask_j[None, :]
    # Element a of each pair is the first half (or the even element), b its partner. The
    # cosines and signed sines: y_a = x_a*c_a + x_b*s_a, y_b = x_b*c_b + x_a*s_b.
    if INTERLEAVED:
        ia = 2 * j
        ib = 2 * j + 1
    else:
        ia = j
        ib = HALF + j
    c_a = tl.load(cos_ptr + cos_off[:, None] + ia[None, :], mask=mask, other=0.0).to(ACC)
    c_b = tl.load(cos_ptr + cos_off[:, None] + ib[None, :], mask=mask, other=0.0).to(ACC)
    n_a = tl.load(sin_ptr + sin_off[:, None] + ia[None, :], mask=mask, other=0.0).to(ACC)
    n_b = tl.load(sin_ptr + sin_off[:, None] + ib[None, :], mask=mask, other=0.0).to(ACC)
    if BACKWARD:
        s_a = n_b
        s_b = -n_a
    else:
        s_a = -n_a
        s_b = n_b
    if HAS_POS:
        # Out-of-range positions: NaN rather than an out-of-bounds read.
        c_a = tl.where(valid[:, None], c_a, float("nan"))
        c_b = tl.where(valid[:, None], c_b, float("nan"))
    H = Hq + Hk
    h_begin = group * heads_per_program
    h_end = tl.minimum(h_begin + heads_per_program, H)
    _rotate_heads(
        q_ptr, qo_ptr, tl.minimum(h_begin, Hq), tl.minimum(h_end, Hq),
        qsb, qsh, qss, qosb, qosh, qoss,
        b, s, mask_p, j, mask_j, c_a, c_b, s_a, s_b, HALF, REST,
        INTERLEAVED, COPY_REST, BLOCK_H, BLOCK_REST, BLOCK_P, ACC,
    )
    _rotate_heads(
        k_ptr, ko_ptr, tl.maximum(h_begin, Hq) - Hq, tl.maximum(h_end, Hq) - Hq,
        ksb, ksh, kss, kosb, kosh, koss,
        b, s, mask_p, j, mask_j, c_a, c_b, s_a, s_b, HALF, REST,
        INTERLEAVED, COPY_REST, BLOCK_H, BLOCK_REST, BLOCK_P, ACC,
    )


def _strides(t: Optional[Tensor]):
    return (t.stride(0), t.stride(1), t.stride(2)) if t is not None else (0, 0, 0)


def _unit_last(t: Optional[Tensor]) -> Optional[Tensor]:
    if t is None or t.shape[-1] <= 1 or t.stride(-1) == 1:
        return t
    return t.contiguous()


# Tile of positions x rotary pairs a program holds (elements of each of its four cos/sin tiles).
_TILE = 2048


def rope(
    q: Optional[Tensor],
    k: Optional[Tensor],
    cos: Tensor,
    sin: Tensor,
    position_ids: Optional[Tensor],
    interleaved: bool,
    backward: bool,
    q_out: Optional[Tensor],
    k_out: Optional[Tensor],
) -> None:
    """Writes the rotation (or with ``backward`` its transpose) of q and k into q_out and k_out
    (new tensors of their shapes, any strides with a unit last stride, or q and k themselves).
    q or k may be None (no heads). The arguments have been checked (ops/rope.py)."""
    ref = q if q is not None else k
    B, S, D = ref.shape[0], ref.shape[2], ref.shape[3]
    Hq = q.shape[1] if q is not None else 0
    Hk = k.shape[1] if k is not None else 0
    if B * S * (Hq + Hk) * D == 0:
        return
    R = cos.shape[-1]
    in_place = q_out is q and k_out is k
    # Kernels need a unit-stride last dimension; others go through contiguous copies.
    qx, kx = _unit_last(q), _unit_last(k)
    qy = qx if in_place else _unit_last(q_out)
    ky = kx if in_place else _unit_last(k_out)
    cos, sin = _unit_last(cos), _unit_last(sin)
    dummy = cos
    if position_ids is not None:
        pos = position_ids
        pos_b = 0 if pos.shape[0] == 1 else pos.stride(0)
        pos_s = pos.stride(1)
        P = cos.shape[0]
        cos_b, cos_s, sin_b, sin_s = 0, cos.stride(0), 0, sin.stride(0)
    else:
        pos, pos_b, pos_s, P = dummy, 0, 0, 0
        cos_b = 0 if cos.shape[0] == 1 else cos.stride(0)
        sin_b = 0 if sin.shape[0] == 1 else sin.stride(0)
        cos_s, sin_s = cos.stride(1), sin.stride(1)
    half = R // 2
    block_h = triton.next_power_of_2(max(half, 1))
    n_pos = B * S
    block_p = max(1, min(_TILE // block_h, triton.next_power_of_2(n_pos)))
    tiles = triton.cdiv(n_pos, block_p)
    heads = Hq + Hk
    # Few tiles (decode): split the heads over programs so that every SM has work.
    want = 4 * _sm_count(ref.device)
    groups = min(heads, max(1, triton.cdiv(want, tiles)))
    per_program = triton.cdiv(heads, groups)
    groups = triton.cdiv(heads, per_program)
    rest = D - R
    block_rest = min(triton.next_power_of_2(max(rest, 1)), 128)
    acc = tl.float64 if ref.dtype == torch.float64 else tl.float32
    with _device_guard(ref.device):
        _rope_kernel[(tiles, groups)](
            qx if qx is not None else dummy, kx if kx is not None else dummy,
            qy if qy is not None else dummy, ky if ky is not None else dummy,
            cos, sin, pos,
            n_pos, S, Hq, Hk, P, per_program,
            *_strides(qx), *_strides(kx), *_strides(qy), *_strides(ky),
            cos_b, cos_s, sin_b, sin_s, pos_b, pos_s,
            half, rest,
            INTERLEAVED=bool(interleaved), BACKWARD=bool(backward), HAS_POS=position_ids is not None,
            COPY_REST=not in_place and rest > 0,
            BLOCK_P=block_p, BLOCK_H=block_h, BLOCK_REST=block_rest, ACC=acc,
            num_warps=4,
        )
    for given, used in ((q, qx), (k, kx)):
        if in_place and given is not None and used is not given:
            given.copy_(used)
    for given, used in ((q_out, qy), (k_out, ky)):
        if not in_place and given is not None and used is not given:
            given.copy_(used)
