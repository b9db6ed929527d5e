"""cross_entropy, its in-place-gradient form cross_entropy_, and the backward scaling ops:
fake kernels, autograd, autocast rule and Triton hook-up.

Schemas (csrc/registration.cpp):
    cross_entropy(Tensor logits, Tensor target, Tensor? weight=None, int ignore_index=-100,
                  str reduction="mean", float label_smoothing=0., float z_loss=0.,
                  float? softcap=None, bool compute_grad=False)
        -> (Tensor loss, Tensor lse, Tensor grad_logits, Tensor bad_target)
    cross_entropy_(Tensor(a!) logits, ...same options...) -> (Tensor loss, Tensor lse, Tensor bad_target)
    cross_entropy_backward(Tensor grad_output, Tensor grad_logits) -> Tensor
    cross_entropy_backward_(Tensor grad_output, Tensor(a!) grad_logits) -> ()
    cross_entropy_slice_stats_(Tensor logits, Tensor target, Tensor? weight, int class_start,
                               int ignore_index, float? softcap, bool smoothing, Tensor(a!) stats) -> ()
    cross_entropy_slice_grad_(Tensor(a!) logits, Tensor target, Tensor? weight, int class_start,
                              int ignore_index, float? softcap, bool smoothing, Tensor coefs) -> ()

The math is in csrc/include/fusedops/cross_entropy.h. The two slice ops are the building blocks
of linear_cross_entropy's low-memory mode (ops/linear_cross_entropy.py), with no autograd of
their own: a first walk over slices of the classes gathers each row's statistics, a second
turns each slice into its gradient.

Saved for backward: only the gradient the forward already computed (compute_grad=True; a
logits-sized tensor in the logits' dtype, or, for cross_entropy_, the logits tensor that now
holds it); with compute_grad=False for logits that need a gradient after all (under vmap),
the logits, target and weight, from which the backward computes it. Nothing else: the
backward is grad_output times that gradient. Eager backward scales it in place
(cross_entropy_backward_, a no-op for rows whose scale is exactly 1, which is what
``loss.backward()`` passes) and hands it on, so forward plus backward reads the logits once and
writes one gradient. When the graph is retained (retain_graph=True, or create_graph), under
torch.compile, for a batched grad_output (is_grads_batched=True), or on a torch without the
engine's keep-graph query, the backward writes a new tensor instead (cross_entropy_backward),
so a second backward through the same graph sees the unscaled gradient again. Double backward
raises. Gradients with respect to weight raise (torch has none either).

Autocast rule: nothing is cast. The logits stay in their dtype (the kernels compute in float32
whatever it is; an fp32 copy would triple the traffic) and the loss the op returns is float32;
the public function returns it as float32 under autocast (as torch's autocast, which runs
cross_entropy in float32, does) and in the logits' dtype outside it.
"""

import math
import threading

import torch

from . import _deferred, _direct
from ._norm import FLOAT_DTYPES, _same_device, acc_dtype, check_given, dtype_name, may_overlap, shape_str

forward = torch.ops.fusedops.cross_entropy.default
forward_ = torch.ops.fusedops.cross_entropy_.default
backward = torch.ops.fusedops.cross_entropy_backward.default
backward_ = torch.ops.fusedops.cross_entropy_backward_.default
slice_stats_ = torch.ops.fusedops.cross_entropy_slice_stats_.default
slice_grad_ = torch.ops.fusedops.cross_entropy_slice_grad_.default

REDUCTIONS = ("mean", "sum", "none")


def _device_str(t):
    return "cpu" if t.device.type == "cpu" else str(t.device)


def _num(v):
    """A float as C++'s ostream writes it (6 significant digits), so that messages match."""
    return f"{v:g}"


def _leading(logits):
    return "[" + ", ".join(str(s) for s in logits.shape[:-1]) + "]"


_FLOAT32_MAX = torch.finfo(torch.float32).max


def _check_float32_range(op, name, value):
    """cross_entropy.h's check_float32_range: the GPU kernels take the options as float32."""
    if value > _FLOAT32_MAX:
        raise ValueError(f"{op}: {name} must be at most float32's largest value, 3.40282e+38, got {_num(value)}")


