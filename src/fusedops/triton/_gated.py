"""Triton gated activations (swiglu, geglu and their packed forms), forward and backward: one
forward and one backward kernel, specialised on the activation (``ACT``: silu, gelu with erf,
gelu's tanh form).

What is computed (in float32, float64 for float64 input; csrc/include/fusedops/gated.h states
the same for the native kernels)::

    y  = act(g) * u
    dg = dy * u * act'(g),   du = dy * act(g)

with gelu's tanh form written as ``g * sigmoid(2z)``, ``z = sqrt(2/pi) (g + 0.044715 g^3)``
(equal to ``0.5 g (1 + tanh z)``, without tanh's cancellation near -1).

Layout: every operand is viewed as (rows, n) with one row stride and a unit-stride last
dimension; a program handles BLOCK columns of one row (grid = rows x column blocks, flattened
into axis 0, which has no 65535 limit). The packed forms pass the two halves of gate_up (and
of the packed gradient) as two views with gate_up's row stride; Triton specialises each pointer
and stride on 16-byte divisibility, so aligned halves get 16-byte accesses and others narrower
ones. When every operand is contiguous the whole tensor is one row. Copies: an operand whose
last dimension is strided, or whose leading dimensions do not merge into one stride, is copied
contiguous first (``reshape``). Offsets are 64-bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import Launcher, cdiv, next_power_of_2

_ACTS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
_SQRT1_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # 1 / sqrt(2 pi)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_TANH_CUBIC = tl.constexpr(0.044715)
_TWO_SQRT_2_OVER_PI = tl.constexpr(2 * 0.7978845608028654)
_THREE_TANH_CUBIC = tl.constexpr(3 * 0.044715)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _sigmoid_pair(x):
    """sigmoid(x) and 1 - sigmoid(x), each with a small relative error (for x >= 0, 1 - s
    would cancel: it is e^-x s; for x < 0, e^-x may be inf while 1 - s is exact enough)."""
    e = tl.exp(-x)
    s = 1.0 / (1.0 + e)
    return s, tl.where(x >= 0, e * s, 1.0 - s)


@triton.jit
def _act(g, ACT: tl.constexpr):
    if ACT == 0:
        a = g * _sigmoid(g)
    elif ACT == 1:
        a = 0.5 * g * (1.0 + tl.erf(g * _SQRT1_2))
    else:
        a = g * _sigmoid((g + g * g * g * _TANH_CUBIC) * _TWO_SQRT_2_OVER_PI)
    return a


@triton.jit
def _act_and_grad(g, ACT: tl.constexpr):
    if ACT == 0:
        s, c = _sigmoid_pair(g)
        a = g * s
        da = s * (1.0 + g * c)
    elif ACT == 1:
        cdf = 0.5 * (1.0 + tl.erf(g * _SQRT1_2))
        a = g * cdf
        da = cdf + g * (_INV_SQRT_2PI * tl.exp(-0.5 * g * g))
    else:
        g2 = g * g
        s, c = _sigmoid_pair((g + g2 * g * _TANH_CUBIC) * _TWO_SQRT_2_OVER_PI)
        a = g * s
        da = s + g * (2.0 * s * c) * ((1.0 + g2 * _THREE_TANH_CUBIC) * _SQRT_2_OVER_PI)
    return a, da


@triton.jit
def _forward_kernel(g_ptr, u_ptr, y_ptr, n, g_stride, u_stride, y_stride, col_blocks,
                    ACT: tl.constexpr, COMPUTE: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    row = (pid // col_blocks).to(tl.int64)
    cols = (pid % col_blocks).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(g_ptr + row * g_stride + cols, mask=mask, other=0.0).to(COMPUTE)
    u = tl.load(u_ptr + row * u_stride + cols, mask=mask, other=0.0).to(COMPUTE)
    y = _act(g, ACT) * u
    tl.store(y_ptr + row * y_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward_kernel(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, dy_stride, g_stride, u_stride, out_stride,
                     col_blocks, ACT: tl.constexpr, COMPUTE: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    row = (pid // col_blocks).to(tl.int64)
    cols = (pid % col_blocks).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    dy = tl.load(dy_ptr + row * dy_stride + cols, mask=mask, other=0.0).to(COMPUTE)
    g = tl.load(g_ptr + row * g_stride + cols, mask=mask, other=0.0).to(COMPUTE)
    u = tl.load(u_ptr + row * u_stride + cols, mask=mask, other=0.0).to(COMPUTE)
    a, da = _act_and_grad(g, ACT)
    out = row * out_stride + cols
    tl.store(dg_ptr + out, (dy * u * da).to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + out, (dy * a).to(du_ptr.dtype.element_ty), mask=mask)


_launch_forward = Launcher(_forward_kernel)
_launch_backward = Launcher(_backward_kernel)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as (rows, n) with a unit-stride last dimension: a view when the layout allows."""
    n = t.shape[-1]
    if n > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, n)


