"""Samples of the gated activations (swiglu, geglu, swiglu_packed, geglu_packed), one
OpTestInfo per public op, built by ``make_info``."""

import math

import torch

import fusedops

from . import ErrorSample, OpTestInfo, Sample, Tolerance

# Widths: 1, odd, not a multiple of any vector width, exactly one 16-byte vector, several, and
# rows wider than the CPU kernels' span (16384) and than one GPU block's tile.
SHAPES = [(1, 8), (3, 7, 64), (17, 100), (4, 1), (6, 7), (2, 1000), (3, 4100), (2, 20000)]
EDGE_SHAPES = [(0, 16), (2, 0, 8), (3, 0), (16,), (1, 1)]
# Values where the activations' approximations change branch or saturate (exp's clamps at about
# -88 and 88, erf's switch at |g| / sqrt(2) = 1 and its saturation at 4).
SPECIAL = [-100.0, -60.0, -20.0, -9.0, -5.7, -1.4142, -1.0, -1e-3, -1e-20, 0.0, 1e-20, 1e-3, 0.7, 1.4143, 3.0,
           5.6, 12.0, 50.0, 90.0, 100.0]

TOL = {
    torch.float32: Tolerance(atol=2e-5, rtol=2e-5),
    torch.bfloat16: Tolerance(atol=1e-2, rtol=1.6e-2),
    torch.float16: Tolerance(atol=2e-3, rtol=2e-3),
    torch.float64: Tolerance(atol=1e-12, rtol=1e-12),
}
# Gradients see two roundings (grad_output's and the result's) on values of order |g u dy|.
GRAD_TOL = {
    torch.float32: Tolerance(atol=1e-4, rtol=1e-4),
    torch.bfloat16: Tolerance(atol=3e-2, rtol=3e-2),
    torch.float16: Tolerance(atol=5e-3, rtol=5e-3),
    torch.float64: Tolerance(atol=1e-10, rtol=1e-10),
}


# ---- fp64 references: the formulas ------------------------------------------------------------


def activation(g, act):
    g = g.double()
    if act == "silu":
        return g * torch.sigmoid(g)
    if act == "gelu":
        return 0.5 * g * (1.0 + torch.erf(g / math.sqrt(2.0)))
    z = math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3)
    return 0.5 * g * (1.0 + torch.tanh(z))


def reference_unpacked(act_of):
    def reference(gate, up, *approximate):
        return activation(gate, act_of(*approximate)) * up.double()

    return reference


def reference_packed(act_of):
    def reference(gate_up, *approximate):
        n = gate_up.shape[-1] // 2
        return activation(gate_up[..., :n], act_of(*approximate)) * gate_up[..., n:].double()

    return reference


# ---- sample inputs ----------------------------------------------------------------------------


def _gate(shape, dtype, device):
    # Scaled so that both branches of erf (|g| / sqrt(2) above and below 1) and the sigmoid's
    # tails are exercised.
    return (2.5 * torch.randn(shape, device=device, dtype=torch.float64)).to(dtype)


def _special_gate(rows, dtype, device):
    return torch.tensor(SPECIAL, dtype=torch.float64, device=device).repeat(rows, 1).to(dtype)


def _leaf(t, requires_grad):
    return t.detach().requires_grad_(requires_grad)


def unpacked_samples(modes):
    """samples(device, dtype, requires_grad, edge) of swiglu (modes = [()]) or geglu (modes =
    [("none",), ("tanh",)])."""

    def samples(device, dtype, requires_grad=False, edge=True):
        for mode in modes:
            tag = f"-{mode[0]}" if mode else ""
            for shape in SHAPES + (EDGE_SHAPES if edge else []):
                g = _leaf(_gate(shape, dtype, device), requires_grad)
                u = _leaf(torch.randn(shape, dtype=dtype, device=device), requires_grad)
                yield Sample((g, u) + mode, f"{list(shape)}{tag}")
            # gate and up slices of wider buffers (row strides of their own, not 16-byte
            # multiples), and one contiguous operand beside one strided one.
            for rows, n, pad in ((5, 33, 3), (3, 4100, 1)):
                gb = _gate((rows, n + pad), dtype, device)
                ub = torch.randn(rows, 2 * n + 5, dtype=dtype, device=device)
                yield Sample((_leaf(gb[:, :n], requires_grad), _leaf(ub[:, 5:n + 5], requires_grad)) + mode,
                             f"sliced-{rows}x{n}{tag}")
                yield Sample((_leaf(_gate((rows, n), dtype, device), requires_grad),
                              _leaf(ub[:, :n], requires_grad)) + mode, f"contiguous+sliced-{rows}x{n}{tag}")
            g = _leaf(_special_gate(3, dtype, device), requires_grad)
            u = _leaf(torch.randn(g.shape, dtype=dtype, device=device), requires_grad)
            yield Sample((g, u) + mode, f"special-values{tag}")

    return samples


