"""The public functional API: defaults, documentation, and the outputs users want.

Each function is a thin call into the registered op (torch.ops.fusedops.<op>), so autograd,
autocast, torch.compile and the fake kernels all come from the op's registration. In eager mode
outside autocast the call skips the dispatcher's round trip through Python (ops/_direct.py)."""

import numbers
import sys
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from .ops import add_rms_norm as _add_rms_norm
from .ops import cross_entropy as _cross_entropy
from .ops import layer_norm as _layer_norm
from .ops import linear_cross_entropy as _linear_cross_entropy
from .ops import rms_norm as _rms_norm
from .ops import geglu as _geglu
from .ops import geglu_packed as _geglu_packed
from .ops import swiglu as _swiglu
from .ops import swiglu_packed as _swiglu_packed
from .ops._direct import direct_call_allowed, dispatch_mode_active, records_grad

# As torch.nn.functional's: an argument that overrides torch functions (a torch.fx Proxy, a tensor
# subclass with __torch_function__) gets the call itself, which the fast paths below cannot take.
_has_torch_function = torch._C._has_torch_function_variadic
_handle_torch_function = torch.overrides.handle_torch_function


def _autocast_enabled(device_type: str) -> bool:
    """torch.is_autocast_enabled for any device type: False where autocast has none (torch
    raises for "meta", where models are built for their shapes)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:
        return False


def _name_the_mistyped_argument(function, arguments):
    """On the way out of a public function that failed: raises a TypeError naming the first
    argument of the wrong type for its annotation (a tensor that is not one, None where the
    annotation does not allow it, a str or float option of another type), as torch's own
    functions do, in place of whatever the call first tripped on (a missing attribute, the
    schema's cast). Otherwise the caller re-raises its own error. (A failed call pays for this, a
    good one nothing.)"""
    for name, hint in function.__annotations__.items():
        if name == "return":
            continue
        value = arguments.get(name)
        if hint in (Tensor, Optional[Tensor]):
            expected = "Tensor"
            wrong = not isinstance(value, Tensor) and not (value is None and hint == Optional[Tensor])
        elif hint in _SCALAR_TYPES:
            expected = hint.__name__
            wrong = not _is_a(hint, value)
        elif hint in _OPTIONAL_SCALAR_TYPES:
            scalar = _OPTIONAL_SCALAR_TYPES[hint]
            expected = f"{scalar.__name__} or None"
            wrong = value is not None and not _is_a(scalar, value)
        else:
            continue
        if wrong:
            article = "an" if expected[0] in "aeiou" else "a"
            raise TypeError(
                f"fusedops.{function.__name__}: {name} must be {article} {expected}, got {type(value).__name__}"
            ) from None


# The message of torch's refusal when torch.func's reverse-mode transforms (grad, vjp, jacrev,
# hessian) meet an autograd formula registered with torch.library.register_autograd, whose
# generated Function lacks the setup_context functorch needs (pytorch/pytorch#170834).
_FUNCTORCH_REFUSAL = "must override the setup_context staticmethod"


def _explain_the_failure(function, arguments):
    """Called in a public function's except block: raises a TypeError naming a mistyped
    argument (_name_the_mistyped_argument), or turns torch's refusal of the registered autograd
    under torch.func.grad and its kin, whose message points at autograd.Function internals the
    caller never wrote, into a NotImplementedError that names the function and the way out.
    Otherwise the caller re-raises its own error."""
    _name_the_mistyped_argument(function, arguments)
    error = sys.exc_info()[1]
    if isinstance(error, RuntimeError) and _FUNCTORCH_REFUSAL in str(error):
        raise NotImplementedError(
            f"fusedops.{function.__name__}: torch.func's reverse-mode transforms (grad, vjp, jacrev, "
            f"hessian) cannot differentiate it with torch {torch.__version__}, whose "
            "torch.library.register_autograd formulas functorch refuses (pytorch/pytorch#170834); "
            "use torch.autograd.grad or .backward()"
        ) from error


# What the schemas take for each scalar annotation (numbers.Real: int, float, numpy's floats;
# numbers.Integral: int, numpy's integers, and bool, as torch's int arguments; bool: bool only,
# not 0 or 1), with the exceptions _is_a adds.
_SCALAR_TYPES = {str: str, float: numbers.Real, int: numbers.Integral, bool: bool}
_OPTIONAL_SCALAR_TYPES = {Optional[float]: float, Optional[int]: int}


def _is_a(scalar_type, value) -> bool:
    """Whether `value` passes for a `scalar_type` argument where the schema takes it: also a 0-d
    tensor for a float or int, and numpy's bool for a bool."""
    if isinstance(value, _SCALAR_TYPES[scalar_type]):
        return True
    if scalar_type in (float, int):
        return isinstance(value, Tensor) and value.dim() == 0
    if scalar_type is bool:
        np = sys.modules.get("numpy")
        return np is not None and isinstance(value, np.bool_)
    return False


