"""How the ops run on DTensors (torch.distributed.tensor): tensor and sequence parallelism.

A norm or a gated activation computes each row on its own, so a tensor sharded over any of its
leading dimensions runs as it is: every rank runs the op on its own rows, the parameters are
replicated, and a parameter's gradient is each rank's partial sum (``Partial``), reduced by
DTensor when it is needed, as torch's own norms do under ``SequenceParallel``. A gated
activation is elementwise, so its feature dimension may be sharded too (the intermediate
dimension of a column-wise parallel gate and up projection); the packed form's may not, as its
halves would land on different ranks. Anything else is replicated first, by DTensor.

``RULES`` below holds each op's rule: from the arguments' shapes, the placements it accepts
(DTensor's ``register_sharding``). The norms and gated activations name the role of every
argument and output (``_rowwise``; the forward ops' roles in ops/_roles.py, which the vmap
rules read too); rope shards q and k over the batch, the heads (where
every rank gets whole groups of q heads with their k head) or the sequence, with cos and sin
following.

The in-place forms (``add_rms_norm_``, ``rope_``) have no rule: DTensor takes an op whose name
ends in ``_`` to update its first argument and return it, which neither does (add_rms_norm_
updates its second, rope_ returns the first bad position), so DTensor refuses them with its "no
sharding strategy" error rather than return the wrong tensor. Nor do the losses: a loss over
sharded rows or a vocabulary-parallel loss needs reductions of its own.

The rules are registered when torch.distributed.tensor is imported (by the user, or already
before fusedops): importing it takes about 0.4 s, which ``import fusedops`` should not cost
those who never shard.
"""

import warnings

import torch

from . import _on_import
from ._roles import EMPTY, FORWARD, OTHER, PARAM, PARAM_GRAD, ROW, STAT

_DTENSOR = "torch.distributed.tensor"

_fusedops = torch.ops.fusedops


def _rowwise(roles, feature_dim=False):
    """The rule of an op whose outputs and arguments have the roles named: ``roles`` is (a role
    per output, a role per schema argument), or a function of the arguments returning that.
    Every tensor replicated, or the rows sharded over one leading dimension (``feature_dim``: or
    over the last, for an elementwise op)."""

    def strategies(*args):
        from torch.distributed.tensor import Partial, Replicate, Shard

        outs, ins = roles(*args) if callable(roles) else roles
        rows = next(a for role, a in zip(ins, args) if role == ROW)
        dims = range(rows.ndim if feature_dim else rows.ndim - 1)
        found = []
        for d in [None, *dims]:
            sharded = Replicate() if d is None else Shard(d)
            by_role = {
                ROW: sharded,
                STAT: sharded,
                PARAM: Replicate(),
                EMPTY: Replicate(),
                PARAM_GRAD: Replicate() if d is None else Partial(),
            }
            # (args: the arguments as called, which may leave out trailing ones with defaults)
            placed = [None if role == OTHER or a is None else by_role[role] for role, a in zip(ins, args)]
            found.append(([by_role[role] for role in outs], placed))
        return found

    return strategies


# A rule may look at the tensors' presence, shapes and dtypes, never at the other arguments:
# DTensor caches a rule's answer by the tensors' specs alone (register_sharding counts the
# arguments from the first int one on as part of the key, and these ops have none). So a
# parameter's gradient is a partial sum whenever the parameter is given, also when it comes
# back empty because it was not asked for (a partial sum of nothing).


def _grad_of(param):
    return EMPTY if param is None else PARAM_GRAD


def _rms_norm_backward(grad_output, saved, weight, *_):
    return ROW + _grad_of(weight), "xxws---"


def _add_rms_norm_backward(grad_output, grad_residual_out, residual_out, weight, *_):
    # grad_residual is empty when grad_input serves residual too (the same dtype)
    grad_residual = EMPTY if residual_out.tensor_meta.dtype == grad_output.tensor_meta.dtype else ROW
    return ROW + grad_residual + _grad_of(weight), "xxxws--"


def _layer_norm_backward(grad_output, input, weight, bias, *_):
    return ROW + _grad_of(weight) + _grad_of(bias), "xxwwss--"


