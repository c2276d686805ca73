// The operator schemas: the one TORCH_LIBRARY block, for every backend. Each
// operator's C++ signature and kernels: library/operators.h.
#include <torch/library.h>

// Masked outputs of batch_norm_backward come back as empty tensors (the Python
// wrapper turns them into None), so every return is a plain Tensor.
//
// Operators tagged flexible_layout take tensors of any strides, and their
// outputs follow src's memory format (as their fake implementations say), so
// that inductor passes the tensors it holds (a convolution output it laid out
// channels_last, say) instead of copying them into the strides seen at tracing.
TORCH_LIBRARY(torch_bn_grad, m) {
  m.def(
      "batch_norm_forward(Tensor src, Tensor? gamma, Tensor? beta, Tensor? mean, Tensor? variance, "
      "float epsilon, str data_format) -> (Tensor dst, Tensor mean, Tensor variance)",
      {at::Tag::flexible_layout});
  m.def(
      "batch_norm_backward(Tensor src, Tensor diff_dst, Tensor mean, Tensor variance, Tensor? gamma, "
      "float epsilon, str data_format, bool training, bool[3] output_mask) "
      "-> (Tensor diff_src, Tensor diff_gamma, Tensor diff_beta)",
      {at::Tag::flexible_layout});
  // The gradient of batch_norm_forward with respect to (src, gamma, beta, mean,
  // variance), given the gradients reaching its three outputs; undefined (None)
  // where output_mask is false. Made of differentiable operators
  // (csrc/autograd/batch_norm_autograd.cpp), so gradients of any order flow through it.
  m.def(
      "batch_norm_forward_grad(Tensor src, Tensor? gamma, Tensor mean, Tensor variance, Tensor? grad_dst, "
      "Tensor? grad_mean, Tensor? grad_variance, float epsilon, str data_format, bool training, "
      "ScalarType? param_dtype, bool[5] output_mask) "
      "-> (Tensor diff_src, Tensor diff_gamma, Tensor diff_beta, Tensor diff_mean, Tensor diff_variance)");
  // Forward-mode AD of batch_norm_forward: the tangents of (dst, mean,
  // variance) given src, gamma, the statistics the forward used (the batch's
  // in training, the given ones frozen) and the inputs' tangents (None: zero);
  // None where zero. The forward operators' Autograd kernels and
  // BatchNormFunction.jvp compute them with it (csrc/autograd/forward_ad.cpp).
  m.def(
      "batch_norm_forward_jvp(Tensor src, Tensor? gamma, Tensor mean, Tensor variance, bool training, "
      "float epsilon, str data_format, Tensor? src_t, Tensor? gamma_t, Tensor? beta_t, Tensor? mean_t, "
      "Tensor? variance_t) -> (Tensor dst_t, Tensor mean_t, Tensor variance_t)");

  // Fused batch norm + residual add + activation:
  // dst = act(batch_norm(src) + residual), activation 'identity', 'relu',
  // 'leaky_relu' (negative_slope >= 0) or 'silu'; the other arguments, the
  // layouts and the returned statistics as batch_norm_forward's. `residual`
  // (optional) has src's shape and dtype. `memory_saving` changes no result:
  // it tells the autograd formula to keep dst (and residual) instead of src,
  // the backward then running from_output (invertible activations only).
  m.def(
      "batch_norm_act_forward(Tensor src, Tensor? gamma, Tensor? beta, Tensor? mean, Tensor? variance, "
      "Tensor? residual, float epsilon, str activation, float negative_slope, str data_format, "
      "bool memory_saving) -> (Tensor dst, Tensor mean, Tensor variance)",
      {at::Tag::flexible_layout});
  // The same, also returning dst's sign bits for the backward's relu /
  // leaky_relu gate: dst_positive, uint8 of ceil(numel / 8) bytes, bit i (least
  // significant first) dst[i] > 0 in the CPU kernels' element order; empty
  // where the kernels cannot write them in their pass (layouts whose rows do
  // not start on a byte, float64 on some ISAs). What the autograd formula
  // saves on CPU instead of reading dst back (CPU only).
  m.def(
      "batch_norm_act_forward_sign_bits(Tensor src, Tensor? gamma, Tensor? beta, Tensor? mean, Tensor? variance, "
      "Tensor? residual, float epsilon, str activation, float negative_slope, str data_format) "
      "-> (Tensor dst, Tensor mean, Tensor variance, Tensor dst_positive)");
  // Its gradient, in two passes over the data: the sums of dz and dz * (x - mean),
  // dz = diff_dst * act'(z), then diff_src (and diff_residual = dz). act' is read
  // from dst for relu/leaky_relu (dst > 0 iff z > 0), recomputed from src (and
  // residual) and the statistics for silu; identity needs neither.
  // from_output=True (memory saving, inplace_abn's idea): src is not read (may
  // be None); x is recovered from dst as (act^-1(dst) - residual - beta) / gamma
  // in the normalized frame (beta absent: 0, as in the forward); the activation must be
  // invertible (identity, leaky_relu with negative_slope > 0), and a gamma with
  // zeros gives inf/nan (the caller's problem, as in inplace_abn). The residual
  // passed must be the forward's (silu and from_output read it).
  // dst_positive (the sign-bits forward's, with the same src) replaces dst as
  // the source of relu / leaky_relu's act'; empty, it is ignored (dst is read).
  // Masked outputs come back empty; diff_residual is dz, of src's shape.
  m.def(
      "batch_norm_act_backward(Tensor diff_dst, Tensor? src, Tensor? dst, Tensor? residual, Tensor mean, "
      "Tensor variance, Tensor? gamma, Tensor? beta, float epsilon, str activation, float negative_slope, "
      "str data_format, bool training, bool from_output, bool[4] output_mask, Tensor? dst_positive=None) "
      "-> (Tensor diff_src, Tensor diff_gamma, Tensor diff_beta, Tensor diff_residual)",
      {at::Tag::flexible_layout});
  // torch BatchNorm's running-statistics update in place, with momentum and
  // the unbiased variance of `count` elements per channel (count 0: no
  // change); one call for eager training steps (csrc/composite/running_stats.cpp).
  m.def(
      "batch_norm_update_running_stats(Tensor(a!)? running_mean, Tensor(b!)? running_var, Tensor mean, "
      "Tensor variance, int count, float momentum) -> ()");
  // The same with `count` a 0-dim tensor (the masked forward's valid count), read on its device.
  m.def(
      "batch_norm_update_running_stats.counted(Tensor(a!)? running_mean, Tensor(b!)? running_var, Tensor mean, "
      "Tensor variance, Tensor count, float momentum) -> ()");
  // batch_norm_forward with batch statistics that then updates the running
  // statistics with them, as batch_norm_update_running_stats does with the
  // elements per channel as count: an eager training step's forward in one
  // call from Python (csrc/composite/running_stats.cpp).
  m.def(
      "batch_norm_forward.update(Tensor src, Tensor? gamma, Tensor? beta, Tensor(a!)? running_mean, "
      "Tensor(b!)? running_var, float momentum, float epsilon, str data_format) "
      "-> (Tensor dst, Tensor mean, Tensor variance)",
      {at::Tag::flexible_layout});
  // batch_norm_forward with frozen statistics, returning dst alone (no copies
  // of the given statistics): an eager eval step's call (csrc/composite/frozen_forward.cpp).
  m.def(
      "batch_norm_forward.frozen(Tensor src, Tensor? gamma, Tensor? beta, Tensor mean, Tensor variance, "
      "float epsilon, str data_format) -> Tensor dst",
      {at::Tag::flexible_layout});
  m.def(
      "batch_norm_act_forward.frozen(Tensor src, Tensor? gamma, Tensor? beta, Tensor mean, Tensor variance, "
      "Tensor? residual, float epsilon, str activation, float negative_slope, str data_format, "
      "bool memory_saving) -> Tensor dst",
      {at::Tag::flexible_layout});
  // The same for the fused forward and its sign-bits form: batch_norm_act_forward
  // (or _sign_bits) with batch statistics, then that update.
  m.def(
      "batch_norm_act_forward.update(Tensor src, Tensor? gamma, Tensor? beta, Tensor(a!)? running_mean, "
      "Tensor(b!)? running_var, Tensor? residual, float momentum, float epsilon, str activation, "
      "float negative_slope, str data_format, bool memory_saving) -> (Tensor dst, Tensor mean, Tensor variance)",
      {at::Tag::flexible_layout});
  m.def(
      "batch_norm_act_forward_sign_bits.update(Tensor src, Tensor? gamma, Tensor? beta, Tensor(a!)? running_mean, "
      "Tensor(b!)? running_var, Tensor? residual, float momentum, float epsilon, str activation, "
      "float negative_slope, str data_format) -> (Tensor dst, Tensor mean, Tensor variance, Tensor dst_positive)");

  // Masked batch norm for padded batches (checks: csrc/args/batch_norm_args.h):
  // mask, bool of src's shape without dim 1 ((N,) for 2-D src), True where a
  // position is valid. The statistics and every sum run over valid positions
  // only; padded positions of dst and diff_src are exactly 0 and are never
  // read, whatever they hold. The channel axis is 1; the per-channel tensors
  // are 1-D. `count` is the number of valid positions per channel, a float64
  // scalar tensor (no host synchronization on the mask is needed to use it);
  // with none, mean and variance are 0 and dst is zeros.
  m.def(
      "batch_norm_masked_forward(Tensor src, Tensor mask, Tensor? gamma, Tensor? beta, Tensor? mean, "
      "Tensor? variance, float epsilon) -> (Tensor dst, Tensor mean, Tensor variance, Tensor count)");
  m.def(
      "batch_norm_masked_backward(Tensor src, Tensor mask, Tensor diff_dst, Tensor mean, Tensor variance, "
      "Tensor? gamma, float epsilon, bool training, bool[3] output_mask) "
      "-> (Tensor diff_src, Tensor diff_gamma, Tensor diff_beta)");
  // The fused masked operators (CPU): dst = act(batch norm + residual) at
  // valid positions, 0 at padded ones (residual's padding is never read);
  // activation and negative_slope as batch_norm_act_forward's. The backward
  // reads dst for act' of relu and leaky_relu, recomputes z (from src,
  // residual and the statistics) for silu; diff_residual is dz, 0 at padded
  // positions.
  m.def(
      "batch_norm_masked_act_forward(Tensor src, Tensor mask, Tensor? gamma, Tensor? beta, Tensor? mean, "
      "Tensor? variance, Tensor? residual, float epsilon, str activation, float negative_slope) "
      "-> (Tensor dst, Tensor mean, Tensor variance, Tensor count)");
  m.def(
      "batch_norm_masked_act_backward(Tensor src, Tensor mask, Tensor? dst, Tensor? residual, Tensor diff_dst, "
      "Tensor mean, Tensor variance, Tensor? gamma, Tensor? beta, float epsilon, str activation, "
      "float negative_slope, bool training, bool[4] output_mask) "
      "-> (Tensor diff_src, Tensor diff_gamma, Tensor diff_beta, Tensor diff_residual)");

  // Split stages, for batch statistics over several processes (SyncBatchNorm).
  // They take the 1-D channel form (src of rank 2 to 8, channel axis chosen by
  // data_format); their per-channel statistics are float64 of shape (C,), and
  // what crosses processes comes packed as rows of one (k, C) float64 tensor.
  //
  // batch_norm_local_stats: rows (count, mean, m2) of src, m2 being the centred
  // second moment sum((src - mean)^2); an empty src gives rows of zeros, which
  // combine with other processes' statistics as "no samples" (Chan et al.).
  m.def("batch_norm_local_stats(Tensor src, str data_format) -> Tensor");
  // batch_norm_stats_affine: the training forward's statistics, mean and biased
  // variance (batch_norm_forward's, bit for bit), and the per-channel affine map
  // its normalization applies, dst = (src - mean) * scale + bias, all in the
  // accumulation dtype; bias carries the mean's rounding. What the torch.compile
  // lowering calls on CPU: the reduction runs in this library's kernels and
  // inductor fuses the elementwise pass with its neighbours (on CUDA the
  // lowering leaves the reduction to inductor).
  m.def(
      "batch_norm_stats_affine(Tensor src, Tensor? gamma, Tensor? beta, float epsilon, str data_format) "
      "-> (Tensor mean, Tensor variance, Tensor scale, Tensor bias)",
      {at::Tag::flexible_layout});
  // batch_norm_grad_sums: rows (sum(diff_dst), sum(diff_dst * (src - mean))) of
  // the local data, about the given (global) mean; zeros for an empty src.
  m.def("batch_norm_grad_sums(Tensor src, Tensor diff_dst, Tensor mean, str data_format) -> Tensor");
  // batch_norm_grad_input: the training-mode diff_src of the whole batch, from
  // its mean, biased variance and per-channel element count and the two
  // gradient sums (rows as batch_norm_grad_sums returns them) summed over it:
  // g * rstd * (diff_dst - sum_dy / count - (src - mean) * rstd^2 * sum_dy_xc / count).
  m.def(
      "batch_norm_grad_input(Tensor src, Tensor diff_dst, Tensor mean, Tensor variance, Tensor? gamma, "
      "Tensor count, Tensor grad_sums, float epsilon, str data_format) -> Tensor");
}