def _check_softcap(op, softcap):
    """cross_entropy.h's check_softcap."""
    if softcap is None:
        return
    if not (softcap > 0.0 and math.isfinite(softcap)):
        raise ValueError(f"{op}: softcap must be a finite number > 0 (or None), got {_num(softcap)}")
    _check_float32_range(op, "softcap", softcap)


def check_options(op, reduction, label_smoothing, z_loss, softcap):
    """The loss options' checks (linear_cross_entropy's too)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be 'mean', 'sum' or 'none', got '{reduction}'")
    if not (0.0 <= label_smoothing <= 1.0):
        raise ValueError(f"{op}: label_smoothing must be in [0, 1], got {_num(label_smoothing)}")
    if not (z_loss >= 0.0 and math.isfinite(z_loss)):
        raise ValueError(f"{op}: z_loss must be a finite number >= 0, got {_num(z_loss)}")
    _check_float32_range(op, "z_loss", z_loss)
    _check_softcap(op, softcap)


def _check_weight_goes_with(op, weight, logits):
    """Class weights in the logits' dtype or float32, on their device."""
    if not (weight.dtype == logits.dtype or weight.dtype == torch.float32):
        raise ValueError(
            f"{op}: weight dtype {dtype_name(weight.dtype)} does not go with logits dtype "
            f"{dtype_name(logits.dtype)}: use logits' dtype or float32"
        )
    if not _same_device(weight, logits):
        raise ValueError(f"{op}: weight is on {_device_str(weight)} but logits is on {_device_str(logits)}")


def check(op, logits, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap, in_place=False):
    """The checks of csrc/include/fusedops/cross_entropy.h (make_problem), in the same words."""
    check_given(op, logits=logits, target=target)
    if logits.dim() < 1:
        raise ValueError(f"{op}: logits must have at least 1 dimension (..., classes), got a 0-dimensional tensor")
    if logits.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"{op}: logits dtype must be float32, bfloat16, float16 or float64, got {dtype_name(logits.dtype)}"
        )
    if target.dtype.is_floating_point:
        raise ValueError(
            f"{op}: target must hold class indices (int64 or int32); probability ({dtype_name(target.dtype)}) "
            "targets are not supported"
        )
    if target.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{op}: target dtype must be int64 or int32, got {dtype_name(target.dtype)}")
    if target.shape != logits.shape[:-1]:
        raise ValueError(
            f"{op}: target shape {shape_str(target)} does not match logits shape {shape_str(logits)} without its "
            f"last (class) dimension: expected {_leading(logits)}"
        )
    if not _same_device(target, logits):
        raise ValueError(f"{op}: target is on {_device_str(target)} but logits is on {_device_str(logits)}")
    V = logits.shape[-1]
    if V < 1:
        raise ValueError(f"{op}: logits must have at least one class (logits.size(-1) is 0)")
    if V >= 2**31:
        raise ValueError(f"{op}: too many classes ({V})")
    if weight is not None:
        if weight.dim() != 1 or weight.shape[0] != V:
            raise ValueError(
                f"{op}: weight must be a 1-D tensor of logits.size(-1) = {V} class weights, got shape "
                f"{shape_str(weight)}"
            )
        _check_weight_goes_with(op, weight, logits)
    check_options(op, reduction, label_smoothing, z_loss, softcap)
    if in_place:
        refuse_unwritable_logits(op, logits)


def check_forward(logits, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                  z_loss=0.0, softcap=None, compute_grad=False, op="cross_entropy"):
    check(op, logits, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap,
          in_place=op == "cross_entropy_")


