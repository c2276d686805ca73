// CPU implementations of the operators: validate, lay the data out as
// [outer, channels, inner], and run the kernels of the running CPU's
// instruction set. Per-channel values travel as float64 vectors in one host
// buffer per call.
#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "dtypes.h"
#include "args/batch_norm_args.h"
#include "cpu/aligned_array.h"
#include "cpu/kernels/kernel_table.h"
#include "cpu/output_cache.h"
#include "library/signatures.h"

namespace torch_bn_grad::cpu {
namespace {

// A contiguous copy of a small per-channel tensor: a plain memcpy where it
// can be (clone's dispatch costs more than copying a few channels).
at::Tensor contiguous_copy(const at::Tensor& t) {
  if (!t.is_contiguous()) return t.clone(at::MemoryFormat::Contiguous);
  at::Tensor copy = at::empty(t.sizes(), t.options());
  std::memcpy(copy.mutable_data_ptr(), t.const_data_ptr(), t.nbytes());
  return copy;
}

// Both forward operators; `copies`: frozen statistics are returned as copies
// (batch_norm_forward), else as undefined tensors (its .frozen overload).
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(
    const at::Tensor& src, const std::optional<at::Tensor>& gamma,
    const std::optional<at::Tensor>& beta, const std::optional<at::Tensor>& mean,
    const std::optional<at::Tensor>& variance, double epsilon, c10::string_view data_format, bool copies) {
  const ChannelPlan plan = check_forward_args(src, gamma, beta, mean, variance, epsilon, data_format);
  const Extent e = plan.extent();
  const int64_t C = plan.channels;
  // Per-channel float64 vectors: gamma, beta, mean, variance; each is set
  // before it is read, so they are left uninitialized (zeroing them was a
  // tenth of a 2x4096 forward's kernel time).
  const auto host = aligned_array_for_overwrite<double>(4 * C);
  double *gamma_d = host.get(), *beta_d = gamma_d + C, *mean_d = beta_d + C, *var_d = mean_d + C;
  load_kernel_channels(gamma, plan, 1, src, gamma_d);
  load_kernel_channels(beta, plan, 0, src, beta_d);
  KernelOutput out = make_kernel_output(src, plan, output_allocator());

  if (mean.has_value()) {
    if (src.numel() > 0) {
      load_kernel_channels(mean, plan, 0, src, mean_d);
      load_kernel_channels(variance, plan, 0, src, var_d);
      kernel_table().forward_frozen(to_kernel_layout(src, plan), {}, out.buffer, e, mean_d, var_d, gamma_d, beta_d,
                                    epsilon);
      finish_kernel_output(out, plan);
    }
    if (!copies) return {out.result, at::Tensor(), at::Tensor()};
    return {out.result, contiguous_copy(*mean), contiguous_copy(*variance)};
  }

  if (plan.reduced_count() == 0) {
    std::fill_n(mean_d, 2 * C, std::numeric_limits<double>::quiet_NaN());
  } else if (src.numel() > 0) {
    kernel_table().forward_batch(to_kernel_layout(src, plan), {}, out.buffer, e, gamma_d, beta_d, epsilon, mean_d, var_d);
    finish_kernel_output(out, plan);
  }
  const auto stats_dtype = accumulation_dtype(src.scalar_type());
  return {out.result, kernel_channels_result(mean_d, plan, stats_dtype, src),
          kernel_channels_result(var_d, plan, stats_dtype, src)};
}

}  // namespace

Outputs3 batch_norm_forward_cpu(TBG_PARAMS(batch_norm_forward)) {
  return forward(src, gamma, beta, mean, variance, epsilon, data_format, true);
}

at::Tensor batch_norm_forward_frozen_cpu(TBG_PARAMS(batch_norm_forward_frozen)) {
  return std::get<0>(forward(src, gamma, beta, mean, variance, epsilon, data_format, false));
}

Outputs3 batch_norm_backward_cpu(TBG_PARAMS(batch_norm_backward)) {
  const ChannelPlan plan =
      check_backward_args(src, diff_dst, mean, variance, gamma, epsilon, data_format);
  const auto grad_dtype = param_grad_dtype(mean, gamma);
  const int64_t C = plan.channels;
  // Per-channel float64 vectors: mean, variance, gamma, diff_gamma, diff_beta.
  // The kernel writes every channel's sums; zeroed only where it does not run
  // (an empty src's parameter gradients are zeros).
  const bool runs = src.numel() > 0 && (output_mask[0] || output_mask[1] || output_mask[2]);
  const auto host = runs ? aligned_array_for_overwrite<double>(5 * C) : aligned_array<double>(5 * C, 0.0);
  double *mean_d = host.get(), *var_d = mean_d + C, *gamma_d = var_d + C, *diff_gamma_d = gamma_d + C,
         *diff_beta_d = diff_gamma_d + C;
  KernelOutput out;
  if (output_mask[0]) out = make_kernel_output(src, plan, output_allocator());

  if (runs) {
    load_kernel_channels(mean, plan, 0, src, mean_d);
    load_kernel_channels(variance, plan, 0, src, var_d);
    load_kernel_channels(gamma, plan, 1, src, gamma_d);
    kernel_table().backward(to_kernel_layout(src, plan), to_kernel_layout(diff_dst, plan), out.buffer,
                            plan.extent(), mean_d, var_d, gamma_d, epsilon, training,
                            output_mask[1] ? diff_gamma_d : nullptr, output_mask[2] ? diff_beta_d : nullptr);
    if (output_mask[0]) finish_kernel_output(out, plan);
  }
  const auto param_grad = [&](bool wanted, const double* sums) {
    return wanted ? kernel_channels_result(sums, plan, grad_dtype, src)
                  : at::empty({0}, mean.options().dtype(grad_dtype));
  };
  return {output_mask[0] ? out.result : at::empty({0}, src.options()), param_grad(output_mask[1], diff_gamma_d),
          param_grad(output_mask[2], diff_beta_d)};
}

}  // namespace torch_bn_grad::cpu
