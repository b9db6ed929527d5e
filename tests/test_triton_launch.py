"""The Triton launcher (src/fusedops/triton/_launch.py): every Triton kernel's launches after the
first of a specialization go straight to the compiled kernel's launcher, so the launcher's key
must separate every specialization Triton would, and its constexpr arguments must reach the
compiled launcher in parameter order."""

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from fusedops.testing.rope import reference
from fusedops.triton import _launch
from fusedops.triton import rope as rope_kernels
from conftest import HAS_CUDA


def _jit(kernel):
    # The JITFunction of a kernel (under TRITON_INTERPRET=1, triton.jit makes an
    # InterpretedFunction, which the launcher only ever calls through kernel[grid]).
    return kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)


def test_constexpr_values_in_parameter_order():
    """The rope kernel's constexprs, passed in another order and beside a launch option, come
    back in the kernel's parameter order; without a keyword or a default there is none."""
    kernel = _jit(rope_kernels._rope_kernel)
    params = kernel.params
    n_runtime = sum(1 for p in params if not p.is_constexpr)
    names = [p.name for p in params if p.is_constexpr]
    values = {name: i + 2 for i, name in enumerate(names)}
    keywords = dict(reversed(list(values.items())))
    keywords["num_warps"] = 4
    launcher = _launch.Launcher(kernel)
    assert launcher._constexpr_values(n_runtime, keywords) == tuple(values[name] for name in names)
    del keywords[names[-1]]
    assert launcher._constexpr_values(n_runtime, keywords) is None  # (no default: no direct launch)


@triton.jit
def _interleaved_kernel(x_ptr, WIDTH: tl.constexpr, n):
    i = tl.arange(0, WIDTH)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)


@triton.jit
def _default_kernel(x_ptr, n, WIDTH: tl.constexpr = 16):
    i = tl.arange(0, WIDTH)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)


def test_kernel_not_laid_out_for_direct_launches():
    """A constexpr among the runtime parameters: never launched directly (every launch takes
    kernel[grid]); a constexpr default is used when its keyword is absent."""
    launcher = _launch.Launcher(_jit(_interleaved_kernel))
    assert launcher._constexpr_values(2, {"WIDTH": 16}) is None
    assert launcher._constexprs is False
    assert _launch.Launcher(_jit(_default_kernel))._constexpr_values(2, {}) == (16,)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="direct launches need a CUDA device (the interpreter launches through kernel[grid])")
def test_direct_launches_follow_alignment_and_values():
    """rope's Triton kernel called alternately on 16-byte-aligned tensors and on views one
    element off (which Triton compiles separately: it assumes 16-byte alignment where it holds),
    and at two sequence lengths (1 is a value Triton specializes on): every call matches the
    float64 reference, each case is compiled once and then launched directly, and a direct
    launch writes exactly what kernel[grid] writes."""
    torch.manual_seed(0)
    B, Hq, Hk, D = 2, 4, 2, 64
    launcher = rope_kernels._launch_rope
    seen = []
    for S in (1, 7, 1, 7):
        for offset in (0, 1, 0, 1):
            q_store = torch.randn(B * Hq * S * D + 1, device="cuda", dtype=torch.bfloat16)
            k_store = torch.randn(B * Hk * S * D + 1, device="cuda", dtype=torch.bfloat16)
            q = q_store[offset:offset + B * Hq * S * D].view(B, Hq, S, D)
            k = k_store[offset:offset + B * Hk * S * D].view(B, Hk, S, D)
            assert (q.data_ptr() % 16 == 0) == (offset == 0)
            cos, sin = torch.randn(B, S, D, device="cuda"), torch.randn(B, S, D, device="cuda")
            q_out, k_out = torch.empty_like(q), torch.empty_like(k)
            before = len(launcher._compiled)
            rope_kernels.rope(q, k, cos, sin, None, False, False, q_out, k_out)
            seen.append(len(launcher._compiled) - before)
            want = reference(q.double(), k.double(), cos.double(), sin.double())
            torch.testing.assert_close((q_out.double(), k_out.double()), want, rtol=1e-2, atol=1e-2)
    # Each (S, alignment) case adds a key the first time and none after (unless this process
    # met it before).
    assert sum(seen) <= 4 and not any(seen[2:4] + seen[6:])
    assert len(launcher._compiled) >= 4

    # Bit for bit against kernel[grid] (the same compiled kernel, launched Triton's way).
    calls = []
    real = _launch.Launcher.__call__

    def spy(self, grid, tensors, scalars, **keywords):
        calls.append((grid, tensors, scalars, keywords))
        return real(self, grid, tensors, scalars, **keywords)

    _launch.Launcher.__call__ = spy
    try:
        rope_kernels.rope(q, k, cos, sin, None, False, False, q_out, k_out)
    finally:
        _launch.Launcher.__call__ = real
    (grid, tensors, scalars, keywords), = calls
    direct = (torch.empty_like(q_out), torch.empty_like(k_out))
    jit = (torch.empty_like(q_out), torch.empty_like(k_out))
    launcher(grid, (q, k) + direct + tensors[4:], scalars, **keywords)
    launcher.kernel[grid](q, k, *jit, *tensors[4:], *scalars, **keywords)
    assert torch.equal(direct[0], jit[0]) and torch.equal(direct[1], jit[1])


def test_norm_backward_pipelines_only_what_fits_shared_memory():
    """The norms' persistent backward pipelines its row loop only where the stages' tiles fit
    the per-program shared memory with room to spare: otherwise the kernel would not launch on
    the GPU (Triton's out-of-resources error) where the unpipelined one does."""
    from fusedops.triton import _norm

    h200 = 232448  # bytes a program may use on an H100 / H200
    stages = _norm._BWD_STAGES
    assert stages > 1
    assert _norm.bwd_stages(8192 * (2 + 2 + 2), h200) == stages  # bf16 add_rms_norm rows of 8192 (run there)
    assert _norm.bwd_stages(8192 * (4 + 4), h200) == 1  # float32 rows of 8192
    assert _norm.bwd_stages(4096 * (2 + 2), 101376) == stages  # bf16 tiles of 4096, a 99 KiB GPU
    assert _norm.bwd_stages(8192 * (2 + 2), 101376) == 1  # bf16 rows of 8192 there
    assert _launch.shared_memory_per_block(torch.device("cpu")) == h200
    if HAS_CUDA:
        props = torch.cuda.get_device_properties(0)
        assert _launch.shared_memory_per_block(torch.device("cuda", 0)) >= props.shared_memory_per_block