def check_backward(grad_output, grad_logits, op="cross_entropy_backward"):
    check_given(op, grad_output=grad_output, grad_logits=grad_logits)
    if grad_logits.dim() < 1 or grad_logits.dtype not in FLOAT_DTYPES:
        got = "a 0-dimensional tensor" if grad_logits.dim() == 0 else dtype_name(grad_logits.dtype)
        raise ValueError(f"{op}: grad_logits must be a floating-point tensor of at least 1 dimension, got {got}")
    if not grad_output.dtype.is_floating_point:
        raise ValueError(f"{op}: grad_output dtype must be floating point, got {dtype_name(grad_output.dtype)}")
    if not _same_device(grad_output, grad_logits):
        raise ValueError(
            f"{op}: grad_output is on {_device_str(grad_output)} but grad_logits is on {_device_str(grad_logits)}"
        )
    if grad_output.dim() != 0 and grad_output.shape != grad_logits.shape[:-1]:
        raise ValueError(
            f"{op}: grad_output must be a 0-dimensional tensor (reduction 'mean' or 'sum') or have shape "
            f"{_leading(grad_logits)} (reduction 'none'), got shape {shape_str(grad_output)}"
        )
    if op == "cross_entropy_backward_":
        if not _unit_last_stride(grad_logits):
            raise ValueError(f"{op}: grad_logits must have a contiguous last dimension to be scaled in place")
        if grad_logits.numel() > 0 and may_overlap(grad_logits):
            raise ValueError(f"{op}: grad_logits has elements that share memory, so it cannot be scaled in place")


def _unit_last_stride(t):
    return t.shape[-1] <= 1 or t.stride(-1) == 1


def _scalable_in_place(t):
    """Whether cross_entropy_backward_ takes `t` (its checks above)."""
    return t.is_contiguous() or (_unit_last_stride(t) and (t.numel() == 0 or not may_overlap(t)))


def bad_target_message(op, target, index, V, ignore_index):
    """The error for the target at flat index `index` (reads it: a sync on a GPU)."""
    where = [int(i) for i in torch.unravel_index(torch.tensor(index), target.shape)] if target.dim() else []
    value = int(target.reshape(-1)[index])
    return (
        f"{op}: target[{', '.join(str(i) for i in where)}] = {value} is outside [0, {V}) and is not ignore_index "
        f"({ignore_index})"
    )


def bad_target_mask(target, V, ignore_index):
    """Where target is outside [0, V) and not ignore_index (a bool tensor of target's shape)."""
    return ((target < 0) | (target >= V)) & (target != ignore_index)


def bad_target_index(target, V, ignore_index):
    """Flat index of the first target outside [0, V) that is not ignore_index, or -1, as a 0-d
    int64 tensor on target's device (computed there: no sync)."""
    return _deferred.first_index(bad_target_mask(target, V, ignore_index))


def check_target_mode(check_target, op="cross_entropy"):
    return _deferred.check_mode(check_target, op, "check_target")


def gpu_target_check(op, check_target, tensor, compiling):
    """The public functions' eager bad-target check on a GPU (ops/_deferred.py), or None."""
    return _deferred.GpuCheck.start(op, "check_target", "target", check_target, tensor, compiling)


def target_message(op, target, V, ignore_index):
    """bad_target_message for a GpuCheck: the error for a flat index of `target`."""
    return lambda index: bad_target_message(op, target, index, V, ignore_index)


# ---- fake kernels ----------------------------------------------------------------------------


def _outputs_like(logits, target, reduction, compute_grad):
    acc = acc_dtype(logits.dtype)
    loss = logits.new_empty(target.shape if reduction == "none" else (), dtype=acc)
    lse = logits.new_empty(target.shape, dtype=acc)
    grad = logits.new_empty(logits.shape if compute_grad else (0,))
    bad = logits.new_empty((), dtype=torch.int64)
    return loss, lse, grad, bad


@torch.library.register_fake("fusedops::cross_entropy")
def _forward_fake(logits, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                  z_loss=0.0, softcap=None, compute_grad=False):
    check("cross_entropy", logits, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap)
    return _outputs_like(logits, target, reduction, compute_grad)


@torch.library.register_fake("fusedops::cross_entropy_")
def _forward_inplace_fake(logits, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                          z_loss=0.0, softcap=None):
    check("cross_entropy_", logits, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap,
          in_place=True)
    loss, lse, _grad, bad = _outputs_like(logits, target, reduction, False)
    return loss, lse, bad


@torch.library.register_fake("fusedops::cross_entropy_backward")
def _backward_fake(grad_output, grad_logits):
    check_backward(grad_output, grad_logits)
    return grad_logits.new_empty(grad_logits.shape)


@torch.library.register_fake("fusedops::cross_entropy_backward_")
def _backward_inplace_fake(grad_output, grad_logits):
    check_backward(grad_output, grad_logits, op="cross_entropy_backward_")


# ---- autograd ------------------------------------------------------------------------------

_keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


def _may_scale_in_place(grad_output, grad, private):
    """Whether this backward may scale the saved gradient where it is: a gradient no caller holds
    (`private`: the public functions drop the op's gradient outputs), in an eager backward (real
    tensors, grad mode off) that frees the graph after it, so nothing can read it again. Without
    the engine's query (older torch) it never does; nor under a torch.func transform or for a
    batched grad_output (`is_grads_batched=True`, torch's older vmap), which cannot scale an
    unbatched gradient in place; nor a gradient the in-place op refuses (a saved-tensor hook may
    unpack it with other strides)."""
    return (
        private
        and _keep_graph is not None
        and not torch.is_grad_enabled()
        and not torch._C._are_functorch_transforms_active()
        and not torch._C._functorch.is_legacy_batchedtensor(grad_output)
        and type(grad) is torch.Tensor
        and type(grad_output) is torch.Tensor
        # (what a saved-tensor hook's unpack hands back may be laid out otherwise)
        and _scalable_in_place(grad)
        and not _keep_graph()
    )


class _Calls(threading.local):
    gradients_dropped = False


_calls = _Calls()


def call_dropping_gradients(op, args, compiling):
    """op(*args) for a public function that drops the registered op's gradient outputs (on the
    route it takes under autocast and torch.func): the op's backward may then scale the saved
    gradient in place. A direct torch.ops caller holds those outputs, so its backward writes a
    new tensor and leaves them as they were returned. (Traced, nothing is marked: the traced
    backward never scales in place.)"""
    if compiling:
        return op(*args)
    _calls.gradients_dropped = True
    try:
        return op(*args)
    finally:
        _calls.gradients_dropped = False


def gradients_dropped() -> bool:
    """In a setup_context: whether the call came through call_dropping_gradients."""
    return _calls.gradients_dropped


def mean_of_rows(loss_rows, target, weight, ignore_index):
    """reduction "mean" from the per-row losses (float32) of reduction "none": their sum over the
    sum of the kept rows' class weights (their count without class weights), and 0 / 0, NaN, when
    that is 0, as torch's (whose gradient then is NaN in kept rows and 0 in ignored ones, as the
    per-row backward gives)."""
    kept = target != ignore_index
    if weight is None:
        denominator = kept.sum(dtype=loss_rows.dtype)
    else:
        w = weight.to(loss_rows.dtype)
        # (a bad target, which has made its row's loss NaN already, must not index out of range)
        denominator = torch.where(kept, w[target.clamp(0, w.numel() - 1)], 0).sum()
    nothing_kept = torch.where(denominator == 0, float("nan"), 0.0)
    return loss_rows.sum() / denominator + nothing_kept


def zero_ignored_rows(grad_output, ignored):
    """A per-row grad_output with the entries of ignored rows (target == ignore_index) set to 0:
    their gradient is 0 whatever arrives, as torch's is, where 0 times a NaN or inf incoming
    gradient (a fully padded sequence's mean, say, later dropped by nan_to_num) would be NaN."""
    if ignored is None or grad_output.dim() == 0:
        return grad_output
    target, ignore_index = ignored
    return grad_output.masked_fill(target == ignore_index, 0)


def scale(grad_output, grad, token, private, public_name="fusedops.cross_entropy", ignored=None):
    """grad_output times the forward's gradient `grad`: in place when nothing can read `grad`
    again, else a new tensor. `token`: the forward's graph_token, which ties a create_graph
    result to the forward's inputs; None where the forward (a registered op's, whose outputs are
    the schema's) has none, and a create_graph backward then raises at once. `ignored`: the
    forward's (target, ignore_index) for a per-row grad_output (reduction "none"), else None."""
    grad_output = zero_ignored_rows(grad_output, ignored)
    if _may_scale_in_place(grad_output, grad, private):
        with _direct.BelowAutograd():
            backward_(grad_output, grad)
        return grad
    if not torch.is_grad_enabled():
        with _direct.BelowAutograd():
            return backward(grad_output, grad)
    if type(grad) is not torch.Tensor or type(grad_output) is not torch.Tensor:
        # Traced (torch.compile): the backward op's own autograd says double backward is not
        # supported if anything differentiates through it.
        return backward(grad_output, grad)
    # Eager create_graph=True: the gradient depends on the forward's inputs (through the
    # softmax), whose graph nothing saved here carries but the token: the result hangs from it
    # through a node whose backward raises, so that any gradient taken through the result, of
    # whichever inputs, reaches that node and says so instead of leaving out the second-order
    # term (a gradient of only some inputs skips nodes that lead to none of them).
    if token is None:
        raise _double_backward_error(public_name)
    return _Undifferentiable.apply(backward(grad_output, grad), token, public_name)