def _rope_placements(d, cos, position_ids):
    """The placements of q and k (B, H, S, D) sharded over dimension d (None: replicated), of
    cos and sin, and of position_ids. Tables indexed by position_ids are replicated, and so
    are the positions: the op reports the first bad position by its index, which must mean the
    same on every rank, so with position_ids only the heads are sharded."""
    from torch.distributed.tensor import Replicate, Shard

    positions = None if position_ids is None else Replicate()
    if d is None:
        return Replicate(), Replicate(), positions
    if d == 1:
        return Shard(1), Replicate(), positions
    # cos (1 or B, S, R): sharded with q over the batch (unless it is one for all) or the sequence
    table = Shard(1) if d == 2 else Shard(0) if cos.shape[0] > 1 else Replicate()
    return Shard(d), table, positions


def _rope_dims(q, k, position_ids):
    """The dimensions q and k may stay sharded over (None: replicated): the heads only where
    every rank then holds whole groups of q heads with their k head (grouped-query attention:
    Hq = 6 and Hk = 3 split in two are 3 and 2 heads on one rank, which no kernel can pair)."""
    heads = q is None or k is None or q.shape[1] == k.shape[1] or k.shape[1] % q.mesh.size() == 0
    dims = [None, 1] if position_ids is not None else [None, 0, 1, 2]
    return dims if heads else [d for d in dims if d != 1]


def _rope(q, k, cos, sin, position_ids=None, *_):
    from torch.distributed.tensor import Replicate

    found = []
    for d in _rope_dims(q, k, position_ids):
        qk, table, positions = _rope_placements(d, cos, position_ids)
        # (bad_position, the first bad position or -1: the same on every rank)
        found.append(([qk, qk, Replicate()], [qk, qk, table, table, positions]))
    return found


def _rope_backward(grad_q_out, grad_k_out, cos, sin, position_ids, *_):
    from torch.distributed.tensor import Replicate

    found = []
    for d in _rope_dims(grad_q_out, grad_k_out, position_ids):
        qk, table, positions = _rope_placements(d, cos, position_ids)
        grads = [None if g is None else qk for g in (grad_q_out, grad_k_out)]
        # (an absent incoming gradient: that output is empty)
        outs = [Replicate() if g is None else qk for g in (grad_q_out, grad_k_out)]
        found.append((outs, grads + [table, table, positions]))
    return found


# op -> its sharding rule: (the op's arguments as called) -> [(outputs' placements, arguments'
# placements)], the strategies register_sharding takes.
RULES = {
    **{op: _rowwise((outs, ins), feature_dim) for op, (outs, ins, feature_dim) in FORWARD.items()},
    _fusedops.rms_norm_backward.default: _rowwise(_rms_norm_backward),
    _fusedops.add_rms_norm_backward.default: _rowwise(_add_rms_norm_backward),
    _fusedops.layer_norm_backward.default: _rowwise(_layer_norm_backward),
    _fusedops.swiglu_backward.default: _rowwise(("xx", "xxx"), feature_dim=True),
    _fusedops.geglu_backward.default: _rowwise(("xx", "xxx-"), feature_dim=True),
    _fusedops.swiglu_packed_backward.default: _rowwise(("x", "xx")),
    _fusedops.geglu_packed_backward.default: _rowwise(("x", "xx-")),
    _fusedops.rope.default: _rope,
    _fusedops.rope_backward.default: _rope_backward,
}


def register_all() -> None:
    """Registers every rule; a failure (an experimental API that changed in some torch) warns
    instead of raising: it must not break the user's import of torch.distributed.tensor."""
    try:
        from torch.distributed.tensor.experimental import register_sharding

        for op, rule in RULES.items():
            register_sharding(op)(rule)
    except Exception as e:  # noqa: BLE001  (see above)
        warnings.warn(
            f"fusedops: its DTensor sharding rules could not be registered ({type(e).__name__}: {e}); "
            "fusedops ops will refuse DTensor inputs",
            stacklevel=2,
        )


def register_when_dtensor_is_imported() -> None:
    if not torch.distributed.is_available():
        return
    _on_import.when_imported(_DTENSOR, register_all)
