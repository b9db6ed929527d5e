"""linear_cross_entropy and its recomputing backward: the kernels (Python composites), fake
kernels, autograd and autocast rule.

Schemas (csrc/registration.cpp):
    linear_cross_entropy(Tensor hidden, Tensor weight, Tensor target, Tensor? bias=None,
                         Tensor? class_weight=None, int ignore_index=-100, str reduction="mean",
                         float label_smoothing=0., float z_loss=0., float? softcap=None,
                         int? chunk_rows=None, bool low_memory=False, int? chunk_classes=None,
                         bool compute_grad=False)
        -> (Tensor loss, Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias, Tensor bad_target)
    linear_cross_entropy_backward(Tensor grad_output, Tensor hidden, Tensor weight, Tensor target,
                                  Tensor? bias, Tensor? class_weight, int ignore_index, str reduction,
                                  float label_smoothing, float z_loss, float? softcap, int? chunk_rows,
                                  bool low_memory=False, int? chunk_classes=None)
        -> (Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)

The value is cross_entropy(hidden @ weight.T + bias, target, ...) with every option of
fusedops.cross_entropy (class_weight is its `weight`). The op is matrix-product bound, so its
CPU and CUDA kernels are Python composites registered with torch.library.register_kernel: the
products are torch.mm/torch.addmm (cuBLAS, oneDNN), the fused part is cross_entropy_'s kernel,
which turns a chunk of logits into its loss and, in place, its gradient in one pass. Per chunk
of rows (never the whole (N, V) logits):

    logits = hidden_c @ weight.T (+ bias)             input dtype (tensor cores on a GPU)
    loss  += cross_entropy_(logits, target_c, ...)    logits now hold d loss / d logits
    grad_hidden_c  = logits @ weight                  input dtype
    grad_weight   += logits.T @ hidden_c              float32 accumulator (see _accumulate_mm;
                                                      the first chunk writes it)
    grad_bias     += logits.sum(0)                    float32

"mean" needs the denominator of the whole batch, not the chunk's: the chunks run with
reduction "sum" and the results are scaled by 1/D, D computed once on the device from the
targets (the count of rows not ignored; the sum of their class weights when there are class
weights and no z-loss). Without a z-loss the scale rides on the class weights the chunks run
with (_scale_foldable), so that nothing multiplies the (V, H) accumulator afterwards. With
class weights *and* a z-loss the two terms have different denominators (cross_entropy.h: Dw
for the cross-entropy, Dn for the z-term); the chunks then run with class weights scaled by
Dn/Dw (the cross-entropy terms are linear in the weights) and the result is multiplied by 1/Dn.
All of it is device arithmetic: no host synchronisation.

Chunk size: chunk_rows, or by default as many rows as keep one chunk's logits within
CHUNK_BYTES (64 MiB; CHUNK_BYTES_CUDA, 1 GiB, on a GPU). The only buffers beyond the inputs
and the returned gradients are one chunk of logits, the float32 weight-gradient accumulator
when the weight is not float32 (an extra 4*V*H bytes: with float32 parameters, as
mixed-precision training has them, the accumulator *is* the returned gradient), and, when the
weight's dtype is not hidden's, one copy of the weight in hidden's dtype for the products.
Small chunks keep memory low but make the weight-gradient product (its inner dimension is the
chunk's rows) read and write the whole (V, H) accumulator per chunk: on a GPU, chunks of a few
thousand rows are needed for it to run at the tensor cores' rate
(docs/ops/linear_cross_entropy.md).

low_memory=True walks the vocabulary in slices instead of the rows in chunks (the section "the
low-memory mode" below): no float32 buffer of the weight's size and only a small slice of
logits, for one more matrix product.

Saved for backward ("mean", "sum"): the gradients the forward computed (grad_output 1). The
backward multiplies them by the 0-d grad_output (in place in an eager backward that frees the
graph, as cross_entropy's does; else into new tensors) and casts grad_weight/grad_bias to the
parameters' dtypes. Reduction "none": the per-row grad_output scales each row of the logits'
gradient before the products, so nothing can be computed ahead; the forward computes only the
loss (one product) and saves hidden, weight, target, bias and class_weight (references, no
copies), and the backward (linear_cross_entropy_backward) recomputes each chunk's logits: three
products in the backward instead of two. Double backward raises.

Autocast rule (CPU and CUDA): hidden is cast to the autocast dtype; weight, bias and
class_weight are passed as they are. The op takes a float32 weight with bfloat16/float16 hidden
by itself (it makes one copy of the weight in hidden's dtype for the products), so a float32
parameter gets its gradient in float32 straight from the float32 accumulator, never rounded to
bfloat16 on the way. The loss is float32.
"""

import math

import torch

from . import _deferred, _direct, _on_import
from . import cross_entropy as _ce
from ._norm import FLOAT_DTYPES, NARROW, _same_device, acc_dtype, check_given, dtype_name, shape_str

forward = torch.ops.fusedops.linear_cross_entropy.default
backward = torch.ops.fusedops.linear_cross_entropy_backward.default

# The default byte budget of one chunk's logits (in hidden's dtype). On a GPU the products
# need chunks of thousands of rows to run at the tensor cores' rate (measured on the H200 at
# Gemma-2-2B's shape: 160 ms with 64 MiB chunks, 49 ms with 1 GiB, 64 ms for the materialised
# eager path); the CPU's products are efficient at a few hundred rows.
CHUNK_BYTES = 64 * 2**20
CHUNK_BYTES_CUDA = 2**30

OP = "linear_cross_entropy"


def _dev(t):
    return _ce._device_str(t)