def _real_number(owner: str, name: str, value, optional: bool = False):
    """float(value) for a float option that the caller converts itself (the functions, the
    modules' constructors), after the check the schema would make: float() alone takes a string
    ("0.1") or a one-element tensor too."""
    if optional and value is None:
        return None
    if not _is_a(float, value):
        expected = "a float or None" if optional else "a float"
        raise TypeError(f"{owner}: {name} must be {expected}, got {type(value).__name__}")
    return float(value)


def _flag(owner: str, name: str, value) -> bool:
    """bool(value) for a bool option, which must be one: bool("False") is True."""
    if not _is_a(bool, value):
        raise TypeError(f"{owner}: {name} must be a bool, got {type(value).__name__}")
    return bool(value)


_rms_norm_op = _rms_norm.forward
_add_rms_norm_op = _add_rms_norm.forward
_add_rms_norm_inplace_op = _add_rms_norm.forward_
_layer_norm_op = _layer_norm.forward


def rms_norm(
    input: Tensor,
    weight: Optional[Tensor] = None,
    eps: float = 1e-6,
    offset: float = 0.0,
    cast_before_weight: bool = False,
    save_output: bool = False,
) -> Tensor:
    r"""Root-mean-square normalisation over the last dimension.

    .. math:: y = \frac{x}{\sqrt{\operatorname{mean}(x^2) + \epsilon}} \cdot (\text{offset} + w)

    Args:
        input: ``(..., n)`` tensor, float32, bfloat16, float16 or float64; any strides on the
            leading dimensions (no copy is made unless the last dimension is strided).
        weight: optional ``(n,)`` scale, in input's dtype or float32 (with bf16/fp16 input).
        eps: added to the mean square before the square root.
        offset: added to the weight before it scales (Gemma: ``offset=1.0``, weights stored as
            ``scale - 1``). Needs a weight.
        cast_before_weight: the casting mode. ``False`` (default): everything in float32, one
            rounding at the end, as Gemma and ``torch.nn.functional.rms_norm`` do. ``True``:
            normalise in float32, round to input's dtype, then multiply by the weight, as
            LLaMA-style models (Hugging Face ``LlamaRMSNorm``) do.
        save_output: the memory-saving backward: autograd keeps the output instead of the input
            and recovers ``x * rstd = y / (offset + w)``. It saves an activation-sized tensor
            per norm when the input is otherwise dead (the next matmul saves the output anyway);
            avoid it when ``offset + w`` can be close to 0.

    Returns:
        A contiguous tensor of input's shape and dtype. The math is float32 (float64 for
        float64 input) whatever the storage dtype.
    """
    if _has_torch_function(input, weight):
        return _handle_torch_function(
            rms_norm, (input, weight), input, weight, eps, offset, cast_before_weight, save_output
        )
    try:
        if direct_call_allowed(input, weight):
            return _rms_norm.direct(input, weight, eps, offset, cast_before_weight, save_output)
        return _rms_norm_op(input, weight, eps, offset, cast_before_weight, save_output)[0]
    except Exception:  # (re-raised below)
        _explain_the_failure(rms_norm, locals())
        raise


def add_rms_norm(
    input: Tensor,
    residual: Tensor,
    weight: Optional[Tensor] = None,
    eps: float = 1e-6,
    offset: float = 0.0,
    cast_before_weight: bool = False,
) -> Tuple[Tensor, Tensor]:
    r"""The pre-norm transformer's residual step: ``residual_out = input + residual`` and
    ``output = rms_norm(residual_out)``, in one pass over the rows.

    Args:
        input: ``(..., n)`` activations (a sublayer's output), float32, bfloat16, float16 or
            float64; any leading strides.
        residual: the residual stream, of input's shape; input's dtype, or float32 with
            bf16/fp16 input (a wide residual stream).
        weight, eps, offset, cast_before_weight: as for :func:`rms_norm` (the cast rounds to
            input's dtype).

    Returns:
        ``(output, residual_out)``: output in input's dtype, residual_out (the sum, rounded to
        residual's dtype, which output normalises) in residual's dtype. Both are contiguous.
        Gradients flow to input, residual and weight through both.
    """
    if _has_torch_function(input, residual, weight):
        return _handle_torch_function(
            add_rms_norm, (input, residual, weight), input, residual, weight, eps, offset, cast_before_weight
        )
    try:
        if direct_call_allowed(input, residual, weight):
            return _add_rms_norm.direct(input, residual, weight, eps, offset, cast_before_weight)
        output, residual_out, _rstd = _add_rms_norm_op(
            input, residual, weight, eps, offset, cast_before_weight
        )
        return output, residual_out
    except Exception:  # (re-raised below)
        _explain_the_failure(add_rms_norm, locals())
        raise