def packed_samples(modes):
    def samples(device, dtype, requires_grad=False, edge=True):
        for mode in modes:
            tag = f"-{mode[0]}" if mode else ""
            shapes = [s[:-1] + (2 * s[-1],) for s in SHAPES + (EDGE_SHAPES if edge else [])]
            for shape in shapes:
                n = shape[-1] // 2
                gu = torch.cat([_gate(shape[:-1] + (n,), dtype, device),
                                torch.randn(shape[:-1] + (n,), dtype=dtype, device=device)], -1)
                yield Sample((_leaf(gu, requires_grad),) + mode, f"{list(shape)}{tag}")
            # A slice of a wider buffer (rows not 16-byte aligned), and special values.
            for rows, n in ((5, 33), (3, 4100)):
                buf = torch.randn(rows, 2 * n + 3, dtype=dtype, device=device)
                yield Sample((_leaf(buf[:, 1:2 * n + 1], requires_grad),) + mode, f"sliced-{rows}x{2 * n}{tag}")
            g = _special_gate(2, dtype, device)
            gu = torch.cat([g, torch.randn(g.shape, dtype=dtype, device=device)], -1)
            yield Sample((_leaf(gu, requires_grad),) + mode, f"special-values{tag}")

    return samples


def strided_tensor(draw, st, shape, dtype, device):
    """A tensor of `shape` with sliced, permuted or expanded leading dimensions and sometimes a
    strided last dimension, drawn by hypothesis."""
    ndim = len(shape)
    steps = draw(st.lists(st.integers(1, 3), min_size=ndim, max_size=ndim))
    steps[-1] = draw(st.sampled_from([1, 1, 1, 2]))
    perm = draw(st.permutations(list(range(ndim - 1))))
    # Build the buffer in the permuted order, so that permuting back gives `shape`.
    pshape = [shape[p] for p in perm] + [shape[-1]]
    base = (2.0 * torch.randn([s * k for s, k in zip(pshape, steps)], device=device, dtype=torch.float64)).to(dtype)
    t = base[tuple(slice(None, None, k) for k in steps)]
    inverse = [perm.index(d) for d in range(ndim - 1)]
    t = t.permute(*inverse, ndim - 1)
    if draw(st.booleans()) and t.shape[0] > 0:
        t = t[:1].expand(*t.shape)  # a stride-0 leading dimension
    return t


def unpacked_strided(modes):
    def strided_samples(device, dtype):
        from hypothesis import strategies as st

        @st.composite
        def strided(draw):
            ndim = draw(st.integers(2, 4))
            shape = draw(st.lists(st.integers(1, 5), min_size=ndim - 1, max_size=ndim - 1))
            shape.append(draw(st.sampled_from([1, 3, 8, 16, 33, 64, 136])))
            g = strided_tensor(draw, st, shape, dtype, device)
            u = strided_tensor(draw, st, shape, dtype, device)
            mode = draw(st.sampled_from(modes))
            return Sample((g, u) + mode, f"shape={shape} gate stride={list(g.stride())} up stride={list(u.stride())}")

        return strided()

    return strided_samples


def packed_strided(modes):
    def strided_samples(device, dtype):
        from hypothesis import strategies as st

        @st.composite
        def strided(draw):
            ndim = draw(st.integers(2, 4))
            shape = draw(st.lists(st.integers(1, 5), min_size=ndim - 1, max_size=ndim - 1))
            shape.append(2 * draw(st.sampled_from([1, 3, 8, 16, 33, 64, 136])))
            gu = strided_tensor(draw, st, shape, dtype, device)
            mode = draw(st.sampled_from(modes))
            return Sample((gu,) + mode, f"shape={shape} stride={list(gu.stride())}")

        return strided()

    return strided_samples


