"""How the ops run under torch.vmap (torch.func.vmap): batching rules.

Without a rule of its own an op under vmap runs torch's fallback: one call per sample, and a
warning asking for a rule. The norms and gated activations need no loop: they treat each row
on its own, so the vmapped dimension is just one more leading dimension of their rows. Their
rule (``_rowwise``, from the roles in ops/_roles.py) moves it to the front of each row
argument (a view: the kernels take leading strides), broadcasts a row argument that is not
batched along it (a stride-0 view, no copy), calls the op once, and returns its row outputs and
per-row statistics batched at dimension 0. Each row goes through the same kernels as under the
fallback.

A batched parameter (say, an ensemble of models whose weights are stacked, through
torch.func.functional_call) gives every sample its own weight, which one call cannot take: those
calls loop over the samples as the fallback would, without its warning.

rope's q and k (B, H, S, D) take the vmapped dimension into their batch, (V, B) as V * B, where
that is a view and every sample shares the cos/sin rows (one for all B, or tables indexed by
positions shared likewise): one call, whose bad-position flag is every sample's. Otherwise it
loops over the samples.

The in-place forms (``add_rms_norm_``, ``rope_``) and the losses have no rule: they keep torch's
fallback (which refuses the in-place forms). The backward ops have none either: vmap reaches
them only through torch.func's reverse-mode transforms, which cannot differentiate these ops
(docs/design.md).
"""

import torch

from ._roles import FORWARD, PARAM, ROW


def _per_sample(op, batch_size, in_dims, args):
    """op on each sample (a batched argument's slice at its batched dimension), the results
    stacked at dimension 0."""
    results = [
        op(*(a if d is None else a.select(d, i) for a, d in zip(args, in_dims))) for i in range(batch_size)
    ]
    if isinstance(results[0], torch.Tensor):
        return torch.stack(results), 0
    return tuple(torch.stack(outs) for outs in zip(*results)), (0,) * len(results[0])


def _sample_shape(t, dim):
    """The shape of one sample of `t`, batched at `dim` (None: not batched)."""
    shape = list(t.shape)
    if dim is not None:
        del shape[dim]
    return shape


def _batch_first(t, dim, batch):
    """`t` with its batched dimension `dim` moved to the front, or broadcast along a new one of
    `batch` (stride 0) where it is not batched: a view either way."""
    return t.expand(batch, *t.shape) if dim is None else t.movedim(dim, 0)


def _rowwise(op, outs, ins):
    """The batching rule of a row-wise op whose arguments have the roles `ins` and whose outputs
    all share the rows (roles x and s)."""

    def rule(info, in_dims, *args):
        batch = info.batch_size
        if any(d is not None for role, d in zip(ins, in_dims) if role == PARAM):
            if batch > 0:
                return _per_sample(op, batch, in_dims, args)
            # No samples, so no rows: any parameter of a sample's shape gives the empty outputs.
            args = [a.new_empty(_sample_shape(a, d)) if role == PARAM and d is not None else a
                    for role, d, a in zip(ins, in_dims, args)]
        call_args = []
        for role, d, a in zip(ins, in_dims, args):
            if role == ROW:
                a = _batch_first(a, d, batch)
            call_args.append(a)
        return op(*call_args), 0 if len(outs) == 1 else (0,) * len(outs)

    return rule


def _merged(t):
    """t (V, B, ...) as (V * B, ...) without a copy, or None where its strides do not allow it."""
    try:
        return t.view(t.shape[0] * t.shape[1], *t.shape[2:])
    except RuntimeError:
        return None


def _rope(info, in_dims, q, k, cos, sin, position_ids=None, interleaved=False):
    op = torch.ops.fusedops.rope.default
    batch = info.batch_size
    args = (q, k, cos, sin, position_ids, interleaved)
    in_dims = tuple(in_dims) + (None,) * (len(args) - len(in_dims))  # (defaults left out)
    dq, dk, dcos, dsin, dpos = in_dims[:5]
    per_row = cos if position_ids is None else position_ids  # (1 or B, S, ...)
    if dcos is None and dsin is None and dpos is None and per_row.dim() > 0 and per_row.shape[0] == 1:
        qv, kv = _batch_first(q, dq, batch), _batch_first(k, dk, batch)
        qm, km = _merged(qv), _merged(kv)
        if qm is not None and km is not None:
            q_out, k_out, bad = op(qm, km, cos, sin, position_ids, interleaved)
            return (q_out.unflatten(0, qv.shape[:2]), k_out.unflatten(0, kv.shape[:2]), bad), (0, 0, None)
    if batch > 0:
        return _per_sample(op, batch, in_dims, args)
    # No samples: the outputs are q's and k's samples' shapes (and a flag each), of none.
    none = (q.new_empty((0, *_sample_shape(q, dq))), k.new_empty((0, *_sample_shape(k, dk))),
            q.new_empty((0,), dtype=torch.int64))
    return none, (0, 0, 0)


# op -> its batching rule: the out-of-place row-wise forward ops and rope.
RULES = {
    **{op: _rowwise(op, outs, ins) for op, (outs, ins, _) in FORWARD.items()},
    torch.ops.fusedops.rope.default: _rope,
}


def register_all() -> None:
    for op, rule in RULES.items():
        torch.library.register_vmap(op, rule)
