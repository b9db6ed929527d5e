"""rope samples for the generic suites. Samples are the op's arguments, in its one logical layout
(q (B, Hq, S, D), k (B, Hk, S, D)); the public layouts appear as the views fusedops.rope makes
of them (bshd: q.transpose(1, 2); thd: packed tokens as a batch of one with position_ids). The
in-place form rope_ runs through opcheck as a variant; tests/test_rope.py covers the layouts by
name, the in-place semantics, RotaryEmbedding and the op-specific errors."""

import math

import torch

import fusedops
from fusedops.ops import rope as _op

from . import ErrorSample, OpTestInfo, PublicVariant, Sample, Tolerance


def rotate(x, interleaved):
    """rotate-half [-x2, x1], or rotate-every-two (x0, x1) -> (-x1, x0) per pair."""
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def reference(q, k, cos, sin, position_ids=None, interleaved=False):
    """(q_out, k_out) in the inputs' dtype (fp64 in tests), written from the definition."""
    if position_ids is not None:
        index = position_ids.long()  # (the generic suites pass every tensor as float64)
        cos, sin = cos[index], sin[index]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    R = c.shape[-1]

    def apply(x):
        xr = x[..., :R]
        return torch.cat((xr * c + rotate(xr, interleaved) * s, x[..., R:]), dim=-1)

    return apply(q), apply(k)


def public(q, k, cos, sin, position_ids=None, interleaved=False):
    """fusedops.rope with the op's argument order (layout "bhsd": the samples are its views)."""
    return fusedops.rope(q, k, cos, sin, position_ids=position_ids, interleaved=interleaved)


def inplace_public(q, k, cos, sin, position_ids=None, interleaved=False):
    """fusedops.rope_ with rope's results, on copies of q and k."""
    return fusedops.rope_(q.clone(), k.clone(), cos, sin, position_ids=position_ids, interleaved=interleaved)


def table_dtypes(dtype):
    return (dtype, torch.float32) if dtype in (torch.bfloat16, torch.float16) else (dtype,)


def _t(shape, dtype, device, requires_grad=False):
    return torch.randn(shape, dtype=dtype, device=device).requires_grad_(requires_grad)


def _rotation_tables(positions, R, dtype, device, interleaved=False, base=10000.0):
    """cos/sin of a real rotation (angles position * base^(-2i/R)), duplicated the way each
    convention expects: halves for rotate-half, per pair for interleaved."""
    inv = base ** (-torch.arange(0, R, 2, dtype=torch.float64, device=device) / R)
    angles = positions.to(torch.float64)[..., None] * inv
    full = torch.repeat_interleave(angles, 2, dim=-1) if interleaved else torch.cat((angles, angles), dim=-1)
    return full.cos().to(dtype), full.sin().to(dtype)


def _qk(B, Hq, Hk, S, D, dtype, device, rg, layout="bhsd"):
    if layout == "bshd":  # the op sees (B, S, H, D) tensors through a transpose
        return (_t((B, S, Hq, D), dtype, device, rg).transpose(1, 2), _t((B, S, Hk, D), dtype, device, rg).transpose(1, 2))
    return _t((B, Hq, S, D), dtype, device, rg), _t((B, Hk, S, D), dtype, device, rg)


