"""Sample building blocks shared by the row normalisations (rms_norm, layer_norm)."""

import torch

from . import Tolerance

# Widths: 1, odd, not a multiple of any vector width, exactly one vector, several cached
# vectors per thread, and one wide enough for the sweeping kernels on the GPU.
SHAPES = [(1, 8), (5, 32), (3, 7, 64), (17, 100), (4, 1), (2, 1000), (3, 4104), (2, 1, 20000)]
EDGE_SHAPES = [(0, 16), (2, 0, 8), (3, 0), (16,)]
# Fewer shapes for each option combination: one row, an odd width, and a wide sweeping row.
OPTION_SHAPES = [(1, 64), (3, 5, 136), (2, 20000)]


def dtype_name(dtype):
    return str(dtype).removeprefix("torch.")


def param_dtypes(dtype):
    """The dtypes an affine parameter may have with an input of `dtype`."""
    return (dtype, torch.float32) if dtype in (torch.bfloat16, torch.float16) else (dtype,)


def param(n, dtype, device, requires_grad, mean=0.0):
    return (mean + torch.randn(n, dtype=dtype, device=device)).requires_grad_(requires_grad)


def param_away_from(n, dtype, device, requires_grad, value):
    """A random parameter none of whose elements is within 0.5 of `value`."""
    magnitude = 0.5 + torch.rand(n, device=device, dtype=torch.float64)
    sign = torch.where(torch.rand(n, device=device) < 0.5, -1.0, 1.0).to(torch.float64)
    return (value + sign * magnitude).to(dtype).requires_grad_(requires_grad)


def scaled_rows(dtype, device, requires_grad, rows=6, n=48, offset=0.0):
    """Rows of very different scales (statistics must not be shared between rows), shifted by
    `offset` (a mean far from zero tests a variance computed without cancellation)."""
    scales = torch.logspace(-3, 3, rows, device=device, dtype=torch.float64)[:, None]
    x = (torch.randn(rows, n, device=device, dtype=torch.float64) + offset) * scales
    return x.to(dtype).requires_grad_(requires_grad)


def strided_inputs(device, dtype, make_args):
    """hypothesis strategy of Samples whose input has sliced, permuted or expanded leading
    dimensions and (sometimes) a strided last dimension. `make_args(x, params)` builds the
    op's arguments from the input and a dict of drawn parameters: name -> tensor or None."""
    from hypothesis import strategies as st

    from . import Sample

    @st.composite
    def strided(draw):
        ndim = draw(st.integers(2, 4))
        shape = draw(st.lists(st.integers(1, 6), min_size=ndim - 1, max_size=ndim - 1))
        n = draw(st.sampled_from([1, 3, 8, 16, 33, 64, 136]))
        steps = draw(st.lists(st.integers(1, 3), min_size=ndim, max_size=ndim))
        steps[-1] = draw(st.sampled_from([1, 1, 1, 2]))
        big = [s * st_ for s, st_ in zip(shape + [n], steps)]
        base = torch.randn(big, dtype=dtype, device=device)
        x = base[tuple(slice(None, None, s) for s in steps)]
        perm = draw(st.permutations(list(range(ndim - 1))))
        x = x.permute(*perm, ndim - 1)
        if draw(st.booleans()) and x.shape[0] > 0:
            x = x[:1].expand(3, *x.shape[1:])  # a stride-0 leading dimension
        kinds = {}
        for name in ("weight", "bias"):
            kind = draw(st.sampled_from(["none", "same", "strided"]))
            kinds[name] = kind
            if kind == "none":
                kinds[name + "_t"] = None
            elif kind == "same":
                kinds[name + "_t"] = torch.randn(n, dtype=dtype, device=device)
            else:
                kinds[name + "_t"] = torch.randn(2 * n, dtype=dtype, device=device)[::2]
        args = make_args(x, {"weight": kinds["weight_t"], "bias": kinds["bias_t"]})
        return Sample(args, f"shape={list(x.shape)} stride={list(x.stride())} w={kinds['weight']} b={kinds['bias']}")

    return strided()


# Output error of one rounding to the storage dtype on values of order 1, plus float32
# accumulation; gradients see two roundings (grad_output and the result). The same for every
# row normalisation.
TOL = {
    torch.float32: Tolerance(atol=2e-5, rtol=2e-5),
    torch.bfloat16: Tolerance(atol=1e-2, rtol=1e-2),
    torch.float16: Tolerance(atol=2e-3, rtol=2e-3),
    torch.float64: Tolerance(atol=1e-12, rtol=1e-12),
}
GRAD_TOL = {
    torch.float32: Tolerance(atol=1e-4, rtol=1e-4),
    torch.bfloat16: Tolerance(atol=5e-2, rtol=2e-2),
    torch.float16: Tolerance(atol=1e-2, rtol=5e-3),
    torch.float64: Tolerance(atol=1e-10, rtol=1e-10),
}

