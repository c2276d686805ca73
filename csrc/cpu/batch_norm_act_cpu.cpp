// CPU implementations of the fused batch_norm_act operators: validate, lay
// the data out as [outer, channels, inner] and run the kernels of the running
// CPU's instruction set (cpu/kernels/act_kernel_table.h).
#include <ATen/ATen.h>

#include <algorithm>
#include <limits>

#include "dtypes.h"
#include "args/batch_norm_args.h"
#include "cpu/aligned_array.h"
#include "cpu/kernels/act_kernel_table.h"
#include "cpu/output_cache.h"
#include "library/signatures.h"

namespace torch_bn_grad::cpu {
namespace {

// Every fused forward operator. With `sign_bits`, also the sign bits of dst
// (cpu/kernels/sign_bits.h), empty where the kernels cannot write them for
// this layout; without, an undefined tensor. `copies`: frozen statistics are
// returned as copies, else as undefined tensors (the .frozen overload).
Outputs4 act_forward(const at::Tensor& src, const OptionalTensor& gamma, const OptionalTensor& beta,
                     const OptionalTensor& mean, const OptionalTensor& variance, const OptionalTensor& residual,
                     double epsilon, c10::string_view activation, double negative_slope,
                     c10::string_view data_format, bool sign_bits, bool copies = true) {
  const ActPlan checked = check_act_forward_args(src, gamma, beta, mean, variance, residual, epsilon, activation,
                                                 negative_slope, data_format);
  const ChannelPlan& plan = checked.plan;
  KernelOutput out = make_kernel_output(src, plan, output_allocator());
  ActForwardArgs a;
  a.src = to_kernel_layout(src, plan);
  a.residual = to_kernel_layout(residual, plan);
  a.dst = out.buffer;
  a.extent = plan.extent();
  // Empty where the layout or dtype does not fit the bits: the backward reads dst there.
  // (The plain forward returns none: its caller drops the fourth output.)
  at::Tensor positive;
  if (sign_bits) {
    const bool fit = act_kernel_table().sign_bits_fit(a.extent, src.scalar_type());
    positive = at::empty({fit ? sign_bits_bytes(a.extent) : 0}, src.options().dtype(at::kByte));
    if (fit) a.dst_positive = positive;
  }
  // Per-channel float64 vectors: gamma, beta, mean, variance.
  const int64_t C = plan.channels;
  const auto host = aligned_array_for_overwrite<double>(4 * C);
  double *gamma_d = host.get(), *beta_d = gamma_d + C;
  load_kernel_channels(gamma, plan, 1, src, gamma_d);
  load_kernel_channels(beta, plan, 0, src, beta_d);
  a.gamma = gamma_d;
  a.beta = beta_d;
  a.mean = beta_d + C;
  a.var = a.mean + C;
  a.epsilon = epsilon;
  a.act = {checked.kind, negative_slope};
  a.batch = !mean.has_value();
  if (!a.batch) {
    load_kernel_channels(mean, plan, 0, src, a.mean);
    load_kernel_channels(variance, plan, 0, src, a.var);
    if (src.numel() > 0) {
      act_kernel_table().forward(a);
      finish_kernel_output(out, plan);
    }
    if (!copies) return {out.result, at::Tensor(), at::Tensor(), positive};
    return {out.result, mean->clone(at::MemoryFormat::Contiguous), variance->clone(at::MemoryFormat::Contiguous),
            positive};
  }
  if (plan.reduced_count() == 0) {
    std::fill_n(a.mean, 2 * C, std::numeric_limits<double>::quiet_NaN());
  } else if (src.numel() > 0) {
    act_kernel_table().forward(a);
    finish_kernel_output(out, plan);
  }
  const auto stats_dtype = accumulation_dtype(src.scalar_type());
  return {out.result, kernel_channels_result(a.mean, plan, stats_dtype, src),
          kernel_channels_result(a.var, plan, stats_dtype, src), positive};
}

}  // namespace

// memory_saving changes what autograd saves, not what the operator computes.
Outputs3 batch_norm_act_forward_cpu(TBG_PARAMS(batch_norm_act_forward)) {
  auto [dst, mean_used, variance_used, unused] =
      act_forward(src, gamma, beta, mean, variance, residual, epsilon, activation, negative_slope, data_format, false);
  return {dst, mean_used, variance_used};
}

at::Tensor batch_norm_act_forward_frozen_cpu(TBG_PARAMS(batch_norm_act_forward_frozen)) {
  return std::get<0>(act_forward(src, gamma, beta, mean, variance, residual, epsilon, activation, negative_slope,
                                 data_format, false, false));
}

Outputs4 batch_norm_act_forward_sign_bits_cpu(TBG_PARAMS(batch_norm_act_forward_sign_bits)) {
  return act_forward(src, gamma, beta, mean, variance, residual, epsilon, activation, negative_slope, data_format,
                     true);
}

Outputs4 batch_norm_act_backward_cpu(TBG_PARAMS(batch_norm_act_backward)) {
  const ActPlan checked =
      check_act_backward_args(diff_dst, src, dst, residual, mean, variance, gamma, beta, epsilon, activation,
                              negative_slope, data_format, training, from_output, output_mask, dst_positive);
  const ChannelPlan& plan = checked.plan;
  const at::Tensor& data = from_output ? *dst : *src;
  ActBackwardArgs a;
  a.data = to_kernel_layout(data, plan);
  if (checked.reads_sign_bits) a.dst_positive = *dst_positive;
  else if (!from_output) a.output = to_kernel_layout(dst, plan);
  a.residual = to_kernel_layout(residual, plan);
  a.diff_dst = to_kernel_layout(diff_dst, plan);
  a.extent = plan.extent();
  // Per-channel float64 vectors: mean, variance, gamma, beta, diff_gamma, diff_beta.
  const int64_t C = plan.channels;
  const auto host = aligned_array<double>(6 * C, 0.0);
  double* const mean_d = host.get();
  load_kernel_channels(mean, plan, 0, data, mean_d);
  load_kernel_channels(variance, plan, 0, data, mean_d + C);
  load_kernel_channels(gamma, plan, 1, data, mean_d + 2 * C);
  load_kernel_channels(beta, plan, 0, data, mean_d + 3 * C);
  a.mean = mean_d;
  a.var = mean_d + C;
  a.gamma = mean_d + 2 * C;
  a.beta = mean_d + 3 * C;
  a.epsilon = epsilon;
  a.training = training;
  a.from_output = from_output;
  a.act = {checked.kind, negative_slope};
  if (output_mask[1]) a.diff_gamma = mean_d + 4 * C;
  if (output_mask[2]) a.diff_beta = mean_d + 5 * C;
  // dz is written by the elementwise pass, which diff_src drives.
  KernelOutput dx, dz;
  if (output_mask[0] || output_mask[3]) {
    dx = make_kernel_output(data, plan, output_allocator());
    a.diff_src = dx.buffer;
  }
  if (output_mask[3]) {
    dz = make_kernel_output(data, plan, output_allocator());
    a.diff_residual = dz.buffer;
  }
  if (data.numel() > 0 && (output_mask[0] || output_mask[1] || output_mask[2] || output_mask[3])) {
    act_kernel_table().backward(a);
    if (output_mask[0]) finish_kernel_output(dx, plan);
    if (output_mask[3]) finish_kernel_output(dz, plan);
  }
  const auto grad_dtype = param_grad_dtype(mean, gamma, beta);
  const auto param_grad = [&](const double* sums) {
    return sums ? kernel_channels_result(sums, plan, grad_dtype, data) : at::Tensor();
  };
  return act_backward_outputs(output_mask, dx.result, param_grad(a.diff_gamma), param_grad(a.diff_beta), dz.result,
                              data, grad_dtype);
}

}  // namespace torch_bn_grad::cpu