def _double_backward_error(public_name):
    return NotImplementedError(
        f"{public_name} does not support double backward (create_graph=True through its backward)"
    )


class _Undifferentiable(torch.autograd.Function):
    """Identity on its first input, with the forward's graph_token as a second; its backward
    raises (double backward is not supported)."""

    @staticmethod
    def forward(ctx, t, _token, public_name):
        ctx.public_name = public_name
        return t.view_as(t)

    @staticmethod
    def backward(ctx, *grads):
        raise _double_backward_error(ctx.public_name)


def _refuse_weight_grad(weight, grad_mode=True):
    if weight is not None and weight.requires_grad and (not grad_mode or torch.is_grad_enabled()):
        raise NotImplementedError(
            "fusedops.cross_entropy: gradients with respect to weight are not supported (torch.nn.functional."
            "cross_entropy has none either); pass weight.detach()"
        )


def refuse_unwritable_logits(op, logits):
    """The in-place gradient mode writes whole rows of unit stride: a strided last dimension or
    elements that share memory are refused."""
    if logits.shape[-1] != 1 and logits.stride(-1) != 1:
        raise ValueError(
            f"{op}: logits must have a contiguous last dimension (stride 1) to receive the gradient in place, "
            f"got stride {logits.stride(-1)}"
        )
    if logits.numel() > 0 and may_overlap(logits):
        raise ValueError(
            f"{op}: logits has elements that share memory (an expanded tensor?), so it cannot receive the "
            "gradient in place"
        )


def _refuse_user_leaf(logits, op):
    """The in-place gradient mode overwrites the logits: refused, as torch refuses an in-place
    op, for a leaf that requires grad or a view of one (a tensor the user holds, whose gradient
    autograd accumulates into .grad)."""
    # A tensor made a leaf after a view (x.view(...).requires_grad_()) is a leaf itself; its base is not.
    base = logits if logits.is_leaf or logits._base is None else logits._base
    if base.is_leaf and base.requires_grad:
        what = "a leaf tensor" if base is logits else "a view of a leaf tensor"
        raise RuntimeError(
            f"{op}: logits is {what} that requires grad, which the in-place gradient mode would "
            "overwrite with its gradient (torch refuses in-place ops on such tensors); pass "
            "inplace_grad=False, or logits computed by an op (an lm_head's output)"
        )


def _lse_grad_error():
    return NotImplementedError(
        "fusedops.cross_entropy: gradients through the lse output are not supported (it is a statistic; "
        "detach it)"
    )


def _setup_context(ctx, inputs, output):
    weight = inputs[2] if len(inputs) > 2 else None
    compute_grad = inputs[8] if len(inputs) > 8 else False
    _refuse_weight_grad(weight, grad_mode=False)
    _loss, lse, grad, bad = output
    ctx.compute_grad = compute_grad
    ctx.private = gradients_dropped()
    ignore_index = inputs[3] if len(inputs) > 3 else -100
    reduction = inputs[4] if len(inputs) > 4 else "mean"
    per_row_target = _per_row_target(ctx, inputs[1], ignore_index, reduction)
    if compute_grad:
        ctx.save_for_backward(grad, *per_row_target)
    else:
        # Called for logits that need a gradient without computing it (the caller could not
        # tell they did: under torch.func.vmap the batched logits report requires_grad=False):
        # the backward computes it from the inputs.
        ctx.save_for_backward(*(t for t in inputs[:3] if t is not None))
        ctx.options = (inputs[2] is not None, *inputs[3:8])
    ctx.mark_non_differentiable(lse, grad, bad)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_loss, grad_lse, _grad_grad, _grad_bad):
    _deferred.pending.raise_finished()
    if grad_lse is not None:
        raise _lse_grad_error()
    if grad_loss is None or not ctx.needs_input_grad[0]:
        return (None,) * 9
    if not ctx.compute_grad:
        has_weight, *options = ctx.options
        logits, target, *weight = ctx.saved_tensors
        with _direct.below_autograd_unless_grad():
            grad = forward(logits, target, weight[0] if has_weight else None, *options, compute_grad=True)[2]
        return (scale(grad_loss, grad, None, True, ignored=_ignored(ctx, [target])),) + (None,) * 8
    grad, *target = ctx.saved_tensors
    return (scale(grad_loss, grad, None, ctx.private, ignored=_ignored(ctx, target)),) + (None,) * 8


