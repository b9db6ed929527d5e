"""rope, its in-place form rope_ and rope_backward: fake kernels, autograd, autocast rule and
Triton hook-up.

Schemas (csrc/registration.cpp):
    rope(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor? position_ids=None,
         bool interleaved=False) -> (Tensor q_out, Tensor k_out, Tensor bad_position)
    rope_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, Tensor? position_ids=None,
          bool interleaved=False) -> Tensor bad_position
    rope_backward(Tensor? grad_q_out, Tensor? grad_k_out, Tensor cos, Tensor sin,
                  Tensor? position_ids, bool interleaved) -> (Tensor grad_q, Tensor grad_k)

bad_position (0-d int64) is the flat (batch, seq) index of the first position outside the
cos/sin tables, or -1. The GPU kernels write NaN for such a position's rotated features rather
than read out of bounds, and record it there; the public functions raise for it without a
synchronisation (ops/_deferred.py). The CPU kernel raises itself.

The op sees one logical layout: q (B, Hq, S, D) and k (B, Hk, S, D), any strides; the public
function (fusedops.rope) turns "bshd" and packed "thd" inputs into views of it. The math is in
csrc/include/fusedops/rope.h.

Saved for backward: cos, sin and position_ids only (no activation): the rotation is linear, so
its gradient is the transposed rotation of the incoming gradient, rope_backward. That is linear
too, and its gradient is the forward rotation again: double (and any higher) backward is
rope / rope_backward. Gradients with respect to cos and sin are not computed: the public
function and the registered autograd raise when they would be needed.

rope_ rotates q and k where they are (its schema declares both mutations; torch.compile
functionalises it) and has no autograd: it raises when called on tensors that require grad
with grad mode on, and bumps q's and k's version counters.

Autocast rule (CPU and CUDA): nothing is cast, except cos and sin when their dtype goes with
neither q's nor float32 (they are then cast to q's dtype). The kernels compute in float32
whatever the storage dtype; outputs keep q's and k's dtype.
"""

import torch

from . import _deferred, _direct, _norm

forward = torch.ops.fusedops.rope.default
forward_ = torch.ops.fusedops.rope_.default
backward = torch.ops.fusedops.rope_backward.default

FLOAT_DTYPES = _norm.FLOAT_DTYPES
NARROW = _norm.NARROW
dtype_name = _norm.dtype_name
shape_str = _norm.shape_str
_same_device = _norm._same_device


def _dims_str(t):
    return "a 0-dimensional tensor" if t.dim() == 0 else f"shape {shape_str(t)}"


def _device_str(t):
    return "cpu" if t.device.type == "cpu" else str(t.device)


def _check_qk(op, name, t):
    """t's shape, after the checks of its rank and dtype."""
    shape = t.shape
    if len(shape) != 4:
        raise ValueError(f"{op}: {name} must be a 4-D (batch, heads, seq, head_dim) tensor, got {_dims_str(t)}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: {name} dtype must be float32, bfloat16, float16 or float64, got {dtype_name(t.dtype)}")
    return shape


def cos_dtype_ok(x_dtype, cos_dtype):
    """cos/sin are in q's dtype, or float32 with bfloat16/float16 q."""
    return cos_dtype == x_dtype or (x_dtype in NARROW and cos_dtype == torch.float32)