def samples(device, dtype, requires_grad=False, edge=True):
    rg = requires_grad
    for cdt in table_dtypes(dtype):
        cname = str(cdt).removeprefix("torch.")
        # (B, Hq, Hk, S, D, R, batch of cos, interleaved, layout, what)
        for B, Hq, Hk, S, D, R, cb, inter, layout, what in [
            (2, 4, 4, 5, 16, 16, 2, False, "bhsd", "MHA"),
            (2, 6, 2, 7, 32, 32, 1, False, "bhsd", "GQA cos-batch-1"),
            (1, 4, 2, 6, 64, 32, 1, False, "bhsd", "partial R=32/64"),
            (2, 4, 2, 3, 16, 16, 2, True, "bhsd", "interleaved"),
            (1, 2, 1, 5, 24, 8, 1, True, "bhsd", "interleaved partial R=8/24"),
            (2, 4, 2, 5, 16, 16, 2, False, "bshd", "bshd"),
            (1, 3, 1, 4, 40, 40, 1, False, "bshd", "bshd D=40"),
            (1, 2, 2, 3, 6, 2, 1, False, "bhsd", "R=2"),
        ]:
            q, k = _qk(B, Hq, Hk, S, D, dtype, device, rg, layout)
            yield Sample((q, k, _t((cb, S, R), cdt, device), _t((cb, S, R), cdt, device), None, inter),
                         f"{what} {layout} q{list(q.shape)} k{list(k.shape)} cos_{cname}")
        # Packed variable-length sequences (thd): tokens of sequences of lengths 4, 1 and 6 with
        # their own positions, as the op sees them: a batch of one.
        lengths = (4, 1, 6)
        positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
        T = positions.numel()
        for inter, pdt in ((False, torch.int32), (True, torch.int64)):
            q = _t((T, 4, 16), dtype, device, rg).unsqueeze(0).transpose(1, 2)
            k = _t((T, 2, 16), dtype, device, rg).unsqueeze(0).transpose(1, 2)
            cos, sin = _rotation_tables(torch.arange(8, device=device), 16, cdt, device, inter)
            yield Sample((q, k, cos, sin, positions.to(pdt)[None], inter),
                         f"thd varlen T={T} positions_{pdt} interleaved={inter} cos_{cname}")
        # Per-batch position ids (B, S) into (P, R) tables: left-padded batches, a real rotation.
        pos = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]], device=device)
        q, k = _qk(2, 4, 2, 5, 32, dtype, device, rg)
        cos, sin = _rotation_tables(torch.arange(16, device=device), 32, cdt, device)
        yield Sample((q, k, cos, sin, pos, False), f"position_ids (B, S) into tables cos_{cname}")
    if not edge:
        return
    for shape_q, shape_k, shape_c in [
        ((0, 4, 5, 8), (0, 2, 5, 8), (1, 5, 8)),  # empty batch
        ((2, 4, 0, 8), (2, 2, 0, 8), (2, 0, 8)),  # empty sequence
        ((2, 0, 3, 8), (2, 0, 3, 8), (2, 3, 8)),  # no heads
        ((2, 2, 3, 8), (2, 2, 3, 8), (2, 3, 0)),  # R = 0: every feature passes through
    ]:
        q, k = _t(shape_q, dtype, device, rg), _t(shape_k, dtype, device, rg)
        yield Sample((q, k, _t(shape_c, dtype, device), _t(shape_c, dtype, device), None, False),
                     f"edge q{list(shape_q)} cos{list(shape_c)}")
    # Odd strides and an odd base offset (no 16-byte access possible): slices of wider buffers.
    q = _t((2, 3, 5, 19), dtype, device, rg)[:, :, :, 1:17]
    k = _t((2, 7, 5, 17), dtype, device, rg)[:, ::7, :, 1:]
    c = _t((2, 5, 13), dtype, device)[..., 1:13]
    s = _t((2, 5, 13), dtype, device)[..., 1:13]
    yield Sample((q, k, c, s, None, False), "odd strides R=12/16")
    yield Sample((q, k, c, s, None, True), "odd strides interleaved R=12/16")


def sample_for_shape(device, dtype, shape, requires_grad=False):
    rows, n = math.prod(shape[:-1]), shape[-1]
    # (head counts unlike the generic suites' row counts, which duck sizing would tie together)
    q = _t((1, 6, rows, n), dtype, device, requires_grad)
    k = _t((1, 3, rows, n), dtype, device, requires_grad)
    cdt = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    cos, sin = _rotation_tables(torch.arange(rows, device=device)[None], n, cdt, device)
    return Sample((q, k, cos, sin, None, False), f"q{list(q.shape)}")