def _compiled_update_goes_out_of_place(*mutated: Tensor) -> bool:
    """Under torch.compile, whether an in-place form computes out of place and copies back into
    `mutated`, which Inductor compiles right. Inductor (torch 2.11-2.13, dynamic shapes)
    misplaces a custom op's in-place update of a view whose storage offset is symbolic (a
    select of a stacked buffer, k split after q from a fused QKV output: written at offset 0, or
    q and k handed over as one buffer), and of a transposed view of a view (pytorch/pytorch
    issue 198068: no lowering for the view's symbolic storage offset). A plain
    torch.library.custom_op fails the same way. Under torch.compile the copy is Inductor's to
    plan."""
    return torch.compiler.is_compiling() and any(
        not t.is_contiguous() or t._base is not None for t in mutated
    )


@torch.fx.node.has_side_effect  # (it updates residual: a traced call with no user must stay)
def add_rms_norm_(
    input: Tensor,
    residual: Tensor,
    weight: Optional[Tensor] = None,
    eps: float = 1e-6,
    offset: float = 0.0,
    cast_before_weight: bool = False,
) -> Tensor:
    """:func:`add_rms_norm` for inference: adds ``input`` into ``residual`` in place and returns
    the normalised sum. No gradient: it raises if a tensor requires grad with grad mode on."""
    if _has_torch_function(input, residual, weight):
        return _handle_torch_function(
            add_rms_norm_, (input, residual, weight), input, residual, weight, eps, offset, cast_before_weight
        )
    try:
        if direct_call_allowed(input, residual, weight):
            return _add_rms_norm.direct_inplace(input, residual, weight, eps, offset, cast_before_weight)
        if _compiled_update_goes_out_of_place(residual) and not records_grad(input, residual, weight):
            output, residual_out, _ = _add_rms_norm_op(input, residual, weight, eps, offset,
                                                       cast_before_weight)
            residual.copy_(residual_out)
            return output
        return _add_rms_norm_inplace_op(input, residual, weight, eps, offset, cast_before_weight)[0]
    except Exception:  # (re-raised below)
        _explain_the_failure(add_rms_norm_, locals())
        raise


def layer_norm(
    input: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, eps: float = 1e-5
) -> Tensor:
    r"""Layer normalisation over the last dimension.

    .. math:: y = \frac{x - \operatorname{mean}(x)}{\sqrt{\operatorname{var}(x) + \epsilon}} \cdot w + b

    with the biased variance, as :func:`torch.nn.functional.layer_norm`.

    Args:
        input: ``(..., n)`` tensor, float32, bfloat16, float16 or float64; any strides on the
            leading dimensions (no copy is made unless the last dimension is strided).
        weight: optional ``(n,)`` scale, in input's dtype or float32 (with bf16/fp16 input).
        bias: optional ``(n,)`` shift, in weight's dtype (the same rule when there is no weight).
        eps: added to the variance before the square root.

    Returns:
        A contiguous tensor of input's shape and dtype. The math is float32 (float64 for
        float64 input) whatever the storage dtype.
    """
    if _has_torch_function(input, weight, bias):
        return _handle_torch_function(layer_norm, (input, weight, bias), input, weight, bias, eps)
    try:
        if direct_call_allowed(input, weight, bias):
            return _layer_norm.direct(input, weight, bias, eps)
        return _layer_norm_op(input, weight, bias, eps)[0]
    except Exception:  # (re-raised below)
        _explain_the_failure(layer_norm, locals())
        raise


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    r"""The gate of a SwiGLU MLP (LLaMA, Mistral, Qwen): ``silu(gate) * up``, in one pass.

    .. math:: y = \frac{g}{1 + e^{-g}} \cdot u

    Args:
        gate: ``(..., n)`` tensor (the gate projection's output), float32, bfloat16, float16 or
            float64; any strides on the leading dimensions (no copy is made unless the last
            dimension is strided).
        up: the up projection's output: gate's shape, dtype and device; its own strides.

    Returns:
        A contiguous tensor of gate's shape and dtype. The math is float32 (float64 for float64
        input); backward recomputes silu from gate (autograd keeps gate and up, nothing else).
    """
    if _has_torch_function(gate, up):
        return _handle_torch_function(swiglu, (gate, up), gate, up)
    try:
        if direct_call_allowed(gate, up):
            return _swiglu.direct(gate, up)
        return _swiglu.forward(gate, up)
    except Exception:  # (re-raised below)
        _explain_the_failure(swiglu, locals())
        raise


def geglu(gate: Tensor, up: Tensor, approximate: str = "none") -> Tensor:
    r"""The gate of a GeGLU MLP (Gemma, T5 v1.1): ``gelu(gate, approximate) * up``, in one pass.

    .. math:: y = \frac{g}{2} \left(1 + \operatorname{erf}\frac{g}{\sqrt 2}\right) \cdot u

    with ``approximate="tanh"`` the tanh form of :func:`torch.nn.functional.gelu`,
    :math:`\frac{g}{2} (1 + \tanh(\sqrt{2/\pi}\,(g + 0.044715 g^3)))` (Gemma's
    ``gelu_pytorch_tanh``).

    Args:
        gate, up: as for :func:`swiglu`.
        approximate: ``"none"`` (erf, the default) or ``"tanh"``.

    Returns:
        A contiguous tensor of gate's shape and dtype, computed in float32.
    """
    if _has_torch_function(gate, up):
        return _handle_torch_function(geglu, (gate, up), gate, up, approximate)
    try:
        if direct_call_allowed(gate, up):
            return _geglu.direct(gate, up, approximate)
        return _geglu.forward(gate, up, approximate)
    except Exception:  # (re-raised below)
        _explain_the_failure(geglu, locals())
        raise


