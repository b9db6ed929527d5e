"""The op sample registry (in the spirit of torch's OpInfo), shared by tests/ and benchmarks/.

Each op describes itself once, in testing/<op>.py, as an :class:`OpTestInfo`: how to call it,
an fp64 reference, sample inputs (ordinary, edge and strided), bad inputs with the error each
must raise, and tolerances per dtype. The generic suites in tests/ run every entry of
:data:`OP_TESTS`, so a new op is covered by adding its entry here.
"""

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple, Type

import torch


@dataclass
class Sample:
    """One call: positional args of the registered op (and of the public function, which takes
    the same arguments first), plus a short description for test ids and failure messages."""

    args: Tuple[Any, ...]
    desc: str = ""


@dataclass
class ErrorSample:
    sample: Sample
    error: Type[Exception]
    match: str  # regex the message must match
    op: Any = None  # the OpOverload to call; None: the entry's forward op
    # Raised by a look at the tensors' values, which only the CPU kernels take in the call (the
    # GPU kernels check them on the device: their own tests).
    on_values: bool = False


@dataclass
class Tolerance:
    atol: float
    rtol: float


@dataclass
class PublicVariant:
    """Another public form of an op (an in-place function, say), called with `public`'s
    arguments and returning what `public` returns: the self-check and the dtype matrix hold it
    to the same fp64 reference."""

    name: str
    call: Callable
    # whether gradients flow through it (else it runs on samples that need none)
    differentiable: bool = False


@dataclass
class OpTestInfo:
    name: str
    op: Any  # the forward OpOverload, torch.ops.fusedops.<name>.default
    public: Callable  # fusedops.<name>: differentiable, returns what users see
    reference: Callable  # same signature and outputs as `public`, any dtype (fp64 in tests)
    samples: Callable[..., Iterator[Sample]]  # (device, dtype, requires_grad) -> samples
    # (device, dtype, shape, requires_grad) -> an ordinary Sample of input shape `shape` with
    # every optional tensor argument given
    sample_for_shape: Callable[..., Sample]
    error_samples: Callable[..., Iterator[ErrorSample]]  # (device) -> bad inputs
    # hypothesis strategy factory: (device, dtype) -> strategy of Samples with unusual strides
    strided_samples: Callable[..., Any]
    backward_ops: Sequence[Any] = ()  # registered backward OpOverloads
    # (sample, forward outputs, grad_output) -> args of backward_ops[0]
    backward_args: Optional[Callable[..., Tuple[Any, ...]]] = None
    # public-output tolerance against the fp64 reference, per dtype; gradients use grad_tol
    dtypes: Tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
    tol: Dict[torch.dtype, Tolerance] = field(default_factory=dict)
    grad_tol: Dict[torch.dtype, Tolerance] = field(default_factory=dict)
    # inputs of `public` that carry gradients, by position
    grad_argnums: Tuple[int, ...] = (0,)
    # (device) -> [(autocast dtype, Sample)] and the checker of one result under autocast
    autocast_check: Optional[Callable[..., None]] = None
    # torch's own implementation with `public`'s signature (for `python -m fusedops`'s timing)
    torch_equivalent: Optional[Callable] = None
    # `public` returns one tensor per entry (a tuple when more than one), each in the dtype of
    # the argument at that position
    output_dtype_argnums: Tuple[int, ...] = (0,)
    # other forms of the op (an in-place variant, say) that opcheck covers on every sample:
    # (OpOverload, sample -> its args)
    variant_ops: Sequence[Tuple[Any, Callable[[Sample], Tuple[Any, ...]]]] = ()
    # the public functions of those forms, which the reference checks cover
    public_variants: Sequence[PublicVariant] = ()
    # whether gradients of gradients are supported (then gradgradcheck runs; else the generic
    # suite checks that double backward raises a clear error)
    double_backward: bool = False
    # (device) -> None: checks an input of more than 2^31 elements (64-bit indexing) its own
    # way; None: the generic check, which replaces arguments of the sample's (rows, n) shape
    large_input_check: Optional[Callable[[str], None]] = None