torch.library.register_autograd("fusedops::cross_entropy", _backward, setup_context=_setup_context)
_direct.register_no_double_backward("fusedops::cross_entropy_backward", "fusedops.cross_entropy")

_forward_entry = forward._op
_forward_inplace_entry = forward_._op


def graph_token(like):
    """An empty tensor that an autograd Function returns beside its outputs and saves: its
    grad_fn is the Function's node, so a create_graph backward can hang its result from the
    forward's inputs (scale). Unlike the loss, no caller sees it, so nothing modifies it in
    place and invalidates the saved copy."""
    return like.new_empty(0)


def _per_row_target(ctx, target, ignore_index, reduction):
    """In a forward: the target to save beside the gradient for a per-row backward (reduction
    "none", whose ignored rows' grad_output the backward zeroes: zero_ignored_rows)."""
    ctx.ignore_index = ignore_index
    ctx.per_row = reduction == "none"
    return (target,) if ctx.per_row else ()


def _ignored(ctx, saved_target):
    """scale()'s `ignored` from what _per_row_target had saved (a list of the target, or none)."""
    return (saved_target[0], ctx.ignore_index) if ctx.per_row else None


def _function_backward(ctx, grad_loss, grad_lse):
    """The backward of both autograd Functions below: the saved gradient, scaled."""
    _deferred.pending.raise_finished()
    if grad_lse is not None:
        raise _lse_grad_error()
    if grad_loss is None:
        return (None,) * 8
    grad, token, *target = ctx.saved_tensors
    return (scale(grad_loss, grad, token, True, ignored=_ignored(ctx, target)),) + (None,) * 7


class _Function(torch.autograd.Function):
    """The public function's autograd path without the detour through the dispatcher (see
    ops/_direct.py): the forward computes the gradient, the backward scales it."""

    @staticmethod
    def forward(ctx, logits, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap):
        with _direct.BelowAutograd():
            loss, lse, grad, bad = _forward_entry(
                logits, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap, True
            )
        token = graph_token(loss)
        ctx.save_for_backward(grad, token, *_per_row_target(ctx, target, ignore_index, reduction))
        ctx.mark_non_differentiable(lse, bad)
        ctx.set_materialize_grads(False)
        return loss, lse, bad, token

    @staticmethod
    def backward(ctx, grad_loss, grad_lse, _grad_bad, _grad_token):
        return _function_backward(ctx, grad_loss, grad_lse)


class _InplaceFunction(torch.autograd.Function):
    """cross_entropy_ with autograd: the gradient is written into the logits, which autograd then
    keeps (the same memory) and scales in the backward. The logits' version counter is bumped,
    so a backward that needs their old values (another op that saved them) raises instead of
    computing with the gradient."""

    @staticmethod
    def forward(ctx, logits, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap):
        with _direct.BelowAutograd():
            loss, lse, bad = _forward_inplace_entry(
                logits, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap
            )
        torch.autograd.graph.increment_version(logits)
        token = graph_token(loss)
        ctx.save_for_backward(logits, token, *_per_row_target(ctx, target, ignore_index, reduction))
        ctx.mark_non_differentiable(lse, bad)
        ctx.set_materialize_grads(False)
        return loss, lse, bad, token

    @staticmethod
    def backward(ctx, grad_loss, grad_lse, _grad_bad, _grad_token):
        return _function_backward(ctx, grad_loss, grad_lse)


_apply_function = _direct.bind_apply(_Function)
_apply_inplace = _direct.bind_apply(_InplaceFunction)
_unwrap = _direct.unwrap_if_dead