def check(op, qn, kn, q, k, cos, sin, position_ids):
    """The checks of csrc/include/fusedops/rope.h (make_problem), in the same words. `q` or `k`
    may be None (a backward's absent gradient). Each tensor's metadata is read once."""
    _norm.check_given(op, cos=cos, sin=sin)
    qs = _check_qk(op, qn, q) if q is not None else None
    ks = _check_qk(op, kn, k) if k is not None else None
    ref, refn, rs = (q, qn, qs) if q is not None else (k, kn, ks)
    if q is not None and k is not None:
        if k.dtype != q.dtype:
            raise ValueError(f"{op}: {kn} dtype {dtype_name(k.dtype)} does not match {qn} dtype {dtype_name(q.dtype)}")
        if not _same_device(k, q):
            raise ValueError(f"{op}: {kn} is on {_device_str(k)} but {qn} is on {_device_str(q)}")
        if ks[0] != qs[0] or ks[2] != qs[2] or ks[3] != qs[3]:
            raise ValueError(
                f"{op}: {kn} shape {shape_str(k)} does not go with {qn} shape {shape_str(q)}: "
                "batch, sequence and head_dim must match"
            )
        if ks[1] != 0 and qs[1] % ks[1] != 0:
            raise ValueError(
                f"{op}: {qn} has {qs[1]} heads, which is not a multiple of {kn}'s {ks[1]} heads "
                "(grouped-query attention)"
            )
    cs, cos_dtype = cos.shape, cos.dtype
    if len(cs) < 1 or cos_dtype not in FLOAT_DTYPES:
        got = "a 0-dimensional tensor" if len(cs) == 0 else f"{dtype_name(cos_dtype)} {_dims_str(cos)}"
        raise ValueError(f"{op}: cos must be a floating-point tensor of at least 1 dimension, got {got}")
    if sin.shape != cs:
        raise ValueError(f"{op}: sin shape {shape_str(sin)} does not match cos shape {shape_str(cos)}")
    if sin.dtype != cos_dtype:
        raise ValueError(f"{op}: sin dtype {dtype_name(sin.dtype)} does not match cos dtype {dtype_name(cos_dtype)}")
    if ref is not None:
        if not cos_dtype_ok(ref.dtype, cos_dtype):
            raise ValueError(
                f"{op}: cos dtype {dtype_name(cos_dtype)} does not go with {refn} dtype {dtype_name(ref.dtype)}: "
                f"use {refn}'s dtype, or float32 with bfloat16/float16 {refn}"
            )
        for name, t in (("cos", cos), ("sin", sin)):
            if not _same_device(t, ref):
                raise ValueError(f"{op}: {name} is on {_device_str(t)} but {refn} is on {_device_str(ref)}")
    B, S, D = (rs[0], rs[2], rs[3]) if ref is not None else (0, 0, 0)
    if position_ids is not None:
        if position_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{op}: position_ids dtype must be int32 or int64, got {dtype_name(position_ids.dtype)}")
        if ref is not None:
            ps = position_ids.shape
            if not (len(ps) == 2 and ps[0] in (1, B) and ps[1] == S):
                raise ValueError(
                    f"{op}: position_ids must have shape (1 or batch, seq) = (1 or {B}, {S}), got {_dims_str(position_ids)}"
                )
            if not _same_device(position_ids, ref):
                raise ValueError(
                    f"{op}: position_ids is on {_device_str(position_ids)} but {refn} is on {_device_str(ref)}"
                )
        if len(cs) != 2:
            raise ValueError(
                f"{op}: with position_ids, cos and sin must be (max_positions, rotary_dim) tables, got cos {_dims_str(cos)}"
            )
    elif ref is not None:
        if not (len(cs) == 3 and cs[0] in (1, B) and cs[1] == S):
            raise ValueError(
                f"{op}: cos must have shape (1 or batch, seq, rotary_dim) = (1 or {B}, {S}, rotary_dim) without "
                f"position_ids, got {_dims_str(cos)}"
            )
    R = cs[-1]
    if ref is not None and not (R % 2 == 0 and R <= D):
        raise ValueError(
            f"{op}: the rotary dimension cos.size(-1) = {R} must be even and at most head_dim {refn}.size(-1) = {D}"
        )


def check_forward(q, k, cos, sin, position_ids=None, op="rope"):
    _norm.check_given(op, q=q, k=k)
    check(op, "q", "k", q, k, cos, sin, position_ids)
    if op == "rope_":
        for name, t in (("q", q), ("k", k)):
            if t.numel() > 0 and _norm.may_overlap(t):
                raise ValueError(
                    f"rope_: {name} has rows that share memory (an expanded tensor?), so it cannot be written in "
                    f"place; pass a contiguous {name}"
                )
        if _norm.overlap(q, k) is not None:
            raise ValueError(
                "rope_: q and k share memory (the same tensor, or overlapping views), so they cannot both be "
                "rotated in place; pass tensors that do not overlap"
            )
        # (the tables are read while q and k are written: one inside either would be read half rotated)
        for name, table in (("cos", cos), ("sin", sin)):
            for written_name, written in (("q", q), ("k", k)):
                if _norm.overlap(table, written) is not None:
                    raise ValueError(
                        f"rope_: {name} shares memory with {written_name}, which is rotated in place; pass a "
                        f"{name} that does not overlap q or k (a clone)"
                    )


def check_backward(grad_q_out, grad_k_out, cos, sin, position_ids):
    check("rope_backward", "grad_q_out", "grad_k_out", grad_q_out, grad_k_out, cos, sin, position_ids)


def check_positions_mode(op, mode):
    return _deferred.check_mode(mode, op, "check_positions")


