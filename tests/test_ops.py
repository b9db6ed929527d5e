"""Generic suites over every op in fusedops.testing.OP_TESTS, on the CPU and (marked gpu) CUDA.

On CUDA the suites test whichever backend serves the op in this process: run them once as is
(the CUDA kernels) and once with FUSEDOPS_BACKEND=triton."""

import inspect
from typing import Optional

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fusedops
from fusedops.ops._batching import RULES as BATCHING_RULES
from fusedops.testing import OP_TESTS, Sample, check_against_reference, grads_for, outputs_of
from conftest import device_params, vmap_fallback

OPS = [pytest.param(info, id=info.name) for info in OP_TESTS]
DEVICES = device_params()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", OPS)
def test_dtype_matrix(info, device):
    """Every dtype, every sample (ordinary and edge shapes), forward and backward, against fp64;
    the op's other public forms (in-place functions) too."""
    for dtype in info.dtypes:
        for sample in info.samples(device, dtype, requires_grad=True):
            check_against_reference(info, sample, dtype)
        for variant in info.public_variants:
            for sample in info.samples(device, dtype, requires_grad=variant.differentiable):
                check_against_reference(info, sample, dtype, variant)


def _one_element_in(t: torch.Tensor) -> torch.Tensor:
    """t's values, shape and strides in a new buffer, starting one element in: the data pointer
    is off the 16-byte alignment of the kernels' vector accesses."""
    if t.numel() == 0:
        return t
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    buffer = t.new_empty(span + 1)
    buffer[1:].copy_(t.detach().as_strided((span,), (1,), t.storage_offset()))
    return buffer.requires_grad_(t.requires_grad).as_strided(t.shape, t.stride(), 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", OPS)
def test_misaligned_storage(info, device):
    """Every tensor argument one element into its buffer (a slice of a packed buffer, such as q,
    k and v split from one projection, starts anywhere): its data pointer is off the vector
    accesses' alignment, so the kernels take their unaligned paths. The reference result,
    forward and backward, in every dtype."""
    for dtype in info.dtypes:
        for sample in info.samples(device, dtype, requires_grad=True, edge=False):
            moved = tuple(_one_element_in(a) if isinstance(a, torch.Tensor) else a for a in sample.args)
            check_against_reference(info, Sample(moved, sample.desc + " at storage offset 1"), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", OPS)
def test_gradcheck_fp64(info, device):
    for sample in info.samples(device, torch.float64, requires_grad=True, edge=False):
        if sample.args[0].numel() > 4096:
            continue  # gradcheck is quadratic in the input size
        grad_inputs = [i for i in info.grad_argnums if isinstance(sample.args[i], torch.Tensor)]

        def fn(*ts, sample=sample, grad_inputs=grad_inputs):
            args = list(sample.args)
            for i, t in zip(grad_inputs, ts):
                args[i] = t
            return info.public(*args)

        assert torch.autograd.gradcheck(fn, [sample.args[i] for i in grad_inputs], eps=1e-6, atol=1e-5), sample.desc


@pytest.mark.parametrize("info", OPS)
def test_torch_func_grad_works_or_says_what_to_do(info):
    """torch.func.grad through the public function gives torch.autograd.grad's gradient, or, on
    a torch whose functorch refuses formulas registered with torch.library.register_autograd
    (pytorch/pytorch#170834; every torch this package supports so far), a NotImplementedError
    naming the function and the way out, never torch's message about autograd.Function
    internals the caller did not write."""
    sample = next(iter(info.samples("cpu", torch.float64, requires_grad=False, edge=False)))
    i = info.grad_argnums[0]

    def loss(t):
        args = list(sample.args)
        args[i] = t
        return sum(o.sum() for o in outputs_of(info.public(*args)) if o.is_floating_point())

    try:
        got = torch.func.grad(loss)(sample.args[i])
    except NotImplementedError as error:
        message = str(error)
        assert message.startswith(f"fusedops.{info.name}: torch.func's"), message
        assert "use torch.autograd.grad or .backward()" in message, message
        return
    x = sample.args[i].detach().requires_grad_()
    (want,) = torch.autograd.grad(loss(x), x)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", OPS)
def test_opcheck(info, device):
    """torch.library.opcheck with all its test_utils, on the forward and the backward ops."""
    tested = 0
    for dtype in (torch.float32, torch.bfloat16):
        for sample in info.samples(device, dtype, requires_grad=True):
            if sample.args[0].numel() > 20000:
                continue
            torch.library.opcheck(info.op, sample.args)
            outputs = outputs_of(info.op(*sample.args))  # (ops of one output return a tensor)
            for bwd in info.backward_ops:
                grad = torch.randn_like(outputs[0])
                torch.library.opcheck(bwd, info.backward_args(sample, outputs, grad))
            for variant, variant_args in info.variant_ops:
                torch.library.opcheck(variant, variant_args(sample))
            tested += 1
    assert tested > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", OPS)
def test_strided_inputs(info, device):
    """Sliced, permuted, expanded leading dimensions and strided last dimensions give the
    reference result (forward and backward)."""
    dtype = torch.float32

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def run(data):
        sample = data.draw(info.strided_samples(device, dtype))
        args = [
            a.requires_grad_() if i in info.grad_argnums and isinstance(a, torch.Tensor) and a.is_leaf else a
            for i, a in enumerate(sample.args)
        ]
        check_against_reference(info, type(sample)(tuple(args), sample.desc), dtype)

    run()


@pytest.mark.parametrize("device", DEVICES + ["meta"])
@pytest.mark.parametrize("info", OPS)
def test_bad_inputs(info, device):
    """Each bad input raises its error, with its message, from the real kernel and from the
    fake kernel (device 'meta')."""
    for err in info.error_samples(device):
        op = err.op or info.op
        with pytest.raises(err.error, match=err.match):
            op(*err.sample.args)


def _required_tensors(op):
    return [(i, a.name) for i, a in enumerate(op._schema.arguments) if a.type == torch._C.TensorType.get()]


@pytest.mark.parametrize("device", DEVICES + ["meta"])
@pytest.mark.parametrize("info", OPS)
def test_none_for_a_required_tensor(info, device):
    """torch.ops hands None, passed for a required Tensor, to the kernels (C++: an undefined
    tensor): each op names the argument, from the real kernels and the fake ones, forward,
    backward and in-place variants. (With no other tensor argument the dispatcher itself refuses
    the call, before any kernel: that case is not the op's.)"""
    sample = next(iter(info.samples("cpu", torch.float32, requires_grad=False, edge=False)))
    outputs = outputs_of(info.op(*sample.args))
    calls = [(info.op, sample.args)]
    calls += [(bwd, info.backward_args(sample, outputs, torch.randn_like(outputs[0]))) for bwd in info.backward_ops]
    calls += [(variant, variant_args(sample)) for variant, variant_args in info.variant_ops]
    checked = 0
    for op, args in calls:
        args = [a.detach().to(device) if isinstance(a, torch.Tensor) else a for a in args]
        for i, name in _required_tensors(op):
            others = [a for j, a in enumerate(args) if j != i and isinstance(a, torch.Tensor)]
            if i >= len(args) or not others:
                continue
            with pytest.raises(ValueError, match=rf"^{op._schema.name.split('::')[1]}: {name} must be a Tensor, got None"):
                op(*args[:i], None, *args[i + 1:])
            checked += 1
    assert checked > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", OPS)
def test_public_function_checks(info, device):
    """The public function raises the same errors as the op for bad forward arguments."""
    for err in info.error_samples(device):
        if err.op is not None:
            continue  # a backward op's sample
        with pytest.raises(err.error, match=err.match):
            info.public(*err.sample.args)


def _has_batching_rule(info) -> bool:
    return info.op in BATCHING_RULES


def _batch_of(a: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """`size` samples like `a` stacked at `dim`: `a` itself, then fresh random values (integer
    arguments, targets or positions, repeat `a`)."""
    fresh = torch.randn_like if a.is_floating_point() else torch.clone
    return torch.stack([a] + [fresh(a) for _ in range(size - 1)], dim)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", OPS)
def test_vmap(info, device):
    """torch.func.vmap of the public function equals a loop over the samples, outputs and the
    gradients through them, with the tensor arguments batched at every dimension in turn, or
    not batched (a parameter batched too: an ensemble's stacked weights). The ops with a
    batching rule (ops/_batching.py) run it, never torch's per-sample fallback; the others run
    the fallback."""
    size = 3
    with vmap_fallback(not _has_batching_rule(info)):
        for s, sample in enumerate(info.samples(device, torch.float32, requires_grad=False, edge=False)):
            tensors = [i for i, a in enumerate(sample.args) if isinstance(a, torch.Tensor)]
            # the k-th tensor at dimension (s + k) mod (its dims + 2), the last choice unbatched
            dims = {i: (s + k) % (sample.args[i].dim() + 2) for k, i in enumerate(tensors)}
            dims = {i: d if d <= sample.args[i].dim() else None for i, d in dims.items()}
            if all(d is None for d in dims.values()):
                dims[tensors[0]] = 0
            args = [a if i not in dims or dims[i] is None else _batch_of(a, dims[i], size)
                    for i, a in enumerate(sample.args)]
            leaves = [args[i].requires_grad_() for i in info.grad_argnums
                      if isinstance(args[i], torch.Tensor)]
            in_dims = tuple(dims.get(i) for i in range(len(args)))
            got = outputs_of(torch.func.vmap(info.public, in_dims=in_dims)(*args))
            each = [
                outputs_of(info.public(*(a if d is None else a.select(d, j) for a, d in zip(args, in_dims))))
                for j in range(size)
            ]
            want = [torch.stack(outs) for outs in zip(*each)]
            what = f"{info.name} {sample.desc} in_dims={in_dims}"
            tol = info.tol[torch.float32]
            for k, (out, expected) in enumerate(zip(got, want, strict=True)):
                assert out.shape == expected.shape, f"{what} output {k}"
                torch.testing.assert_close(
                    out, expected, atol=tol.atol, rtol=tol.rtol, msg=lambda m: f"{what} output {k}: {m}"
                )
            # and the gradients through vmap (autograd outside it), as through the loop
            pairs = [(o, e) for o, e in zip(got, want) if o.requires_grad]
            cotangents = grads_for([e for _, e in pairs])
            through_vmap = torch.autograd.grad([o for o, _ in pairs], leaves, cotangents, allow_unused=True)
            through_loop = torch.autograd.grad([e for _, e in pairs], leaves, cotangents, allow_unused=True)
            for g, e in zip(through_vmap, through_loop):
                torch.testing.assert_close(
                    g, e, atol=tol.atol, rtol=tol.rtol, msg=lambda m: f"{what} gradient: {m}"
                )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", [p for p in OPS if _has_batching_rule(p.values[0])])
def test_vmap_over_no_samples(info, device):
    """vmap over a batch of none (every tensor batched, the parameters too) gives empty outputs
    of a sample's shapes: the batching rules take it (torch's fallback refuses it)."""
    sample = next(iter(info.samples(device, torch.float32, requires_grad=False, edge=False)))
    none = [a.expand(0, *a.shape) if isinstance(a, torch.Tensor) else a for a in sample.args]
    in_dims = tuple(0 if isinstance(a, torch.Tensor) else None for a in none)
    got = outputs_of(torch.func.vmap(info.public, in_dims=in_dims)(*none))
    want = outputs_of(info.public(*sample.args))
    assert [o.shape for o in got] == [(0, *w.shape) for w in want]
    assert [o.dtype for o in got] == [w.dtype for w in want]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", [p for p in OPS if _has_batching_rule(p.values[0])])
def test_vmap_under_compile(info, device):
    """torch.compile(fullgraph=True) of a vmapped call traces the batching rule (no graph break)
    and gives eager vmap's result."""
    sample = next(iter(info.samples(device, torch.float32, requires_grad=False, edge=False)))
    batched = [_batch_of(sample.args[0], 0, 3), *sample.args[1:]]
    in_dims = (0,) + (None,) * (len(batched) - 1)  # the input batched, the rest shared
    call = torch.func.vmap(info.public, in_dims=in_dims)
    torch._dynamo.reset()
    got = outputs_of(torch.compile(call, fullgraph=True)(*batched))
    for out, want in zip(got, outputs_of(call(*batched)), strict=True):
        torch.testing.assert_close(out, want, atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_tensors_of_many_dimensions(device):
    """torch allows an empty tensor of more than 64 dimensions (its own norms refuse one): the ops
    return empty results of the right shapes, forward and backward, instead of overrunning the
    kernels' row layout."""
    lead = [0] * 69
    x = torch.empty(lead + [8], device=device, requires_grad=True)
    w = torch.ones(8, device=device)
    calls = {
        "rms_norm": lambda: fusedops.rms_norm(x, w),
        "layer_norm": lambda: fusedops.layer_norm(x, w, w),
        "add_rms_norm": lambda: fusedops.add_rms_norm(x, x.detach().clone(), w)[0],
        "swiglu": lambda: fusedops.swiglu(x, x),
        "geglu_packed": lambda: fusedops.geglu_packed(x),
        "cross_entropy": lambda: fusedops.cross_entropy(
            x, torch.empty(lead, dtype=torch.long, device=device), reduction="none"),
    }
    for name, call in calls.items():
        out = call()
        expected = lead + [4] if name == "geglu_packed" else lead if name == "cross_entropy" else lead + [8]
        assert list(out.shape) == expected, name
        (grad,) = torch.autograd.grad(out, x, torch.ones_like(out))
        assert grad.shape == x.shape, name


@pytest.mark.parametrize("info", OPS)
def test_public_function_names_a_non_tensor(info):
    """A list where the public function takes a tensor raises TypeError naming that argument
    (as torch's functions do), with gradients recording (the direct path) and without."""
    names = list(inspect.signature(info.public).parameters)  # the function's own names, in order
    sample = next(iter(info.samples("cpu", torch.float32, requires_grad=True)))
    for i, arg in enumerate(sample.args):
        if not isinstance(arg, torch.Tensor):
            continue
        args = list(sample.args)
        args[i] = arg.tolist()
        message = rf"fusedops.{info.name}: {names[i]} must be a Tensor, got list"
        with pytest.raises(TypeError, match=message):
            info.public(*args)
        with torch.no_grad(), pytest.raises(TypeError, match=message):
            info.public(*args)


@pytest.mark.parametrize("info", OPS)
def test_public_function_names_a_mistyped_option(info):
    """None for a str, float or int option of the public function (a str for an optional float
    or int, or for a bool; a numeric string for a float, which float() would take) raises
    TypeError naming it, where the schema's own cast or a comparison would say only which type it
    expected (or a truthy string would switch a mode on). (The sample's leading arguments fill
    the function's required parameters; each option goes by keyword.)"""
    function = getattr(fusedops, info.name)
    params = inspect.signature(function).parameters
    required = [p for p in params.values() if p.default is inspect.Parameter.empty]
    sample = next(iter(info.samples("cpu", torch.float32, requires_grad=False)))
    args = sample.args[: len(required)]
    function(*args)  # (the call is good as it is)
    options = [name for name, p in params.items() if p.annotation in (str, float, int)]
    assert options or info.name in ("swiglu", "swiglu_packed")  # (they have none)
    for name in options:
        expected = {str: "a str", float: "a float", int: "an int"}[params[name].annotation]
        with pytest.raises(TypeError, match=rf"fusedops.{info.name}: {name} must be {expected}, got NoneType"):
            function(*args, **{name: None})
        if params[name].annotation is float:
            with pytest.raises(TypeError, match=rf"fusedops.{info.name}: {name} must be a float, got str"):
                function(*args, **{name: "0.5"})
    for name, p in params.items():
        if p.annotation in (Optional[int], Optional[float]):
            expected = "an int or None" if p.annotation == Optional[int] else "a float or None"
            for text in ("x", "0.5"):
                with pytest.raises(TypeError, match=rf"fusedops.{info.name}: {name} must be {expected}, got str"):
                    function(*args, **{name: text})
        if p.annotation is bool:
            with pytest.raises(TypeError, match=rf"fusedops.{info.name}: {name} must be a bool, got str"):
                function(*args, **{name: "False"})


@pytest.mark.parametrize("info", OPS)
def test_torch_fx_records_the_public_function(info):
    """torch.fx's symbolic tracing (quantization, Hugging Face's fx tracer, pipeline splitting)
    passes Proxies for tensors: the public functions (and their in-place forms) hand the call to
    them, as torch.nn.functional's do, and the graph gives the eager result, bit for bit."""
    for call in (info.public, *(variant.call for variant in info.public_variants)):
        sample = next(iter(info.samples("cpu", torch.float32, requires_grad=False)))
        graph = torch.fx.Graph()
        tracer = torch.fx.proxy.GraphAppendingTracer(graph)
        traced = [torch.fx.Proxy(graph.placeholder(f"arg{i}"), tracer) if isinstance(a, torch.Tensor) else a
                  for i, a in enumerate(sample.args)]
        result = call(*traced)
        graph.output(torch.fx.node.map_aggregate(result, lambda v: v.node if isinstance(v, torch.fx.Proxy) else v))
        module = torch.fx.GraphModule(torch.nn.Module(), graph)
        assert [n.op for n in graph.nodes].count("call_function") >= 1
        tensors = [a.clone() for a in sample.args if isinstance(a, torch.Tensor)]
        got = outputs_of(module(*tensors))
        expected = outputs_of(call(*sample.args))
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            assert torch.equal(g, e), info.name
        # (an in-place form updated the graph's inputs as the eager call updated the sample's)
        for t, a in zip(tensors, (a for a in sample.args if isinstance(a, torch.Tensor))):
            assert torch.equal(t, a), info.name


def test_torch_fx_keeps_in_place_calls_nothing_reads():
    """The in-place forms are marked as having side effects: dead-code elimination, which many
    fx passes run, keeps a call whose result nothing reads (it updates its inputs)."""
    def rotate(q, k, cos, sin):
        fusedops.rope_(q, k, cos, sin)
        return q, k

    def add(input, residual):
        fusedops.add_rms_norm_(input, residual)
        return residual

    class AddByModule(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = fusedops.nn.AddRMSNorm(8, inplace=True, elementwise_affine=False)

        def forward(self, input, residual):
            self.norm(input, residual)
            return residual

    rope_args = (torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8), torch.randn(1, 3, 8), torch.randn(1, 3, 8))
    norm_args = (torch.randn(3, 8), torch.randn(3, 8))
    for fn, args in ((rotate, rope_args), (add, norm_args), (AddByModule(), norm_args)):
        graph_module = torch.fx.symbolic_trace(fn)
        graph_module.graph.eliminate_dead_code()
        graph_module.recompile()
        got, expected = graph_module(*[a.clone() for a in args]), fn(*[a.clone() for a in args])
        for g, e in zip(outputs_of(got), outputs_of(expected)):
            assert torch.equal(g, e), fn
        assert not torch.equal(outputs_of(got)[-1], args[1]), fn  # (it was updated)


def test_a_failed_call_blames_only_what_the_schema_refuses():
    """What the schema takes (a 0-d tensor for a float, numpy's bool for a bool) is not named as
    mistyped when a call fails for another reason: the real error comes through."""
    x, short_weight = torch.randn(4, 8), torch.randn(7)
    for options in ({"eps": torch.tensor(1e-6)}, {"cast_before_weight": np.bool_(True)}):
        fusedops.rms_norm(x, torch.randn(8), **options)  # (good as it is)
        with pytest.raises(ValueError, match=r"rms_norm: weight must be a 1-D tensor of size 8"):
            fusedops.rms_norm(x, short_weight, **options)
    target = torch.zeros(4, dtype=torch.long)
    assert torch.equal(fusedops.cross_entropy(x, target, inplace_grad=np.bool_(False)), fusedops.cross_entropy(x, target))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", OPS)
def test_weight_grad_is_deterministic(info, device):
    for sample in info.samples(device, torch.float32, requires_grad=True, edge=False):
        tensors = [sample.args[i] for i in info.grad_argnums if isinstance(sample.args[i], torch.Tensor)]
        outs = outputs_of(info.public(*sample.args))
        g = grads_for(outs)
        first = torch.autograd.grad(outs, tensors, g, retain_graph=True)
        second = torch.autograd.grad(outs, tensors, g)
        for a, b in zip(first, second):
            assert torch.equal(a, b), sample.desc


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", OPS)
def test_direct_call_matches_dispatcher_route(info, device, monkeypatch):
    """The public function's direct call (fusedops/ops/_direct.py) and its route through the
    dispatcher and the registered autograd give bitwise-equal outputs and gradients, with and
    without gradients wanted."""
    import fusedops.functional

    def run(sample):
        outs = outputs_of(info.public(*sample.args))
        tensors = [sample.args[i] for i in info.grad_argnums if isinstance(sample.args[i], torch.Tensor)]
        if not outs[0].requires_grad:
            return outs, ()
        return outs, torch.autograd.grad(outs, tensors, [torch.ones_like(o) for o in outs])

    for requires_grad in (True, False):
        for sample in info.samples(device, torch.float32, requires_grad=requires_grad, edge=False):
            monkeypatch.setattr(fusedops.functional, "direct_call_allowed", lambda *tensors: True)
            direct = run(sample)
            monkeypatch.setattr(fusedops.functional, "direct_call_allowed", lambda *tensors: False)
            routed = run(sample)
            for a, b in zip(direct[0], routed[0], strict=True):
                assert a.requires_grad == b.requires_grad == requires_grad, sample.desc
                assert torch.equal(a, b), sample.desc
            assert len(direct[1]) == len(routed[1]), sample.desc
            for a, b in zip(direct[1], routed[1]):
                assert torch.equal(a, b), sample.desc


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", OPS)
def test_double_backward_raises(info, device):
    if info.double_backward:
        pytest.skip("supported: test_gradgradcheck_fp64")
    sample = next(info.samples(device, torch.float64, requires_grad=True, edge=False))
    outs = outputs_of(info.public(*sample.args))
    (g,) = torch.autograd.grad(sum(o.sum() for o in outs), sample.args[0], create_graph=True)
    with pytest.raises(NotImplementedError, match="does not support double backward"):
        g.sum().backward()
    # A gradient of some inputs only (a gradient penalty's pattern): autograd skips the nodes
    # that lead to none of them, so the raising one must lie on the way to the inputs.
    with pytest.raises(NotImplementedError, match="does not support double backward"):
        torch.autograd.grad(g.pow(2).sum(), sample.args[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", OPS)
def test_forward_mode_ad_raises(info, device):
    """No route has a forward-mode formula: a tangent through the op would come out zero or
    missing, so the public function refuses a call that would lose one (under torch.func.jvp, or
    any differentiable input carrying a tangent). Inputs without tangents run as usual inside a
    forward-mode level (the level is process-wide: it may be another thread's)."""
    sample = next(info.samples(device, torch.float64, requires_grad=False, edge=False))
    x = sample.args[0]
    rest = sample.args[1:]
    match = "fusedops ops have no forward-mode AD"
    with pytest.raises(NotImplementedError, match=match):
        torch.func.jvp(lambda x: outputs_of(info.public(x, *rest))[0], (x,), (torch.randn_like(x),))
    expected = outputs_of(info.public(*sample.args))
    with torch.autograd.forward_ad.dual_level():
        for i in info.grad_argnums:
            if not isinstance(sample.args[i], torch.Tensor):
                continue
            args = list(sample.args)
            args[i] = torch.autograd.forward_ad.make_dual(args[i], torch.randn_like(args[i]))
            with pytest.raises(NotImplementedError, match=match):
                info.public(*args)
        torch.testing.assert_close(outputs_of(info.public(*sample.args)), expected, atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", OPS)
def test_gradgradcheck_fp64(info, device):
    """Ops that support double backward: second derivatives against finite differences."""
    if not info.double_backward:
        pytest.skip("double backward raises: test_double_backward_raises")
    checked = 0
    for sample in info.samples(device, torch.float64, requires_grad=True, edge=False):
        if sample.args[0].numel() > 1024:
            continue
        grad_inputs = [i for i in info.grad_argnums if isinstance(sample.args[i], torch.Tensor)]

        def fn(*ts, sample=sample, grad_inputs=grad_inputs):
            args = list(sample.args)
            for i, t in zip(grad_inputs, ts):
                args[i] = t
            return info.public(*args)

        assert torch.autograd.gradgradcheck(fn, [sample.args[i] for i in grad_inputs], eps=1e-6, atol=1e-5), sample.desc
        checked += 1
    assert checked > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", OPS)
def test_autocast(info, device):
    info.autocast_check(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", OPS)
def test_compile_fullgraph_dynamic(info, device):
    """torch.compile(fullgraph=True, dynamic=True): one frame for every shape, no recompile,
    forward and backward equal to eager."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(info.public, backend="inductor", fullgraph=True, dynamic=True)
    for rows, n in [(4, 64), (7, 64), (9, 128)]:
        sample = info.sample_for_shape(device, torch.float32, (rows, n), requires_grad=True)
        tensors = [sample.args[i] for i in info.grad_argnums]
        outs = outputs_of(compiled(*sample.args))
        expected = outputs_of(info.public(*sample.args))
        torch.testing.assert_close(outs, expected)
        g = grads_for(outs)
        torch.testing.assert_close(torch.autograd.grad(outs, tensors, g), torch.autograd.grad(expected, tensors, g))
    assert counters["stats"]["unique_graphs"] == 1, f"recompiled: {dict(counters['stats'])}"
    assert not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}"


class _Call(torch.nn.Module):
    """`fn` over a sample's tensor arguments, its other arguments fixed (torch.export traces a
    module whose inputs are tensors)."""

    def __init__(self, fn, args):
        super().__init__()
        self.fn, self.args = fn, args
        self.where = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def forward(self, *tensors):
        args = list(self.args)
        for i, t in zip(self.where, tensors):
            args[i] = t
        return outputs_of(self.fn(*args))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", OPS)
def test_export_dynamic_and_reload(info, device):
    """torch.export with every dimension free: the program calls the op itself (not a
    decomposition), survives torch.export.save / load, and on other shapes computes what eager
    does (fusedops' ops deploy through export as they are)."""
    import io

    sample = info.sample_for_shape(device, torch.float32, (5, 64))
    module = _Call(info.public, sample.args)
    tensors = tuple(sample.args[i] for i in module.where)
    # (a dimension of size 1 stays static: export would specialise it, with a warning)
    dims = tuple({d: torch.export.Dim.AUTO for d in range(t.dim()) if t.shape[d] > 1} for t in tensors)
    program = torch.export.export(module, tensors, dynamic_shapes={"tensors": dims})
    called = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert f"fusedops.{info.name}.default" in called, called
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    reloaded = torch.export.load(buffer).module()
    for rows, n in [(7, 64), (9, 128)]:
        other = info.sample_for_shape(device, torch.float32, (rows, n))
        inputs = tuple(other.args[i] for i in module.where)
        torch.testing.assert_close(reloaded(*inputs), _Call(info.public, other.args)(*inputs))