def swiglu_packed(gate_up: Tensor) -> Tensor:
    """:func:`swiglu` of the two halves of one tensor: ``gate_up`` of shape ``(..., 2n)`` holds
    ``[gate | up]`` (a fused gate-up projection's output, as in Phi-3 or vLLM), the result has
    shape ``(..., n)``. Its backward writes one ``(..., 2n)`` gradient, which the fused
    projection's backward takes as it is (no concatenation of two gradients)."""
    if _has_torch_function(gate_up):
        return _handle_torch_function(swiglu_packed, (gate_up,), gate_up)
    try:
        if direct_call_allowed(gate_up):
            return _swiglu_packed.direct(gate_up)
        return _swiglu_packed.forward(gate_up)
    except Exception:  # (re-raised below)
        _explain_the_failure(swiglu_packed, locals())
        raise


def geglu_packed(gate_up: Tensor, approximate: str = "none") -> Tensor:
    """:func:`geglu` of the two halves of ``gate_up`` ``(..., 2n)`` = ``[gate | up]``; see
    :func:`swiglu_packed`."""
    if _has_torch_function(gate_up):
        return _handle_torch_function(geglu_packed, (gate_up,), gate_up, approximate)
    try:
        if direct_call_allowed(gate_up):
            return _geglu_packed.direct(gate_up, approximate)
        return _geglu_packed.forward(gate_up, approximate)
    except Exception:  # (re-raised below)
        _explain_the_failure(geglu_packed, locals())
        raise


# ---- rotary position embeddings -------------------------------------------------------------

from .ops import rope as _rope  # noqa: E402

_rope_op = _rope.forward
_rope_inplace_op = _rope.forward_
LAYOUTS = ("bhsd", "bshd", "thd")


def _rope_views(op, q, k, cos, sin, layout, position_ids):
    """q, k, cos, sin and position_ids as the op's (B, H, S, D) views of the caller's layout."""
    if layout == "bhsd":
        return q, k, cos, sin, position_ids
    if layout == "bshd":
        for name, t in (("q", q), ("k", k)):
            if t.dim() != 4:
                raise ValueError(
                    f"{op}: {name} must be a 4-D (batch, seq, heads, head_dim) tensor for layout 'bshd', got "
                    f"{_rope._dims_str(t)}"
                )
        # (in the caller's terms: the op would name the transposed shapes)
        if (k.shape[0], k.shape[1], k.shape[3]) != (q.shape[0], q.shape[1], q.shape[3]):
            raise ValueError(
                f"{op}: k {_rope._dims_str(k)} does not go with q {_rope._dims_str(q)} for layout 'bshd': batch, "
                "seq and head_dim must match"
            )
        return q.transpose(1, 2), k.transpose(1, 2), cos, sin, position_ids
    if layout == "thd":
        for name, t in (("q", q), ("k", k)):
            if t.dim() != 3:
                raise ValueError(
                    f"{op}: {name} must be a 3-D (tokens, heads, head_dim) tensor for layout 'thd', got "
                    f"{_rope._dims_str(t)}"
                )
        # (checked here in the caller's terms: the op sees the unsqueezed views)
        T = q.shape[0]
        if k.shape[0] != T:
            raise ValueError(f"{op}: k has {k.shape[0]} tokens and q {T}: they must match for layout 'thd'")
        if k.shape[2] != q.shape[2]:
            raise ValueError(
                f"{op}: k {_rope._dims_str(k)} does not go with q {_rope._dims_str(q)} for layout 'thd': head_dim "
                "must match"
            )
        rows = "(tokens, rotary_dim)" if position_ids is None else "(positions, rotary_dim) tables"
        for name, t in (("cos", cos), ("sin", sin)):
            if t.dim() != 2 or (position_ids is None and t.shape[0] != T):
                raise ValueError(
                    f"{op}: {name} must be {rows} for layout 'thd'"
                    + (f" with {T} tokens" if position_ids is None else "")
                    + f", got {_rope._dims_str(t)}"
                )
        if position_ids is not None:
            if position_ids.dim() != 1 or position_ids.shape[0] != T:
                raise ValueError(
                    f"{op}: position_ids must be a 1-D (tokens,) tensor of {T} for layout 'thd', got "
                    f"{_rope._dims_str(position_ids)}"
                )
            position_ids = position_ids.unsqueeze(0)
        else:  # per-token cos/sin rows
            cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
        return q.unsqueeze(0).transpose(1, 2), k.unsqueeze(0).transpose(1, 2), cos, sin, position_ids
    raise ValueError(f"{op}: layout must be 'bhsd', 'bshd' or 'thd', got {layout!r}")