def gpu_position_check(op, mode, q, compiling):
    """The public functions' eager position check on a GPU (ops/_deferred.py), or None."""
    return _deferred.GpuCheck.start(op, "check_positions", "position_ids", mode, q, compiling)


def position_message(op, position_ids, rows):
    """For a GpuCheck (ops/_deferred.py): the error for bad_position `index`, a flat index
    into position_ids (1 or B, S) (reads the value)."""

    def message(index):
        b, s = divmod(index, position_ids.shape[1])
        value = int(position_ids[b, s])
        return f"{op}: position_ids[{b}, {s}] = {value} is outside the cos/sin tables' {rows} rows"

    return message


# ---- fake kernels ----------------------------------------------------------------------------


def _keeps_strides(shape, stride, t):
    return (shape[-1] <= 1 or stride[-1] == 1) and _norm.non_overlapping_and_dense(t, shape, stride)


def output_like(t):
    """csrc/include/fusedops/rope.h's rule: t's strides when dense with a unit-stride last
    dimension, else dense in t's order of dimensions: the leading ones with an order in memory
    (size 2 or more, stride not 0) outermost first by decreasing stride (ties in logical order)
    in the places such dimensions hold, the others (size 1, broadcast) where they are, the last
    innermost."""
    shape, stride = t.shape, t.stride()
    if _keeps_strides(shape, stride, t):
        return torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device)
    order = list(range(len(shape)))
    places = [d for d in order[:-1] if shape[d] >= 2 and stride[d] != 0]
    # (sorted keeps ties in their order under reverse=True too)
    for place, d in zip(places, sorted(places, key=lambda d: stride[d], reverse=True)):
        order[place] = d
    out = torch.empty([shape[d] for d in order], dtype=t.dtype, device=t.device)
    return out.permute([order.index(d) for d in range(len(shape))])


def _bad_position_like(q):
    return q.new_empty((), dtype=torch.int64)


def _absent_like(present, cos):
    like = present if present is not None else cos
    return like.new_empty((0,))


@torch.library.register_fake("fusedops::rope")
def _forward_fake(q, k, cos, sin, position_ids=None, interleaved=False):
    check_forward(q, k, cos, sin, position_ids)
    return output_like(q), output_like(k), _bad_position_like(q)


@torch.library.register_fake("fusedops::rope_")
def _forward_inplace_fake(q, k, cos, sin, position_ids=None, interleaved=False):
    check_forward(q, k, cos, sin, position_ids, op="rope_")
    return _bad_position_like(q)


@torch.library.register_fake("fusedops::rope_backward")
def _backward_fake(grad_q_out, grad_k_out, cos, sin, position_ids, interleaved):
    check_backward(grad_q_out, grad_k_out, cos, sin, position_ids)
    other = grad_q_out if grad_q_out is not None else grad_k_out
    return (
        output_like(grad_q_out) if grad_q_out is not None else _absent_like(other, cos),
        output_like(grad_k_out) if grad_k_out is not None else _absent_like(other, cos),
    )


# ---- autograd ------------------------------------------------------------------------------


def _refuse_table_grads(cos, sin, grad_mode=True):
    # (setup_context runs with grad mode off, inside the autograd Function: it passes False)
    if (not grad_mode or torch.is_grad_enabled()) and (cos.requires_grad or sin.requires_grad):
        raise NotImplementedError(
            "fusedops.rope: gradients with respect to cos and sin are not supported; pass them detached "
            "(cos.detach(), sin.detach()) or compute the rotation with plain torch ops"
        )


def _save(ctx, cos, sin, position_ids, interleaved, outputs):
    # (each output depends on its own input only: k_out of a k needing no gradient needs none)
    constant = [out for out, need in zip(outputs[:2], ctx.needs_input_grad) if not need]
    ctx.mark_non_differentiable(outputs[2], *constant)
    ctx.save_for_backward(cos, sin, position_ids)
    ctx.interleaved = interleaved
    # An unused output's gradient stays None rather than zeros the kernel would read.
    ctx.set_materialize_grads(False)


def _setup_context(ctx, inputs, output):
    _q, _k, cos, sin, position_ids, interleaved = _full_args(inputs)
    _save(ctx, cos, sin, position_ids, interleaved, output)


def _full_args(inputs):
    q, k, cos, sin = inputs[:4]
    position_ids = inputs[4] if len(inputs) > 4 else None
    interleaved = inputs[5] if len(inputs) > 5 else False
    return q, k, cos, sin, position_ids, interleaved


