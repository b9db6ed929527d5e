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
fusedops::add_rms_norm(Tensor input, Tensor residual, Tensor? weight, float eps, float offset=0., bool cast_before_weight=False) -> (Tensor output, Tensor residual_out, Tensor rstd)
fusedops::add_rms_norm_(Tensor input, Tensor(a!) residual, Tensor? weight, float eps, float offset=0., bool cast_before_weight=False) -> (Tensor output, Tensor rstd)
fusedops::add_rms_norm_backward(Tensor grad_output, Tensor? grad_residual_out, Tensor residual_out, Tensor? weight, Tensor rstd, float offset, bool weight_requires_grad) -> (Tensor grad_input, Tensor grad_residual, Tensor grad_weight)
fusedops::cross_entropy(Tensor logits, Tensor target, Tensor? weight=None, int ignore_index=-100, str reduction="mean", float label_smoothing=0., float z_loss=0., float? softcap=None, bool compute_grad=False) -> (Tensor loss, Tensor lse, Tensor grad_logits, Tensor bad_target)
fusedops::cross_entropy_(Tensor(a!) logits, Tensor target, Tensor? weight=None, int ignore_index=-100, str reduction="mean", float label_smoothing=0., float z_loss=0., float? softcap=None) -> (Tensor loss, Tensor lse, Tensor bad_target)
fusedops::cross_entropy_backward(Tensor grad_output, Tensor grad_logits) -> Tensor
fusedops::cross_entropy_backward_(Tensor grad_output, Tensor(a!) grad_logits) -> ()
fusedops::cross_entropy_slice_grad_(Tensor(a!) logits, Tensor target, Tensor? weight, int class_start, int ignore_index, float? softcap, bool smoothing, Tensor coefs) -> ()
fusedops::cross_entropy_slice_stats_(Tensor logits, Tensor target, Tensor? weight, int class_start, int ignore_index, float? softcap, bool smoothing, Tensor(a!) stats) -> ()
fusedops::geglu(Tensor gate, Tensor up, str approximate="none") -> Tensor
fusedops::geglu_backward(Tensor grad_output, Tensor gate, Tensor up, str approximate="none") -> (Tensor grad_gate, Tensor grad_up)
fusedops::geglu_packed(Tensor gate_up, str approximate="none") -> Tensor
fusedops::geglu_packed_backward(Tensor grad_output, Tensor gate_up, str approximate="none") -> Tensor
fusedops::layer_norm(Tensor input, Tensor? weight, Tensor? bias, float eps) -> (Tensor output, Tensor mean, Tensor rstd)
fusedops::layer_norm_backward(Tensor grad_output, Tensor input, Tensor? weight, Tensor? bias, Tensor mean, Tensor rstd, bool weight_requires_grad, bool bias_requires_grad) -> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)
fusedops::linear_cross_entropy(Tensor hidden, Tensor weight, Tensor target, Tensor? bias=None, Tensor? class_weight=None, int ignore_index=-100, str reduction="mean", float label_smoothing=0., float z_loss=0., float? softcap=None, int? chunk_rows=None, bool low_memory=False, int? chunk_classes=None, bool compute_grad=False, bool[3] output_mask=[True, True, True]) -> (Tensor loss, Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias, Tensor bad_target)
fusedops::linear_cross_entropy_backward(Tensor grad_output, Tensor hidden, Tensor weight, Tensor target, Tensor? bias, Tensor? class_weight, int ignore_index, str reduction, float label_smoothing, float z_loss, float? softcap, int? chunk_rows, bool low_memory=False, int? chunk_classes=None, bool[3] output_mask=[True, True, True]) -> (Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)
fusedops::rms_norm(Tensor input, Tensor? weight, float eps, float offset=0., bool cast_before_weight=False, bool save_output=False) -> (Tensor output, Tensor rstd)
fusedops::rms_norm_backward(Tensor grad_output, Tensor saved, Tensor? weight, Tensor rstd, float offset, bool saved_is_output, bool weight_requires_grad) -> (Tensor grad_input, Tensor grad_weight)
fusedops::rope(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor? position_ids=None, bool interleaved=False) -> (Tensor q_out, Tensor k_out, Tensor bad_position)
fusedops::rope_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, Tensor? position_ids=None, bool interleaved=False) -> Tensor bad_position
fusedops::rope_backward(Tensor? grad_q_out, Tensor? grad_k_out, Tensor cos, Tensor sin, Tensor? position_ids, bool interleaved) -> (Tensor grad_q, Tensor grad_k)
fusedops::swiglu(Tensor gate, Tensor up) -> Tensor
fusedops::swiglu_backward(Tensor grad_output, Tensor gate, Tensor up) -> (Tensor grad_gate, Tensor grad_up)
fusedops::swiglu_packed(Tensor gate_up) -> Tensor
fusedops::swiglu_packed_backward(Tensor grad_output, Tensor gate_up) -> Tensor
""")
