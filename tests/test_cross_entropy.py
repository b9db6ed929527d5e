"""cross_entropy beyond the generic suites: the backward's scaling by any grad_output (one value,
or one per row with rows at exactly 1), retain_graph, the in-place gradient mode (aliasing,
version counter, what is allocated), bad targets (CPU error, GPU eager error, never an
out-of-bounds read), torch's edge cases (every row ignored), the nn module as a drop-in, and
torch.compile without graph breaks. GPU-only behaviour (wide rows through the cluster kernels,
peak memory) is marked gpu."""

import functools
import os

import pytest
import torch
import torch.nn.functional as F

import fusedops
from fusedops.ops import cross_entropy as ce_op
from fusedops.testing.cross_entropy import reference
from conftest import HAS_CUDA, NO_GPU_REASON, device_params

DEVICES = device_params()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason=NO_GPU_REASON)]


def _problem(device, dtype=torch.float32, shape=(6, 50), ignore=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(shape, generator=g)).to(device=device, dtype=dtype).requires_grad_()
    t = torch.randint(0, shape[-1], shape[:-1], generator=g).to(device)
    if ignore:
        t.view(-1)[::4] = -100
    return x, t


def _ref_grad(x, t, grad_output, **kw):
    xd = x.detach().double().requires_grad_()
    loss = reference(xd, t, **kw)
    (g,) = torch.autograd.grad(loss, xd, grad_output.double())
    return loss, g


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("scale", [2.5, -0.75, 0.0])
def test_backward_scales_by_grad_output(device, reduction, scale):
    """A grad_output other than 1 scales the gradient the forward computed (compared relative to
    the gradient's size: "mean" divides it by the row count)."""
    x, t = _problem(device)
    kw = dict(weight=torch.rand(50, device=device) + 0.5, reduction=reduction, label_smoothing=0.1, z_loss=0.01)
    loss = fusedops.cross_entropy(x, t, **kw)
    go = torch.tensor(scale, device=device)
    (g,) = torch.autograd.grad(loss, x, go)
    _, rg = _ref_grad(x, t, go, **kw)
    norm = max(rg.abs().max().item(), 1e-30)
    torch.testing.assert_close(g.double() / norm, rg / norm, atol=1e-6, rtol=1e-5)
    if scale == 0.0:
        assert torch.all(g == 0)


@pytest.mark.parametrize("device", DEVICES)
def test_reduction_none_per_row_grad_output(device):
    """reduction="none": each row scaled by its own grad_output, rows at exactly 1 included (the
    in-place scaling skips those rows: they must still hold the right values), ignored rows 0."""
    x, t = _problem(device, shape=(2, 4, 40))
    loss = fusedops.cross_entropy(x, t, reduction="none", softcap=4.0)
    assert loss.shape == t.shape
    go = torch.tensor([[1.0, 2.0, 1.0, -1.0], [0.5, 1.0, 1.0, 3.0]], device=device)
    (g,) = torch.autograd.grad(loss, x, go)
    rl, rg = _ref_grad(x, t, go, reduction="none", softcap=4.0)
    torch.testing.assert_close(loss.double(), rl, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g.double(), rg, atol=1e-6, rtol=1e-5)
    assert torch.all(g.view(-1, 40)[t.view(-1) == -100] == 0)
    # loss.sum().backward() passes an expanded grad_output of ones: every row skipped, still right.
    x2 = x.detach().clone().requires_grad_()
    fusedops.cross_entropy(x2, t, reduction="none", softcap=4.0).sum().backward()
    _, rg1 = _ref_grad(x, t, torch.ones_like(go), reduction="none", softcap=4.0)
    torch.testing.assert_close(x2.grad.double(), rg1, atol=1e-6, rtol=1e-5)