def _backward(ctx, grad_q_out, grad_k_out, _grad_bad_position=None):
    _deferred.pending.raise_finished()
    cos, sin, position_ids = ctx.saved_tensors
    need_q, need_k = ctx.needs_input_grad[:2]  # (cos and sin never: refused in the forward)
    if grad_q_out is None and grad_k_out is None:
        return None, None, None, None, None, None
    with _direct.below_autograd_unless_grad():  # create_graph=True: rope_backward's own autograd
        grad_q, grad_k = backward(grad_q_out, grad_k_out, cos, sin, position_ids, ctx.interleaved)
    return (
        grad_q if need_q and grad_q_out is not None else None,
        grad_k if need_k and grad_k_out is not None else None,
        None,
        None,
        None,
        None,
    )


def _setup_context_checked(ctx, inputs, output):
    _q, _k, cos, sin, _pos, _interleaved = _full_args(inputs)
    _refuse_table_grads(cos, sin, grad_mode=False)
    _setup_context(ctx, inputs, output)


def _backward_setup_context(ctx, inputs, output):
    grad_q_out, grad_k_out, cos, sin, position_ids, interleaved = inputs
    _refuse_table_grads(cos, sin, grad_mode=False)
    ctx.save_for_backward(cos, sin, position_ids)
    ctx.interleaved = interleaved
    ctx.set_materialize_grads(False)


def _backward_backward(ctx, gg_q, gg_k):
    """rope_backward is linear in the incoming gradients; its transpose is the forward rotation.
    An absent second-order gradient is passed to rope as zero heads of the present one."""
    cos, sin, position_ids = ctx.saved_tensors
    need_q, need_k = ctx.needs_input_grad[:2]
    if gg_q is None and gg_k is None:
        return None, None, None, None, None, None
    q_in = gg_q if gg_q is not None and gg_q.dim() == 4 else None
    k_in = gg_k if gg_k is not None and gg_k.dim() == 4 else None
    if q_in is None and k_in is None:
        return None, None, None, None, None, None
    q_arg = q_in if q_in is not None else k_in[:, :0]
    k_arg = k_in if k_in is not None else q_in[:, :0]
    with _direct.below_autograd_unless_grad():
        out_q, out_k, _bad = forward(q_arg, k_arg, cos, sin, position_ids, ctx.interleaved)
    return (
        out_q if need_q and q_in is not None else None,
        out_k if need_k and k_in is not None else None,
        None,
        None,
        None,
        None,
    )


_forward_entry = forward._op
_forward_inplace_entry = forward_._op