def _launch_params(n: int, dtype: torch.dtype, rows: int):
    # 16 bytes a thread for 16-bit dtypes at 4 warps (2048 x 2 bytes = 128 threads x 16 bytes x 2).
    block = 2048 if dtype.itemsize <= 2 else 1024
    block = min(block, max(16, next_power_of_2(n)))
    col_blocks = cdiv(n, block)
    warps = 4 if block >= 512 else 1
    return block, col_blocks, warps


def _compute_dtype(dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _forward_2d(g: torch.Tensor, u: torch.Tensor, y: torch.Tensor, act: str) -> None:
    rows, n = g.shape
    if rows == 0 or n == 0:
        return
    block, col_blocks, warps = _launch_params(n, g.dtype, rows)
    _launch_forward(
        (rows * col_blocks,), (g, u, y), (n, g.stride(0), u.stride(0), y.stride(0), col_blocks),
        ACT=_ACTS[act], COMPUTE=_compute_dtype(g.dtype), BLOCK=block, num_warps=warps,
    )


def _backward_2d(dy, g, u, dg, du, act: str) -> None:
    rows, n = g.shape
    if rows == 0 or n == 0:
        return
    block, col_blocks, warps = _launch_params(n, g.dtype, rows)
    _launch_backward(
        (rows * col_blocks,), (dy, g, u, dg, du), (n, dy.stride(0), g.stride(0), u.stride(0), dg.stride(0), col_blocks),
        ACT=_ACTS[act], COMPUTE=_compute_dtype(g.dtype), BLOCK=block, num_warps=warps,
    )


def _flat_if_contiguous(*ts):
    """All contiguous: each as one row of numel elements (the kernel then splits it freely)."""
    if all(t.is_contiguous() for t in ts):
        return tuple(t.view(1, -1) for t in ts)
    return tuple(_rows(t) for t in ts)


def forward(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    out = torch.empty_like(gate, memory_format=torch.contiguous_format)
    if out.numel() == 0:
        return out
    g, u = _flat_if_contiguous(gate, up)
    _forward_2d(g, u, out.view(g.shape), act)
    return out


def backward(grad_output, gate, up, act: str):
    grad_gate = torch.empty_like(gate, memory_format=torch.contiguous_format)
    grad_up = torch.empty_like(gate, memory_format=torch.contiguous_format)
    if gate.numel() == 0:
        return grad_gate, grad_up
    dy, g, u = _flat_if_contiguous(grad_output, gate, up)
    shape = g.shape
    _backward_2d(dy, g, u, grad_gate.view(shape), grad_up.view(shape), act)
    return grad_gate, grad_up


def packed_forward(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    n = gate_up.shape[-1] // 2
    out = gate_up.new_empty(tuple(gate_up.shape[:-1]) + (n,))
    if out.numel() == 0:
        return out
    gu = _rows(gate_up)
    _forward_2d(gu[:, :n], gu[:, n:], out.view(-1, n), act)
    return out


def packed_backward(grad_output: torch.Tensor, gate_up: torch.Tensor, act: str) -> torch.Tensor:
    n = gate_up.shape[-1] // 2
    grad = torch.empty_like(gate_up, memory_format=torch.contiguous_format)
    if grad.numel() == 0:
        return grad
    gu = _rows(gate_up)
    g2 = grad.view(-1, 2 * n)
    _backward_2d(_rows(grad_output), gu[:, :n], gu[:, n:], g2[:, :n], g2[:, n:], act)
    return grad
