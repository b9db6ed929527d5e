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
are formed once per program, so both directions share one body.

Launch: one program per tile of BLOCK_P positions x BLOCK_HH heads (of q or of k) x the whole
head dimension, with no loop: it loads its positions' cos/sin once for its BLOCK_HH heads and
then every element of the tile with one load per half-row, so a program has its whole tile in
flight at once. The programs are numbered so that consecutive ones touch neighbouring memory:
positions fastest for a (B, H, S, D) tensor, head tiles fastest for (B, S, H, D) and packed
strides. With position_ids, a position outside [0, P) never reads out of bounds: its rotated
features come out NaN, and the forward records the first such position's flat (batch, seq)
index in bad_position (preset to -1, lowered with an unsigned atomic min, as the CUDA kernel
does), which the public function raises for; without position_ids the first program writes
the record's -1.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._launch import Launcher, cdiv, next_power_of_2

__all__ = ["rope"]


@triton.jit
def _rotate_tile(
    x_ptr, y_ptr, h0, H,
    xsb, xsh, xss, ysb, ysh, yss,
    b, s, mask_p, c_a, c_b, s_a, s_b,
    HALF, REST,
    INTERLEAVED: tl.constexpr, COPY_REST: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_HH: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_REST: tl.constexpr,
    ACC: tl.constexpr,
):
    # Tile (positions, heads, features); c_a, ... are (positions, 1, features).
    hh = h0 + tl.arange(0, BLOCK_HH)
    mask_ph = mask_p[:, None, None] & (hh < H)[None, :, None]
    h64 = hh.to(tl.int64)[None, :, None]  # (head * head stride passes 2**31 in large tensors)
    x_row = x_ptr + (b * xsb + s * xss)[:, None, None] + h64 * xsh
    y_row = y_ptr + (b * ysb + s * yss)[:, None, None] + h64 * ysh
    if INTERLEAVED:
        # Pairs are adjacent: load the rotary part whole and split it into even and odd.
        jj = tl.arange(0, 2 * BLOCK_H)[None, None, :]
        mask = mask_ph & (jj < 2 * HALF)
        x = tl.load(x_row + jj, mask=mask, other=0.0).to(ACC)
        x_a, x_b = tl.split(tl.reshape(x, (BLOCK_P, BLOCK_HH, BLOCK_H, 2)))
        y_a = x_a * c_a + x_b * s_a
        y_b = x_b * c_b + x_a * s_b
        y = tl.reshape(tl.join(y_a, y_b), (BLOCK_P, BLOCK_HH, 2 * BLOCK_H))
        tl.store(y_row + jj, y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        j = tl.arange(0, BLOCK_H)[None, None, :]
        mask = mask_ph & (j < HALF)
        x_a = tl.load(x_row + j, mask=mask, other=0.0).to(ACC)
        x_b = tl.load(x_row + HALF + j, mask=mask, other=0.0).to(ACC)
        y_a = x_a * c_a + x_b * s_a
        y_b = x_b * c_b + x_a * s_b
        tl.store(y_row + j, y_a.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(y_row + HALF + j, y_b.to(y_ptr.dtype.element_ty), mask=mask)
    if COPY_REST:
        for r0 in range(0, REST, BLOCK_REST):
            r = 2 * HALF + r0 + tl.arange(0, BLOCK_REST)[None, None, :]
            mask_r = mask_ph & (r < 2 * HALF + REST)
            v = tl.load(x_row + r, mask=mask_r)
            tl.store(y_row + r, v, mask=mask_r)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, pos_ptr, bad_ptr,
    n_pos, S, Hq, Hk, P, q_tiles, head_tiles,
    qsb, qsh, qss, ksb, ksh, kss,
    qosb, qosh, qoss, kosb, kosh, koss,
    cos_b, cos_s, sin_b, sin_s, pos_b, pos_s,
    HALF, REST,
    INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr, HAS_POS: tl.constexpr, RECORD_BAD: tl.constexpr,
    COPY_REST: tl.constexpr, HEADS_FAST: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_HH: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_REST: tl.constexpr, ACC: tl.constexpr,
):
    pid = tl.program_id(0)
    if HEADS_FAST:
        tile = pid // head_tiles
        ht = pid % head_tiles
    else:
        n_tiles = tl.cdiv(n_pos, BLOCK_P)
        tile = pid % n_tiles
        ht = pid // n_tiles
    p = tile.to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_p = p < n_pos
    b = p // S
    s = p % S
    if RECORD_BAD and not HAS_POS:  # (no position can be bad: the record is -1)
        if pid == 0:
            tl.store(bad_ptr, -1)
    if HAS_POS:
        row = tl.load(pos_ptr + b * pos_b + s * pos_s, mask=mask_p, other=0).to(tl.int64)
        valid = (row >= 0) & (row < P)
        if RECORD_BAD and ht == 0:  # (one program per position tile records its first bad position)
            first = tl.min(tl.where(mask_p & ~valid, p, n_pos), axis=0)
            if first < n_pos:
                tl.atomic_min(bad_ptr.to(tl.pointer_type(tl.uint64)), first.to(tl.uint64))
        row = tl.where(valid, row, 0)
        cos_off = row * cos_s
        sin_off = row * sin_s
    else:
        cos_off = b * cos_b + s * cos_s
        sin_off = b * sin_b + s * sin_s
    j = tl.arange(0, BLOCK_H)[None, None, :]
    mask_c = mask_p[:, None, None] & (j < HALF)
    # Element a of each pair is the first half (or the even element), b its partner. The
    # cosines and signed sines: y_a = x_a*c_a + x_b*s_a, y_b = x_b*c_b + x_a*s_b.
    if INTERLEAVED:
        ia = 2 * j
        ib = 2 * j + 1
    else:
        ia = j
        ib = HALF + j
    cos_row = cos_ptr + cos_off[:, None, None]
    sin_row = sin_ptr + sin_off[:, None, None]
    c_a = tl.load(cos_row + ia, mask=mask_c, other=0.0).to(ACC)
    c_b = tl.load(cos_row + ib, mask=mask_c, other=0.0).to(ACC)
    n_a = tl.load(sin_row + ia, mask=mask_c, other=0.0).to(ACC)
    n_b = tl.load(sin_row + ib, mask=mask_c, other=0.0).to(ACC)
    if BACKWARD:
        s_a = n_b
        s_b = -n_a
    else:
        s_a = -n_a
        s_b = n_b
    if HAS_POS:
        # Out-of-range positions: NaN rather than an out-of-bounds read.
        c_a = tl.where(valid[:, None, None], c_a, float("nan"))
        c_b = tl.where(valid[:, None, None], c_b, float("nan"))
    # Tried and not kept (H200, 2026-12-03): issuing the tile's loads before the position lookup
    # and the cos/sin loads (as the CUDA kernel does), with the bad position recorded by a masked
    # vector atomic instead of a tile minimum: 14-23% slower in every layout (bhsd forward 3.81
    # -> 3.29 TB/s, thd 3.62 -> 2.92).
    if ht < q_tiles:
        _rotate_tile(
            q_ptr, qo_ptr, ht * BLOCK_HH, Hq,
            qsb, qsh, qss, qosb, qosh, qoss,
            b, s, mask_p, c_a, c_b, s_a, s_b, HALF, REST,
            INTERLEAVED, COPY_REST, BLOCK_P, BLOCK_HH, BLOCK_H, BLOCK_REST, ACC,
        )
    else:
        _rotate_tile(
            k_ptr, ko_ptr, (ht - q_tiles) * BLOCK_HH, Hk,
            ksb, ksh, kss, kosb, kosh, koss,
            b, s, mask_p, c_a, c_b, s_a, s_b, HALF, REST,
            INTERLEAVED, COPY_REST, BLOCK_P, BLOCK_HH, BLOCK_H, BLOCK_REST, ACC,
        )


_launch_rope = Launcher(_rope_kernel)


def _strides(t: Optional[Tensor]):
    return t.stride()[:3] if t is not None else (0, 0, 0)


def _unit_last(t: Optional[Tensor]) -> Optional[Tensor]:
    if t is None or t.shape[-1] <= 1 or t.stride(-1) == 1:
        return t
    return t.contiguous()


class Config(NamedTuple):
    """A launch's tile: positions and heads a program, warps, and whether consecutive programs
    take consecutive head tiles of a position tile or consecutive position tiles of a head tile."""

    block_p: int
    block_hh: int
    num_warps: int
    heads_fast: bool


# Elements of q/k a program holds (its tile), and the most heads a tile spans. Eight positions
# by eight heads by D = 128 features, four warps, ran at 3.62-3.93 TB/s forward and backward
# on the H200 (benchmarks/rope_triton_tiles.py: bf16 LLaMA-3-8B shape, every layout), within 3%
# of the best of nine other tiles in each case; wider tiles (16 or 32 positions, or eight warps)
# lost 3-20%, and interleaved pairs at 32 positions collapsed to 1.5-2.0 TB/s.
_TILE = 8192
_HEADS = 8


def config(ref: Tensor, Hq: int, Hk: int, R: int) -> Config:
    """The tile for q/k like `ref` ((B, H, S, D) view) with rotary dimension R. Head tiles come
    fastest when a position's heads are neighbours in memory (bshd, thd) and with full rotary
    whatever the strides, where consecutive programs then share their positions' cos/sin rows
    in L2 (H200, bhsd forward 3.63 -> 3.80 TB/s, interleaved 3.63 -> 3.83); partial rotary in
    (B, H, S, D) keeps positions fastest (3.72 against 3.60)."""
    shape, stride = ref.shape, ref.stride()
    return _config(shape[0] * shape[2], shape[3], Hq, Hk, R, stride[1] < stride[2])


@functools.lru_cache(maxsize=256)  # (a model's calls repeat a few shapes: arithmetic once)
def _config(n_pos: int, D: int, Hq: int, Hk: int, R: int, heads_inner: bool) -> Config:
    block_hh = min(next_power_of_2(max(Hq, Hk, 1)), _HEADS)
    width = 2 * next_power_of_2(max(R // 2, 1)) + (D - R)
    block_p = max(1, min(next_power_of_2(max(_TILE // (block_hh * width), 1)), next_power_of_2(n_pos)))
    return Config(block_p, block_hh, 4, R == D or heads_inner)


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
    bad_position: Optional[Tensor] = None,
    tile: Optional[Config] = None,
) -> None:
    """Writes the rotation (or with ``backward`` its transpose) of q and k into q_out and k_out
    (new tensors of their shapes, any strides with a unit last stride, or q and k themselves).
    q or k may be None (no heads). ``bad_position``, a 0-d int64 tensor, receives the flat
    index of the first position outside the tables, or -1; with position_ids it must hold -1
    already (the kernel only lowers it), without them it may hold anything. ``tile``
    overrides the launch configuration (benchmarks). The arguments have been checked
    (ops/rope.py)."""
    ref = q if q is not None else k
    B, S, D = ref.shape[0], ref.shape[2], ref.shape[3]
    Hq = q.shape[1] if q is not None else 0
    Hk = k.shape[1] if k is not None else 0
    if B * S * (Hq + Hk) * D == 0:
        if bad_position is not None:
            bad_position.fill_(-1)
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
        if P == 0:
            # Every position is out of range; the kernel stands row 0 in for such a position's
            # row (its result is NaN either way), which tables without rows lack: a row of zeros.
            cos = sin = cos.new_zeros(1, R)
        cos_b, cos_s, sin_b, sin_s = 0, cos.stride(0), 0, sin.stride(0)
    else:
        pos, pos_b, pos_s, P = dummy, 0, 0, 0
        cos_b = 0 if cos.shape[0] == 1 else cos.stride(0)
        sin_b = 0 if sin.shape[0] == 1 else sin.stride(0)
        cos_s, sin_s = cos.stride(1), sin.stride(1)
    tile = tile or config(ref, Hq, Hk, R)
    n_pos = B * S
    q_tiles = cdiv(Hq, tile.block_hh)
    head_tiles = q_tiles + cdiv(Hk, tile.block_hh)
    rest = D - R
    _launch_rope(
        (cdiv(n_pos, tile.block_p) * head_tiles,),
        (
            qx if qx is not None else dummy, kx if kx is not None else dummy,
            qy if qy is not None else dummy, ky if ky is not None else dummy,
            cos, sin, pos, bad_position if bad_position is not None else pos,
        ),
        (
            n_pos, S, Hq, Hk, P, q_tiles, head_tiles,
            *_strides(qx), *_strides(kx), *_strides(qy), *_strides(ky),
            cos_b, cos_s, sin_b, sin_s, pos_b, pos_s,
            R // 2, rest,
        ),
        INTERLEAVED=bool(interleaved), BACKWARD=bool(backward),
        HAS_POS=position_ids is not None, RECORD_BAD=bad_position is not None,
        COPY_REST=not in_place and rest > 0, HEADS_FAST=tile.heads_fast,
        BLOCK_P=tile.block_p, BLOCK_HH=tile.block_hh, BLOCK_H=next_power_of_2(max(R // 2, 1)),
        BLOCK_REST=min(next_power_of_2(max(rest, 1)), 128),
        ACC=tl.float64 if ref.dtype == torch.float64 else tl.float32,
        num_warps=tile.num_warps,
    )
    for given, used in ((q, qx), (k, kx)):
        if in_place and given is not None and used is not given:
            given.copy_(used)
    for given, used in ((q_out, qy), (k_out, ky)):
        if not in_place and given is not None and used is not given:
            given.copy_(used)