def _rope_back(t, layout, given):
    """The op's output `t` in the caller's layout, for the caller's input `given`."""
    if layout == "bhsd":
        return t
    if layout == "bshd":
        out = t.transpose(1, 2)
    else:
        # squeeze, not [0]: indexing's backward would allocate and fill a zeroed copy of the gradient.
        out = t.transpose(1, 2).squeeze(0)
    # The op keeps an expanded (stride-0) dimension in its place in the (B, H, S) view it was
    # given, which in the caller's layout is out of order: copied to the contiguous output a
    # caller expects, as torch's elementwise ops give (one more pass, for expanded inputs only).
    if any(st == 0 and n > 1 for n, st in zip(given.shape[:-1], given.stride()[:-1])):
        out = out.contiguous()
    return out


def _rope_position_check(op, q, position_ids, check_positions):
    """The GPU position check to finish after the launch, or None. The CPU kernel checks the
    positions itself; the GPU kernels record the first bad one."""
    if position_ids is not None:
        return _rope.gpu_position_check(op, check_positions, q, torch.compiler.is_compiling())
    if check_positions is not True:
        _rope.check_positions_mode(op, check_positions)
    return None


def rope(
    q: Tensor,
    k: Tensor,
    cos: Tensor,
    sin: Tensor,
    *,
    interleaved: bool = False,
    layout: str = "bhsd",
    position_ids: Optional[Tensor] = None,
    check_positions: Union[bool, str] = True,
) -> Tuple[Tensor, Tensor]:
    r"""Rotary position embeddings of queries and keys, both in one kernel launch.

    For each head vector x (of q or k) at a position with rotary tables c, s (R values):

    .. math:: y_{:R} = x_{:R} \odot c + \operatorname{rotate}(x_{:R}) \odot s, \qquad y_{R:} = x_{R:}

    ``rotate`` is rotate-half ``[-x_2, x_1]`` (Hugging Face, the default) or, with
    ``interleaved=True``, rotate-every-two ``(x_0, x_1) -> (-x_1, x_0)`` per pair (GPT-J, Meta's
    LLaMA). cos/sin are used elementwise as given.

    Args:
        q, k: queries and keys, float32, bfloat16, float16 or float64 (the same dtype), with
            ``Hq`` a multiple of ``Hk`` (grouped-query attention). By ``layout``:
            ``"bhsd"`` (default) ``(B, Hq, S, D)`` and ``(B, Hk, S, D)``;
            ``"bshd"`` ``(B, S, Hq, D)`` and ``(B, S, Hk, D)``;
            ``"thd"`` packed variable-length sequences ``(T, Hq, D)`` and ``(T, Hk, D)``.
            Any strides (the last dimension contiguous, else it is copied).
        cos, sin: ``(1 or B, S, R)`` per position (``(T, R)`` per token for "thd"), or, with
            ``position_ids``, ``(P, R)`` tables indexed by position. ``R`` even, ``R <= D``
            (partial rotary: features from ``R`` on pass through). In q's dtype or float32.
        interleaved: rotate adjacent pairs instead of halves.
        layout: ``"bhsd"``, ``"bshd"`` or ``"thd"``.
        position_ids: int32/int64, ``(B or 1, S)`` (``(T,)`` for "thd"): the table row of each
            position. The GPU kernels never read outside the tables: a position outside
            ``[0, P)`` gets NaN rotated features, and the kernel records the first one.
        check_positions: on a GPU in eager mode, how a position outside ``[0, P)`` raises its
            ValueError (which names it): ``True`` without waiting for the GPU (no
            synchronisation; the error is raised by the first ``rope``/``rope_`` call or rope
            backward, or cross_entropy call, that starts after the GPU has finished the bad
            call), ``"sync"`` in the call itself (one synchronisation per call), ``False``
            never. Never checked under torch.compile or CUDA-graph capture (NaN). On the CPU
            the kernel always checks, in the call.

    Returns:
        ``(q_out, k_out)`` in q's and k's dtype and layout (their strides when dense). Math in
        float32 (float64 for float64 input). Differentiable in q and k (any order); gradients
        with respect to cos and sin are not supported (a clear error if they require grad).
    """
    if _has_torch_function(q, k, cos, sin, position_ids):
        return _handle_torch_function(
            rope, (q, k, cos, sin, position_ids), q, k, cos, sin, interleaved=interleaved, layout=layout,
            position_ids=position_ids, check_positions=check_positions,
        )
    try:
        q4, k4, cos4, sin4, pos = _rope_views("fusedops.rope", q, k, cos, sin, layout, position_ids)
        gpu_check = _rope_position_check("rope", q4, pos, check_positions)
        if direct_call_allowed(q4, k4, cos4, sin4):
            q_out, k_out, bad = _rope.direct(q4, k4, cos4, sin4, pos, interleaved)
        else:
            q_out, k_out, bad = _rope_op(q4, k4, cos4, sin4, pos, interleaved)
        if gpu_check is not None:
            gpu_check.finish(bad, _rope.position_message("rope", pos, cos4.shape[0]))
        return _rope_back(q_out, layout, q), _rope_back(k_out, layout, k)
    except Exception:  # (re-raised below)
        _explain_the_failure(rope, locals())
        raise