def direct(logits, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0,
           softcap=None):
    """(loss, bad_target) of ``forward(...)`` with autograd, where ``_direct.direct_call_allowed()``.
    The gradient is computed (and its buffer allocated) only when the logits need one."""
    if torch.is_grad_enabled() and logits.requires_grad:
        _refuse_weight_grad(weight)
        loss, _lse, bad, _token = _apply_function(
            _unwrap(logits), target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap
        )
        return loss, bad
    with _direct.BelowAutograd():
        loss, _lse, _grad, bad = _forward_entry(
            logits, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap, False
        )
    return loss, bad


def direct_inplace(logits, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                   z_loss=0.0, softcap=None):
    """(loss, bad_target) of ``forward_(...)``: the gradient goes into the logits."""
    _refuse_weight_grad(weight)
    _refuse_user_leaf(logits, "fusedops.cross_entropy(inplace_grad=True)")
    if logits.dim() > 0:  # (in the public function's name; the op checks the rest)
        refuse_unwritable_logits("fusedops.cross_entropy(inplace_grad=True)", logits)
    loss, _lse, bad, _token = _apply_inplace(
        _unwrap(logits), target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap
    )
    return loss, bad


_lib = torch.library.Library("fusedops", "IMPL")


def _inplace_autograd(logits, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                      z_loss=0.0, softcap=None):
    # The Autograd kernel of the in-place form: the same Function as the public function's. (A
    # None logits goes on to the kernels' error.)
    if torch.is_grad_enabled() and logits is not None and logits.requires_grad:
        _refuse_weight_grad(weight)
        _refuse_user_leaf(logits, "fusedops::cross_entropy_")
        loss, lse, bad, _token = _InplaceFunction.apply(
            logits, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap
        )
        return loss, lse, bad
    _direct.refuse_inference_tensor_update("cross_entropy_", logits=logits)
    with _direct.BelowAutograd():
        out = forward_(logits, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap)
    torch.autograd.graph.increment_version(logits)
    return out


def _backward_inplace_autograd(grad_output, grad_logits):
    # A backward building block with no gradient of its own; the mutation is recorded.
    _direct.refuse_inference_tensor_update("cross_entropy_backward_", grad_logits=grad_logits)
    with _direct.BelowAutograd():
        backward_(grad_output, grad_logits)
    torch.autograd.graph.increment_version(grad_logits)


_lib.impl("cross_entropy_", _inplace_autograd, "Autograd")
_lib.impl("cross_entropy_backward_", _backward_inplace_autograd, "Autograd")


# ---- the slice ops ---------------------------------------------------------------------------


def check_slice(op, logits, target, weight, class_start, softcap, state, state_name, in_place):
    """The checks of cross_entropy.h's make_slice_problem, in the same words."""
    check_given(op, logits=logits, target=target, **{state_name: state})
    if logits.dim() != 2:
        raise ValueError(
            f"{op}: logits must be 2-D (rows, a slice of the classes), got shape {shape_str(logits)}"
        )
    if logits.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"{op}: logits dtype must be float32, bfloat16, float16 or float64, got "
            f"{dtype_name(logits.dtype)}"
        )
    R, S = logits.shape
    if S > 1 and logits.stride(1) != 1:
        raise ValueError(
            f"{op}: logits must have a contiguous last dimension (stride 1), got stride {logits.stride(1)}"
        )
    if in_place and logits.numel() > 0 and may_overlap(logits):
        raise ValueError(
            f"{op}: logits has elements that share memory, so it cannot receive the gradient in place"
        )
    if target.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{op}: target dtype must be int64 or int32, got {dtype_name(target.dtype)}")
    if target.dim() != 1 or target.shape[0] != R:
        raise ValueError(
            f"{op}: target must have shape [{R}] (one class index per row of logits), got shape "
            f"{shape_str(target)}"
        )
    if not _same_device(target, logits):
        raise ValueError(f"{op}: target is on {_device_str(target)} but logits is on {_device_str(logits)}")
    if class_start < 0:
        raise ValueError(f"{op}: class_start must be >= 0, got {class_start}")
    if weight is not None:
        if weight.dim() != 1 or class_start + S > weight.shape[0]:
            raise ValueError(
                f"{op}: weight must be a 1-D tensor of the class weights of every class, at least "
                f"class_start + logits.size(1) = {class_start + S} of them, got shape {shape_str(weight)}"
            )
        _check_weight_goes_with(op, weight, logits)
    _check_softcap(op, softcap)
    acc = acc_dtype(logits.dtype)
    if state.dim() != 2 or state.shape[0] != R or state.shape[1] != 4:
        raise ValueError(f"{op}: {state_name} must have shape [{R}, 4], got shape {shape_str(state)}")
    if state.dtype != acc:
        raise ValueError(
            f"{op}: {state_name} dtype must be {dtype_name(acc)} for {dtype_name(logits.dtype)} logits, got "
            f"{dtype_name(state.dtype)}"
        )
    if state.numel() > 0 and not state.is_contiguous():
        raise ValueError(f"{op}: {state_name} must be contiguous")
    if not _same_device(state, logits):
        raise ValueError(
            f"{op}: {state_name} is on {_device_str(state)} but logits is on {_device_str(logits)}"
        )