def _through_each_route(x, t, **kw):
    """cross_entropy's loss by each of its autograd routes: the public function (eager direct
    call), its in-place gradient mode (on a non-leaf copy), and the registered op with autograd."""
    yield "public", x, fusedops.cross_entropy(x, t, **kw)
    xi = x * 1.0
    yield "inplace_grad", xi, fusedops.cross_entropy(xi, t, inplace_grad=True, **kw)
    options = (kw.get("ignore_index", -100), kw.get("reduction", "mean"), 0.0, 0.0, None, True)
    yield "torch.ops", x, torch.ops.fusedops.cross_entropy(x, t, None, *options)[0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ignore_index", [-100, 3])
def test_ignored_rows_get_zero_whatever_grad_output_they_receive(device, ignore_index):
    """reduction="none" with NaN and inf arriving at ignored rows (a fully padded sequence's mean,
    later dropped by nan_to_num, sends NaN there): their gradient is 0, as torch's, not 0 * NaN;
    the other rows are scaled as usual. Every autograd route."""
    x, t = _problem(device, shape=(3, 4, 40), ignore=False)
    t[1] = ignore_index  # a whole sequence ignored
    t[0, 1] = ignore_index
    go = torch.rand(3, 4, device=device) + 0.5
    go[1] = torch.tensor([float("nan"), float("inf"), -float("inf"), float("nan")])
    go[0, 1] = float("nan")
    _, rg = _ref_grad(x, t, go.nan_to_num(0.0, 0.0, 0.0), reduction="none", ignore_index=ignore_index)
    for route, xr, loss in _through_each_route(x, t, reduction="none", ignore_index=ignore_index):
        (g,) = torch.autograd.grad(loss, xr, go)
        assert torch.all(g[t == ignore_index] == 0), route
        torch.testing.assert_close(g.double(), rg, atol=1e-6, rtol=1e-5, msg=route)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inplace_grad", [False, True])
def test_retain_graph(device, inplace_grad):
    """With retain_graph the backward scales into a new tensor: a second backward through the same
    graph gets the same gradient, and the first one's result is not changed by it."""
    x, t = _problem(device)
    h = x * 1.0  # (the in-place mode writes into a non-leaf, as an lm_head output)
    loss = fusedops.cross_entropy(h, t, inplace_grad=inplace_grad)
    (g1,) = torch.autograd.grad(loss, x, torch.tensor(3.0, device=device), retain_graph=True)
    kept = g1.clone()
    (g2,) = torch.autograd.grad(loss, x, torch.tensor(3.0, device=device), retain_graph=True)
    (g3,) = torch.autograd.grad(loss, x, torch.tensor(-2.0, device=device))
    assert torch.equal(g1, kept) and torch.equal(g1, g2)
    torch.testing.assert_close(g3, g1 * (-2.0 / 3.0), atol=1e-7, rtol=1e-6)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(loss, x)
    # loss.backward() twice with retain_graph accumulates twice the gradient.
    x.grad = None
    loss = fusedops.cross_entropy(x * 1.0, t, inplace_grad=inplace_grad)
    loss.backward(retain_graph=True)
    once = x.grad.clone()
    loss.backward()
    torch.testing.assert_close(x.grad, 2 * once)


def test_registered_op_keeps_its_gradient_output():
    """torch.ops.fusedops.cross_entropy with compute_grad=True returns the gradient it saves; a
    backward scales a copy (the public functions, which drop that output, let it scale in place),
    and a create_graph backward on this route, which has no graph to hang its result from,
    raises at once."""
    x, t = _problem("cpu")
    loss, _lse, grad, _bad = torch.ops.fusedops.cross_entropy(x, t, compute_grad=True)
    returned = grad.clone()
    (loss * 3).backward()
    assert torch.equal(grad, returned)
    torch.testing.assert_close(x.grad, 3 * returned)
    loss = torch.ops.fusedops.cross_entropy(x, t, compute_grad=True)[0]
    with pytest.raises(NotImplementedError, match="fusedops.cross_entropy does not support double backward"):
        torch.autograd.grad(loss, x, create_graph=True)


@pytest.mark.parametrize("device", DEVICES)
def test_double_backward_and_weight_grad_raise(device):
    x, t = _problem(device)
    loss = fusedops.cross_entropy(x, t)
    (g,) = torch.autograd.grad(loss, x, create_graph=True)  # create_graph itself works
    _, rg = _ref_grad(x, t, torch.tensor(1.0))
    torch.testing.assert_close(g.double(), rg, atol=1e-6, rtol=1e-5)
    with pytest.raises(NotImplementedError, match="does not support double backward"):
        g.sum().backward()
    w = torch.rand(50, device=device, requires_grad=True)
    with pytest.raises(NotImplementedError, match="gradients with respect to weight are not supported"):
        fusedops.cross_entropy(x, t, weight=w)
    # A detached weight, or no grad mode, is fine.
    fusedops.cross_entropy(x, t, weight=w.detach())
    with torch.no_grad():
        fusedops.cross_entropy(x, t, weight=w)


@pytest.mark.parametrize("device", DEVICES)
def test_registered_op_without_compute_grad(device):
    """torch.ops.fusedops.cross_entropy called with compute_grad=False for logits that need a
    gradient (as under vmap, whose batched logits report requires_grad=False) computes it in
    the backward; with compute_grad=True the forward hands it over."""
    x, t = _problem(device)
    _, rg = _ref_grad(x, t, torch.tensor(2.5))
    for compute_grad in (False, True):
        loss, lse, grad, bad = torch.ops.fusedops.cross_entropy(x, t, compute_grad=compute_grad)
        assert int(bad) == -1 and grad.shape == (x.shape if compute_grad else (0,)) and not lse.requires_grad
        (got,) = torch.autograd.grad(loss, x, torch.tensor(2.5, device=device))
        torch.testing.assert_close(got.double(), rg, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_vmap_forward_and_backward(device, reduction):
    """torch.func.vmap over a batch of problems, and the gradient through it, as torch's."""
    x, t = _problem(device, shape=(3, 4, 9))
    w = torch.rand(9, device=device) + 0.5
    kw = dict(weight=w, reduction=reduction, label_smoothing=0.1)
    got = torch.func.vmap(lambda x, t: fusedops.cross_entropy(x, t, **kw))(x, t)
    xr = x.detach().double().requires_grad_()
    # (torch's own weighted mean cannot be vmapped: its reference is a loop)
    ref = torch.stack([F.cross_entropy(xr[b], t[b], **{**kw, "weight": w.double()}) for b in range(3)])
    torch.testing.assert_close(got.double(), ref, atol=1e-6, rtol=1e-5)
    g = torch.randn_like(ref)
    (grad,) = torch.autograd.grad(got, x, g.to(got.dtype))
    (ref_grad,) = torch.autograd.grad(ref, xr, g)
    torch.testing.assert_close(grad.double(), ref_grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_batched_backward_like_torch(device, reduction):
    """Several vector-Jacobian products at once (is_grads_batched=True, and jacobian with
    vectorize=True): the backward leaves the saved gradient as it is (a batched grad_output
    cannot scale it in place), and every product is torch's."""
    x, t = _problem(device, dtype=torch.float64, shape=(5, 7))
    xr = x.detach().requires_grad_()
    out_shape = (5,) if reduction == "none" else ()
    v = torch.randn(3, *out_shape, dtype=torch.float64, device=device)
    (got,) = torch.autograd.grad(fusedops.cross_entropy(x, t, reduction=reduction), x, v, is_grads_batched=True)
    (want,) = torch.autograd.grad(F.cross_entropy(xr, t, reduction=reduction), xr, v, is_grads_batched=True)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    jac = torch.autograd.functional.jacobian(lambda x: fusedops.cross_entropy(x, t, reduction=reduction), x,
                                             vectorize=True)
    jac_ref = torch.autograd.functional.jacobian(lambda x: F.cross_entropy(x, t, reduction=reduction), xr,
                                                 vectorize=True)
    torch.testing.assert_close(jac, jac_ref, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inplace_grad", [False, True])
def test_saved_gradient_unpacked_with_other_strides(device, inplace_grad):
    """A saved-tensor hook may hand the saved gradient back with other strides (here stored
    transposed, unpacked as a transposed view): the backward, which scales it in place when it
    can, then writes a new tensor, with torch's result."""
    x, t = _problem(device, dtype=torch.float64, shape=(5, 7))
    pack = lambda s: s.t().contiguous() if s.dim() == 2 else s  # noqa: E731
    unpack = lambda s: s.t() if s.dim() == 2 else s  # noqa: E731
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss = fusedops.cross_entropy(x * 1.0, t, inplace_grad=inplace_grad)
    (got,) = torch.autograd.grad(loss, x)
    (want,) = torch.autograd.grad(F.cross_entropy(x, t), x)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("device", DEVICES)
def test_vmap_bad_target_raises_in_the_call(device):
    """A target out of range in one vmapped problem raises in the call on every device (on a GPU
    the flag of each problem is read at once: a deferred record would outlive the transform)."""
    x, t = _problem(device, shape=(3, 4, 9))
    t = t.clamp(min=0)
    t[1, 2] = 11
    pattern = r"^cross_entropy: target(\[2\] = 11 is outside| is out of range at flat index 2 of a problem)"
    with pytest.raises(ValueError, match=pattern):
        torch.func.vmap(lambda x, t: fusedops.cross_entropy(x, t))(x.detach(), t)
    fusedops.cross_entropy(x[0], t[0])  # (nothing deferred is left to raise later)


@pytest.mark.parametrize("device", DEVICES)
def test_no_gradient_buffer_without_grad(device, monkeypatch):
    """The gradient is computed (its buffer allocated) only when the logits need one."""
    seen = []
    real = ce_op._forward_entry

    def spy(*args):
        seen.append(args[8])
        return real(*args)

    monkeypatch.setattr(ce_op, "_forward_entry", spy)
    x, t = _problem(device)
    fusedops.cross_entropy(x.detach(), t)
    with torch.no_grad():
        fusedops.cross_entropy(x, t)
    fusedops.cross_entropy(x, t)
    assert seen == [False, False, True]
    assert torch.ops.fusedops.cross_entropy(x.detach(), t)[2].numel() == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_inplace_grad_mode(device, reduction):
    """inplace_grad=True: the same loss and gradients; the gradient handed to the logits' producer
    is the logits' own memory; the logits' version counter is bumped."""
    x, t = _problem(device, shape=(8, 64))
    w = torch.randn(64, 64, device=device, requires_grad=True)
    logits = x @ w
    ptr = logits.data_ptr()
    seen = []
    logits.register_hook(lambda g: seen.append(g.data_ptr()))
    version = logits._version
    loss = fusedops.cross_entropy(logits, t, reduction=reduction, inplace_grad=True, label_smoothing=0.1)
    assert logits._version > version
    go = torch.rand_like(loss) + 0.5
    gx, gw = torch.autograd.grad(loss, (x, w), go)
    assert seen == [ptr]
    x2, w2 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = reference(x2 @ w2, t, reduction=reduction, label_smoothing=0.1)
    torch.testing.assert_close(loss.double(), ref, atol=1e-4, rtol=1e-5)
    rgx, rgw = torch.autograd.grad(ref, (x2, w2), go.double())
    torch.testing.assert_close(gx.double(), rgx, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(gw.double(), rgw, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_grad_mode_refuses_saved_logits(device):
    """An op that saved the logits would see the gradient instead: autograd raises."""
    x, t = _problem(device)
    logits = x * 1.0
    side = logits.sin().sum()  # sin saves its input
    loss = fusedops.cross_entropy(logits, t, inplace_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + side).backward()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("saved", ["cross_entropy_", "every fusedops op", "all but mm"])
def test_inplace_grad_mode_under_selective_checkpointing(device, saved):
    """Selective activation checkpointing hands back a saved op's outputs on recompute without
    running it: cross_entropy_ (or a copy into the logits) would then leave the recomputed
    logits, which the backward reads as the gradient, unwritten. Under a dispatch mode the public
    function computes out of place; the gradients must be a float64 run's without
    checkpointing, whatever the policy saves."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    g = torch.Generator().manual_seed(3)
    h = torch.randn(16, 32, generator=g).to(device).requires_grad_()
    w = torch.randn(40, 32, generator=g).to(device).requires_grad_()
    t = torch.randint(0, 40, (16,), generator=g).to(device)

    def policy(ctx, op, *args, **kwargs):
        if saved == "cross_entropy_":
            keep = op is torch.ops.fusedops.cross_entropy_.default
        elif saved == "every fusedops op":
            keep = getattr(op, "namespace", None) == "fusedops"
        else:
            keep = op is not torch.ops.aten.mm.default
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    def loss_of(h, w):
        return fusedops.cross_entropy(h @ w.T, t, inplace_grad=True, label_smoothing=0.1)

    contexts = functools.partial(create_selective_checkpoint_contexts, policy, allow_cache_entry_mutation=True)
    loss = checkpoint(loss_of, h, w, use_reentrant=False, context_fn=contexts)
    gh, gw = torch.autograd.grad(loss, (h, w))
    h64, w64 = (v.detach().double().requires_grad_() for v in (h, w))
    ref = reference(h64 @ w64.T, t, label_smoothing=0.1)
    torch.testing.assert_close(loss.double(), ref, atol=1e-5, rtol=1e-5)
    for got, want in zip((gh, gw), torch.autograd.grad(ref, (h64, w64))):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)


def test_inplace_ops_refuse_inference_tensors():
    """As torch's in-place ops: an inference tensor is written only inside inference_mode."""
    with torch.inference_mode():
        logits, grad_logits = torch.randn(6, 10), torch.randn(6, 10)
    t = torch.randint(0, 10, (6,))
    kept = logits.clone(), grad_logits.clone()
    with pytest.raises(RuntimeError, match=r"^fusedops.cross_entropy_: logits is an inference tensor, which cannot"):
        torch.ops.fusedops.cross_entropy_(logits, t, None, -100, "mean", 0.0, 0.0, None)
    with pytest.raises(RuntimeError, match=r"^fusedops.cross_entropy_backward_: grad_logits is an inference tensor"):
        torch.ops.fusedops.cross_entropy_backward_(torch.tensor(2.0), grad_logits)
    assert torch.equal(logits, kept[0]) and torch.equal(grad_logits, kept[1])
    with torch.inference_mode():
        torch.ops.fusedops.cross_entropy_(logits, t, None, -100, "mean", 0.0, 0.0, None)
        torch.ops.fusedops.cross_entropy_backward_(torch.tensor(2.0), grad_logits)
    torch.testing.assert_close(logits, torch.func.grad(lambda x: F.cross_entropy(x, t))(kept[0]))
    torch.testing.assert_close(grad_logits, 2 * kept[1])


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_grad_mode_refuses_user_leaves(device):
    """The in-place mode would overwrite a tensor the user holds: refused for a leaf that requires
    grad and for views of one (as torch refuses in-place ops there), through the public function
    and the registered op; the logits are left as they were. Logits it cannot write into (a
    strided last dimension, an expanded tensor) are refused in the public function's name."""
    x, t = _problem(device)
    kept = x.detach().clone()
    leaf_msg = "logits is a leaf tensor that requires grad, which the in-place gradient mode would overwrite"
    with pytest.raises(RuntimeError, match=r"fusedops.cross_entropy\(inplace_grad=True\): " + leaf_msg):
        fusedops.cross_entropy(x, t, inplace_grad=True)
    with pytest.raises(RuntimeError, match="logits is a view of a leaf tensor that requires grad"):
        fusedops.cross_entropy(x[..., :-1], t.clamp(max=x.shape[-1] - 2), inplace_grad=True)
    with pytest.raises(RuntimeError, match="fusedops::cross_entropy_: " + leaf_msg):
        torch.ops.fusedops.cross_entropy_(x, t, None, -100, "mean", 0.0, 0.0, None)
    assert torch.equal(x.detach(), kept)
    # What the mode cannot write into is refused in the public function's name too.
    for logits, match in (((x * 1.0).t(), r"logits must have a contiguous last dimension \(stride 1\) to receive the "
                                         r"gradient in place, got stride 50"),
                          ((x[:1] * 1.0).expand(6, 50), r"logits has elements that share memory")):
        with pytest.raises(ValueError, match=r"^fusedops.cross_entropy\(inplace_grad=True\): " + match):
            fusedops.cross_entropy(logits, torch.zeros(logits.shape[:-1], dtype=torch.long, device=device),
                                   inplace_grad=True)
    # A view made a leaf afterwards is a leaf itself (its base does not require grad).
    viewed_leaf = kept.clone().view(2, 3, -1).requires_grad_()
    with pytest.raises(RuntimeError, match=leaf_msg):
        fusedops.cross_entropy(viewed_leaf, t.view(2, 3), inplace_grad=True)
    assert torch.equal(viewed_leaf.detach().view_as(kept), kept)
    # A non-leaf (and its views) may be overwritten, and no grad mode needs no autograd at all.
    fusedops.cross_entropy((x * 1.0)[..., :-1], t.clamp(max=x.shape[-1] - 2), inplace_grad=True).backward()
    with torch.no_grad():
        torch.ops.fusedops.cross_entropy_(x, t, None, -100, "mean", 0.0, 0.0, None)
    assert not torch.equal(x.detach(), kept)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_inplace_grad_mode_through_leading_dims_that_do_not_collapse(device, reduction):
    """Five strided leading dimensions do not collapse into the kernels' row layout, so the
    in-place backward scales a copy: the copy must reach the logits' own gradient."""
    g = torch.Generator().manual_seed(7)
    leaf = torch.randn((4, 4, 4, 4, 4, 11), generator=g, dtype=torch.float64).to(device).requires_grad_()
    t = torch.randint(0, 11, (2, 2, 2, 2, 2), generator=g).to(device)
    go = torch.rand((2, 2, 2, 2, 2) if reduction == "none" else (), generator=g, dtype=torch.float64).to(device) + 0.5
    grads = []
    for inplace_grad in (False, True):
        logits = (leaf * 1.0)[::2, ::2, ::2, ::2, ::2]
        loss = fusedops.cross_entropy(logits, t, reduction=reduction, inplace_grad=inplace_grad)
        grads.append(torch.autograd.grad(loss, leaf, go)[0])
    ref = torch.zeros_like(leaf)
    ref[::2, ::2, ::2, ::2, ::2] = _ref_grad(leaf[::2, ::2, ::2, ::2, ::2], t, go, reduction=reduction)[1]
    torch.testing.assert_close(grads[0], ref, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(grads[1], ref, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("shape", [(3, 5, 33), (4, 128256), (2, 262152)], ids=["small", "cluster", "sweep"])
@pytest.mark.parametrize("device", DEVICES)
def test_inplace_op_writes_gradient(device, shape):
    """cross_entropy_ leaves in the logits exactly the gradient cross_entropy returns, and the
    same loss (the target's logit is read before the row is overwritten)."""
    if device == "cpu" and shape != (3, 5, 33):
        pytest.skip("the wide rows exercise the GPU's cluster and sweep kernels")
    x, t = _problem(device, shape=shape, dtype=torch.float32 if shape[-1] == 33 else torch.bfloat16)
    x = x.detach()
    w = torch.rand(shape[-1], device=device)
    for opts in ((w, -100, "sum", 0.2, 0.01, 3.0), (None, -100, "none", 0.0, 0.0, None)):
        expected = torch.ops.fusedops.cross_entropy(x, t, *opts, True)
        y = x.clone()
        got = torch.ops.fusedops.cross_entropy_(y, t, *opts)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        assert torch.equal(y, expected[2])


_INTERPRETER = pytest.mark.skipif(
    HAS_CUDA or os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernel in Triton's interpreter, on a machine without a GPU (the GPU runs it for real "
    "under FUSEDOPS_BACKEND=triton)")
# The registered op on the CPU and on CUDA, and the Triton kernel's entry point in Triton's interpreter.
IMPLS = ["cpu", pytest.param("cuda", marks=gpu), pytest.param("triton-interpreter", marks=_INTERPRETER)]


def _device_and_op(impl):
    if impl == "triton-interpreter":
        return "cpu", ce_op.TRITON_IMPLS["cross_entropy"]
    return impl, torch.ops.fusedops.cross_entropy


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("offset", [1e4, 1e7, 1e30])
def test_large_logits_keep_their_precision(impl, offset):
    """Logits far from zero (every row shifted by `offset`, which cancels in the softmax) give
    the loss and gradient of the unshifted problem to float32's precision, as torch's do: each
    difference is taken from the row's maximum, never from lse once rounded (where float32's
    spacing, 8 at 1e8, swallows log V), and label smoothing's sum of the logits is kept relative
    to the maximum or the target's logit too (with and without class weights: two GPU kernel
    variants; at 1e30 a sum of the logits themselves loses the smoothing term). Widths reach
    every GPU path: one block, a cluster or split blocks (with and without a gradient), the
    sweep."""
    interpreted = impl == "triton-interpreter"
    device, op = _device_and_op(impl)
    g = torch.Generator().manual_seed(0)
    for V in (200,) if interpreted else (1000, 70000, 140000):
        x = (3 * torch.randn(6, V, generator=g) + offset).to(device)
        t = torch.randint(0, V, (6,), generator=g).to(device)
        w = torch.rand(V, generator=g).to(device)
        xd = x.double().requires_grad_()
        for weight, eps in ((None, 0.0), (None, 0.1), (w, 0.1)):
            ref = F.cross_entropy(xd, t, weight=None if weight is None else weight.double(), reduction="none",
                                  label_smoothing=eps)
            (gr,) = torch.autograd.grad(ref.sum(), xd)
            for want_grad in (True, False):
                loss, _, gx, _ = op(x, t, weight, -100, "none", eps, 0.0, None, want_grad)
                torch.testing.assert_close(loss.double(), ref.detach(), atol=1e-5, rtol=1e-5)
                if want_grad:
                    torch.testing.assert_close(gx.double(), gr, atol=1e-3 / V, rtol=1e-4)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_smoothing_with_a_masked_target_like_torch(impl, dtype):
    """A target logit masked to a large negative value (weight 0, or label_smoothing 1, so that
    only the smoothing term is left), down to the dtype's lowest value (a masked_fill with
    finfo.min): the smoothing sum must not be taken relative to that logit, where every
    difference is ~1e30 and the term cancels to 0 (or overflows), nor scaled where it overflows.
    V spans several of the CPU kernel's chunks, so the running maximum moves."""
    interpreted = impl == "triton-interpreter"
    device, op = _device_and_op(impl)
    g = torch.Generator().manual_seed(4)
    V = 300 if interpreted else 5000
    lowest = torch.finfo(dtype).min
    if impl == "cuda" and fusedops.backend_for("cross_entropy", "cuda") == "cuda":
        lowest = -1e35  # (the CUDA kernels' loss is inf there: docs/ops/cross_entropy.md)
    t = torch.tensor([5, 7, V - 1000 if V > 1000 else 100, V - 1, V // 2])
    x = (3 * torch.randn(len(t), V, generator=g)).to(dtype)
    x[torch.arange(len(t)), t] = torch.tensor([-1e4, -1e30, -1e35, lowest, -1e30]).to(dtype)
    x[4, :16] = -1e30  # (other masked logits beside the target's; not the lowest: 16 of those overflow
    # float32's sum, as torch's float32 loss does)
    weight = torch.ones(V).index_fill_(0, t, 0.0)
    for eps, w in ((1.0, None), (0.5, weight)):
        ref = F.cross_entropy(x.double(), t, weight=None if w is None else w.double(), reduction="none",
                              label_smoothing=eps)
        loss = op(x.to(device), t.to(device), None if w is None else w.to(device), -100, "none", eps, 0.0, None,
                  False)[0]
        torch.testing.assert_close(loss.double().cpu(), ref, atol=1e-5, rtol=1e-5)


def _non_finite_rows(V, generator):
    """Rows of V logits whose non-finite values torch turns into a NaN or infinite loss, or
    not: finite; NaN but for the first 16 values (the target's); a span of 64 NaN; all NaN; one
    +inf; -inf but for the target; all -inf; NaN over the first half, the target in the last
    value (a walk over the row meets only NaN first). The other targets lie in the first 16
    columns."""
    x = 3 * torch.randn(8, V, generator=generator)
    t = torch.randint(0, 16, (8,), generator=generator)
    x[1, 16:] = float("nan")
    x[2, V // 2 - 32: V // 2 + 32] = float("nan")
    x[3] = float("nan")
    x[4, V - 1] = float("inf")
    x[5] = float("-inf")
    x[5, t[5]] = 2.0
    x[6] = float("-inf")
    x[7, : V // 2] = float("nan")
    t[7] = V - 1
    return x, t


@pytest.mark.parametrize("impl", IMPLS)
def test_non_finite_logits_like_torch(impl):
    """NaN and infinite logits give torch's losses and gradients, NaN for NaN: a share of a row
    holding only NaN (one thread's values, one block's) must not pass for an empty one, whose
    statistics are (-inf, 0), or the NaN vanishes from the row's sum (every width class of the
    GPU kernels: one block, a cluster or split blocks, the sweep; with label smoothing, class
    weights and softcap, whose kernels take their maximum and sums their own ways)."""
    interpreted = impl == "triton-interpreter"
    device, op = _device_and_op(impl)
    g = torch.Generator().manual_seed(0)
    widths = (64,) if interpreted else (64, 4096, 70000, 140000) if device == "cuda" else (64, 4096)
    dtypes = (torch.float32,) if interpreted else (torch.float32, torch.bfloat16)
    for V, dtype in [(V, dtype) for V in widths for dtype in dtypes]:
        x, t = _non_finite_rows(V, g)
        x, t = x.to(device=device, dtype=dtype), t.to(device)
        w = (0.5 + torch.rand(V, generator=g)).to(device)  # (float32 weights, beside bf16 logits too)
        for eps, cap, weight in ((0.0, None, None), (0.1, None, None), (0.0, 30.0, None), (0.1, 30.0, None),
                                 (0.1, None, w), (0.1, 30.0, w)):
            xd = x.double().requires_grad_()
            wd = None if weight is None else weight.double()
            ref = reference(xd, t, weight=wd, reduction="none", label_smoothing=eps, softcap=cap)
            (gr,) = torch.autograd.grad(ref.sum(), xd)
            for want_grad in (True, False):
                what = (f"V={V} {dtype} label_smoothing={eps} softcap={cap} weighted={weight is not None} "
                        f"grad={want_grad}")
                loss, _, gx, _ = op(x, t, weight, -100, "none", eps, 0.0, cap, want_grad)
                torch.testing.assert_close(loss.double(), ref.detach(), atol=1e-4, rtol=1e-4, equal_nan=True,
                                           msg=lambda m: f"{what}: loss\n{m}")
                if want_grad:
                    rtol = 1e-4 if dtype == torch.float32 else 4e-3  # (the gradient is stored in bf16)
                    torch.testing.assert_close(gx.double(), gr, atol=1e-3 / V, rtol=rtol, equal_nan=True,
                                               msg=lambda m: f"{what}: gradient\n{m}")


@pytest.mark.parametrize("device", DEVICES)
def test_class_weights_at_any_alignment(device):
    """Class weights that are a view one element into a buffer (not 16-byte aligned), with label
    smoothing: the CUDA register kernel loads the weights as 16-byte vectors, so such weights
    take the sweep kernel instead; loss and gradient as with an aligned copy and as torch's."""
    x, t = _problem(device, shape=(6, 4096))
    w = (0.5 + torch.rand(4097)).to(device)[1:]
    assert w.data_ptr() % 16 != 0
    kw = dict(reduction="sum", label_smoothing=0.1, softcap=20.0)
    for weight in (w, w.clone()):
        loss = fusedops.cross_entropy(x, t, weight=weight, **kw)
        (g,) = torch.autograd.grad(loss, x)
        rl, rg = _ref_grad(x, t, torch.ones((), device=device), weight=weight, **kw)
        torch.testing.assert_close(loss.double(), rl, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(g.double(), rg, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_all_ignored_mean_is_nan_like_torch(device):
    x, t = _problem(device)
    t = torch.full_like(t, -100)
    loss = fusedops.cross_entropy(x, t)
    ref = F.cross_entropy(x.detach(), t)
    assert torch.isnan(loss) and torch.isnan(ref)
    loss.backward()
    xr = x.detach().clone().requires_grad_()
    F.cross_entropy(xr, t).backward()
    assert torch.equal(x.grad, xr.grad)  # zeros, as torch's
    assert fusedops.cross_entropy(x, t, reduction="sum").item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", [{}, {"inplace_grad": True}, {"label_smoothing": 0.1, "weighted": True},
                                     {"z_loss": 1e-3}],
                         ids=["plain", "inplace_grad", "smoothing_weights", "z_loss"])
def test_float16_mean_gradient_survives_loss_scaling(device, options):
    """float16 logits, "mean", the loss scaled by 4096 before the backward (a loss scaler): the
    gradient keeps float16's precision (entries p_j / N lie below float16's normal range, and a
    gradient kept already divided by N lost them: a quarter of them 0, median error 1e-1); here
    at least as accurate as torch's float16 path against float64."""
    options = dict(options)
    g = torch.Generator().manual_seed(1)
    x = (2 * torch.randn(512, 2048, generator=g)).half().to(device)
    t = torch.randint(0, 2048, (512,), generator=g).to(device)
    t[::7] = -100
    if options.pop("weighted", False):
        options["weight"] = (torch.rand(2048, generator=g) + 0.5).half().to(device)
    torch_options = {k: v for k, v in options.items() if k in ("weight", "label_smoothing")}
    xo = x.clone().requires_grad_()
    loss = fusedops.cross_entropy(xo * 1.0 if options.get("inplace_grad") else xo, t, **options)
    (loss * 4096).backward()
    xt = x.clone().requires_grad_()
    (F.cross_entropy(xt, t, **torch_options) * 4096).backward()
    xd = x.double().requires_grad_()
    reference_loss = reference(xd, t, **{k: v for k, v in options.items() if k != "inplace_grad"})
    (reference_loss * 4096).backward()
    nonzero = xd.grad != 0

    def error(grad):
        return ((grad.double() - xd.grad).abs()[nonzero] / xd.grad.abs()[nonzero]).median().item()

    assert error(xo.grad) <= max(error(xt.grad), 2e-3), (error(xo.grad), error(xt.grad))
    assert ((xo.grad == 0) & nonzero).float().mean().item() < 1e-3
    torch.testing.assert_close(loss.double(), reference_loss.detach(), atol=0, rtol=2e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_float16_mean_with_nothing_kept_like_torch(device):
    """float16 "mean" where no row counts (all ignored; or every kept target's weight 0): the
    loss is 0 / 0, NaN, and the gradient 0 in ignored rows and NaN in kept ones, as torch's."""
    x, t = _problem(device, dtype=torch.float16)
    for case in ("all ignored", "zero weights"):
        kw = {}
        tc = torch.full_like(t, -100) if case == "all ignored" else t
        if case == "zero weights":
            kw["weight"] = torch.ones(50, device=device, dtype=torch.float16)
            kw["weight"][t[t >= 0]] = 0
        loss = fusedops.cross_entropy(x, tc, **kw)
        (grad,) = torch.autograd.grad(loss, x)
        xr = x.detach().clone().requires_grad_()
        F.cross_entropy(xr.float(), tc, **{k: v.float() for k, v in kw.items()}).backward()
        assert torch.isnan(loss), case
        assert torch.equal(grad.isnan(), xr.grad.isnan()) and (grad[tc == -100] == 0).all(), case


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_zero_weight_mean_like_torch(device, label_smoothing):
    """Weights that are 0 for every kept target: 0 / 0 under "mean", as torch, even where the
    smoothing term alone would be finite / 0 = inf; the kept rows' gradients are NaN and the
    ignored rows' 0, as torch's."""
    x, t = _problem(device)
    w = torch.ones(50, device=device)
    w[t[t >= 0]] = 0
    kw = dict(weight=w, label_smoothing=label_smoothing)
    loss = fusedops.cross_entropy(x, t, **kw)
    (grad,) = torch.autograd.grad(loss, x)
    xr = x.detach().clone().requires_grad_()
    ref = F.cross_entropy(xr, t, **kw)
    ref.backward()
    assert torch.isnan(loss) and torch.isnan(ref)
    assert torch.equal(grad.isnan(), xr.grad.isnan()) and (grad[t == -100] == 0).all()
    assert torch.isnan(fusedops.cross_entropy(x.detach(), t, **kw))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("weight_of_the_absent_class", [float("inf"), float("nan")])
def test_a_class_no_row_targets_may_have_any_weight(impl, weight_of_the_absent_class):
    """Without label smoothing torch reads only the targets' weights, so inverse-frequency weights
    (1 / count: inf for a class no row has) give finite losses and gradients; so do ours, for
    cross_entropy and both linear_cross_entropy modes."""
    device, op = _device_and_op(impl)
    x, t = _problem(device, shape=(6, 9), ignore=False)
    x, t = x.detach(), t % 8  # (class 8 is no row's target)
    w = torch.rand(9, device=device) + 0.5
    w[8] = weight_of_the_absent_class
    ref, ref_grad = _ref_grad(x, t, torch.tensor(1.0), weight=w.double())
    loss, _, grad, _ = op(x, t, w, -100, "mean", 0.0, 0.0, None, True)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-6)
    if impl == "triton-interpreter":
        return
    hidden = torch.randn(6, 5, device=device, dtype=torch.float64, requires_grad=True)
    lm_head = torch.randn(9, 5, device=device, dtype=torch.float64)
    expected = torch.autograd.grad(F.cross_entropy(hidden @ lm_head.T, t, weight=w.double()), hidden)[0]
    for low_memory in (False, True):
        got = fusedops.linear_cross_entropy(hidden, lm_head, t, class_weight=w.double(), low_memory=low_memory)
        torch.testing.assert_close(torch.autograd.grad(got, hidden)[0], expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_million_rows_add_up(device, reduction):
    """2^20 rows: the per-row losses and the mean's weighted denominator are added without
    float32's drift (a running float32 sum is off by about 2e-3 here)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2**20, 2, generator=g).to(device)
    t = torch.randint(0, 2, (2**20,), generator=g).to(device)
    t[::5] = -100
    w = (torch.rand(2, generator=g) + 0.5).to(device)
    loss = fusedops.cross_entropy(x, t, weight=w, reduction=reduction)
    expected = F.cross_entropy(x.double(), t, weight=w.double(), reduction=reduction)
    torch.testing.assert_close(loss.double(), expected, atol=0, rtol=1e-5)


def test_bad_target_cpu():
    x, t = _problem("cpu")
    t[1] = 50
    with pytest.raises(ValueError, match=r"target\[1\] = 50 is outside \[0, 50\) and is not ignore_index \(-100\)"):
        fusedops.cross_entropy(x, t)
    with pytest.raises(ValueError, match=r"target\[1\] = 50 is outside"):
        fusedops.cross_entropy(x, t, check_target=False)  # the CPU kernel always checks


def test_z_loss_and_weights_follow_liger():
    """The z-term is z * lse^2 per row not ignored, unweighted, divided by the count of those rows
    under "mean" (Liger-Kernel's definition) while the weighted cross-entropy is divided by the sum
    of their weights (torch's)."""
    x, t = _problem("cpu", dtype=torch.float64)
    w = torch.rand(50, dtype=torch.float64) + 0.5
    z = 0.1
    got = fusedops.cross_entropy(x, t, weight=w, z_loss=z)
    kept = t != -100
    lse = torch.logsumexp(x.detach(), -1)
    expected = F.cross_entropy(x.detach(), t, weight=w) + (z * lse[kept] ** 2).sum() / kept.sum()
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_float32_weight_with_other_logits(device, dtype):
    """A float32 weight goes with logits of any dtype (read as float32, not as the logits' type)."""
    x, t = _problem(device, dtype=dtype)
    w = torch.rand(50, device=device) + 0.5
    kw = dict(weight=w, label_smoothing=0.2, reduction="sum")
    loss = fusedops.cross_entropy(x, t, **kw)
    tol = 1e-10 if dtype == torch.float64 else 2e-2
    torch.testing.assert_close(loss.double(), reference(x.detach().double(), t, **kw), atol=tol, rtol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_nn_module_drop_in(device):
    """Same constructor (legacy arguments too), state_dict and repr as torch's; the same values
    and gradients for (N, C) inputs; torch's state loads."""
    w = torch.rand(30, device=device) + 0.5
    for kwargs in [{}, {"weight": w}, {"ignore_index": 3, "reduction": "sum"}, {"label_smoothing": 0.2},
                   {"reduction": "none", "weight": w, "label_smoothing": 0.1}, {"size_average": False}]:
        mine, ref = fusedops.nn.CrossEntropyLoss(**kwargs), torch.nn.CrossEntropyLoss(**kwargs)
        assert repr(mine) == repr(ref) and list(mine.state_dict()) == list(ref.state_dict())
        assert mine.reduction == ref.reduction
        mine.load_state_dict(ref.state_dict())
        x = torch.randn(7, 30, device=device, requires_grad=True)
        t = torch.randint(0, 30, (7,), device=device)
        y, y_ref = mine(x, t), ref(x, t)
        torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
        g = torch.rand_like(y)
        torch.testing.assert_close(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(y_ref, x, g)[0],
                                   atol=1e-6, rtol=1e-5)
    extra = fusedops.nn.CrossEntropyLoss(z_loss=1e-4, softcap=30.0)
    assert "z_loss=0.0001" in repr(extra) and "softcap=30.0" in repr(extra)
    # (B, T, V) with the class dimension last, where torch wants (B, V, T).
    x = torch.randn(2, 5, 30, device=device)
    t = torch.randint(0, 30, (2, 5), device=device)
    torch.testing.assert_close(fusedops.nn.CrossEntropyLoss()(x, t), F.cross_entropy(x.transpose(1, 2), t))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inplace_grad", [False, True])
def test_compile_shifted_labels_no_graph_break(device, inplace_grad):
    """A causal-LM loss (shifted rows of (B, T, V) logits) under torch.compile(fullgraph=True):
    no graph break, the eager values and gradients (the in-place mode is ignored there)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    def lm_loss(h, w, labels):
        logits = h @ w
        return fusedops.cross_entropy(logits[:, :-1], labels[:, 1:], z_loss=1e-3, inplace_grad=inplace_grad)

    h = torch.randn(2, 6, 16, device=device, requires_grad=True)
    w = torch.randn(16, 40, device=device, requires_grad=True)
    labels = torch.randint(0, 40, (2, 6), device=device)
    compiled = torch.compile(lm_loss, fullgraph=True)
    got = compiled(h, w, labels)
    expected = lm_loss(h, w, labels)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(torch.autograd.grad(got, (h, w)), torch.autograd.grad(expected, (h, w)))
    assert not counters["graph_break"], dict(counters["graph_break"])


# ---- GPU ------------------------------------------------------------------------------------

# Widths: one block's registers (32000 bf16), clusters of 8 (128256 at 4 vectors a thread,
# 256000 at 8), past a cluster (the sweep kernel), and widths no vector divides (the sweep's
# scalar accesses).
WIDE = [32000, 128256, 256000, 262152, 32001, 131073]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("V", WIDE)
@pytest.mark.parametrize("ls_z_cap_w", [(0.0, 0.0, None, False), (0.1, 1e-4, 30.0, True), (0.0, 1e-4, 30.0, True),
                                        (0.1, 0.0, 30.0, False)],
                         ids=["plain", "options", "softcap-weight", "softcap-smoothing"])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu)])
def test_wide_rows(device, V, dtype, ls_z_cap_w):
    """Every option set the CUDA kernels compile apart (plain; softcap, with class weights or
    with unweighted smoothing; class-weighted smoothing) at every width class."""
    ls, z, cap, weighted = ls_z_cap_w
    x = (3 * torch.randn(5, V, device=device)).to(dtype).requires_grad_()
    t = torch.randint(0, V, (5,), device=device)
    t[2] = -100
    w = torch.rand(V, device=device) + 0.5 if weighted else None
    kw = dict(weight=w, reduction="sum", label_smoothing=ls, z_loss=z, softcap=cap)
    loss = fusedops.cross_entropy(x, t, **kw)
    go = torch.tensor(1.5, device=device)
    (g,) = torch.autograd.grad(loss, x, go)
    rl, rg = _ref_grad(x, t, go, **kw)
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(loss.double(), rl, atol=tol * V ** 0.5, rtol=tol)
    with torch.no_grad():
        torch.testing.assert_close(fusedops.cross_entropy(x, t, **kw).double(), rl, atol=tol * V ** 0.5, rtol=tol)
    norm = rg.abs().max().item()
    torch.testing.assert_close(g.double() / norm, rg / norm, atol=tol / 2, rtol=2 * tol)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu)])
def test_bad_target_gpu(device):
    """Eager: a ValueError naming the value, raised by the next call once the GPU has finished
    (check_target=True, no sync) or by the call itself ("sync"). check_target=False, CUDA-graph
    capture: no error, the bad row's loss is NaN and nothing is read out of bounds
    (compute-sanitizer runs this test)."""
    x, t = _problem(device, shape=(2, 3, 64))
    t[1, 2] = 1000
    good = t.clone()
    good[1, 2] = 3
    message = r"target\[1, 2\] = 1000 is outside \[0, 64\) and is not ignore_index"
    with pytest.raises(ValueError, match=message):
        fusedops.cross_entropy(x, t, check_target="sync")
    loss = fusedops.cross_entropy(x, t)  # returns: the check is deferred
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=message + r".*found after that earlier call returned"):
        fusedops.cross_entropy(x, good)
    fusedops.cross_entropy(x, good)  # reported once
    torch.cuda.synchronize()
    fusedops.cross_entropy(x, good)
    # A backward after the GPU finished raises too; so does the module.
    loss = fusedops.nn.CrossEntropyLoss()(x, t)
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=message):
        loss.backward()
    with pytest.raises(ValueError, match="check_target must be True, False or 'sync', got 'yes'"):
        fusedops.cross_entropy(x, good, check_target="yes")
    with pytest.raises(ValueError, match="check_target must be True, False or 'sync'"):
        fusedops.nn.CrossEntropyLoss(check_target="later")
    t2 = t.clone()
    t2[1, 2] = -7
    with pytest.raises(ValueError, match=r"target\[1, 2\] = -7 is outside"):
        fusedops.cross_entropy(x.detach().clone().requires_grad_() * 1.0, t2, inplace_grad=True, check_target="sync")
    loss = fusedops.cross_entropy(x, t, reduction="none", check_target=False)
    assert torch.isnan(loss[1, 2]) and torch.isfinite(loss[0]).all()
    (g,) = torch.autograd.grad(loss.sum(), x)
    assert torch.isnan(g[1, 2]).all() and torch.isfinite(g[0]).all()
    big = torch.full((4,), 2**40, device=device, dtype=torch.int64)
    xs = torch.randn(4, 128256, device=device, dtype=torch.bfloat16)
    assert torch.isnan(fusedops.cross_entropy(xs, big, check_target=False))
    graph = torch.cuda.CUDAGraph()
    fusedops.cross_entropy(x.detach(), t, check_target=False)  # warm up
    with torch.cuda.graph(graph):
        out = fusedops.cross_entropy(x.detach(), t)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isnan(out)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu)])
def test_peak_memory(device):
    """Past the logits, forward+backward allocates one logits-sized gradient buffer, and none in
    the in-place mode (the lm_head's own gradients, and per-row statistics, aside)."""
    N, d, V = 2048, 64, 32000
    t = torch.randint(0, V, (N,), device=device)
    # (warm-up: the backward's cuBLAS workspace, allocated on first use, is not the op's memory)
    hw = torch.randn(N, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    ww = torch.randn(d, V, device=device, dtype=torch.bfloat16, requires_grad=True)
    fusedops.cross_entropy(hw @ ww, t).backward()
    del hw, ww
    for inplace in (False, True):
        h = torch.randn(N, d, device=device, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(d, V, device=device, dtype=torch.bfloat16, requires_grad=True)
        logits = h @ w
        size = logits.numel() * logits.element_size()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = fusedops.cross_entropy(logits, t, inplace_grad=inplace)
        del logits
        loss.backward()
        peak = torch.cuda.max_memory_allocated() - base
        params = (h.numel() + w.numel()) * 2
        budget = (0 if inplace else size) + params + 64 * N + (4 << 20)
        assert peak <= budget, (inplace, peak, budget, size)


# Widths that pick each CUDA kernel: one block per row at 1, 2 and 8 vectors a thread (bf16),
# clusters of 2, 4 (LLaMA-3's vocabulary) and 8 blocks, and a width no vector divides (swept).
# 300 rows: more than the persistent grid has blocks or clusters, so each walks several rows,
# some ignored, ending on either of the two rows it holds.
CE_CUDA_WIDTHS = [4096, 8000, 32000, 40960, 128256, 262144, 262143]


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu)])
@pytest.mark.parametrize("options", [False, True], ids=["plain", "options"])
@pytest.mark.parametrize("V", CE_CUDA_WIDTHS)
def test_rows_of_every_kernel_width(device, V, options):
    """Losses, lse and gradients (a separate buffer, in place, and none) of 300 bf16 rows against
    fp64, for every width class of the CUDA kernels (the Triton backend runs it too)."""
    R = 300
    g = torch.Generator(device=device).manual_seed(V)
    x = (3 * torch.randn(R, V, device=device, generator=g)).to(torch.bfloat16)
    t = torch.randint(0, V, (R,), device=device, generator=g)
    t[::7] = -100
    smoothing, z, cap = (0.1, 1e-3, 20.0) if options else (0.0, 0.0, None)
    xd = x.double().requires_grad_()
    expected = reference(xd, t, reduction="none", label_smoothing=smoothing, z_loss=z, softcap=cap)
    (expected_grad,) = torch.autograd.grad(expected.sum(), xd)
    capped = xd.detach() if cap is None else cap * torch.tanh(xd.detach() / cap)
    args = (None, -100, "none", smoothing, z, cap)

    loss, lse, grad, _bad = torch.ops.fusedops.cross_entropy(x, t, *args, True)
    torch.testing.assert_close(loss.double(), expected, atol=1e-4, rtol=1e-4)
    kept = t != -100
    torch.testing.assert_close(lse[kept].double(), torch.logsumexp(capped[kept], -1), atol=1e-4, rtol=1e-4)
    scale = expected_grad.abs().amax()
    torch.testing.assert_close(grad.double() / scale, expected_grad / scale, atol=8e-3, rtol=0)
    # Without a gradient (rows wider than a block: split_kernel's slices, merged in another order
    # than the row kernel's, so equal to rounding) and with the gradient written over the logits
    # (the same kernel: the same bits).
    loss_ng, lse_ng = torch.ops.fusedops.cross_entropy(x, t, *args, False)[:2]
    torch.testing.assert_close(loss_ng.double(), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(loss_ng, loss, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(lse_ng[kept], lse[kept], atol=2e-6, rtol=2e-6)
    xi = x.clone()
    torch.testing.assert_close(torch.ops.fusedops.cross_entropy_(xi, t, *args)[0], loss, atol=0, rtol=0)
    torch.testing.assert_close(xi, grad, atol=0, rtol=0)


# ---- the slice ops (linear_cross_entropy's low-memory mode) ------------------------------------


def _slices(V, width):
    return [(v0, min(V, v0 + width)) for v0 in range(0, V, width)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("options", [{}, {"label_smoothing": 0.1, "z_loss": 0.01, "softcap": 4.0,
                                          "weighted": True},
                                     {"label_smoothing": 0.2}], ids=["plain", "all", "smoothing"])
@pytest.mark.parametrize("width", [1, 7, 16, 53])
def test_slices_give_cross_entropy(device, dtype, options, width):
    """Statistics gathered slice by slice (cross_entropy_slice_stats_), finished per row, and the
    gradient written slice by slice (cross_entropy_slice_grad_) give cross_entropy's loss and
    gradient on the whole rows, for a per-row grad_output; slices of 1 class, ragged ones, one
    slice wider than a 16-byte vector, and the whole row at once."""
    from fusedops.ops.linear_cross_entropy import _finish_rows

    opts = dict(options)
    weighted = opts.pop("weighted", False)
    ls, z, cap = opts.get("label_smoothing", 0.0), opts.get("z_loss", 0.0), opts.get("softcap")
    R, V = 9, 53
    x, t = _problem(device, dtype, (R, V))
    t[2] = 52
    cw = (0.5 + torch.rand(V)).to(device) if weighted else None
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    stats = torch.zeros(R, 4, dtype=acc, device=device)
    stats[:, 0] = float("-inf")
    logits = x.detach().clone()
    for v0, v1 in _slices(V, width):
        ce_op.slice_stats_(logits[:, v0:v1].contiguous(), t, cw, v0, -100, cap, ls > 0, stats)
    go = torch.rand(R, device=device, dtype=acc) + 0.5
    for reduction in ("none", "sum", "mean"):
        g_out = go if reduction == "none" else go[0]
        loss, coefs = _finish_rows(stats, t, cw, V, -100, reduction, ls, z, g_out, acc)
        exp_loss, _lse, exp_grad, _bad = ce_op.forward(x.detach(), t, cw, -100, reduction, ls, z, cap, True)
        exp_grad = exp_grad.to(acc) * (g_out[:, None] if reduction == "none" else g_out)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype != torch.bfloat16 else dict(atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(loss, exp_loss.to(acc), **tol)
        grad = torch.empty_like(logits)
        for v0, v1 in _slices(V, width):
            part = logits[:, v0:v1].clone()
            ce_op.slice_grad_(part, t, cw, v0, -100, cap, ls > 0, coefs)
            grad[:, v0:v1] = part
        torch.testing.assert_close(grad.to(acc), exp_grad, **tol)
        assert (grad[t == -100] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_slice_ops_opcheck_and_errors(device):
    """opcheck over both slice ops (float32, a strided slice of a wider buffer, int32 targets,
    float32 class weights with bf16 logits), and their argument errors, each message asserted."""
    base = torch.randn(6, 40, device=device)
    t = torch.tensor([0, 5, -100, 39, 12, 7], device=device, dtype=torch.int32)
    stats = torch.zeros(6, 4, device=device)
    stats[:, 0] = float("-inf")
    coefs = torch.rand(6, 4, device=device)
    cw = torch.rand(40, device=device)
    for logits, w in ((base[:, 8:24], cw), (base.bfloat16()[:, :16].contiguous(), cw), (base[:, :5], None)):
        torch.library.opcheck(ce_op.slice_stats_, (logits, t, w, 8, -100, 3.0, True, stats.clone()))
        torch.library.opcheck(ce_op.slice_grad_, (logits.clone(), t, w, 8, -100, None, True, coefs))
    x = base[:, :16].contiguous()

    def slice_args(logits=x, target=t, weight=None, start=0, cap=None, state=stats):
        return (logits, target, weight, start, -100, cap, False, state)

    cases = [
        (slice_args(logits=base[0]), r"logits must be 2-D \(rows, a slice of the classes\)"),
        (slice_args(logits=x.int()), r"logits dtype must be float32, bfloat16, float16 or float64"),
        (slice_args(logits=base[:, ::2]), r"logits must have a contiguous last dimension"),
        (slice_args(target=t.float()), r"target dtype must be int64 or int32, got float32"),
        (slice_args(target=t[:5]), r"target must have shape \[6\] \(one class index per row"),
        (slice_args(start=-1), r"class_start must be >= 0, got -1"),
        (slice_args(weight=cw, start=30),
         r"weight must be a 1-D tensor of the class weights of every class, at least class_start \+ "
         r"logits.size\(1\) = 46"),
        (slice_args(weight=cw.half()), r"weight dtype float16 does not go with logits dtype float32"),
        (slice_args(cap=0.0), r"softcap must be a finite number > 0 \(or None\), got 0"),
        (slice_args(cap=1e39), r"softcap must be at most float32's largest value, 3.40282e\+38, got 1e\+39"),
        (slice_args(state=stats[:, :3]), r"stats must have shape \[6, 4\], got shape \[6, 3\]"),
        (slice_args(state=stats.double()), r"stats dtype must be float32 for float32 logits"),
        (slice_args(state=stats.t().contiguous().t()), r"stats must be contiguous"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match="cross_entropy_slice_stats_: " + match):
            ce_op.slice_stats_(*args)
    with pytest.raises(ValueError, match=r"cross_entropy_slice_grad_: coefs must have shape \[6, 4\]"):
        ce_op.slice_grad_(x, t, None, 0, -100, None, False, coefs[:4])
    with pytest.raises(ValueError, match=r"cross_entropy_slice_grad_: logits has elements that share memory"):
        ce_op.slice_grad_(*slice_args(logits=torch.zeros(1, 16, device=device).expand(6, 16), state=coefs))