@torch.fx.node.has_side_effect  # (it updates q and k: a traced call with no user must stay)
def rope_(
    q: Tensor,
    k: Tensor,
    cos: Tensor,
    sin: Tensor,
    *,
    interleaved: bool = False,
    layout: str = "bhsd",
    position_ids: Optional[Tensor] = None,
    check_positions: Union[bool, str] = True,
) -> Tuple[Tensor, Tensor]:
    """:func:`rope` for inference: rotates ``q`` and ``k`` in place (features past R are not
    touched) and returns them. No gradient: it raises if a tensor requires grad with grad mode
    on. q and k must not have rows that share memory (an expanded tensor), nor share memory with
    each other (the same tensor twice, or overlapping views; views of one fused QKV output are
    fine). As for torch's in-place ops, overlap is detected where both are dense: strided views
    that partly overlap are not refused, and where they meet the result is undefined (rotated
    twice on the CPU, a race on a GPU)."""
    if _has_torch_function(q, k, cos, sin, position_ids):
        return _handle_torch_function(
            rope_, (q, k, cos, sin, position_ids), q, k, cos, sin, interleaved=interleaved, layout=layout,
            position_ids=position_ids, check_positions=check_positions,
        )
    try:
        q4, k4, cos4, sin4, pos = _rope_views("fusedops.rope_", q, k, cos, sin, layout, position_ids)
        gpu_check = _rope_position_check("rope_", q4, pos, check_positions)
        if direct_call_allowed(q4, k4, cos4, sin4):
            bad = _rope.direct_inplace(q4, k4, cos4, sin4, pos, interleaved)
        elif _compiled_update_goes_out_of_place(q4, k4) and not records_grad(q, k):
            # (q and k split from a fused QKV output are transposed views of views in the op's
            # (B, H, S, D) order, whichever layout the caller names)
            q_out, k_out, bad = _rope_op(q4, k4, cos4, sin4, pos, interleaved)
            q4.copy_(q_out)
            k4.copy_(k_out)
        else:
            bad = _rope_inplace_op(q4, k4, cos4, sin4, pos, interleaved)
        if gpu_check is not None:
            gpu_check.finish(bad, _rope.position_message("rope_", pos, cos4.shape[0]))
        return q, k
    except Exception:  # (re-raised below)
        _explain_the_failure(rope_, locals())
        raise


_cross_entropy_op = _cross_entropy.forward
_call_dropping_gradients = _cross_entropy.call_dropping_gradients
_cross_entropy_inplace_op = _cross_entropy.forward_


