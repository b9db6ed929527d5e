// Every fusedops schema, in one place. Kernels register against these names from
// csrc/cpu/<op>.cpp and csrc/cuda/<op>.cu; fake kernels, autograd and autocast rules from
// src/fusedops/ops/<op>.py. tests/test_schemas.py freezes this list: a change here is an ABI
// change and shows up there as a deliberate diff.
#include <torch/csrc/stable/library.h>

STABLE_TORCH_LIBRARY(fusedops, m) {
  // RMSNorm over the last dimension. Returns the output (input's dtype) and the reciprocal
  // root-mean-square of each row (float32; float64 for float64 input), which backward reuses.
  // The weight scales as (offset + weight) (Gemma: offset 1); cast_before_weight rounds the
  // normalised row to input's dtype before the weight multiply (LLaMA), else all math is float32.
  // save_output tells autograd to keep the output rather than the input (kernels ignore it).
  m.def(
      "rms_norm(Tensor input, Tensor? weight, float eps, float offset=0., bool cast_before_weight=False, "
      "bool save_output=False) -> (Tensor output, Tensor rstd)");
  // `saved` is the forward's input, or with saved_is_output its output (the memory-saving
  // backward). grad_weight is an empty tensor unless weight is given and weight_requires_grad.
  m.def(
      "rms_norm_backward(Tensor grad_output, Tensor saved, Tensor? weight, Tensor rstd, float offset, "
      "bool saved_is_output, bool weight_requires_grad) -> (Tensor grad_input, Tensor grad_weight)");

  // rms_norm(input + residual), also returning the sum (residual_out, in residual's dtype, which
  // may be float32 under 16-bit input); the output has input's dtype. One read of each input,
  // one write of each output.
  m.def(
      "add_rms_norm(Tensor input, Tensor residual, Tensor? weight, float eps, float offset=0., "
      "bool cast_before_weight=False) -> (Tensor output, Tensor residual_out, Tensor rstd)");
  // The same, writing the sum into residual (no autograd: an inference form).
  m.def(
      "add_rms_norm_(Tensor input, Tensor(a!) residual, Tensor? weight, float eps, float offset=0., "
      "bool cast_before_weight=False) -> (Tensor output, Tensor rstd)");
  // grad_input (grad_output's dtype) is the gradient of input and, when residual_out has the same
  // dtype, of residual too; grad_residual is then empty, else it is that gradient in
  // residual_out's dtype. grad_residual_out (absent: zero) is the gradient reaching residual_out.
  m.def(
      "add_rms_norm_backward(Tensor grad_output, Tensor? grad_residual_out, Tensor residual_out, "
      "Tensor? weight, Tensor rstd, float offset, bool weight_requires_grad) "
      "-> (Tensor grad_input, Tensor grad_residual, Tensor grad_weight)");

  // LayerNorm over the last dimension, with optional weight and bias (same dtype). Returns the
  // output (input's dtype) and each row's mean and reciprocal standard deviation (float32;
  // float64 for float64 input), which backward reuses.
  m.def("layer_norm(Tensor input, Tensor? weight, Tensor? bias, float eps) -> (Tensor output, Tensor mean, Tensor rstd)");
  // grad_weight / grad_bias are empty tensors unless that parameter is given and requires grad.
  m.def(
      "layer_norm_backward(Tensor grad_output, Tensor input, Tensor? weight, Tensor? bias, Tensor mean, "
      "Tensor rstd, bool weight_requires_grad, bool bias_requires_grad) "
      "-> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");

  // Gated activations of a gated MLP: act(gate) * up over tensors of one shape and dtype (the
  // last dimension the feature dimension), float32 math, output in that dtype. swiglu's act is
  // silu, geglu's gelu (approximate: "none", the erf form, or "tanh"). The backwards recompute
  // act from gate rather than keep it: the forward saves only its inputs.
  m.def("swiglu(Tensor gate, Tensor up) -> Tensor");
  m.def("swiglu_backward(Tensor grad_output, Tensor gate, Tensor up) -> (Tensor grad_gate, Tensor grad_up)");
  // The packed forms take the output of a fused gate-up projection, (..., 2n) holding
  // [gate | up], and return (..., n). Their backward returns one (..., 2n) gradient, so the
  // projection's backward gets it without a concatenation. Separate ops rather than views into
  // the unpacked ones: autograd of two views of one tensor would allocate two gradients and add
  // them into a third.
  m.def("swiglu_packed(Tensor gate_up) -> Tensor");
  m.def("swiglu_packed_backward(Tensor grad_output, Tensor gate_up) -> Tensor");
  m.def("geglu(Tensor gate, Tensor up, str approximate=\"none\") -> Tensor");
  m.def(
      "geglu_backward(Tensor grad_output, Tensor gate, Tensor up, str approximate=\"none\") "
      "-> (Tensor grad_gate, Tensor grad_up)");
  m.def("geglu_packed(Tensor gate_up, str approximate=\"none\") -> Tensor");
  m.def("geglu_packed_backward(Tensor grad_output, Tensor gate_up, str approximate=\"none\") -> Tensor");
  // Rotary position embeddings of q (B, Hq, S, D) and k (B, Hk, S, D), any strides (the public
  // function passes bshd and packed thd inputs as views of this layout), in one launch. cos/sin
  // are (1 or B, S, R), or (P, R) tables indexed by position_ids (1 or B, S); features from R on
  // pass through. Outputs keep q's and k's strides when those are dense (else contiguous).
  // bad_position: the flat (batch, seq) index of the first position outside the tables, or -1
  // (its rotated features are NaN; nothing is read out of bounds). Always -1 without
  // position_ids, and on the CPU, whose kernel raises instead.
  m.def(
      "rope(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor? position_ids=None, bool interleaved=False) "
      "-> (Tensor q_out, Tensor k_out, Tensor bad_position)");
  // The same, rotating q and k where they are (no autograd: an inference form).
  m.def(
      "rope_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, Tensor? position_ids=None, "
      "bool interleaved=False) -> Tensor bad_position");
  // The transpose of the rotation, applied to the incoming gradients (absent: zero; its output
  // is then an empty tensor). Linear, so its own gradient is rope again.
  m.def(
      "rope_backward(Tensor? grad_q_out, Tensor? grad_k_out, Tensor cos, Tensor sin, Tensor? position_ids, "
      "bool interleaved) -> (Tensor grad_q, Tensor grad_k)");

  // Cross-entropy of (..., V) logits against (...) class-index targets (int64 or int32), with
  // torch's options (class weights, ignore_index, reduction, label_smoothing) plus a z-loss
  // term and Gemma-2 style logit soft-capping (the math: csrc/include/fusedops/cross_entropy.h).
  // Returns the loss (float32; float64 for float64 logits), each row's log-sum-exp, the gradient
  // of the loss with respect to the logits when compute_grad (else an empty tensor; one read of
  // the logits gives both), and bad_target: the flat index of the first target outside [0, V)
  // that is not ignore_index, or -1 (its row's loss and gradient are NaN; nothing is read out
  // of bounds).
  m.def(
      "cross_entropy(Tensor logits, Tensor target, Tensor? weight=None, int ignore_index=-100, "
      "str reduction=\"mean\", float label_smoothing=0., float z_loss=0., float? softcap=None, "
      "bool compute_grad=False) -> (Tensor loss, Tensor lse, Tensor grad_logits, Tensor bad_target)");
  // The same, writing the gradient into the logits (the memory-saving mode).
  m.def(
      "cross_entropy_(Tensor(a!) logits, Tensor target, Tensor? weight=None, int ignore_index=-100, "
      "str reduction=\"mean\", float label_smoothing=0., float z_loss=0., float? softcap=None) "
      "-> (Tensor loss, Tensor lse, Tensor bad_target)");
  // The backward: the forward's gradient times grad_output (0-d for "mean"/"sum", one value
  // per row for "none"), as a new tensor, or in place, where rows whose scale is exactly 1 are
  // left untouched (the usual loss.backward() costs no pass over the gradient).
  m.def("cross_entropy_backward(Tensor grad_output, Tensor grad_logits) -> Tensor");
  m.def("cross_entropy_backward_(Tensor grad_output, Tensor(a!) grad_logits) -> ()");
  // Building blocks of linear_cross_entropy's low-memory mode, which makes the logits one slice
  // of the vocabulary at a time (logits: (rows, S), classes class_start .. class_start + S - 1;
  // weight: all the class weights). slice_stats_ merges the slice into each row's running
  // (max, sum of exp, sum of w_j x_j, target's logit) in stats (rows, 4); slice_grad_ turns the
  // slice into its gradient in place from each row's (base, scale, ct, cw) in coefs (rows, 4). The
  // math: csrc/include/fusedops/cross_entropy.h.
  m.def(
      "cross_entropy_slice_stats_(Tensor logits, Tensor target, Tensor? weight, int class_start, int ignore_index, "
      "float? softcap, bool smoothing, Tensor(a!) stats) -> ()");
  m.def(
      "cross_entropy_slice_grad_(Tensor(a!) logits, Tensor target, Tensor? weight, int class_start, int ignore_index, "
      "float? softcap, bool smoothing, Tensor coefs) -> ()");

  // Cross-entropy of hidden @ weight.T (+ bias) against class-index targets, never holding the
  // whole (tokens, vocab) logits: rows go through in chunks of chunk_rows (None: as many as fit
  // a fixed byte budget), each chunk's logits made by one matrix product and turned into their
  // gradient in place by cross_entropy_. low_memory: the vocabulary goes through in chunks of
  // chunk_classes instead (None: a fixed byte budget; cross_entropy_slice_stats_, then
  // cross_entropy_slice_grad_; one more product, and no float32 buffer of the weight's size). The options are cross_entropy's (class_weight is its
  // `weight`). With compute_grad, also the gradients of the loss (grad_output 1) with respect to
  // hidden (hidden's dtype), weight and bias (float32, float64 for float64 hidden: the
  // accumulators; with low_memory the weight's gradient is in the weight's dtype; bias absent:
  // an empty tensor). bad_target as cross_entropy's. The kernels are Python composites
  // (src/fusedops/ops/linear_cross_entropy.py): cuBLAS/oneDNN do the products.
  m.def(
      "linear_cross_entropy(Tensor hidden, Tensor weight, Tensor target, Tensor? bias=None, "
      "Tensor? class_weight=None, int ignore_index=-100, str reduction=\"mean\", float label_smoothing=0., "
      "float z_loss=0., float? softcap=None, int? chunk_rows=None, bool low_memory=False, int? chunk_classes=None, "
      "bool compute_grad=False, bool[3] output_mask=[True, True, True]) "
      "-> (Tensor loss, Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias, Tensor bad_target)");
  // The backward by recomputation (reduction "none", or a forward without compute_grad): the
  // gradients for grad_output (0-d for "mean"/"sum", target's shape for "none"), dtypes as above.
  // output_mask (both ops): which of grad_hidden, grad_weight, grad_bias are computed; the
  // others come back empty (a frozen lm_head needs no (V, H) weight gradient, nor its product).
  m.def(
      "linear_cross_entropy_backward(Tensor grad_output, Tensor hidden, Tensor weight, Tensor target, "
      "Tensor? bias, Tensor? class_weight, int ignore_index, str reduction, float label_smoothing, float z_loss, "
      "float? softcap, int? chunk_rows, bool low_memory=False, int? chunk_classes=None, "
      "bool[3] output_mask=[True, True, True]) "
      "-> (Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)");
}
