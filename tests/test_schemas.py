"""The schema list is the library's ABI: freeze it, so every change is a deliberate diff.
Regenerate after an intended change with: EXPECTTEST_ACCEPT=1 python -m pytest tests/test_schemas.py"""

import expecttest
import torch

import fusedops  # noqa: F401


def _schemas():
    ops = []
    for name in sorted(torch._C._dispatch_get_all_op_names()):
        if name.startswith("fusedops::"):
            ops.append(str(torch._C._get_schema(name, "")))
    return "\n".join(ops) + "\n"


class TestSchemas(expecttest.TestCase):
    def test_schema_list(self):
        self.assertExpectedInline(_schemas(), """\
fusedops::layer_norm(Tensor input, Tensor? weight, Tensor? bias, float eps) -> (Tensor output, Tensor mean, Tensor rstd)
fusedops::layer_norm_backward(Tensor grad_output, Tensor input, Tensor? weight, Tensor? bias, Tensor mean, Tensor rstd, bool weight_requires_grad, bool bias_requires_grad) -> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)
fusedops::rms_norm(Tensor input, Tensor? weight, float eps) -> (Tensor output, Tensor rstd)
fusedops::rms_norm_backward(Tensor grad_output, Tensor input, Tensor? weight, Tensor rstd, bool weight_requires_grad) -> (Tensor grad_input, Tensor grad_weight)
""")
