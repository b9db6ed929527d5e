"""The role of each argument and output of the row-wise ops, one character each: what the
DTensor sharding rules (ops/_sharding.py) and the vmap batching rules (ops/_batching.py) both
read. A norm or a gated activation computes each row on its own, so whatever splits the rows
(shards over a leading dimension, a vmapped batch) splits its row arguments and its per-row
statistics alike, and leaves its parameters whole."""

import torch

ROW = "x"  # shares the input's leading dimensions
STAT = "s"  # one value per row (the input's leading dimensions)
PARAM = "w"  # a parameter over the last dimension
PARAM_GRAD = "g"  # a parameter's gradient: a sum over the rows
EMPTY = "0"  # an output the op returns empty (a gradient not asked for, or served by another)
OTHER = "-"  # not a tensor, or an absent optional tensor

_fusedops = torch.ops.fusedops

# The out-of-place forward ops: op -> (a role per output, a role per schema argument, whether
# the op is elementwise, so that its last dimension may be split too).
FORWARD = {
    _fusedops.rms_norm.default: ("xs", "xw----", False),
    _fusedops.add_rms_norm.default: ("xxs", "xxw---", False),
    _fusedops.layer_norm.default: ("xss", "xww-", False),
    _fusedops.swiglu.default: ("x", "xx", True),
    _fusedops.geglu.default: ("x", "xx-", True),
    _fusedops.swiglu_packed.default: ("x", "x", False),
    _fusedops.geglu_packed.default: ("x", "x-", False),
}