# ---- bad inputs -------------------------------------------------------------------------------


def _other_device(device):
    return "meta" if device != "meta" else "cpu"


def unpacked_errors(name, op_module, gelu):
    def error_samples(device):
        x = torch.randn(4, 8, device=device)
        extra = ("none",) if gelu else ()

        def bad(args, match, desc, op=None):
            return ErrorSample(Sample(args, desc), ValueError, match, op=op)

        yield bad((torch.randn((), device=device), torch.randn((), device=device)) + extra,
                  rf"{name}: gate must have at least 1 dimension, got a 0-dimensional tensor", "0-d")
        yield bad((x.to(torch.int32), x.to(torch.int32)) + extra,
                  rf"{name}: gate dtype must be float32, bfloat16, float16 or float64, got int32", "int input")
        yield bad((x, torch.randn(4, 9, device=device)) + extra,
                  rf"{name}: up shape \[4, 9\] does not match gate shape \[4, 8\]", "shape mismatch")
        yield bad((x, torch.randn(8, device=device)) + extra,
                  rf"{name}: up shape \[8\] does not match gate shape \[4, 8\]", "broadcastable shape")
        yield bad((x, x.double()) + extra, rf"{name}: up dtype float64 does not match gate dtype float32",
                  "dtype mismatch")
        yield bad((x.bfloat16(), x.half()) + extra, rf"{name}: up dtype float16 does not match gate dtype bfloat16",
                  "bf16 with fp16")
        yield bad((x, torch.randn(4, 8, device=_other_device(device))) + extra,
                  rf"{name}: up is on (meta|cpu) but gate is on", "device mismatch")
        if gelu:
            yield bad((x, x, "sigmoid"), rf'{name}: approximate must be "none" or "tanh", got "sigmoid"',
                      "bad approximate")
            yield bad((x, x, "Tanh"), r'approximate must be "none" or "tanh", got "Tanh"', "approximate case")
        bwd = op_module.backward
        yield bad((torch.randn(4, 9, device=device), x, x) + extra,
                  rf"{name}_backward: grad_output shape \[4, 9\] does not match gate shape \[4, 8\]",
                  "bwd grad shape", bwd)
        yield bad((x.half(), x, x) + extra,
                  rf"{name}_backward: grad_output dtype float16 does not match gate dtype float32", "bwd grad dtype", bwd)
        yield bad((x, x, x.double()) + extra, rf"{name}_backward: up dtype float64 does not match gate dtype float32",
                  "bwd up dtype", bwd)
        if gelu:
            yield bad((x, x, x, "exact"), rf'{name}_backward: approximate must be "none" or "tanh", got "exact"',
                      "bwd bad approximate", bwd)

    return error_samples


def packed_errors(name, op_module, gelu):
    def error_samples(device):
        x = torch.randn(4, 16, device=device)
        extra = ("none",) if gelu else ()

        def bad(args, match, desc, op=None):
            return ErrorSample(Sample(args, desc), ValueError, match, op=op)

        yield bad((torch.randn((), device=device),) + extra,
                  rf"{name}: gate_up must have at least 1 dimension, got a 0-dimensional tensor", "0-d")
        yield bad((x.to(torch.int64),) + extra,
                  rf"{name}: gate_up dtype must be float32, bfloat16, float16 or float64, got int64", "int input")
        yield bad((torch.randn(4, 7, device=device),) + extra,
                  rf"{name}: gate_up's last dimension must be even \(it holds \[gate \| up\]\), got 7", "odd width")
        if gelu:
            yield bad((x, "erf"), rf'{name}: approximate must be "none" or "tanh", got "erf"', "bad approximate")
        bwd = op_module.backward
        yield bad((torch.randn(4, 16, device=device), x) + extra,
                  rf"{name}_backward: grad_output shape \[4, 16\] does not match the output shape \[4, 8\]",
                  "bwd grad shape", bwd)
        yield bad((torch.randn(4, 8, device=device, dtype=torch.bfloat16), x) + extra,
                  rf"{name}_backward: grad_output dtype bfloat16 does not match the output dtype float32",
                  "bwd grad dtype", bwd)
        yield bad((torch.randn(4, 8, device=_other_device(device)), x) + extra,
                  rf"{name}_backward: grad_output is on (meta|cpu) but the output is on", "bwd grad device", bwd)
        yield bad((torch.randn(4, 3, device=device), torch.randn(4, 7, device=device)) + extra,
                  rf"{name}_backward: gate_up's last dimension must be even", "bwd odd width", bwd)

    return error_samples


