"""rope beyond the generic suites: the public layouts by name, the in-place form, gradients that
reach only one output, refused gradients of cos/sin, positions out of range (CPU error, GPU
eager error and never an out-of-bounds read), Hugging Face's formula, and RotaryEmbedding
against an fp64 transcription of its formulas (including LLaMA-3 scaling)."""

import math
import os
import re

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fusedops
from fusedops.testing.rope import _rotation_tables, reference, rotate
from conftest import HAS_CUDA, device_params, vmap_fallback

DEVICES = device_params()


def _layout_tensors(layout, device, dtype, B=2, S=5, Hq=4, Hk=2, D=32, requires_grad=False):
    """q, k in `layout`, and the (B, H, S, D) views of them the reference takes."""
    if layout == "bhsd":
        q, k = torch.randn(B, Hq, S, D, dtype=dtype, device=device), torch.randn(B, Hk, S, D, dtype=dtype, device=device)
        view = lambda t: t  # noqa: E731
    elif layout == "bshd":
        q, k = torch.randn(B, S, Hq, D, dtype=dtype, device=device), torch.randn(B, S, Hk, D, dtype=dtype, device=device)
        view = lambda t: t.transpose(1, 2)  # noqa: E731
    else:
        q, k = torch.randn(B * S, Hq, D, dtype=dtype, device=device), torch.randn(B * S, Hk, D, dtype=dtype, device=device)
        view = lambda t: t.unsqueeze(0).transpose(1, 2)  # noqa: E731
    return q.requires_grad_(requires_grad), k.requires_grad_(requires_grad), view


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd", "thd"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_layouts(layout, interleaved, device):
    """Each layout by name: values and gradients against fp64, outputs in the input's layout."""
    q, k, view = _layout_tensors(layout, device, torch.float32, requires_grad=True)
    R = 24  # partial rotary
    if layout == "thd":
        positions = torch.tensor([0, 1, 2, 0, 1, 2, 3, 4, 5, 6], device=device)
        cos, sin = _rotation_tables(torch.arange(9, device=device), R, torch.float32, device, interleaved)
        q_out, k_out = fusedops.rope(q, k, cos, sin, layout="thd", position_ids=positions, interleaved=interleaved)
        eq, ek = reference(view(q).double(), view(k).double(), cos.double(), sin.double(), positions[None], interleaved)
    else:
        cos, sin = torch.randn(2, 5, R, device=device), torch.randn(2, 5, R, device=device)
        q_out, k_out = fusedops.rope(q, k, cos, sin, layout=layout, interleaved=interleaved)
        eq, ek = reference(view(q).double(), view(k).double(), cos.double(), sin.double(), None, interleaved)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    assert q_out.is_contiguous() and k_out.is_contiguous()  # the input's layout again
    torch.testing.assert_close(view(q_out).double(), eq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(view(k_out).double(), ek, atol=1e-5, rtol=1e-5)
    gq, gk = torch.randn_like(q_out), torch.randn_like(k_out)
    dq, dk = torch.autograd.grad((q_out, k_out), (q, k), (gq, gk))
    qd, kd = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    if layout == "thd":
        rq, rk = reference(view(qd), view(kd), cos.double(), sin.double(), positions[None], interleaved)
    else:
        rq, rk = reference(view(qd), view(kd), cos.double(), sin.double(), None, interleaved)
    eq_grad, ek_grad = torch.autograd.grad((rq, rk), (qd, kd), (view(gq).double(), view(gk).double()))
    torch.testing.assert_close(dq.double(), eq_grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dk.double(), ek_grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_thd_per_token_tables(device):
    """thd without position_ids: cos/sin hold one (T, R) row per token."""
    q, k, view = _layout_tensors("thd", device, torch.float32)
    cos, sin = torch.randn(10, 32, device=device), torch.randn(10, 32, device=device)
    q_out, k_out = fusedops.rope(q, k, cos, sin, layout="thd")
    eq, ek = reference(view(q), view(k), cos[None], sin[None])
    torch.testing.assert_close(view(q_out), eq)
    torch.testing.assert_close(view(k_out), ek)


@pytest.mark.parametrize("device", DEVICES)
def test_outputs_keep_dense_strides(device):
    """A dense permuted input gives an output with its strides; a sliced one a dense output in
    the input's order of dimensions (contiguous for a sliced bhsd input)."""
    base = torch.randn(2, 5, 4, 16, device=device)
    q = base.transpose(1, 2)  # bshd storage seen as bhsd
    k = torch.randn(2, 5, 2, 16, device=device).transpose(1, 2)
    c, s = torch.randn(1, 5, 16, device=device), torch.randn(1, 5, 16, device=device)
    q_out, k_out = fusedops.rope(q, k, c, s)
    assert q_out.stride() == q.stride() and k_out.stride() == k.stride()
    sliced = torch.randn(2, 4, 5, 20, device=device)[..., 2:18]
    q_out, _ = fusedops.rope(sliced, k, c, s)
    assert q_out.is_contiguous()
    torch.testing.assert_close(q_out, reference(sliced, k, c, s)[0])
    # positions outermost, then the batch, then the heads: the output is laid out (S, B, H, D)
    odd = torch.randn(5, 2, 4, 20, device=device)[..., :16].permute(1, 2, 0, 3)
    q_out, _ = fusedops.rope(odd, k, c, s)
    assert q_out.permute(2, 0, 1, 3).is_contiguous()
    torch.testing.assert_close(q_out, reference(odd, k, c, s)[0])
    # Broadcast (stride-0) dimensions keep their places, as in torch's elementwise results: an
    # expanded batch or head dimension gives a contiguous output, whatever the layout, and the
    # fake kernel agrees with the real one.
    # (bshd with expanded heads or positions: one copy of the output, from the op's (B, H, S) order)
    expanded_inputs = (
        (torch.randn(1, 5, 4, 16, device=device).expand(2, 5, 4, 16), "bshd"),
        (torch.randn(2, 5, 1, 16, device=device).expand(2, 5, 4, 16), "bshd"),
        (torch.randn(2, 1, 4, 16, device=device).expand(2, 5, 4, 16), "bshd"),
        (torch.randn(2, 1, 5, 16, device=device).expand(2, 4, 5, 16), "bhsd"),
    )
    for expanded, layout in expanded_inputs:
        k_in = k.transpose(1, 2) if layout == "bshd" else k
        q_out, _ = fusedops.rope(expanded, k_in, c, s, layout=layout)
        assert q_out.stride() == torch.empty_like(expanded).stride(), (layout, expanded.stride())
        as_bhsd = expanded.transpose(1, 2) if layout == "bshd" else expanded
        torch.testing.assert_close(q_out if layout == "bhsd" else q_out.transpose(1, 2),
                                   reference(as_bhsd, k, c, s)[0])
        real = torch.ops.fusedops.rope(as_bhsd, k, c, s)[0]
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = torch.ops.fusedops.rope(*(mode.from_tensor(a) for a in (as_bhsd, k, c, s)))[0]
        assert fake.stride() == real.stride(), layout


@pytest.mark.parametrize("device", DEVICES)
def test_thd_expanded_heads_give_a_contiguous_output(device):
    """Packed tokens (T, H, D) whose heads are one expanded head: the output is (T, H, D)
    contiguous, as torch's elementwise ops give, and right."""
    T, H, D = 6, 4, 16
    q = torch.randn(T, 1, D, device=device).expand(T, H, D)
    k = torch.randn(T, 2, D, device=device)
    c, s = torch.randn(T, D, device=device), torch.randn(T, D, device=device)
    q_out, k_out = fusedops.rope(q, k, c, s, layout="thd")
    assert q_out.is_contiguous() and k_out.is_contiguous()
    expected = reference(q.transpose(0, 1)[None], k.transpose(0, 1)[None], c[None], s[None])
    torch.testing.assert_close(q_out, expected[0][0].transpose(0, 1))
    torch.testing.assert_close(k_out, expected[1][0].transpose(0, 1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_sliced_outputs_keep_the_layout(layout, device):
    """q and k sliced from a fused QKV output (not dense) give contiguous outputs in their own
    layout, which a view back to (..., H * D) takes, forward and backward; the fake kernel
    agrees on the strides."""
    B, S, Hq, Hk, D = 2, 5, 4, 2, 16
    lead = (B, S) if layout == "bshd" else (B * S,)
    qkv = torch.randn(*lead, (Hq + 2 * Hk) * D, device=device)
    q = qkv[..., : Hq * D].view(*lead, Hq, D).requires_grad_()
    k = qkv[..., Hq * D : (Hq + Hk) * D].view(*lead, Hk, D).requires_grad_()
    shape = (B, S, D) if layout == "bshd" else (B * S, D)
    c, s = torch.randn(shape, device=device), torch.randn(shape, device=device)
    q_out, k_out = fusedops.rope(q, k, c, s, layout=layout)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    q_out.view(*lead, Hq * D)
    view = (lambda t: t.transpose(1, 2)) if layout == "bshd" else (lambda t: t.unsqueeze(0).transpose(1, 2))
    cs = (c, s) if layout == "bshd" else (c[None], s[None])
    eq, ek = reference(view(q.detach()), view(k.detach()), *cs)
    torch.testing.assert_close(view(q_out), eq)
    torch.testing.assert_close(view(k_out), ek)
    gq = torch.randn(*lead, 3 * Hq * D, device=device)[..., : Hq * D].view(*lead, Hq, D)
    dq, _ = torch.autograd.grad((q_out, k_out), (q, k), (gq, torch.zeros_like(k_out)))
    assert dq.is_contiguous()
    # the registered op sees the (B, H, S, D) views; its fake kernel gives the real strides
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = (view(q.detach()), view(k.detach()), *cs)
    real = torch.ops.fusedops.rope(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = torch.ops.fusedops.rope(*(mode.from_tensor(a) for a in args))
    assert [t.stride() for t in fake[:2]] == [t.stride() for t in real[:2]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd", "thd"])
def test_inplace(layout, device):
    """rope_ writes rope's result into q and k themselves (features past R untouched), returns
    them, and bumps their version counters."""
    q, k, view = _layout_tensors(layout, device, torch.bfloat16)
    R = 16
    if layout == "thd":
        positions = torch.arange(10, device=device) % 5
        cos, sin = _rotation_tables(torch.arange(5, device=device), R, torch.float32, device)
        kwargs = dict(layout=layout, position_ids=positions)
    else:
        cos, sin = torch.randn(1, 5, R, device=device), torch.randn(1, 5, R, device=device)
        kwargs = dict(layout=layout)
    eq, ek = fusedops.rope(q, k, cos, sin, **kwargs)
    q0, k0 = q.clone(), k.clone()
    versions = (q._version, k._version)
    rq, rk = fusedops.rope_(q, k, cos, sin, **kwargs)
    assert rq is q and rk is k
    assert q._version > versions[0] and k._version > versions[1]
    assert torch.equal(q, eq) and torch.equal(k, ek)
    assert torch.equal(q[..., R:], q0[..., R:]) and torch.equal(k[..., R:], k0[..., R:])


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_strided_last_dim(device):
    """A q whose last dimension is strided is rotated through a copy and written back."""
    q = torch.randn(1, 2, 3, 16, device=device).transpose(2, 3).contiguous().transpose(2, 3)
    assert q.stride(-1) != 1
    k = torch.randn(1, 2, 3, 16, device=device)
    c, s = torch.randn(1, 3, 16, device=device), torch.randn(1, 3, 16, device=device)
    eq, ek = reference(q, k, c, s)
    fusedops.rope_(q, k, c, s)
    torch.testing.assert_close(q, eq)
    torch.testing.assert_close(k, ek)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_qkv_views(device):
    """q and k as views of one fused QKV projection output (B, S, (Hq + 2 Hk) * D): rotated
    without a copy, and in place straight into the projection's buffer."""
    B, S, Hq, Hk, D = 2, 5, 4, 2, 16
    qkv = torch.randn(B, S, (Hq + 2 * Hk) * D, device=device)
    q = qkv[..., : Hq * D].view(B, S, Hq, D)
    k = qkv[..., Hq * D : (Hq + Hk) * D].view(B, S, Hk, D)
    c, s = torch.randn(B, S, D, device=device), torch.randn(B, S, D, device=device)
    eq, ek = reference(q.transpose(1, 2), k.transpose(1, 2), c, s)
    q_out, k_out = fusedops.rope(q, k, c, s, layout="bshd")
    torch.testing.assert_close(q_out.transpose(1, 2), eq)
    torch.testing.assert_close(k_out.transpose(1, 2), ek)
    v_before = qkv[..., (Hq + Hk) * D :].clone()
    fusedops.rope_(q, k, c, s, layout="bshd")
    torch.testing.assert_close(q.transpose(1, 2), eq)
    torch.testing.assert_close(k.transpose(1, 2), ek)
    assert torch.equal(qkv[..., (Hq + Hk) * D :], v_before)  # v untouched


def test_inplace_refuses_grad():
    q = torch.randn(1, 2, 3, 8, requires_grad=True)
    k = torch.randn(1, 2, 3, 8)
    c, s = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    with pytest.raises(RuntimeError, match=r"fusedops.rope_ rotates q and k in place and has no gradient"):
        fusedops.rope_(q, k, c, s)
    with pytest.raises(RuntimeError, match=r"fusedops.rope_ rotates q and k in place and has no gradient"):
        torch.ops.fusedops.rope_(q, k, c, s)
    with torch.no_grad():
        fusedops.rope_(q, k, c, s)


@pytest.mark.parametrize("route", ["public", "registered"])
def test_output_of_an_input_needing_no_grad_needs_none(route):
    """q_out depends on q alone and k_out on k alone: with only q trainable, k_out needs no
    gradient (a backward from it raises as torch's would), and the reverse."""
    c, s = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    for trainable in ("q", "k"):
        q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8)
        (q if trainable == "q" else k).requires_grad_()
        rope = fusedops.rope if route == "public" else torch.ops.fusedops.rope
        q_out, k_out = rope(q, k, c, s)[:2]
        assert (q_out.requires_grad, k_out.requires_grad) == (trainable == "q", trainable == "k")
        frozen_out = k_out if trainable == "q" else q_out
        with pytest.raises(RuntimeError, match="does not require grad"):
            frozen_out.sum().backward()
        trained, trained_out = (q, q_out) if trainable == "q" else (k, k_out)
        dy = torch.randn_like(trained_out)
        (grad,) = torch.autograd.grad(trained_out, trained, dy)
        ref = trained.detach().double().requires_grad_()
        ref_out = reference(ref, ref, c.double(), s.double())[0]
        torch.testing.assert_close(grad.double(), torch.autograd.grad(ref_out, ref, dy.double())[0], atol=1e-5, rtol=1e-5)


def test_inplace_refuses_inference_tensors():
    """As torch's in-place ops: an inference tensor is written only inside inference_mode."""
    q = torch.randn(1, 2, 3, 8)
    c, s = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    with torch.inference_mode():
        k = torch.randn(1, 2, 3, 8)
    message = r"fusedops.rope_: k is an inference tensor, which cannot be updated in place outside"
    with pytest.raises(RuntimeError, match=message):
        fusedops.rope_(q, k, c, s)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.fusedops.rope_(q, k, c, s)
    with torch.inference_mode():
        expected = fusedops.rope(q, k, c, s)
        fusedops.rope_(q, k, c, s)
    assert torch.equal(q, expected[0]) and torch.equal(k, expected[1])


def test_inplace_compiles():
    """Under torch.compile the in-place form is functionalised and still mutates its inputs."""
    q, k = torch.randn(2, 4, 6, 16), torch.randn(2, 2, 6, 16)
    c, s = torch.randn(1, 6, 16), torch.randn(1, 6, 16)
    eq, ek = reference(q, k, c, s)

    def f(q, k, c, s):
        fusedops.rope_(q, k, c, s)
        return q * 2

    out = torch.compile(f, fullgraph=True)(q, k, c, s)
    torch.testing.assert_close(q, eq)
    torch.testing.assert_close(k, ek)
    torch.testing.assert_close(out, 2 * eq)


@pytest.mark.parametrize("heads", [(8, 4, 4), (4, 4)], ids=["qkv", "qk"])
@pytest.mark.parametrize("layout", ["bshd", "thd", "bhsd"])
def test_inplace_compiles_into_fused_qkv_views(layout, heads):
    """rope_ on q and k split from one fused QKV (or QK) buffer, compiled with dynamic shapes by
    Inductor, writes the buffer as eager does, in every layout (bhsd: the caller transposes the
    split views itself, as Hugging Face attention does). torch 2.13's Inductor misplaced the
    in-place op's writes through these views' transposes, or handed q and k over as one buffer:
    rope_ goes out of place and copies back there."""
    lead = (7,) if layout == "thd" else (2, 5)
    c, s = torch.randn(*lead, 8, dtype=torch.float64), torch.randn(*lead, 8, dtype=torch.float64)

    def f(qkv):
        q, k = qkv.split(heads, dim=-2)[:2]
        if layout == "bhsd":
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        fusedops.rope_(q, k, c, s, layout=layout)
        return qkv.sum()

    qkv = torch.randn(*lead, sum(heads), 8, dtype=torch.float64)
    compiled, eager = qkv.clone(), qkv.clone()
    with torch.no_grad():
        torch.compile(f, backend="inductor", fullgraph=True, dynamic=True)(compiled)
        f(eager)
    assert not torch.equal(eager, qkv)  # (rotated)
    torch.testing.assert_close(compiled, eager, rtol=1e-12, atol=1e-12)


def test_inplace_compiles_into_slots_of_a_stacked_buffer():
    """rope_ on q and k taken as slots of one stacked (2, B, H, S, D) buffer (contiguous views at
    storage offsets), compiled by Inductor with dynamic shapes over three sequence lengths: the
    buffer comes out as eager's. Inductor (torch 2.11-2.13) wrote k's update at offset 0, over
    q, or refused q and k as one buffer."""

    def f(qk, c, s):
        fusedops.rope_(qk[0], qk[1], c, s)
        return qk.sum()

    compiled = torch.compile(f, backend="inductor", fullgraph=True, dynamic=True)
    with torch.no_grad():
        for seq in (5, 6, 9):
            c, s = torch.randn(1, seq, 8, dtype=torch.float64), torch.randn(1, seq, 8, dtype=torch.float64)
            qk = torch.randn(2, 2, 3, seq, 8, dtype=torch.float64)
            eager, out = qk.clone(), qk.clone()
            f(eager, c, s)
            compiled(out, c, s)
            assert not torch.equal(eager, qk)
            torch.testing.assert_close(out, eager, rtol=1e-12, atol=1e-12)


def test_table_gradients_refused():
    q, k = torch.randn(1, 2, 3, 8, requires_grad=True), torch.randn(1, 2, 3, 8)
    c, s = torch.randn(1, 3, 8, requires_grad=True), torch.randn(1, 3, 8)
    with pytest.raises(NotImplementedError, match=r"gradients with respect to cos and sin are not supported"):
        fusedops.rope(q, k, c, s)
    with pytest.raises(NotImplementedError, match=r"gradients with respect to cos and sin are not supported"):
        torch.ops.fusedops.rope(q, k, c, s)
    # (torch.compile reports it wrapped, message included)
    with pytest.raises(Exception, match=r"gradients with respect to cos and sin are not supported"):
        torch.compile(fusedops.rope, fullgraph=True)(q, k, c, s)
    q_out, _ = fusedops.rope(q, k, c.detach(), s)  # detached tables are fine
    assert q_out.requires_grad


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_through_one_output(device):
    """Only k_out used: q's gradient is None (not read as zeros), k's is right."""
    q = torch.randn(1, 4, 3, 8, device=device, requires_grad=True)
    k = torch.randn(1, 2, 3, 8, device=device, requires_grad=True)
    c, s = torch.randn(1, 3, 8, device=device), torch.randn(1, 3, 8, device=device)
    _q_out, k_out = fusedops.rope(q, k, c, s)
    g = torch.randn_like(k_out)
    dq, dk = torch.autograd.grad(k_out, (q, k), g, allow_unused=True)
    assert dq is None
    kd = k.detach().double().requires_grad_()
    (expected,) = torch.autograd.grad(reference(q.detach().double(), kd, c.double(), s.double())[1], kd, g.double())
    torch.testing.assert_close(dk.double(), expected, atol=1e-5, rtol=1e-5)  # float32 math against fp64
    # Double backward with one output: the transposes run on zero heads of the other.
    qd = q.detach().double().requires_grad_()
    kd = k.detach().double().requires_grad_()
    assert torch.autograd.gradgradcheck(lambda a, b: fusedops.rope(a, b, c.double(), s.double())[1], (qd, kd))


@pytest.mark.parametrize("device", DEVICES)
def test_inverse_rotation(device):
    """With a real rotation, backward is the inverse: rope_backward(rope(x)) == x."""
    q, k = torch.randn(2, 4, 7, 64, device=device, dtype=torch.float64), torch.randn(2, 2, 7, 64, device=device, dtype=torch.float64)
    for interleaved in (False, True):
        c, s = _rotation_tables(torch.arange(7, device=device)[None], 64, torch.float64, device, interleaved)
        y = torch.ops.fusedops.rope(q, k, c, s, None, interleaved)
        back = torch.ops.fusedops.rope_backward(*y[:2], c, s, None, interleaved)
        torch.testing.assert_close(back[0], q)
        torch.testing.assert_close(back[1], k)


def _hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """Hugging Face's apply_rotary_pos_emb, as written in transformers' LLaMA model."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate(q, False) * sin, k * cos + rotate(k, False) * sin


@pytest.mark.parametrize("device", DEVICES)
def test_matches_hugging_face_with_rotary_embedding(device):
    """RotaryEmbedding's tables with fusedops.rope equal HF's formula in fp32, and bf16 within
    one rounding (fusedops rounds once; HF's bf16 math rounds at each step)."""
    rot = fusedops.nn.RotaryEmbedding(64, max_position_embeddings=128, device=device)
    position_ids = torch.arange(10, device=device)[None].expand(2, 10) + torch.tensor([[0], [5]], device=device)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        q = torch.randn(2, 8, 10, 64, device=device, dtype=dtype)
        k = torch.randn(2, 2, 10, 64, device=device, dtype=dtype)
        cos, sin = rot(q, position_ids)
        assert cos.dtype == dtype and cos.shape == (2, 10, 64)
        eq, ek = _hf_apply_rotary_pos_emb(q.float(), k.float(), cos.float(), sin.float())
        q_out, k_out = fusedops.rope(q, k, cos, sin)
        torch.testing.assert_close(q_out.float(), eq, atol=tol, rtol=tol)
        torch.testing.assert_close(k_out.float(), ek, atol=tol, rtol=tol)


def test_bad_layout_and_shapes():
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    c, s = torch.randn(1, 5, 8), torch.randn(1, 5, 8)
    with pytest.raises(ValueError, match=r"fusedops.rope: layout must be 'bhsd', 'bshd' or 'thd', got 'sbhd'"):
        fusedops.rope(q, k, c, s, layout="sbhd")
    with pytest.raises(ValueError, match=r"fusedops.rope_: layout must be 'bhsd', 'bshd' or 'thd', got 'BHSD'"):
        fusedops.rope_(q, k, c, s, layout="BHSD")
    with pytest.raises(ValueError, match=r"fusedops.rope: q must be a 3-D \(tokens, heads, head_dim\) tensor for layout "
                                         r"'thd', got shape \[2, 4, 5, 8\]"):
        fusedops.rope(q, k, c, s, layout="thd")
    with pytest.raises(ValueError, match=r"fusedops.rope: k must be a 4-D \(batch, seq, heads, head_dim\) tensor for "
                                         r"layout 'bshd', got a 0-dimensional tensor"):
        fusedops.rope(q, torch.tensor(0.0), c, s, layout="bshd")
    # thd: the tables and positions are checked in the caller's terms (the op sees them unsqueezed)
    qt, kt = torch.randn(4, 4, 8), torch.randn(4, 2, 8)  # 4 tokens
    with pytest.raises(ValueError, match=r"fusedops.rope: position_ids must be a 1-D \(tokens,\) tensor of 4 for "
                                         r"layout 'thd', got shape \[1, 4\]"):
        fusedops.rope(qt, kt, c[0], s[0], layout="thd", position_ids=torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"fusedops.rope: cos must be \(tokens, rotary_dim\) for layout 'thd' with 4 "
                                         r"tokens, got shape \[1, 5, 8\]"):
        fusedops.rope(qt, kt, c, s, layout="thd")
    with pytest.raises(ValueError, match=r"fusedops.rope: sin must be \(positions, rotary_dim\) tables for layout "
                                         r"'thd', got shape \[1, 5, 8\]"):
        fusedops.rope(qt, kt, c[0], s, layout="thd", position_ids=torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"fusedops.rope: k has 3 tokens and q 4: they must match for layout 'thd'"):
        fusedops.rope(qt, kt[:3], c[0, :4], s[0, :4], layout="thd")
    # q and k that do not go together are named in the caller's layout, not the op's (B, H, S, D)
    with pytest.raises(ValueError, match=r"fusedops.rope: k shape \[4, 2, 6\] does not go with q shape \[4, 4, 8\] for "
                                         r"layout 'thd': head_dim must match"):
        fusedops.rope(qt, kt[..., :6], c[0, :4], s[0, :4], layout="thd")
    for bad_k, what in ((torch.randn(2, 4, 2, 8), "[2, 4, 2, 8]"), (torch.randn(2, 5, 2, 6), "[2, 5, 2, 6]")):
        match = (rf"fusedops.rope_: k shape {re.escape(what)} does not go with q shape \[2, 5, 4, 8\] for layout "
                 r"'bshd': batch, seq and head_dim must match")
        with pytest.raises(ValueError, match=match):
            fusedops.rope_(q.transpose(1, 2), bad_k, c, s, layout="bshd")


@pytest.mark.parametrize("device", DEVICES)
def test_positions_out_of_range_raise(device):
    """Eager calls name the first bad position: on the CPU the kernel, in the call; on a GPU the
    call itself with check_positions="sync", else the next call once the GPU has finished."""
    q, k = torch.randn(6, 4, 8, device=device), torch.randn(6, 2, 8, device=device)
    table = torch.randn(4, 8, device=device)
    good = torch.tensor([0, 1, 2, 3, 2, 0], device=device)
    for positions, match in [
        (torch.tensor([0, 1, 2, 3, 4, 0], device=device), r"rope: position_ids\[0, 4\] = 4 is outside the cos/sin tables' 4 rows"),
        (torch.tensor([0, -2, 1, 5, 3, 0], device=device, dtype=torch.int32), r"rope: position_ids\[0, 1\] = -2 is outside"),
    ]:
        for op, name in ((fusedops.rope, "rope:"), (fusedops.rope_, "rope_:")):
            message = match.replace("rope:", name)
            if device == "cpu":
                with pytest.raises(ValueError, match=message):
                    op(q, k, table, table, layout="thd", position_ids=positions)
                continue
            with pytest.raises(ValueError, match=message):
                op(q, k, table, table, layout="thd", position_ids=positions, check_positions="sync")
            op(q, k, table, table, layout="thd", position_ids=positions)  # returns: the check is deferred
            torch.cuda.synchronize()
            with pytest.raises(ValueError, match=message + r".*found after that earlier call returned: "
                               r"check_positions=True checks without waiting"):
                op(q, k, table, table, layout="thd", position_ids=good)
            op(q, k, table, table, layout="thd", position_ids=good)  # reported once
            out = op(q, k, table, table, layout="thd", position_ids=positions, check_positions=False)
            torch.cuda.synchronize()
            op(q, k, table, table, layout="thd", position_ids=good)  # False: nothing recorded
            assert out[0][4 if "4 is" in match else 1].isnan().all()
    with pytest.raises(ValueError, match=r"rope: check_positions must be True, False or 'sync', got 'later'"):
        fusedops.rope(q, k, table, table, layout="thd", position_ids=good, check_positions="later")
    with pytest.raises(ValueError, match=r"rope_: check_positions must be True, False or 'sync', got 1"):
        fusedops.rope_(q, k, table, table, layout="thd", position_ids=good, check_positions=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd", "thd"])
@pytest.mark.parametrize("indexed", [False, True], ids=["tables", "position_ids"])
def test_vmap_of_shared_tables_is_one_call(layout, indexed, device, monkeypatch):
    """vmap over a stack of q and k that share cos/sin (per position, or tables indexed by shared
    positions) runs one call with the stack folded into the batch (the rule's loop is switched off
    here, and torch's): values and gradients as a loop over the stack; a bad position still raises
    in the call with check_positions="sync"."""
    from fusedops.ops import _batching

    def no_loop(*args):
        raise AssertionError("rope's batching rule looped over the samples")

    monkeypatch.setattr(_batching, "_per_sample", no_loop)
    with vmap_fallback(False):  # (nor torch's loop)
        V, B, S, R = 3, (1 if layout == "thd" else 2), 5, 16
        stacked = [_layout_tensors(layout, device, torch.float32, B=B, S=S)[:2] for _ in range(V)]
        q, k = (torch.stack(ts).detach().requires_grad_() for ts in zip(*stacked))
        rows = B * S if layout == "thd" else S
        if indexed:
            cos, sin = torch.randn(2, 7, R, device=device).unbind(0)
            positions = torch.randint(0, 7, (rows,) if layout == "thd" else (1, S), device=device)
        else:
            cos, sin = torch.randn(2, *(() if layout == "thd" else (1,)), rows, R, device=device).unbind(0)
            positions = None

        def call(q, k, positions=positions, check_positions=True):
            return fusedops.rope(q, k, cos, sin, layout=layout, position_ids=positions,
                                 check_positions=check_positions)

        # The one call and the loop run the same kernel on the same values: bit for bit. Except
        # where Triton serves the call: thd's values came out an ulp or so apart there (H100,
        # 4.8e-7 at most, on values of order 1). Likely, not isolated: its tile's positions
        # (BLOCK_P) follow the number of positions, which the fold multiplies, and a kernel
        # compiled for another tile may contract x * c + x' * n into FMAs differently.
        exact = fusedops.ops.backend_for("rope", device) != "triton"
        tol = dict(atol=0, rtol=0) if exact else dict(atol=2e-6, rtol=2e-6)
        got = torch.func.vmap(call)(q, k)
        want = [torch.stack(outs) for outs in zip(*(call(q[i], k[i]) for i in range(V)))]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, **tol)
        grads = [torch.randn_like(w) for w in want]
        through_vmap = torch.autograd.grad(got, (q, k), grads)
        through_loop = torch.autograd.grad(want, (q, k), grads)
        for g, w in zip(through_vmap, through_loop, strict=True):
            torch.testing.assert_close(g, w, **tol)
        if indexed:
            bad = positions.clone()
            bad.view(-1)[2] = 7
            with pytest.raises(ValueError, match=r"rope: position_ids\[0, 2\] = 7 is outside the cos/sin tables' 7 rows"):
                torch.func.vmap(lambda q, k: call(q, k, bad, "sync"))(q.detach(), k.detach())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
def test_positions_out_of_range_gpu_kernels_write_nan():
    """Where eager checks do not run (the op called directly, as under torch.compile or a CUDA
    graph), the GPU kernels never read outside the tables: the rotated features of such a
    position are NaN, the others exact (compute-sanitizer runs this too)."""
    q, k = torch.randn(1, 4, 3, 32, device="cuda"), torch.randn(1, 2, 3, 32, device="cuda")
    table = torch.randn(4, 16, device="cuda")
    positions = torch.tensor([[1, 1 << 40, -3]], device="cuda")
    q_out, k_out, bad = torch.ops.fusedops.rope(q, k, table, table, positions)
    assert bad.item() == 1  # the first bad position's flat index
    good = reference(q[:, :, :1], k[:, :, :1], table, table, positions[:, :1])
    torch.testing.assert_close(q_out[:, :, :1], good[0])
    torch.testing.assert_close(k_out[:, :, :1], good[1])
    for out, x in ((q_out, q), (k_out, k)):
        assert out[:, :, 1:, :16].isnan().all()
        assert torch.equal(out[:, :, 1:, 16:], x[:, :, 1:, 16:])
    # Tables with no rows (a null pointer): every position is out of range, and no kernel reads
    # where a row would be, forward or backward.
    empty = torch.empty(0, 16, device="cuda")
    for op in (torch.ops.fusedops.rope, torch.ops.fusedops.rope_backward):
        q_out, k_out, *bad = op(q, k, empty, empty, torch.tensor([[0, 1, 2]], device="cuda"), False)
        if bad:
            assert bad[0].item() == 0
        for out, x in ((q_out, q), (k_out, k)):
            assert out[..., :16].isnan().all() and torch.equal(out[..., 16:], x[..., 16:])


_IN_THE_INTERPRETER = pytest.mark.skipif(
    HAS_CUDA or os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs the Triton kernel in Triton's interpreter on a machine without a GPU (on a GPU, "
    "test_positions_out_of_range_gpu_kernels_write_nan runs it for real)",
)


@_IN_THE_INTERPRETER
def test_triton_kernel_reads_no_row_of_an_empty_table():
    """Tables with no rows: every position is out of range, and the kernel reads nothing where a
    row would be (an empty CPU tensor's pointer is null: a read would crash the interpreter)."""
    from fusedops.ops import rope as op

    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 12)[..., :8]
    empty = torch.empty(0, 8)
    positions = torch.tensor([[0, 2, 1]])
    for name in ("rope", "rope_backward"):
        q_out, k_out, *bad = op.TRITON_IMPLS[name](q, k, empty, empty, positions, False)
        if bad:
            assert bad[0].item() == 0
        assert q_out.isnan().all() and k_out.isnan().all()


@_IN_THE_INTERPRETER
@pytest.mark.parametrize("heads_fast", [False, True])
@pytest.mark.parametrize("batch_positions", [False, True], ids=["positions_1xS", "positions_BxS"])
def test_triton_kernel_records_first_bad_position(batch_positions, heads_fast):
    """The Triton kernel over several position tiles with bad positions in more than one: the
    record is the smallest flat (batch, seq) index among them (the programs race to lower it),
    bad positions' rotated features are NaN and every other row is exact."""
    from fusedops.triton import rope as kernels

    B, S, Hq, Hk, D, R = 2, 6, 4, 2, 8, 4
    q, k = torch.randn(B, Hq, S, D, dtype=torch.float64), torch.randn(B, Hk, S, D, dtype=torch.float64)
    table = torch.randn(5, R, dtype=torch.float64)
    if batch_positions:
        positions = torch.tensor([[0, 1, 2, 3, 4, 0], [1, 2, -1, 3, 9, 0]])
        bad_rows, first = [(1, 2), (1, 4)], 8
    else:
        positions = torch.tensor([[0, 4, 7, 1, -5, 2]])
        bad_rows, first = [(b, s) for b in range(B) for s in (2, 4)], 2
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    bad = torch.full((), -1, dtype=torch.int64)
    tile = kernels.Config(block_p=2, block_hh=2, num_warps=1, heads_fast=heads_fast)
    kernels.rope(q, k, table, table, positions, False, False, q_out, k_out, bad, tile=tile)
    assert int(bad) == first
    good = positions.clamp(0, 4)
    want = reference(q, k, table, table, good.expand(B, S))
    for got, expected, x in zip((q_out, k_out), want, (q, k)):
        for b in range(B):
            for s in range(S):
                if (b, s) in bad_rows:
                    assert got[b, :, s, :R].isnan().all()
                    assert torch.equal(got[b, :, s, R:], x[b, :, s, R:])
                else:
                    torch.testing.assert_close(got[b, :, s], expected[b, :, s], rtol=1e-12, atol=1e-12)


def test_triton_kernel_writes_no_bad_position_without_positions():
    """Without position_ids the forward's record needs no preset: the kernel itself writes -1
    over whatever the tensor held (the op hands it an uninitialised one)."""
    from fusedops.triton import rope as kernels

    B, S, Hq, Hk, D = 2, 3, 2, 1, 8
    q, k = torch.randn(B, Hq, S, D, dtype=torch.float64), torch.randn(B, Hk, S, D, dtype=torch.float64)
    cos, sin = torch.randn(1, S, D, dtype=torch.float64), torch.randn(1, S, D, dtype=torch.float64)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    bad = torch.full((), 12345, dtype=torch.int64)
    kernels.rope(q, k, cos, sin, None, False, False, q_out, k_out, bad)
    assert int(bad) == -1
    want = reference(q, k, cos, sin)
    torch.testing.assert_close((q_out, k_out), want, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("heads", [(32, 8), (10, 5), (3, 3), (6, 1)])
def test_many_positions_gpu(heads, layout, dtype):
    """Enough positions and heads for many blocks, in the walk that visits a position's q and k
    heads together (full rotary, cos/sin per (batch, position)), with head counts that leave a
    partial group of heads, and a single kv head; forward and backward against float64."""
    Hq, Hk = heads
    B, S, D = 3, 67, 64
    shape = (lambda H: (B, S, H, D)) if layout == "bshd" else (lambda H: (B, H, S, D))
    q = torch.randn(shape(Hq), device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(shape(Hk), device="cuda", dtype=dtype, requires_grad=True)
    angles = torch.rand(B, S, D // 2, device="cuda", dtype=torch.float64) * 2 * math.pi
    full = torch.cat((angles, angles), -1)
    cos, sin = full.cos().to(dtype), full.sin().to(dtype)
    q_out, k_out = fusedops.rope(q, k, cos, sin, layout=layout)
    gq, gk = torch.randn_like(q_out), torch.randn_like(k_out)
    dq, dk = torch.autograd.grad((q_out, k_out), (q, k), (gq, gk))
    view = (lambda t: t.transpose(1, 2)) if layout == "bshd" else (lambda t: t)
    qd, kd = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    want = reference(view(qd), view(kd), cos.double(), sin.double())
    want_grad = torch.autograd.grad(want, (qd, kd), (view(gq).double(), view(gk).double()))
    # Each output is one rounding of an fp32 result: half a unit in the last place, 2^-9 of it
    # for bf16 (2^-12 for fp16), well inside rtol.
    for got, ref in zip((q_out, k_out), want):
        torch.testing.assert_close(view(got).double(), ref.detach(), rtol=8e-3, atol=1e-3)
    for got, ref in zip((dq, dk), want_grad):
        torch.testing.assert_close(got.double(), ref, rtol=8e-3, atol=1e-3)


# ---- RotaryEmbedding -------------------------------------------------------------------------


def _inv_freq_fp64(dim, base, scaling=None):
    """The frequencies from the formulas, in fp64: base^(-2i/dim), and LLaMA-3's scaling: long
    wavelengths (> original_max / low_freq_factor) divided by `factor`, short ones (<
    original_max / high_freq_factor) kept, and in between a blend by the smoothing factor
    (original_max / wavelength - low) / (high - low)."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if scaling is None:
        return inv
    factor, low, high, orig = (scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"],
                               scaling["original_max_position_embeddings"])
    out = []
    for f in inv.tolist():
        wavelength = 2 * math.pi / f
        if wavelength < orig / high:
            out.append(f)
        elif wavelength > orig / low:
            out.append(f / factor)
        else:
            smooth = (orig / wavelength - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return torch.tensor(out, dtype=torch.float64)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["default", "llama3"])
def test_rotary_embedding_against_formulas(scaling):
    dim, base = 128, 500000.0
    rot = fusedops.nn.RotaryEmbedding(dim, max_position_embeddings=131072, base=base, rope_scaling=scaling)
    expected = _inv_freq_fp64(dim, base, scaling)
    assert rot.inv_freq.dtype == torch.float32 and rot.inv_freq.shape == (dim // 2,)
    torch.testing.assert_close(rot.inv_freq.double(), expected, atol=0, rtol=1e-6)  # a few float32 ulps
    # The band edges of LLaMA-3 are all present in this range of frequencies.
    if scaling is not None:
        unscaled = _inv_freq_fp64(dim, base)
        assert (expected == unscaled).any() and (expected == unscaled / 8).any()
        assert ((expected != unscaled) & (expected != unscaled / 8)).any()
    position_ids = torch.tensor([[0, 1, 2, 1000, 65535], [7, 8, 9, 10, 131071]])
    x = torch.randn(2, 5, 16, dtype=torch.bfloat16)
    cos, sin = rot(x, position_ids)
    assert cos.dtype == sin.dtype == torch.bfloat16 and cos.shape == (2, 5, dim)
    # HF computes angles in float32 from the float32 inv_freq: compare in fp64 to that.
    angles = position_ids.double()[..., None] * rot.inv_freq.double()
    angles = angles.float().double()
    full = torch.cat((angles, angles), dim=-1)
    cos32, sin32 = rot(x.float(), position_ids)
    torch.testing.assert_close(cos32.double(), full.cos(), atol=1e-5, rtol=0)
    torch.testing.assert_close(sin32.double(), full.sin(), atol=1e-5, rtol=0)
    torch.testing.assert_close(cos, cos32.to(torch.bfloat16), atol=0, rtol=0)


def test_rotary_embedding_module_behaviour():
    rot = fusedops.nn.RotaryEmbedding(64)
    assert "inv_freq" not in rot.state_dict()  # a non-persistent buffer, as in HF
    assert rot.attention_scaling == 1.0
    with pytest.raises(ValueError, match=r"RotaryEmbedding: dim must be a positive even number, got 7"):
        fusedops.nn.RotaryEmbedding(7)
    with pytest.raises(TypeError, match=r"RotaryEmbedding: dim must be an integer, got float"):
        fusedops.nn.RotaryEmbedding(64.0)
    # Integers of other types, as torch's modules take them (a config's numpy value, say).
    assert fusedops.nn.RotaryEmbedding(np.int64(64)).dim == 64 == fusedops.nn.RotaryEmbedding(torch.tensor(64)).dim
    with pytest.raises(ValueError, match=r"RotaryEmbedding: rope_type 'yarn' is not supported"):
        fusedops.nn.RotaryEmbedding(64, rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match=r"RotaryEmbedding: llama3 rope_scaling needs 'low_freq_factor'"):
        fusedops.nn.RotaryEmbedding(64, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    # A rope_scaling that names no rotation is refused (Hugging Face refuses it too), not read as
    # the default one; the older "type" key names it as well.
    no_type = {k: v for k, v in LLAMA3.items() if k != "rope_type"}
    message = r"rope_scaling must name its rotation with 'rope_type' \(or 'type'\), got keys \['factor', "
    with pytest.raises(ValueError, match=message):
        fusedops.nn.RotaryEmbedding(64, rope_scaling=no_type)
    with pytest.raises(ValueError, match=r"got \['default', 'llama3'\]"):
        fusedops.nn.RotaryEmbedding(64, rope_scaling={**LLAMA3, "type": "default"})
    legacy = fusedops.nn.RotaryEmbedding(64, rope_scaling={**no_type, "type": "llama3"})
    assert torch.equal(legacy.inv_freq, fusedops.nn.RotaryEmbedding(64, rope_scaling=LLAMA3).inv_freq)
    # (the device given one place early lands in rope_scaling)
    with pytest.raises(TypeError, match=r"RotaryEmbedding: rope_scaling must be a dict .* or None, got str"):
        fusedops.nn.RotaryEmbedding(64, 2048, 10000.0, "cpu")
    # The module keeps its own copy of rope_scaling: editing the config afterwards changes nothing,
    # not even the inv_freq formed again after .to().
    scaling = dict(LLAMA3)
    llama3 = fusedops.nn.RotaryEmbedding(64, rope_scaling=scaling)
    before = llama3.inv_freq.clone()
    scaling["factor"] = 2.0
    assert torch.equal(llama3.to(torch.float64).inv_freq, before) and llama3.rope_scaling == LLAMA3
    # On the meta device, where a model is built for its shapes (no autocast there to turn off).
    meta = fusedops.nn.RotaryEmbedding(64, device="meta")
    cos, sin = meta(torch.empty(2, 5, 8, device="meta", dtype=torch.bfloat16), torch.arange(5, device="meta")[None])
    assert cos.shape == sin.shape == (1, 5, 64) and cos.dtype == torch.bfloat16 and cos.device.type == "meta"
    # The table follows x to its device (Hugging Face's rotary modules move it the same way).
    cos, _ = rot(torch.empty(2, 5, 8, device="meta"), torch.arange(5, device="meta")[None])
    assert cos.device.type == "meta" and rot.inv_freq.device.type == "cpu"
    x = torch.randn(1, 3, 8)
    cos, sin = torch.compile(rot, fullgraph=True)(x, torch.arange(3)[None])
    torch.testing.assert_close(cos, rot(x, torch.arange(3)[None])[0])


_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize("scaling", [None, _LLAMA3])
def test_rotary_embedding_keeps_float32_frequencies(scaling):
    """inv_freq is formed again in float32 after a module cast (model.to(torch.bfloat16)) and
    after to_empty() (a model built on the meta device), where a cast would have rounded it and
    to_empty left it uninitialised; no state dict carries it to repair either."""
    expected = fusedops.nn.RotaryEmbedding(128, base=500000.0, rope_scaling=scaling).inv_freq
    position_ids = torch.tensor([[0, 1, 1000, 100000]])
    x = torch.randn(1, 4, 8, dtype=torch.bfloat16)
    for rot in (
        fusedops.nn.RotaryEmbedding(128, base=500000.0, rope_scaling=scaling).to(torch.bfloat16),
        fusedops.nn.RotaryEmbedding(128, base=500000.0, rope_scaling=scaling).half().double(),
    ):
        assert rot.inv_freq.dtype == torch.float32
        assert torch.equal(rot.inv_freq, expected)
    with torch.device("meta"):
        rot = fusedops.nn.RotaryEmbedding(128, base=500000.0, rope_scaling=scaling)
    assert rot.inv_freq.is_meta
    rot.to_empty(device="cpu")
    assert torch.equal(rot.inv_freq, expected)
    cos, sin = rot(x, position_ids)
    angles = position_ids[..., None].float() * expected
    torch.testing.assert_close(cos, torch.cat((angles, angles), -1).cos().to(torch.bfloat16), atol=0, rtol=0)