def cross_entropy(
    logits: Tensor,
    target: Tensor,
    *,
    weight: Optional[Tensor] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    inplace_grad: bool = False,
    check_target: Union[bool, str] = True,
) -> Tensor:
    r"""Cross-entropy between ``(..., V)`` logits and class-index targets, with the value, the
    log-sum-exp and (when the logits need a gradient) the gradient from one read of the logits.

    Same semantics as :func:`torch.nn.functional.cross_entropy` for every option it has, with
    the class dimension **last**: logits ``(N, V)`` or ``(B, T, V)`` (any leading dimensions)
    and target ``(N,)`` or ``(B, T)``, where torch wants ``(N, C, d1, ...)``.

    .. math:: \ell_i = (1 - \varepsilon)\, w_{t_i} (\mathrm{lse}_i - x_{i,t_i})
              + \frac{\varepsilon}{V} \sum_j w_j (\mathrm{lse}_i - x_{ij})
              + z \cdot \mathrm{lse}_i^2

    with :math:`x = \mathrm{softcap} \cdot \tanh(\mathrm{logits} / \mathrm{softcap})` when
    ``softcap`` is given. Rows whose target is ``ignore_index`` contribute 0. ``"mean"`` divides
    the cross-entropy terms by the sum of :math:`w_{t_i}` over the rows not ignored (torch's rule)
    and the z-terms by the number of those rows (Liger-Kernel's); all rows ignored gives NaN, as
    in torch.

    Args:
        logits: ``(..., V)``, float32, bfloat16, float16 or float64. Leading dimensions may have
            any strides (``logits[:, :-1]`` of a ``(B, T, V)`` tensor is read in place); a
            strided last dimension is copied.
        target: ``(...)`` class indices, int64 or int32 (probability targets are not supported).
        weight: optional ``(V,)`` class weights, in logits' dtype or float32. No gradient.
        ignore_index: target value whose rows are skipped.
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (per-row losses, target's shape).
        label_smoothing: in ``[0, 1]``, as torch.
        z_loss: weight of the ``lse^2`` term (PaLM's auxiliary loss), per row not ignored.
        softcap: Gemma-2 style logit soft-capping (``> 0``), gradient included.
        inplace_grad: write the gradient into ``logits`` (which then hold it, not the logits)
            instead of a new logits-sized buffer, to save memory. Only when the logits need a
            gradient; ignored under torch.compile (which plans memory itself). Nothing else may
            need the logits afterwards (autograd raises if a saved copy was overwritten). Logits
            that are a leaf requiring grad, or a view of one, are refused (RuntimeError), as
            torch refuses in-place ops on them.
        check_target: on a GPU in eager mode, a target outside ``[0, V)`` that is not
            ``ignore_index`` raises a ValueError naming it. The kernel records the first bad
            row on the device; with ``True`` the host reads that record without waiting for the
            GPU (no synchronisation), so the error is raised by the first ``cross_entropy`` call
            or backward that starts after the GPU has finished the bad call; ``"sync"`` waits
            and raises in the call itself (one synchronisation per call); ``False`` never
            checks. Bad rows give NaN whatever the mode. Never checked under torch.compile or
            CUDA-graph capture (NaN). On the CPU the kernel always checks, in the call.

    Returns:
        The loss: 0-d for ``"mean"``/``"sum"``, target's shape for ``"none"``; in the logits'
        dtype (float32 under autocast, as torch). Math in float32 (float64 for float64 logits).
    """
    if _has_torch_function(logits, target, weight):
        return _handle_torch_function(
            cross_entropy, (logits, target, weight), logits, target, weight=weight, ignore_index=ignore_index,
            reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
            inplace_grad=inplace_grad, check_target=check_target,
        )
    try:
        compiling = torch.compiler.is_compiling()
        gpu_check = _cross_entropy.gpu_target_check("cross_entropy", check_target, logits, compiling)
        owner = "fusedops.cross_entropy"
        args = (logits, target, weight, ignore_index, reduction,
                _real_number(owner, "label_smoothing", label_smoothing),
                _real_number(owner, "z_loss", z_loss), _real_number(owner, "softcap", softcap, optional=True))
        if not _is_a(bool, inplace_grad):  # (a truthy "False" must not overwrite the logits)
            raise TypeError(f"fusedops.cross_entropy: inplace_grad must be a bool, got {type(inplace_grad).__name__}")
        # (not while a TorchDispatchMode sees the ops: it may answer cross_entropy_ without running
        # it, as selective activation checkpointing does on recompute with a policy that saves it
        # or the copy of its result, and the logits would never hold the gradient the backward
        # reads from them)
        in_place = (inplace_grad and not compiling and torch.is_grad_enabled() and logits.requires_grad
                    and not dispatch_mode_active())
        # float16 "mean" with a gradient: the kernels fold the mean's denominator into the
        # gradient they keep in float16, where p_j / N falls below float16's normal range before
        # the backward's grad_output (a loss scaler's 2^16) could lift it. The per-row losses
        # instead, averaged here in float32: their gradient is kept unscaled, and the denominator
        # reaches the backward with grad_output.
        mean_of_rows = (reduction == "mean" and logits.dtype == torch.float16 and logits.shape[-1] > 0
                        and torch.is_grad_enabled() and logits.requires_grad
                        and (weight is None or not z_loss))
        if mean_of_rows:
            args = (*args[:4], "none", *args[5:])
        if direct_call_allowed(logits, weight):
            if in_place:
                loss, bad = _cross_entropy.direct_inplace(*args)
            else:
                loss, bad = _cross_entropy.direct(*args)
        elif in_place:
            loss, _lse, bad = _cross_entropy_inplace_op(*args)
        else:
            needs_grad = torch.is_grad_enabled() and logits.requires_grad
            loss, _lse, _grad, bad = _call_dropping_gradients(
                _cross_entropy_op, (*args, needs_grad), compiling
            )
        if gpu_check is not None:
            gpu_check.finish(
                bad, _cross_entropy.target_message("cross_entropy", target, logits.shape[-1], ignore_index)
            )
        if mean_of_rows:
            loss = _cross_entropy.mean_of_rows(loss, target, weight, ignore_index)
        if loss.dtype != logits.dtype and not _autocast_enabled(logits.device.type):
            loss = loss.to(logits.dtype)
        return loss
    except Exception:  # (re-raised below)
        _explain_the_failure(cross_entropy, locals())
        raise