def error_samples(device):
    other = "meta" if device != "meta" else "cpu"
    q, k = torch.randn(2, 4, 5, 8, device=device), torch.randn(2, 2, 5, 8, device=device)
    c, s = torch.randn(1, 5, 8, device=device), torch.randn(1, 5, 8, device=device)

    def bad(args, match, desc, op=None, on_values=False):
        return ErrorSample(Sample(args, desc), ValueError, match, op=op, on_values=on_values)

    yield bad((torch.randn(2, 6, 5, 8, device=device), k.repeat(1, 2, 1, 1), c, s),
              r"rope: q has 6 heads, which is not a multiple of k's 4 heads \(grouped-query attention\)", "GQA heads")
    yield bad((q, k, torch.randn(1, 5, 7, device=device), torch.randn(1, 5, 7, device=device)),
              r"rope: the rotary dimension cos.size\(-1\) = 7 must be even and at most head_dim q.size\(-1\) = 8", "R odd")
    yield bad((q, k, torch.randn(1, 5, 10, device=device), torch.randn(1, 5, 10, device=device)),
              r"rope: the rotary dimension cos.size\(-1\) = 10 must be even and at most head_dim", "R > D")
    yield bad((q, k, torch.randn(1, 4, 8, device=device), torch.randn(1, 4, 8, device=device)),
              r"rope: cos must have shape \(1 or batch, seq, rotary_dim\) = \(1 or 2, 5, rotary_dim\) without "
              r"position_ids, got shape \[1, 4, 8\]", "cos seq")
    yield bad((q, k, torch.randn(3, 5, 8, device=device), torch.randn(3, 5, 8, device=device)),
              r"rope: cos must have shape \(1 or batch, seq, rotary_dim\)", "cos batch")
    yield bad((q, k, c, torch.randn(1, 5, 6, device=device)),
              r"rope: sin shape \[1, 5, 6\] does not match cos shape \[1, 5, 8\]", "sin shape")
    yield bad((q, k.half(), c, s), r"rope: k dtype float16 does not match q dtype float32", "k dtype")
    yield bad((q.bfloat16(), k.bfloat16(), c.double(), s.double()),
              r"rope: cos dtype float64 does not go with q dtype bfloat16: use q's dtype, or float32 with "
              r"bfloat16/float16 q", "cos dtype")
    yield bad((q, k, c.half(), s.half()), r"rope: cos dtype float16 does not go with q dtype float32", "cos fp16 q fp32")
    yield bad((q, k, c, s.double()), r"rope: sin dtype float64 does not match cos dtype float32", "sin dtype")
    yield bad((q.int(), k.int(), c, s), r"rope: q dtype must be float32, bfloat16, float16 or float64, got int32", "int q")
    yield bad((torch.tensor(1.0, device=device), k, c, s),
              r"rope: q must be a 4-D \(batch, heads, seq, head_dim\) tensor, got a 0-dimensional tensor", "0-d q")
    yield bad((q, torch.randn(2, 5, 8, device=device), c, s),
              r"rope: k must be a 4-D \(batch, heads, seq, head_dim\) tensor, got shape \[2, 5, 8\]", "3-d k")
    yield bad((q, torch.randn(2, 2, 5, 6, device=device), c, s),
              r"rope: k shape \[2, 2, 5, 6\] does not go with q shape \[2, 4, 5, 8\]: batch, sequence and head_dim "
              r"must match", "k head_dim")
    yield bad((q, k, torch.tensor(1.0, device=device), torch.tensor(1.0, device=device)),
              r"rope: cos must be a floating-point tensor of at least 1 dimension, got a 0-dimensional tensor", "0-d cos")
    yield bad((q, torch.randn(2, 2, 5, 8, device=other), c, s), r"rope: k is on (meta|cpu) but q is on", "k device")
    yield bad((q, k, torch.randn(1, 5, 8, device=other), torch.randn(1, 5, 8, device=other)),
              r"rope: cos is on (meta|cpu) but q is on", "cos device")
    table = torch.randn(16, 8, device=device)
    pos = torch.arange(5, device=device)[None]
    yield bad((q, k, table, table, pos.float()), r"rope: position_ids dtype must be int32 or int64, got float32",
              "position dtype")
    yield bad((q, k, table, table, pos[:, :4]),
              r"rope: position_ids must have shape \(1 or batch, seq\) = \(1 or 2, 5\), got shape \[1, 4\]",
              "position shape")
    yield bad((q, k, c, s, pos),
              r"rope: with position_ids, cos and sin must be \(max_positions, rotary_dim\) tables, got cos shape "
              r"\[1, 5, 8\]", "tables with positions")
    yield bad((q, k, table, table, torch.arange(5, device=other)[None]),
              r"rope: position_ids is on (meta|cpu) but q is on", "position device")
    if device == "cpu":  # values are seen by the CPU kernel only (GPU: tests/test_rope.py)
        yield bad((q, k, table, table, torch.tensor([[0, 1, 2, 16, 3]], device=device)),
                  r"rope: position_ids\[0, 3\] = 16 is outside the cos/sin tables' 16 rows",
                  "position too large", on_values=True)
        yield bad((q, k, table, table, torch.tensor([[0, 1, -1, 2, 3]], device=device, dtype=torch.int32)),
                  r"rope: position_ids\[0, 2\] = -1 is outside the cos/sin tables' 16 rows",
                  "negative position", on_values=True)
    # The in-place form checks the same way, under its own name, and refuses expanded rows.
    yield bad((torch.randn(2, 6, 5, 8, device=device), k.repeat(1, 2, 1, 1), c, s),
              r"rope_: q has 6 heads, which is not a multiple of k's 4 heads", "in-place GQA heads", op=_op.forward_)
    yield bad((torch.randn(1, 4, 5, 8, device=device).expand(2, 4, 5, 8), k, c, s),
              r"rope_: q has rows that share memory \(an expanded tensor\?\), so it cannot be written in place",
              "in-place expanded q", op=_op.forward_)
    if device != "meta":  # (a fake tensor has no address: the fake kernel cannot tell these apart)
        buf = torch.randn(2 * 4 * 5 * 8 + 40, device=device)
        for q_, k_, desc in ((q, q, "q is k"), (buf[:320].view(2, 4, 5, 8), buf[40:].view(2, 4, 5, 8), "q overlaps k")):
            yield bad((q_, k_, c, s), r"rope_: q and k share memory \(the same tensor, or overlapping views\), so they "
                      r"cannot both be rotated in place", "in-place " + desc, op=_op.forward_)
        # A table inside q or k would be read half rotated.
        q_, k_ = q.clone(), k.clone()
        yield bad((q_, k_, q_[1, 2][None], s), r"rope_: cos shares memory with q, which is rotated in place; pass a "
                  r"cos that does not overlap q or k", "in-place cos inside q", op=_op.forward_)
        yield bad((q_, k_, c, k_[0, 1][None]), r"rope_: sin shares memory with k, which is rotated in place",
                  "in-place sin inside k", op=_op.forward_)
    # The backward op checks the gradients against each other and the tables.
    bwd = _op.backward
    for args, match, desc in [
        ((q, k.half(), c, s, None, False), r"rope_backward: grad_k_out dtype float16 does not match grad_q_out dtype "
         r"float32", "bwd grad dtype"),
        ((None, k, torch.randn(1, 4, 8, device=device), torch.randn(1, 4, 8, device=device), None, False),
         r"rope_backward: cos must have shape \(1 or batch, seq, rotary_dim\) = \(1 or 2, 5, rotary_dim\)",
         "bwd cos seq (k only)"),
        ((q.bfloat16(), None, c.double(), s.double(), None, False),
         r"rope_backward: cos dtype float64 does not go with grad_q_out dtype bfloat16", "bwd cos dtype"),
    ]:
        yield ErrorSample(Sample(args, desc), ValueError, match, op=bwd)