class _Function(torch.autograd.Function):
    """The public function's autograd path without the detour through the dispatcher (see
    ops/_direct.py)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, position_ids, interleaved):
        with _direct.BelowAutograd():
            out = _forward_entry(q, k, cos, sin, position_ids, interleaved)
        _save(ctx, cos, sin, position_ids, interleaved, out)
        return out

    @staticmethod
    def backward(ctx, grad_q_out, grad_k_out, _grad_bad_position):
        return _backward(ctx, grad_q_out, grad_k_out)


_apply_function = _direct.bind_apply(_Function)
_unwrap = _direct.unwrap_if_dead


def direct(q, k, cos, sin, position_ids=None, interleaved=False):
    """``forward(...)`` with autograd, where ``_direct.direct_call_allowed()``."""
    if _direct.records_grad(q, k, cos, sin):
        _refuse_table_grads(cos, sin)
        return _apply_function(
            _unwrap(q), _unwrap(k), cos, sin, None if position_ids is None else position_ids, interleaved
        )
    with _direct.BelowAutograd():
        return _forward_entry(q, k, cos, sin, position_ids, interleaved)


def _inplace_no_grad_check(q, k, cos, sin):
    _direct.refuse_inference_tensor_update("rope_", q=q, k=k)
    if _direct.records_grad(q, k, cos, sin):
        raise RuntimeError(
            "fusedops.rope_ rotates q and k in place and has no gradient (it is the inference form); "
            "use fusedops.rope when gradients are needed, or call it under torch.no_grad()"
        )


def direct_inplace(q, k, cos, sin, position_ids=None, interleaved=False):
    """``forward_(...)``, where ``_direct.direct_call_allowed()``."""
    _inplace_no_grad_check(q, k, cos, sin)
    with _direct.BelowAutograd():
        bad = _forward_inplace_entry(q, k, cos, sin, position_ids, interleaved)
    torch.autograd.graph.increment_version(q)
    torch.autograd.graph.increment_version(k)
    return bad


torch.library.register_autograd("fusedops::rope", _backward, setup_context=_setup_context_checked)
torch.library.register_autograd(
    "fusedops::rope_backward", _backward_backward, setup_context=_backward_setup_context
)

_lib = torch.library.Library("fusedops", "IMPL")


def _inplace_autograd(q, k, cos, sin, position_ids=None, interleaved=False):
    # The Autograd kernel of the in-place form: no gradient, but the mutations are recorded in
    # the version counters, so autograd notices if a saved copy of q or k is modified.
    _inplace_no_grad_check(q, k, cos, sin)
    with _direct.BelowAutograd():
        bad = forward_(q, k, cos, sin, position_ids, interleaved)
    torch.autograd.graph.increment_version(q)
    torch.autograd.graph.increment_version(k)
    return bad


_lib.impl("rope_", _inplace_autograd, "Autograd")


# ---- autocast ------------------------------------------------------------------------------


def autocast_tables(q, cos, sin):
    """cos/sin whose dtype goes with neither q's nor float32 are cast to q's dtype."""
    if not cos_dtype_ok(q.dtype, cos.dtype):
        cos = cos.to(q.dtype)
    if not cos_dtype_ok(q.dtype, sin.dtype):
        sin = sin.to(q.dtype)
    return cos, sin


def _autocast(q, k, cos, sin, position_ids=None, interleaved=False):
    with torch._C._ExcludeDispatchKeyGuard(_norm.AUTOCAST_KEYS):
        return forward(q, k, *autocast_tables(q, cos, sin), position_ids, interleaved)


def _autocast_inplace(q, k, cos, sin, position_ids=None, interleaved=False):
    with torch._C._ExcludeDispatchKeyGuard(_norm.AUTOCAST_KEYS):
        return forward_(q, k, *autocast_tables(q, cos, sin), position_ids, interleaved)


for _key in ("AutocastCPU", "AutocastCUDA"):
    _lib.impl("rope", _autocast, _key)
    _lib.impl("rope_", _autocast_inplace, _key)


# ---- Triton, for CUDA tensors when the CUDA kernels do not serve them (ops/__init__.py) -------


def _new_output(t):
    """output_like(t) for a real tensor, without the stride analysis when t is contiguous (and
    not empty: torch calls any empty tensor contiguous, whatever its strides)."""
    return torch.empty_like(t) if t.is_contiguous() and t.numel() else output_like(t)


def _new_bad_position(q, position_ids):
    # With positions the kernel lowers a preset -1 to a bad one's index; without, it writes -1.
    if position_ids is None:
        return torch.empty((), dtype=torch.int64, device=q.device)
    return torch.full((), -1, dtype=torch.int64, device=q.device)


def _triton_forward(q, k, cos, sin, position_ids=None, interleaved=False):
    check_forward(q, k, cos, sin, position_ids)
    from ..triton import rope as kernels

    q_out, k_out = _new_output(q), _new_output(k)
    bad = _new_bad_position(q, position_ids)
    kernels.rope(q, k, cos, sin, position_ids, interleaved, False, q_out, k_out, bad)
    return q_out, k_out, bad


def _triton_forward_inplace(q, k, cos, sin, position_ids=None, interleaved=False):
    check_forward(q, k, cos, sin, position_ids, op="rope_")
    from ..triton import rope as kernels

    bad = _new_bad_position(q, position_ids)
    kernels.rope(q, k, cos, sin, position_ids, interleaved, False, q, k, bad)
    return bad


def _triton_backward(grad_q_out, grad_k_out, cos, sin, position_ids, interleaved):
    check_backward(grad_q_out, grad_k_out, cos, sin, position_ids)
    from ..triton import rope as kernels

    other = grad_q_out if grad_q_out is not None else grad_k_out
    grad_q = _new_output(grad_q_out) if grad_q_out is not None else _absent_like(other, cos)
    grad_k = _new_output(grad_k_out) if grad_k_out is not None else _absent_like(other, cos)
    if other is not None:
        kernels.rope(
            grad_q_out, grad_k_out, cos, sin, position_ids, interleaved, True,
            grad_q if grad_q_out is not None else None, grad_k if grad_k_out is not None else None,
        )
    return grad_q, grad_k


TRITON_IMPLS = {
    "rope": _triton_forward,
    "rope_": _triton_forward_inplace,
    "rope_backward": _triton_backward,
}
