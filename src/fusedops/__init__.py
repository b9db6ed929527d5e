"""fusedops: fused PyTorch operators for LLM training and inference.

    import fusedops
    y = fusedops.rms_norm(x, weight, eps=1e-6)          # functional
    y = fusedops.layer_norm(x, weight, bias, eps=1e-5)
    h = fusedops.swiglu(gate, up)                       # silu(gate) * up (geglu: gelu)
    y, residual = fusedops.add_rms_norm(x, residual, weight)  # residual-add + norm, one pass
    y, rstd = torch.ops.fusedops.rms_norm(x, weight, 1e-6)  # the registered op
    norm = fusedops.nn.RMSNorm(4096)                    # drop-in module
    q, k = fusedops.rope(q, k, cos, sin)                 # rotary embeddings of q and k, one launch
    loss = fusedops.cross_entropy(logits, target)        # loss and gradient from one read of the logits

`python -m fusedops` prints the build record, the backend of every op and a self-check.
"""

from . import _native

# (which backend serves CUDA tensors is backend_for's answer: a GPU the CUDA kernels have no
# code for switches to Triton when CUDA initialises, after this)
_native.load()
build_info = _native.build_info

from . import ops  # noqa: E402  (registers fake kernels, autograd and autocast rules)
from . import nn  # noqa: E402
from .functional import add_rms_norm, add_rms_norm_, layer_norm, rms_norm  # noqa: E402
from .functional import geglu, geglu_packed, rope, rope_, swiglu, swiglu_packed  # noqa: E402
from .functional import cross_entropy  # noqa: E402
from .functional import linear_cross_entropy  # noqa: E402
from .ops import OPS, backend_for  # noqa: E402

__version__ = "0.1.0.dev0"
__all__ = [
    "rms_norm", "add_rms_norm", "add_rms_norm_", "layer_norm", "swiglu", "geglu", "swiglu_packed", "geglu_packed",
    "rope", "rope_", "cross_entropy", "linear_cross_entropy", "nn", "ops", "OPS", "backend_for", "build_info", "__version__",
]