def check(op, hidden, weight, target, bias, class_weight, ignore_index, reduction, label_smoothing, z_loss, softcap,
          chunk_rows, low_memory=False, chunk_classes=None):
    check_given(op, hidden=hidden, weight=weight, target=target)
    if hidden.dim() < 1:
        raise ValueError(f"{op}: hidden must have at least 1 dimension (..., hidden_size), got a 0-dimensional tensor")
    if hidden.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"{op}: hidden dtype must be float32, bfloat16, float16 or float64, got {dtype_name(hidden.dtype)}"
        )
    H = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != H:
        raise ValueError(
            f"{op}: weight must be a 2-D (vocab_size, hidden_size) tensor with hidden_size = hidden.size(-1) = {H}, "
            f"got shape {shape_str(weight)}"
        )
    if not (weight.dtype == hidden.dtype or (weight.dtype == torch.float32 and hidden.dtype in NARROW)):
        raise ValueError(
            f"{op}: weight dtype {dtype_name(weight.dtype)} does not go with hidden dtype {dtype_name(hidden.dtype)}: "
            + ("use hidden's dtype or float32" if hidden.dtype in NARROW else "use hidden's dtype")
        )
    if not _same_device(weight, hidden):
        raise ValueError(f"{op}: weight is on {_dev(weight)} but hidden is on {_dev(hidden)}")
    V = weight.shape[0]
    if V < 1:
        raise ValueError(f"{op}: weight must have at least one row (vocab_size is 0)")
    if V >= 2**31:
        raise ValueError(f"{op}: too many classes ({V})")
    if target.dtype.is_floating_point or target.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{op}: target dtype must be int64 or int32 (class indices), got {dtype_name(target.dtype)}")
    if target.shape != hidden.shape[:-1]:
        raise ValueError(
            f"{op}: target shape {shape_str(target)} does not match hidden shape {shape_str(hidden)} without its "
            f"last dimension: expected {_ce._leading(hidden)}"
        )
    if not _same_device(target, hidden):
        raise ValueError(f"{op}: target is on {_dev(target)} but hidden is on {_dev(hidden)}")
    for name, t in (("bias", bias), ("class_weight", class_weight)):
        if t is None:
            continue
        if t.dim() != 1 or t.shape[0] != V:
            raise ValueError(
                f"{op}: {name} must be a 1-D tensor of weight.size(0) = {V} elements, got shape {shape_str(t)}"
            )
        if not (t.dtype == hidden.dtype or t.dtype == weight.dtype or t.dtype == torch.float32):
            raise ValueError(
                f"{op}: {name} dtype {dtype_name(t.dtype)} does not go with hidden dtype {dtype_name(hidden.dtype)}: "
                "use hidden's dtype, weight's dtype or float32"
            )
        if not _same_device(t, hidden):
            raise ValueError(f"{op}: {name} is on {_dev(t)} but hidden is on {_dev(hidden)}")
    _ce.check_options(op, reduction, label_smoothing, z_loss, softcap)
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"{op}: chunk_rows must be >= 1 (or None: automatic), got {chunk_rows}")
    if low_memory and chunk_rows is not None:
        raise ValueError(
            f"{op}: chunk_rows does not apply with low_memory=True (the vocabulary is split into chunks "
            "instead)"
        )
    if chunk_classes is not None and not low_memory:
        raise ValueError(f"{op}: chunk_classes applies with low_memory=True only")
    if chunk_classes is not None and chunk_classes < 1:
        raise ValueError(f"{op}: chunk_classes must be >= 1 (or None: automatic), got {chunk_classes}")


def check_backward(grad_output, hidden, target, reduction):
    op = "linear_cross_entropy_backward"
    check_given(op, grad_output=grad_output)
    if not grad_output.dtype.is_floating_point:
        raise ValueError(f"{op}: grad_output dtype must be floating point, got {dtype_name(grad_output.dtype)}")
    if not _same_device(grad_output, hidden):
        raise ValueError(f"{op}: grad_output is on {_dev(grad_output)} but hidden is on {_dev(hidden)}")
    expected = target.shape if reduction == "none" else torch.Size([])
    if grad_output.shape != expected:
        raise ValueError(
            f"{op}: grad_output must have shape {list(expected)} for reduction '{reduction}', got shape "
            f"{shape_str(grad_output)}"
        )


# ---- the composite -------------------------------------------------------------------------