_linear_cross_entropy_op = _linear_cross_entropy.forward


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor] = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    class_weight: Optional[Tensor] = None,
    chunk_rows: Optional[int] = None,
    low_memory: bool = False,
    chunk_classes: Optional[int] = None,
    check_target: Union[bool, str] = True,
) -> Tensor:
    r"""``fusedops.cross_entropy(hidden @ weight.T + bias, target, ...)`` and its gradients with
    respect to ``hidden``, ``weight`` and ``bias``, without ever holding the ``(tokens, V)``
    logits: the rows go through in chunks, each chunk's logits made, turned into their gradient
    in place and consumed before the next (docs/ops/linear_cross_entropy.md).

    Args:
        hidden: ``(..., H)``: the last layer's hidden states; float32, bfloat16, float16 or
            float64. The matrix products run in this dtype.
        weight: ``(V, H)``, the ``lm_head`` weight (``nn.Linear(H, V).weight``); hidden's dtype,
            or float32 with bfloat16/float16 hidden (mixed precision: the gradient is then
            float32, accumulated in float32).
        target: ``(...)`` class indices, int64 or int32.
        bias: optional ``(V,)``.
        ignore_index, reduction, label_smoothing, z_loss, softcap, check_target: as for
            :func:`fusedops.cross_entropy`.
        class_weight: optional ``(V,)`` class weights (cross_entropy's ``weight``). No gradient.
        chunk_rows: rows per chunk; ``None`` picks as many as keep one chunk's logits within
            ``fusedops.ops.linear_cross_entropy.CHUNK_BYTES_CUDA`` (1 GiB) on a GPU,
            ``CHUNK_BYTES`` (64 MiB) on the CPU. Larger chunks make the products faster and
            cost that many more bytes.
        low_memory: walk the vocabulary in chunks of classes instead of the rows in chunks:
            besides the inputs and the gradients, only one chunk of every row's logits, a float32
            copy of the gradient of ``hidden`` (when hidden is narrower) and ~50 bytes a row, with
            no float32 buffer of the weight's size; the weight's gradient comes in the weight's
            dtype (accumulated in float32 inside the matrix products). Costs one more matrix
            product (four instead of three). Not with ``chunk_rows``.
        chunk_classes: with ``low_memory``, classes per chunk; ``None`` picks as many as keep
            one chunk of logits within ``fusedops.ops.linear_cross_entropy.SLICE_BYTES`` (32
            MiB), at least 128.

    Returns:
        The loss: 0-d for ``"mean"``/``"sum"``, target's shape for ``"none"``; in hidden's dtype
        (float32 under autocast, as cross_entropy); math in float32 (float64 for float64 hidden).
        With ``"mean"``/``"sum"`` the gradients are computed in the forward (when anything needs
        them) and scaled in the backward; with ``"none"`` the backward recomputes the logits
        chunk by chunk.
    """
    if _has_torch_function(hidden, weight, target, bias, class_weight):
        return _handle_torch_function(
            linear_cross_entropy, (hidden, weight, target, bias, class_weight), hidden, weight, target, bias,
            ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss,
            softcap=softcap, class_weight=class_weight, chunk_rows=chunk_rows, low_memory=low_memory,
            chunk_classes=chunk_classes, check_target=check_target,
        )
    try:
        owner = "fusedops.linear_cross_entropy"
        compiling = torch.compiler.is_compiling()
        if torch.jit.is_tracing():
            raise NotImplementedError(
                "fusedops.linear_cross_entropy cannot be recorded by torch.jit.trace, whose tracer takes no "
                "list of bools (the op's output_mask); use torch.export or torch.compile"
            )
        if not _is_a(bool, low_memory):
            raise TypeError(f"fusedops.linear_cross_entropy: low_memory must be a bool, got {type(low_memory).__name__}")
        gpu_check = _cross_entropy.gpu_target_check("linear_cross_entropy", check_target, hidden, compiling)
        # (under autocast the op checks its arguments itself, after its rule has cast them: a float32
        # hidden with a bf16 weight is fine there, as for torch's linear)
        if not compiling and not _autocast_enabled(hidden.device.type):
            _linear_cross_entropy.check(
                "linear_cross_entropy", hidden, weight, target, bias, class_weight, ignore_index, reduction,
                label_smoothing, z_loss, softcap, chunk_rows, low_memory, chunk_classes,
            )
        needs_grad = torch.is_grad_enabled() and (
            hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
        )
        if needs_grad:
            _linear_cross_entropy._refuse_class_weight_grad(class_weight)
        args = (
            hidden, weight, target, bias, class_weight, ignore_index, reduction,
            _real_number(owner, "label_smoothing", label_smoothing), _real_number(owner, "z_loss", z_loss),
            _real_number(owner, "softcap", softcap, optional=True), chunk_rows, bool(low_memory),
            chunk_classes,
            needs_grad and reduction != "none",
            # (only the gradients wanted: a frozen lm_head's (V, H) one would cost its product
            # and a float32 buffer of the weight's size until the backward)
            [hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad],
        )
        if direct_call_allowed(hidden, weight, bias, class_weight):
            loss, bad = _linear_cross_entropy.direct(needs_grad, *args)
        else:
            loss, _gh, _gw, _gb, bad = _call_dropping_gradients(_linear_cross_entropy_op, args, compiling)
        if gpu_check is not None:
            gpu_check.finish(
                bad,
                _cross_entropy.target_message("linear_cross_entropy", target, weight.shape[0], ignore_index),
            )
        if loss.dtype != hidden.dtype and not _autocast_enabled(hidden.device.type):
            loss = loss.to(hidden.dtype)  # as cross_entropy on the logits, which are in hidden's dtype
        return loss
    except Exception:  # (re-raised below)
        _explain_the_failure(linear_cross_entropy, locals())
        raise