def strided_samples(device, dtype):
    """q and k as arbitrary permutations and slices of larger buffers (possibly an expanded
    batch), cos/sin sliced or broadcast, with or without position_ids."""
    from hypothesis import strategies as st

    @st.composite
    def strided(draw):
        B, S, Hk = draw(st.integers(1, 3)), draw(st.integers(1, 5)), draw(st.integers(1, 3))
        Hq = Hk * draw(st.integers(1, 3))
        D = draw(st.sampled_from([2, 6, 8, 16, 24, 64]))
        R = 2 * draw(st.integers(0 if D > 2 else 1, D // 2))
        inter = draw(st.booleans())

        def make(H):
            order = draw(st.permutations([0, 1, 2]))  # storage order of (B, H, S)
            steps = [draw(st.integers(1, 2)) for _ in range(3)]
            pad = draw(st.sampled_from([0, 0, 3]))
            logical = [B, H, S]
            storage = [logical[i] * steps[i] for i in order] + [D + pad]
            base = torch.randn(storage, dtype=dtype, device=device)[..., pad:]
            inverse = [order.index(i) for i in range(3)] + [3]
            t = base.permute(*inverse)
            t = t[tuple(slice(None, None, st_) for st_ in steps)]
            if B > 1 and draw(st.integers(0, 4)) == 0:
                t = t[:1].expand(B, *t.shape[1:])  # a stride-0 batch
            return t

        q, k = make(Hq), make(Hk)
        pad = draw(st.sampled_from([0, 2]))
        if draw(st.booleans()):
            P = S + 3
            cos = torch.randn(P, R + pad, dtype=dtype, device=device)[:, pad:]
            sin = torch.randn(P, R + pad, dtype=dtype, device=device)[:, pad:]
            pos = torch.randint(0, P, (draw(st.sampled_from([1, B])), S), device=device)
        else:
            cb = draw(st.sampled_from([1, B]))
            cos = torch.randn(cb, S, R + pad, dtype=dtype, device=device)[..., pad:]
            sin = torch.randn(cb, S, R + pad, dtype=dtype, device=device)[..., pad:]
            if cb == 1 and B > 1 and draw(st.booleans()):
                cos, sin = cos.expand(B, S, R), sin.expand(B, S, R)
            pos = None
        return Sample((q, k, cos, sin, pos, inter),
                      f"q{list(q.shape)} stride={list(q.stride())} k stride={list(k.stride())} R={R} "
                      f"pos={pos is not None} interleaved={inter}")

    return strided()


def check_autocast(device):
    """Nothing is cast (outputs keep q's dtype), except cos/sin whose dtype goes with neither
    q's nor float32, which are cast to q's."""
    amp = torch.bfloat16 if device == "cpu" else torch.float16
    for qdt, cdt in [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                     (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float64), (torch.float32, torch.bfloat16)]:
        q = torch.randn(2, 4, 6, 16, dtype=qdt, device=device)
        k = torch.randn(2, 2, 6, 16, dtype=qdt, device=device)
        c = torch.randn(1, 6, 16, dtype=cdt, device=device)
        s = torch.randn(1, 6, 16, dtype=cdt, device=device)
        with torch.autocast(device_type=device, dtype=amp):
            qo, ko = fusedops.rope(q, k, c, s)
        assert (qo.dtype, ko.dtype) == (qdt, qdt), (qdt, cdt, qo.dtype, ko.dtype)
        ok = _op.cos_dtype_ok(qdt, cdt)
        eq, ek = fusedops.rope(q, k, c if ok else c.to(qdt), s if ok else s.to(qdt))
        torch.testing.assert_close(qo, eq, atol=0, rtol=0)
        torch.testing.assert_close(ko, ek, atol=0, rtol=0)


def backward_args(sample, outputs, grad_output):
    _q, _k, cos, sin, pos, inter = sample.args
    return (grad_output, torch.randn_like(outputs[1]), cos, sin, pos, inter)


def inplace_args(sample):
    """The in-place form's arguments for `sample`, on copies of q and k (their strides kept)."""
    args = [a.detach() if isinstance(a, torch.Tensor) else a for a in sample.args]
    args[0], args[1] = args[0].clone(), args[1].clone()
    return tuple(args)


def check_large_input(device):
    """64-bit offsets: q of more than 2^31 elements (heads x head stride past 2^31); its last
    heads and k are right."""
    B, Hq, Hk, S, D = 1, 16400, 8, 1024, 128
    try:
        q = torch.randn(B, Hq, S, D, dtype=torch.bfloat16, device=device)
    except torch.OutOfMemoryError:
        import pytest

        pytest.skip("not enough GPU memory for a 2^31-element tensor")
    assert q.numel() > 2**31
    k = torch.randn(B, Hk, S, D, dtype=torch.bfloat16, device=device)
    cos, sin = _rotation_tables(torch.arange(S, device=device)[None], D, torch.float32, device)
    q_out, k_out = fusedops.rope(q, k, cos, sin)
    for part in (slice(Hq - 8, Hq), slice(0, 8)):
        eq, ek = reference(q[:, part].double(), k.double(), cos.double(), sin.double())
        torch.testing.assert_close(q_out[:, part].double(), eq, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(k_out.double(), ek, atol=2e-2, rtol=2e-2)


# One rounding of the output (the math is float32, as is the reference's fp64 up to that); the
# gradients are rotations too (no sums grow with the size).
TOL = {
    torch.float32: Tolerance(atol=1e-5, rtol=1e-5),
    torch.bfloat16: Tolerance(atol=1e-2, rtol=1e-2),
    torch.float16: Tolerance(atol=2e-3, rtol=2e-3),
    torch.float64: Tolerance(atol=1e-12, rtol=1e-12),
}
GRAD_TOL = TOL

INFO = OpTestInfo(
    name="rope",
    op=_op.forward,
    public=public,
    reference=reference,
    samples=samples,
    sample_for_shape=sample_for_shape,
    error_samples=error_samples,
    strided_samples=strided_samples,
    backward_ops=(_op.backward,),
    backward_args=backward_args,
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
    tol=TOL,
    grad_tol=GRAD_TOL,
    grad_argnums=(0, 1),
    autocast_check=check_autocast,
    torch_equivalent=reference,
    output_dtype_argnums=(0, 1),
    variant_ops=((_op.forward_, inplace_args),),
    public_variants=(PublicVariant("rope_", inplace_public),),
    double_backward=True,
    large_input_check=check_large_input,
)