@torch.library.register_fake("fusedops::cross_entropy_slice_stats_")
def _slice_stats_fake(logits, target, weight, class_start, ignore_index, softcap, smoothing, stats):
    check_slice("cross_entropy_slice_stats_", logits, target, weight, class_start, softcap, stats, "stats",
                False)


@torch.library.register_fake("fusedops::cross_entropy_slice_grad_")
def _slice_grad_fake(logits, target, weight, class_start, ignore_index, softcap, smoothing, coefs):
    check_slice("cross_entropy_slice_grad_", logits, target, weight, class_start, softcap, coefs, "coefs",
                True)


# ---- Triton, for CUDA tensors when the CUDA kernels do not serve them (ops/__init__.py) -------


def _triton_forward(logits, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                    z_loss=0.0, softcap=None, compute_grad=False):
    check("cross_entropy", logits, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap)
    from ..triton import cross_entropy as kernels

    loss, lse, grad, bad = _outputs_like(logits, target, reduction, compute_grad)
    kernels.forward(logits, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap,
                    loss, lse, grad if compute_grad else None, bad)
    return loss, lse, grad, bad


def _triton_forward_inplace(logits, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                            z_loss=0.0, softcap=None):
    check("cross_entropy_", logits, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap,
          in_place=True)
    from ..triton import cross_entropy as kernels

    loss, lse, _grad, bad = _outputs_like(logits, target, reduction, False)
    kernels.forward(logits, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap,
                    loss, lse, logits, bad)
    return loss, lse, bad


def _triton_backward(grad_output, grad_logits):
    check_backward(grad_output, grad_logits)
    from ..triton import cross_entropy as kernels

    out = grad_logits.new_empty(grad_logits.shape)
    kernels.scale(grad_output, grad_logits, out, in_place=False)
    return out


def _triton_backward_inplace(grad_output, grad_logits):
    check_backward(grad_output, grad_logits, op="cross_entropy_backward_")
    from ..triton import cross_entropy as kernels

    kernels.scale(grad_output, grad_logits, grad_logits, in_place=True)


def _triton_slice_stats(logits, target, weight, class_start, ignore_index, softcap, smoothing, stats):
    check_slice("cross_entropy_slice_stats_", logits, target, weight, class_start, softcap, stats, "stats",
                False)
    from ..triton import cross_entropy as kernels

    kernels.slice_stats(logits, target, weight, class_start, ignore_index, softcap, smoothing, stats)


def _triton_slice_grad(logits, target, weight, class_start, ignore_index, softcap, smoothing, coefs):
    check_slice("cross_entropy_slice_grad_", logits, target, weight, class_start, softcap, coefs, "coefs",
                True)
    from ..triton import cross_entropy as kernels

    kernels.slice_grad(logits, target, weight, class_start, ignore_index, softcap, smoothing, coefs)


TRITON_IMPLS = {
    "cross_entropy": _triton_forward,
    "cross_entropy_": _triton_forward_inplace,
    "cross_entropy_backward": _triton_backward,
    "cross_entropy_backward_": _triton_backward_inplace,
    "cross_entropy_slice_stats_": _triton_slice_stats,
    "cross_entropy_slice_grad_": _triton_slice_grad,
}