def chunk_rows_for(V, itemsize, chunk_rows=None, device_type="cpu"):
    if chunk_rows is not None:
        return chunk_rows
    budget = CHUNK_BYTES_CUDA if device_type == "cuda" else CHUNK_BYTES
    return max(1, budget // (V * itemsize))


# Whether addmm with out_dtype (a float32 result from bfloat16/float16 factors, accumulated in
# place) exists for a device type: torch has it for CUDA only. Probed once per device type by a
# call that raises where it is missing (no value is read back: no sync, so a first call under
# CUDA-graph capture is fine; the GPU tests check the values).
_out_dtype_ok = {}


def _out_dtype_works(device):
    ok = _out_dtype_ok.get(device.type)
    if ok is None:
        try:
            a = torch.zeros(2, 3, device=device, dtype=torch.bfloat16)
            acc = torch.zeros(2, 2, device=device, dtype=torch.float32)
            torch.addmm(acc, a, a.t(), out_dtype=torch.float32, out=acc)
            ok = True
        except (RuntimeError, NotImplementedError, TypeError):
            ok = False
        _out_dtype_ok[device.type] = ok
    return ok


def _accumulate_mm(acc, a, b, first=False):
    """acc += a @ b (first: acc = a @ b, acc's old contents ignored, NaN included) with acc
    float32 (float64) and a, b maybe narrower: the product is made in a's dtype and accumulated
    in acc's; no acc-sized temporary. On CUDA addmm(out_dtype=float32) does exactly that (tensor
    cores, float32 accumulation and output); elsewhere the chunk's factors are upcast
    (chunk-sized copies). `first` spares the accumulator a zero fill and the product a read of
    it: at Gemma-2-2B's head, 2.2 GiB each."""
    beta = 0 if first else 1
    if a.dtype == acc.dtype:
        torch.addmm(acc, a, b, beta=beta, out=acc)
    elif _out_dtype_works(a.device):
        torch.addmm(acc, a, b, beta=beta, out_dtype=acc.dtype, out=acc)
    else:
        torch.addmm(acc, a.to(acc.dtype), b.to(acc.dtype), beta=beta, out=acc)


# Whether this CPU multiplies bfloat16 / float16 natively, by dtype: probed once (_product_dtype).
_cpu_native_16bit = {}


def _product_dtype(hidden):
    """The dtype the products run in: hidden's, except for bfloat16/float16 on a CPU without
    native dot products of that type (AVX512-BF16 or AMX for bfloat16, AMX-FP16 for float16).
    There a 16-bit product runs far below the float32 rate (512x256 by 256x8192: 4x slower on an
    AVX-512 Xeon, 8x on an AVX2 EPYC, the development VMs of 2026-11-30 and 2026-12-01), so the
    chunk's factors are upcast and multiplied in float32, as torch.compile's reference does. The
    results are at least as accurate; the cost is a float32 copy of the weight per call and
    float32 logits chunks."""
    dt = hidden.dtype
    if hidden.device.type != "cpu" or dt not in (torch.bfloat16, torch.float16):
        return dt
    native = _cpu_native_16bit.get(dt)
    if native is None:
        probe = ("_is_avx512_bf16_supported", "_is_amx_tile_supported") if dt == torch.bfloat16 else (
            "_is_amx_fp16_supported",)
        native = any(getattr(torch.cpu, name, lambda: False)() for name in probe)
        _cpu_native_16bit[dt] = native
    return dt if native else torch.float32


def _class_weight_for(class_weight, dt):
    """Class weights the cross_entropy kernels take with logits of dtype dt: dt's or float32 (a
    16-bit weight with float32 products, on a CPU without 16-bit dot products, is upcast)."""
    if class_weight is None or class_weight.dtype in (dt, torch.float32):
        return class_weight
    return class_weight.float()


def _reciprocal_or_nan(weight_sum):
    """1 / the kept targets' weight sum under "mean"; NaN where that sum is 0 (0 / 0, as torch's,
    even where label smoothing's term alone would give finite / 0)."""
    return torch.where(weight_sum != 0, 1.0 / weight_sum, torch.full_like(weight_sum, float("nan")))


def _plan(target_flat, class_weight, ignore_index, reduction, z_loss, acc, V):
    """(class weights the chunks use, the factor the loss is multiplied by at the end, the one the
    gradients are) for the whole batch, the factors None unless "mean"; device arithmetic only.
    Every row ignored: the loss is 0 / 0 (NaN) and the gradients 0, as torch's."""
    w = None if class_weight is None else class_weight
    if reduction != "mean":
        return w, None, None
    kept = target_flat != ignore_index
    count = kept.sum().to(acc)
    if w is None:
        factor = 1.0 / count
    else:
        safe = torch.where(kept & (target_flat >= 0) & (target_flat < V), target_flat, torch.zeros_like(target_flat))
        wsum = torch.where(kept, w.to(acc)[safe], torch.zeros((), dtype=acc, device=w.device)).sum()
        if z_loss == 0.0:
            factor = _reciprocal_or_nan(wsum)
        else:
            w, factor = w.to(acc) * (count * _reciprocal_or_nan(wsum)), 1.0 / count
    return w, factor, torch.where(count > 0, factor, torch.zeros_like(factor))


def _scale_foldable(scale, z_loss, dt):
    """Whether the gradients' scale (1/D under "mean", times a 0-d grad_output) can ride on the
    class weights the chunks' kernel multiplies each row's terms by (_scaled_class_weight), so
    that the logits' gradient is written already scaled and no pass multiplies the (V, H)
    accumulator afterwards (at Gemma-2-2B's head 4.4 GiB of float32 traffic, about 1 ms on an
    H200). Not with a z-loss, whose terms the class weights do not scale, nor for float16 logits,
    whose range would lose gradients of order p / D to underflow (bfloat16 has float32's)."""
    return scale is not None and z_loss == 0.0 and dt != torch.float16


def _scaled_class_weight(class_weight, scale, V, acc):
    """Class weights times the 0-d `scale` (uniform weights without class weights), in acc's
    dtype: every cross-entropy term, and its gradient, is linear in the class weights
    (cross_entropy.h), so the kernel's results come multiplied by `scale`."""
    if class_weight is None:
        return scale.expand(V).contiguous()
    return class_weight.to(acc) * scale


def _wanted_grads(want_grad, output_mask, bias):
    """(hidden's, weight's, bias's): which gradients a call computes."""
    want_h, want_w, want_b = (bool(want_grad and m) for m in output_mask)
    return want_h, want_w, want_b and bias is not None


def compute(kernels, hidden, weight, target, bias=None, class_weight=None, ignore_index=-100, reduction="mean",
            label_smoothing=0.0, z_loss=0.0, softcap=None, chunk_rows=None, want_loss=True, want_grad=False,
            grad_output=None, output_mask=(True, True, True)):
    """The chunk loop. `kernels` = (cross_entropy forward, cross_entropy_ in place, slice_stats_,
    slice_grad_) with the registered ops' signatures; this loop uses the first two. class_weight
    in a dtype the kernels take (_run sees to it). grad_output: None (1) or a tensor (0-d, or per
    row for "none"). output_mask: which of the three gradients want_grad computes.
    Returns (loss or None, grad_hidden, grad_weight, grad_bias) with empty tensors for what was
    not wanted."""
    ce_forward, ce_inplace = kernels[:2]
    acc = acc_dtype(hidden.dtype)
    H = hidden.shape[-1]
    V = weight.shape[0]
    t = target.reshape(-1)
    N = t.shape[0]
    x = hidden.reshape(N, H)  # (N spelled out: -1 cannot be inferred when H is 0)
    dt = _product_dtype(hidden)  # hidden's dtype, or float32 on a CPU without 16-bit products
    w = weight if weight.dtype == dt else weight.to(dt)
    b = None if bias is None else (bias if bias.dtype == dt else bias.to(dt))
    cw, factor, grad_factor = _plan(t, class_weight, ignore_index, reduction, z_loss, acc, V)
    red = "none" if reduction == "none" else "sum"
    scale = grad_factor
    if grad_output is not None and reduction != "none":
        scale = grad_output.to(acc) if scale is None else scale * grad_output.to(acc)
    folded = want_grad and (grad_output is None or not want_loss) and _scale_foldable(scale, z_loss, dt)
    if folded:
        cw = _scaled_class_weight(cw, scale, V, acc)
    loss = None
    if want_loss:
        loss = hidden.new_zeros(target.shape if reduction == "none" else (), dtype=acc)
    loss_rows = loss.view(-1) if (want_loss and reduction == "none") else None
    go_rows = None
    if grad_output is not None and reduction == "none":
        go_rows = _ce.zero_ignored_rows(grad_output.reshape(-1), (t, ignore_index))
    want_h, want_w, want_b = _wanted_grads(want_grad, output_mask, bias)
    grad_hidden = hidden.new_empty((N, H) if want_h else (0,))
    # (the first chunk's product writes the weight's: zeros only for a batch of no rows)
    grad_weight = (hidden.new_empty if N else hidden.new_zeros)((V, H) if want_w else (0,), dtype=acc)
    grad_bias = hidden.new_zeros((V,) if want_b else (0,), dtype=acc)
    rows = chunk_rows_for(V, w.element_size(), chunk_rows, hidden.device.type)
    buf = hidden.new_empty((min(rows, N), V), dtype=dt) if N else None
    for start in range(0, N, rows):
        n = min(rows, N - start)
        xc, tc = x[start:start + n].to(dt), t[start:start + n]
        logits = buf[:n]
        if b is not None:
            torch.addmm(b, xc, w.t(), out=logits)
        else:
            torch.mm(xc, w.t(), out=logits)
        if want_grad:
            chunk_loss, _lse, _bad = ce_inplace(logits, tc, cw, ignore_index, red, label_smoothing, z_loss, softcap)
        else:
            chunk_loss, _lse, _g, _bad = ce_forward(logits, tc, cw, ignore_index, red, label_smoothing, z_loss,
                                                    softcap, False)
        if want_loss:
            if loss_rows is not None:
                loss_rows[start:start + n] = chunk_loss
            else:
                loss += chunk_loss
        if not want_grad:
            continue
        if go_rows is not None:
            logits.mul_(go_rows[start:start + n, None])
        if want_h and grad_hidden.dtype == dt:
            torch.mm(logits, w, out=grad_hidden[start:start + n])
        elif want_h:
            grad_hidden[start:start + n] = torch.mm(logits, w)
        if want_w:
            _accumulate_mm(grad_weight, logits.t(), xc, first=start == 0)
        if want_b:
            grad_bias += logits.sum(0, dtype=acc)
    if want_loss and factor is not None:
        if folded:
            # The chunks' losses came multiplied by grad_factor, which is factor except when no
            # row counts: then they are 0 and the loss 0 * factor = 0 / 0, NaN, as torch's.
            loss = torch.where(grad_factor == 0, loss * factor, loss)
        else:
            loss *= factor
    if want_grad:
        if scale is not None and not folded:
            grad_hidden.mul_(scale)
            grad_weight.mul_(scale)
            grad_bias.mul_(scale)
        if want_h:
            grad_hidden = grad_hidden.view(hidden.shape)
    return loss, grad_hidden, grad_weight, grad_bias


# ---- the low-memory mode: the vocabulary in slices (chunk_classes classes each) -------------
#
# The chunk loop above needs a float32 accumulator of the weight's size (the weight gradient is
# summed over chunks of rows) and chunks of thousands of rows to keep its products fast. Walking
# the vocabulary instead, each slice's weight gradient is one product over every row, made in
# float32 by the matrix product itself and written straight into the returned gradient. The
# price: each slice's gradient needs every row's log-sum-exp over the whole vocabulary first, so
# the logits are made twice (four products instead of three):
#
#   for each slice: logits = hidden @ weight_s.T (+ bias_s); cross_entropy_slice_stats_
#   per row: lse, loss, the gradient's coefficients (_finish_rows, device arithmetic)
#   for each slice: logits again; cross_entropy_slice_grad_ (the logits now hold d loss / d logits)
#                   grad_hidden_acc += logits @ weight_s      float32 accumulator (N, H)
#                   grad_weight_s    = logits.T @ hidden      float32 in the product, weight's dtype
#                   grad_bias_s      = logits.sum(0)
#
# Memory beyond inputs and gradients: one slice of logits (SLICE_BYTES), the (N, H) float32
# accumulator when hidden is narrower, a slice of the weight in hidden's dtype when the weight
# is float32, and the per-row statistics and coefficients (some 50 bytes a row).

SLICE_BYTES = 32 * 2**20


def slice_classes_for(N, V, itemsize, chunk_classes=None):
    """Classes per slice: chunk_classes, or as many as keep a slice of all N rows' logits within
    SLICE_BYTES, a multiple of 128 (at least 128: many rows make a slice larger than the budget)."""
    if chunk_classes is not None:
        return min(V, chunk_classes)
    per_class = max(N, 1) * itemsize
    return min(V, max(128, SLICE_BYTES // per_class // 128 * 128))


def _mm_to(out, a, b):
    """out = a @ b made in a's dtype and written in out's: for an out of a's dtype or wider,
    _accumulate_mm's first product (float32 accumulation for a narrower a); otherwise through
    a copy."""
    if out.dtype == a.dtype or out.dtype.itemsize > a.dtype.itemsize:
        _accumulate_mm(out, a, b, first=True)
    else:
        out.copy_(torch.mm(a, b.to(a.dtype)))


def _finish_rows(stats, t, class_weight, V, ignore_index, reduction, eps, z, grad_output, acc):
    """From each row's (max, sum of exp, sum of w_j x_j, target's x): the loss and, per row, the
    gradient's coefficients (base, scale, ct, cw), g_j = exp(x_j - base) * scale - ..., with
    grad_output and the "mean" denominators folded in (the formulas of
    csrc/include/fusedops/cross_entropy.h). As in the row kernels, nothing is taken from a
    rounded lse: the loss uses lse - x_t = log(s) - (x_t - max), and the gradient base = max,
    scale = cp / s (exp(x - lse) * cp, whose lse would be off by a unit in its last place,
    0.008 at 1e5). Device arithmetic only."""
    m, s, wx, xt = stats.unbind(1)
    kept = t != ignore_index
    valid = (t >= 0) & (t < V)
    zero = torch.zeros((), dtype=acc, device=stats.device)
    ls = torch.where(kept, torch.log(s), zero)
    m = torch.where(kept, m, zero)
    lse = m + ls
    if class_weight is None:
        wt = torch.ones_like(lse)
        W = float(V)
    else:
        cw_acc = class_weight.to(acc)
        wt = cw_acc[torch.where(valid, t, torch.zeros_like(t))]
        W = cw_acc.sum()
    wt = torch.where(kept, torch.where(valid, wt, torch.full_like(wt, float("nan"))), zero)
    ce = (1.0 - eps) * wt * (ls - (xt - m))
    if eps > 0:  # (with -inf logits the smoothing term would be 0 * inf)
        ce = ce + (eps / V) * (W * ls + (W * m - wx))
    zl = z * lse * lse
    ce = torch.where(kept, ce, zero)
    zl = torch.where(kept, zl, zero)
    if reduction == "mean":
        sw = _reciprocal_or_nan(wt.sum())
        sn = 1.0 / kept.sum().to(acc)
        loss = ce.sum() * sw + zl.sum() * sn  # (every row ignored: 0 / 0, NaN, as torch)
    else:
        sw = sn = torch.ones((), dtype=acc, device=stats.device)
        loss = (ce + zl).sum() if reduction == "sum" else ce + zl
    # (W only when smoothing: an inf class weight no row targets must not reach the gradient)
    cp = ((1.0 - eps) * wt + ((eps / V) * W if eps > 0 else 0.0)) * sw + (2.0 * z) * lse * sn
    ct = (1.0 - eps) * wt * sw
    cw = ((eps / V) * sw).expand_as(lse)
    coefs = torch.stack((m, torch.where(kept, cp / s, zero), ct, cw), 1)
    if grad_output is not None:
        go = grad_output.to(acc)
        coefs[:, 1:] *= go.reshape(-1, 1) if go.dim() > 0 else go
    return loss, coefs


def compute_low_memory(kernels, hidden, weight, target, bias=None, class_weight=None, ignore_index=-100,
                       reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None, chunk_classes=None,
                       want_loss=True, want_grad=False, grad_output=None, output_mask=(True, True, True)):
    """The slice loops. `kernels` as compute()'s, plus (slice_stats_, slice_grad_). Returns
    (loss or None, grad_hidden, grad_weight in the weight's dtype, grad_bias), empty tensors for
    what was not wanted (output_mask as compute()'s)."""
    slice_stats, slice_grad = kernels[2], kernels[3]
    acc = acc_dtype(hidden.dtype)
    H = hidden.shape[-1]
    V = weight.shape[0]
    t = target.reshape(-1)
    N = t.shape[0]
    x = hidden.reshape(N, H)  # (N spelled out: -1 cannot be inferred when H is 0)
    dt = _product_dtype(hidden)
    xd = x if x.dtype == dt else x.to(dt)
    smoothing = label_smoothing > 0
    S = slice_classes_for(N, V, dt.itemsize, chunk_classes)
    buf = hidden.new_empty((N * S,), dtype=dt)

    def slice_logits(v0, v1):
        ws = weight[v0:v1] if weight.dtype == dt else weight[v0:v1].to(dt)
        logits = buf[: N * (v1 - v0)].view(N, v1 - v0)
        if bias is not None:
            torch.addmm(bias[v0:v1].to(dt), xd, ws.t(), out=logits)
        else:
            torch.mm(xd, ws.t(), out=logits)
        return logits, ws

    stats = torch.zeros((N, 4), dtype=acc, device=hidden.device)
    stats[:, 0] = float("-inf")
    for v0 in range(0, V, S):
        logits = slice_logits(v0, min(V, v0 + S))[0]
        slice_stats(logits, t, class_weight, v0, ignore_index, softcap, smoothing, stats)
    loss, coefs = _finish_rows(stats, t, class_weight, V, ignore_index, reduction, label_smoothing, z_loss,
                               grad_output, acc)
    if reduction == "none":
        loss = loss.view(target.shape)
    want_h, want_w, want_b = _wanted_grads(want_grad, output_mask, bias)
    # (three tensors, not one returned thrice, where nothing is wanted: an op's outputs may not
    # alias each other)
    gh = hidden.new_zeros((N, H) if want_h else (0,), dtype=acc)
    grad_weight = weight.new_empty((V, H)) if want_w else hidden.new_empty((0,), dtype=acc)
    grad_bias = hidden.new_empty((V,) if want_b else (0,), dtype=acc)
    for v0 in range(0, V, S) if want_h or want_w or want_b else ():
        v1 = min(V, v0 + S)
        logits, ws = slice_logits(v0, v1)
        slice_grad(logits, t, class_weight, v0, ignore_index, softcap, smoothing, coefs)
        if want_h:
            _accumulate_mm(gh, logits, ws)
        if want_w:
            _mm_to(grad_weight[v0:v1], logits.t(), xd)
        if want_b:
            torch.sum(logits, 0, dtype=acc, out=grad_bias[v0:v1])
        del ws  # (a float32 weight's chunk copy: gone before the next one is made)
    grad_hidden = gh if gh.dtype == hidden.dtype else gh.to(hidden.dtype)
    if want_h:
        grad_hidden = grad_hidden.view(hidden.shape)
    return (loss if want_loss else None), grad_hidden, grad_weight, grad_bias


def _check_targets_cpu(op, target, V, ignore_index):
    if target.device.type == "cpu":  # free to read here: name the bad value as cross_entropy does
        bad = _ce.bad_target_mask(target, V, ignore_index)
        if bad.any():
            index = int(_deferred.first_index(bad))
            raise ValueError(_ce.bad_target_message(op, target, index, V, ignore_index))


def _bad_target_record(op, target, V, ignore_index):
    """The forward's bad_target output. On the CPU a bad target raises here and the record is
    -1; on a GPU it is the first bad target's flat index, or -1, computed there (no sync)."""
    if target.device.type != "cpu":
        return _ce.bad_target_index(target, V, ignore_index)
    _check_targets_cpu(op, target, V, ignore_index)
    return torch.full((), -1, dtype=torch.int64)


def _run(kernels, hidden, weight, target, bias, class_weight, ignore_index, reduction, label_smoothing,
         z_loss, softcap, chunk_rows, low_memory, chunk_classes, **wants):
    """The chunk loop of the mode asked for, with class weights the kernels take."""
    class_weight = _class_weight_for(class_weight, _product_dtype(hidden))
    inputs = (kernels, hidden, weight, target, bias, class_weight, ignore_index, reduction, label_smoothing,
              z_loss, softcap)
    if low_memory:
        return compute_low_memory(*inputs, chunk_classes, **wants)
    return compute(*inputs, chunk_rows, **wants)


def _make_forward(kernels):
    def kernel(hidden, weight, target, bias=None, class_weight=None, ignore_index=-100, reduction="mean",
               label_smoothing=0.0, z_loss=0.0, softcap=None, chunk_rows=None, low_memory=False,
               chunk_classes=None, compute_grad=False, output_mask=(True, True, True)):
        check(OP, hidden, weight, target, bias, class_weight, ignore_index, reduction, label_smoothing, z_loss,
              softcap, chunk_rows, low_memory, chunk_classes)
        with _direct.BelowAutograd(), torch.no_grad():
            bad = _bad_target_record(OP, target, weight.shape[0], ignore_index)
            loss, gh, gw, gb = _run(kernels, hidden, weight, target, bias, class_weight, ignore_index,
                                    reduction, label_smoothing, z_loss, softcap, chunk_rows, low_memory,
                                    chunk_classes, want_loss=True, want_grad=compute_grad,
                                    output_mask=tuple(output_mask))
        return loss, gh, gw, gb, bad

    return kernel


def _make_backward(kernels):
    def kernel(grad_output, hidden, weight, target, bias, class_weight, ignore_index, reduction, label_smoothing,
               z_loss, softcap, chunk_rows, low_memory=False, chunk_classes=None,
               output_mask=(True, True, True)):
        op = "linear_cross_entropy_backward"
        check(op, hidden, weight, target, bias, class_weight, ignore_index, reduction, label_smoothing, z_loss,
              softcap, chunk_rows, low_memory, chunk_classes)
        check_backward(grad_output, hidden, target, reduction)
        _check_targets_cpu(op, target, weight.shape[0], ignore_index)
        with _direct.BelowAutograd(), torch.no_grad():
            _loss, gh, gw, gb = _run(kernels, hidden, weight, target, bias, class_weight, ignore_index,
                                     reduction, label_smoothing, z_loss, softcap, chunk_rows, low_memory,
                                     chunk_classes, want_loss=False, want_grad=True, grad_output=grad_output,
                                     output_mask=tuple(output_mask))
        return gh, gw, gb

    return kernel


# The dispatcher's cross_entropy ops: CPU kernels, CUDA kernels or Triton, as fusedops chose.
_DISPATCHED = (_ce.forward, _ce.forward_, _ce.slice_stats_, _ce.slice_grad_)
_forward_kernel = _make_forward(_DISPATCHED)
_backward_kernel = _make_backward(_DISPATCHED)
for _device in ("cpu", "cuda"):
    torch.library.register_kernel("fusedops::linear_cross_entropy", _device, _forward_kernel)
    torch.library.register_kernel("fusedops::linear_cross_entropy_backward", _device, _backward_kernel)


# ---- fake kernels ----------------------------------------------------------------------------


def _grads_like(hidden, weight, bias, wanted, low_memory, output_mask):
    acc = acc_dtype(hidden.dtype)
    want_h, want_w, want_b = _wanted_grads(wanted, output_mask, bias)
    gh = hidden.new_empty(hidden.shape if want_h else (0,))
    if not want_w:
        gw = hidden.new_empty((0,), dtype=acc)
    else:
        gw = weight.new_empty(weight.shape) if low_memory else hidden.new_empty(weight.shape, dtype=acc)
    gb = hidden.new_empty((weight.shape[0],) if want_b else (0,), dtype=acc)
    return gh, gw, gb


@torch.library.register_fake("fusedops::linear_cross_entropy")
def _forward_fake(hidden, weight, target, bias=None, class_weight=None, ignore_index=-100, reduction="mean",
                  label_smoothing=0.0, z_loss=0.0, softcap=None, chunk_rows=None, low_memory=False,
                  chunk_classes=None, compute_grad=False, output_mask=(True, True, True)):
    check(OP, hidden, weight, target, bias, class_weight, ignore_index, reduction, label_smoothing, z_loss, softcap,
          chunk_rows, low_memory, chunk_classes)
    loss = hidden.new_empty(target.shape if reduction == "none" else (), dtype=acc_dtype(hidden.dtype))
    grads = _grads_like(hidden, weight, bias, compute_grad, low_memory, output_mask)
    return (loss, *grads, hidden.new_empty((), dtype=torch.int64))


@torch.library.register_fake("fusedops::linear_cross_entropy_backward")
def _backward_fake(grad_output, hidden, weight, target, bias, class_weight, ignore_index, reduction, label_smoothing,
                   z_loss, softcap, chunk_rows, low_memory=False, chunk_classes=None,
                   output_mask=(True, True, True)):
    check("linear_cross_entropy_backward", hidden, weight, target, bias, class_weight, ignore_index, reduction,
          label_smoothing, z_loss, softcap, chunk_rows, low_memory, chunk_classes)
    check_backward(grad_output, hidden, target, reduction)
    return _grads_like(hidden, weight, bias, True, low_memory, output_mask)


# ---- autograd ------------------------------------------------------------------------------


def _refuse_class_weight_grad(class_weight):
    if class_weight is not None and class_weight.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(
            "fusedops.linear_cross_entropy: gradients with respect to class_weight are not supported "
            "(torch.nn.functional.cross_entropy has none either); pass class_weight.detach()"
        )


def _setup_context(ctx, inputs, output):
    _save(ctx, _all_inputs(inputs), output, None, _ce.gradients_dropped())


def _save(ctx, inputs, output, token, private):
    """`token`: the direct Function's graph_token (None on the registered route); `private`:
    whether no caller holds the gradient outputs, so that backward may scale them in place."""
    (hidden, weight, target, bias, class_weight, ignore_index, reduction, ls, z, cap, chunk_rows, low_memory,
     chunk_classes, compute_grad, output_mask) = inputs
    _loss, gh, gw, gb, bad = output
    # (a direct torch.ops caller may leave out of output_mask a gradient autograd will ask for:
    # the backward then computes it again)
    needs = tuple(ctx.needs_input_grad) + (False,) * 4
    computed = all(made or not needed for made, needed in zip(output_mask, (needs[0], needs[1], needs[3])))
    ctx.recompute = reduction == "none" or not compute_grad or not computed
    ctx.options = (ignore_index, reduction, ls, z, cap, chunk_rows, low_memory, chunk_classes)
    ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
    ctx.has_bias = bias is not None
    ctx.private = private
    if ctx.recompute:
        ctx.save_for_backward(hidden, weight, target, bias, class_weight)
    else:
        ctx.save_for_backward(gh, gw, gb, token)
    ctx.mark_non_differentiable(gh, gw, gb, bad)
    ctx.set_materialize_grads(False)


_DEFAULTS = (None, None, -100, "mean", 0.0, 0.0, None, None, False, None, False, (True, True, True))


def _all_inputs(inputs):
    return tuple(inputs) + _DEFAULTS[len(inputs) - 3:]


def _scale(grad_output, grad, token, private):
    return _ce.scale(grad_output, grad, token, private, "fusedops.linear_cross_entropy")


def _scale_to(grad_output, grad, dtype, token, private):
    """grad_output * grad in `dtype`. On a GPU a float32 accumulator for a narrower parameter is
    scaled and rounded in one pass (the kernel casts as it writes), unless the backward builds a
    graph (create_graph: the result must hang from the forward's, see cross_entropy.scale). On
    the CPU, where a multiply into a narrower `out` goes through a float32 temporary of the
    accumulator's size, it is scaled (in place where it may be) and cast."""
    if grad.dtype == dtype or not grad.is_cuda or torch.is_grad_enabled():
        return _scale(grad_output, grad, token, private).to(dtype)
    return torch.mul(grad, grad_output, out=torch.empty_like(grad, dtype=dtype))


def _backward(ctx, grad_loss, *_unused):
    _deferred.pending.raise_finished()
    n_inputs = 15
    if grad_loss is None:
        return (None,) * n_inputs
    # (padded: the dispatcher leaves out trailing arguments that equal their defaults, and
    # needs_input_grad has one flag an argument passed)
    needs = tuple(ctx.needs_input_grad) + (False,) * (n_inputs - len(ctx.needs_input_grad))
    if needs[4]:
        raise NotImplementedError(
            "fusedops.linear_cross_entropy: gradients with respect to class_weight are not supported; pass "
            "class_weight.detach()"
        )
    wdt, bdt = ctx.dtypes
    if ctx.recompute:
        hidden, weight, target, bias, class_weight = ctx.saved_tensors
        mask = [needs[0], needs[1], ctx.has_bias and needs[3]]
        with _direct.below_autograd_unless_grad():
            gh, gw, gb = backward(grad_loss, hidden, weight, target, bias, class_weight, *ctx.options, mask)
        gw = gw.to(wdt) if needs[1] else None
        gb = gb.to(bdt) if ctx.has_bias and needs[3] else None
    else:
        gh, gw, gb, token = ctx.saved_tensors
        gh = _scale(grad_loss, gh, token, ctx.private) if needs[0] else None
        gw = _scale_to(grad_loss, gw, wdt, token, ctx.private) if needs[1] else None
        gb = _scale_to(grad_loss, gb, bdt, token, ctx.private) if ctx.has_bias and needs[3] else None
    return (gh if needs[0] else None, gw, None, gb) + (None,) * (n_inputs - 4)


torch.library.register_autograd("fusedops::linear_cross_entropy", _backward, setup_context=_setup_context)
_direct.register_no_double_backward("fusedops::linear_cross_entropy_backward", "fusedops.linear_cross_entropy")


# ---- FLOP counting ---------------------------------------------------------------------------
# The products run inside the ops' composite kernels, out of sight of torch's FlopCounterMode,
# which would count the lm_head as nothing: these formulas give it the products each call makes.
# (Registered when torch.utils.flop_counter is imported: it imports triton, 0.2 s.)


def _product_flops(hidden, weight, bias, low_memory, want_grad, output_mask):
    """2 N H V for each (N, H) x (H, V) product the chunk loops make (hidden, weight: shapes)."""
    want_h, want_w, want_b = _wanted_grads(want_grad, output_mask, bias)
    products = 1 + want_h + want_w
    if low_memory and (want_h or want_w or want_b):
        products += 1  # (the logits made again, slice by slice, once every row's lse is known)
    return 2 * math.prod(hidden[:-1]) * hidden[-1] * weight[0] * products


def _forward_flops(hidden, weight, target, bias=None, class_weight=None, ignore_index=-100, reduction="mean",
                   label_smoothing=0.0, z_loss=0.0, softcap=None, chunk_rows=None, low_memory=False,
                   chunk_classes=None, compute_grad=False, output_mask=(True, True, True), **_out):
    return _product_flops(hidden, weight, bias, low_memory, compute_grad, output_mask)


def _backward_flops(grad_output, hidden, weight, target, bias, class_weight, ignore_index, reduction,
                    label_smoothing, z_loss, softcap, chunk_rows, low_memory=False, chunk_classes=None,
                    output_mask=(True, True, True), **_out):
    return _product_flops(hidden, weight, bias, low_memory, True, output_mask)


def _register_flop_formulas():
    from torch.utils.flop_counter import register_flop_formula

    register_flop_formula(torch.ops.fusedops.linear_cross_entropy)(_forward_flops)
    register_flop_formula(torch.ops.fusedops.linear_cross_entropy_backward)(_backward_flops)


_on_import.when_imported("torch.utils.flop_counter", _register_flop_formulas)

# The op's pybind entry point: what OpOverload.__call__ forwards to, one Python frame less.
_forward_entry = forward._op


class _Function(torch.autograd.Function):
    """The public function's autograd path: the registered autograd (_save, _backward) without
    the detour through the dispatcher (ops/_direct.py), whose Python autograd kernel re-reads the
    op's 14-argument schema on every call (about 120 us on a 2-core CPU)."""

    @staticmethod
    def forward(ctx, *inputs):
        with _direct.BelowAutograd():
            output = _forward_entry(*inputs)
        token = _ce.graph_token(output[0])
        _save(ctx, inputs, output, token, True)  # (the public function drops the gradient outputs)
        return (*output, token)

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        return _backward(ctx, grad_loss)


_apply_function = _direct.bind_apply(_Function)
_unwrap = _direct.unwrap_if_dead


def direct(needs_grad, hidden, weight, target, bias, *options):
    """(loss, bad_target) of ``forward(hidden, weight, target, bias, *options)`` with autograd,
    where ``_direct.direct_call_allowed()``; ``needs_grad``: whether a gradient is recorded."""
    if needs_grad:
        loss, _gh, _gw, _gb, bad, _token = _apply_function(
            _unwrap(hidden), _unwrap(weight), target, None if bias is None else _unwrap(bias), *options
        )
    else:
        with _direct.BelowAutograd():
            loss, _gh, _gw, _gb, bad = _forward_entry(hidden, weight, target, bias, *options)
    return loss, bad


# ---- autocast ------------------------------------------------------------------------------

_lib = torch.library.Library("fusedops", "IMPL")
_AUTOCAST_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.AutocastCUDA
)


def _autocast_kernel(device_type):
    def rule(hidden, weight, target, bias=None, class_weight=None, ignore_index=-100, reduction="mean",
             label_smoothing=0.0, z_loss=0.0, softcap=None, chunk_rows=None, low_memory=False,
             chunk_classes=None, compute_grad=False, output_mask=(True, True, True)):
        dt = torch.get_autocast_dtype(device_type)
        if hidden.dtype in NARROW + (torch.float32,) and hidden.dtype != dt:
            hidden = hidden.to(dt)
        # Only the other 16-bit dtype is cast: float32 parameters stay float32 (the op casts the
        # weight for the products itself and returns the gradient in float32); float64 and
        # integer tensors are not autocast's to cast (as torch's rule), so the op refuses them.
        if weight.dtype in NARROW and weight.dtype != dt:
            weight = weight.to(dt)
        if bias is not None and bias.dtype in NARROW and bias.dtype != dt:
            bias = bias.to(dt)
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS):
            return forward(hidden, weight, target, bias, class_weight, ignore_index, reduction, label_smoothing,
                           z_loss, softcap, chunk_rows, low_memory, chunk_classes, compute_grad, output_mask)

    return rule


_lib.impl("linear_cross_entropy", _autocast_kernel("cpu"), "AutocastCPU")
_lib.impl("linear_cross_entropy", _autocast_kernel("cuda"), "AutocastCUDA")


# ---- Triton, for CUDA tensors when the CUDA kernels do not serve them (ops/__init__.py) -------
# The same composite with cross_entropy's Triton kernels called directly (the products stay
# cuBLAS's): what FUSEDOPS_BACKEND=triton runs, and what the interpreter tests run on the CPU.

_TRITON = (_ce._triton_forward, _ce._triton_forward_inplace, _ce._triton_slice_stats, _ce._triton_slice_grad)

# Its CUDA kernel calls cross_entropy's ops through the dispatcher, which switch to Triton
# themselves: use_triton_for_cuda leaves it registered (torch refuses a second Python kernel for
# the key anyway), and this table serves the interpreter tests.
DISPATCHES_TO_FUSEDOPS_OPS = True

TRITON_IMPLS = {
    "linear_cross_entropy": _make_forward(_TRITON),
    "linear_cross_entropy_backward": _make_backward(_TRITON),
}