# ---- autocast ---------------------------------------------------------------------------------


def autocast_check(public, packed, modes):
    """The documented rule: nothing is cast; the output keeps the inputs' dtype and equals the
    result outside autocast bit for bit; mismatched dtypes are rejected as outside."""

    def check(device):
        amp = torch.bfloat16 if device == "cpu" else torch.float16
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for mode in modes:
                if packed:
                    args = (torch.randn(8, 128, dtype=dtype, device=device),) + mode
                else:
                    args = (torch.randn(8, 64, dtype=dtype, device=device),
                            torch.randn(8, 64, dtype=dtype, device=device)) + mode
                with torch.autocast(device_type=device, dtype=amp):
                    y = public(*args)
                assert y.dtype == dtype, (dtype, y.dtype)
                torch.testing.assert_close(y, public(*args), atol=0, rtol=0)
        # A gated MLP under autocast: the projections run in the autocast dtype, so do we.
        x = torch.randn(4, 32, device=device)
        w = torch.randn(128 if packed else 64, 32, device=device)
        with torch.autocast(device_type=device, dtype=amp):
            h = x @ w.t()
            y = public(h, *modes[0]) if packed else public(h, h.flip(-1), *modes[0])
        assert y.dtype == amp, y.dtype
        if not packed:
            import pytest

            with torch.autocast(device_type=device, dtype=amp), pytest.raises(ValueError, match="does not match"):
                public(torch.randn(4, 8, device=device), torch.randn(4, 8, device=device, dtype=amp), *modes[0])

    return check


# ---- the entries ------------------------------------------------------------------------------


def make_info(name, op_module, public, torch_equivalent):
    packed = name.endswith("_packed")
    gelu = name.startswith("geglu")
    modes = [("none",), ("tanh",)] if gelu else [()]

    def act_of(approximate="none"):
        return ("gelu_tanh" if approximate == "tanh" else "gelu") if gelu else "silu"

    def sample_for_shape(device, dtype, shape, requires_grad=False):
        if packed:
            return Sample((_leaf(_gate(shape, dtype, device), requires_grad),), f"{list(shape)}")
        g = _leaf(_gate(shape, dtype, device), requires_grad)
        u = _leaf(torch.randn(shape, dtype=dtype, device=device), requires_grad)
        return Sample((g, u), f"{list(shape)}")

    def backward_args(sample, outputs, grad_output):
        k = 1 if packed else 2
        return (grad_output,) + tuple(t.detach() for t in sample.args[:k]) + tuple(sample.args[k:])

    return OpTestInfo(
        name=name,
        op=op_module.forward,
        public=public,
        reference=(reference_packed if packed else reference_unpacked)(act_of),
        samples=(packed_samples if packed else unpacked_samples)(modes),
        sample_for_shape=sample_for_shape,
        error_samples=(packed_errors if packed else unpacked_errors)(name, op_module, gelu),
        strided_samples=(packed_strided if packed else unpacked_strided)(modes),
        backward_ops=(op_module.backward,),
        backward_args=backward_args,
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
        tol=TOL,
        grad_tol=GRAD_TOL,
        grad_argnums=(0,) if packed else (0, 1),
        autocast_check=autocast_check(public, packed, modes),
        torch_equivalent=torch_equivalent,
    )


def _silu_mul(g, u):
    return torch.nn.functional.silu(g) * u


def _gelu_mul(g, u, approximate="none"):
    return torch.nn.functional.gelu(g, approximate=approximate) * u


def _halves(f):
    def run(gate_up, *args):
        g, u = gate_up.chunk(2, dim=-1)
        return f(g, u, *args)

    return run


def infos():
    from ..ops import geglu, geglu_packed, swiglu, swiglu_packed

    return [
        make_info("swiglu", swiglu, fusedops.swiglu, _silu_mul),
        make_info("geglu", geglu, fusedops.geglu, _gelu_mul),
        make_info("swiglu_packed", swiglu_packed, fusedops.swiglu_packed, _halves(_silu_mul)),
        make_info("geglu_packed", geglu_packed, fusedops.geglu_packed, _halves(_gelu_mul)),
    ]