def outputs_of(result) -> Tuple[torch.Tensor, ...]:
    """The public function's result as a tuple of tensors."""
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def grads_for(outputs: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """Fresh random incoming gradients, one per output."""
    return tuple(torch.randn_like(o) for o in outputs)


def check_against_reference(
    info: OpTestInfo, sample: Sample, dtype: torch.dtype, variant: Optional[PublicVariant] = None
) -> None:
    """Forward and backward of `info.public` (or of `variant`) on `sample` against the fp64
    reference, within the dtype's tolerances; raises AssertionError naming the sample otherwise.
    Gradients (which grow with the number of rows summed) are compared relative to their largest
    element in each row (the last dimension), at least 1: a row of small gradients beside rows
    of large ones is held to its own size, not theirs."""
    tol, gtol = info.tol[dtype], info.grad_tol[dtype]
    name = variant.name if variant else info.name
    outs = outputs_of((variant.call if variant else info.public)(*sample.args))
    ref_args = tuple(
        a.detach().double().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
        for a in sample.args
    )
    refs = outputs_of(info.reference(*ref_args))
    _require(len(outs) == len(refs) == len(info.output_dtype_argnums), f"{name} {sample.desc}: outputs")
    for k, (out, ref, argnum) in enumerate(zip(outs, refs, info.output_dtype_argnums)):
        what = f"{name} {sample.desc} output {k}"
        _require(out.dtype == sample.args[argnum].dtype, f"{what}: dtype {out.dtype}")
        _require(out.shape == ref.shape, f"{what}: shape {tuple(out.shape)}")
        _assert_close(out, ref, tol, f"{what} (forward)")
    wrt = [i for i in info.grad_argnums if isinstance(sample.args[i], torch.Tensor) and sample.args[i].requires_grad]
    if not wrt:
        return
    grad_outs = grads_for(outs)
    grads = torch.autograd.grad(outs, [sample.args[i] for i in wrt], grad_outs, allow_unused=True)
    ref_grads = torch.autograd.grad(
        refs, [ref_args[i] for i in wrt], [g.double() for g in grad_outs], allow_unused=True
    )
    for i, g, rg in zip(wrt, grads, ref_grads):
        t = sample.args[i]
        if rg is None:
            rg = torch.zeros_like(t, dtype=torch.float64)
        _require(g is not None and g.dtype == t.dtype and g.shape == t.shape, f"{name} grad {i} {sample.desc}")
        scale = row_scale(rg)
        _assert_close(g / scale, rg / scale, gtol, f"{name} grad of arg {i} {sample.desc}")


def row_scale(t: torch.Tensor) -> torch.Tensor:
    """max(1, the largest |element| of each row of `t`), broadcastable to `t`. (Not below 1: a
    gradient that cancels to near 0, a row of one value say, keeps an absolute tolerance.)"""
    if t.numel() == 0:
        return torch.ones((), dtype=torch.float64, device=t.device)
    peak = t.detach().abs().amax(dim=-1, keepdim=True) if t.dim() >= 2 else t.detach().abs().max()
    return peak.clamp(min=1.0)


def _require(condition: bool, what: str) -> None:
    # (not `assert`, which python -O removes: `python -m fusedops`'s self-check runs this too)
    if not condition:
        raise AssertionError(what)


def _assert_close(actual, expected, tol, what):
    torch.testing.assert_close(
        actual.double(), expected.detach().double(), atol=tol.atol, rtol=tol.rtol,
        msg=lambda m: f"{what}: {m}",
    )


from . import add_rms_norm as _add_rms_norm  # noqa: E402
from . import layer_norm as _layer_norm  # noqa: E402
from . import rms_norm as _rms_norm  # noqa: E402
from . import _gated  # noqa: E402
from . import rope as _rope  # noqa: E402
from . import cross_entropy as _cross_entropy  # noqa: E402
from . import linear_cross_entropy as _linear_cross_entropy  # noqa: E402

OP_TESTS = [_rms_norm.INFO, _add_rms_norm.INFO, _layer_norm.INFO, *_gated.infos(), _rope.INFO, _cross_entropy.INFO,
            _linear_cross_entropy.INFO]  # _gated: swiglu, geglu and their packed forms
OP_TESTS_BY_NAME = {info.name: info for info in OP_TESTS}
