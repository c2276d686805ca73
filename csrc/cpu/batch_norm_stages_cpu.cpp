// CPU implementations of the split-stage operators (see ops.cpp): the
// per-process pieces of a batch norm whose statistics span several processes.
// They run the same kernels as the fused operators; per-channel values are
// float64 in logical channel order, which for 1-D statistics is also the
// kernels' channel order.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>

#include "batch_norm_args.h"
#include "cpu/kernels/kernel_table.h"
#include "cpu/output_cache.h"

namespace torch_bn_grad::cpu {
namespace {

at::Tensor batch_norm_local_stats_cpu(const at::Tensor& src, c10::string_view data_format) {
  const ChannelPlan plan = check_local_stats_args(src, data_format);
  const int64_t count = plan.reduced_count();
  at::Tensor stats = at::zeros({3, plan.channels}, src.options().dtype(at::kDouble));
  if (count > 0 && plan.channels > 0) {
    at::Tensor mean = stats[1];
    at::Tensor m2 = stats[2];
    kernel_table().batch_stats(to_kernel_layout(src, plan), {plan.outer, plan.channels, plan.inner},
                               mean, m2);
    m2.mul_(static_cast<double>(count));  // biased variance -> centred second moment
    stats[0].fill_(static_cast<double>(count));
  }
  return stats;
}

at::Tensor batch_norm_grad_sums_cpu(const at::Tensor& src, const at::Tensor& diff_dst,
                                    const at::Tensor& mean, c10::string_view data_format) {
  const ChannelPlan plan = check_grad_sums_args(src, diff_dst, mean, data_format);
  at::Tensor sums = at::zeros({2, plan.channels}, src.options().dtype(at::kDouble));
  if (plan.reduced_count() > 0 && plan.channels > 0) {
    at::Tensor sum_dy = sums[0];
    at::Tensor sum_dy_xc = sums[1];
    kernel_table().grad_sums(to_kernel_layout(src, plan), to_kernel_layout(diff_dst, plan),
                             {plan.outer, plan.channels, plan.inner},
                             to_kernel_channels(mean, plan, accumulate_type(src.scalar_type()), 0, src),
                             sum_dy, sum_dy_xc);
  }
  return sums;
}

at::Tensor batch_norm_grad_input_cpu(const at::Tensor& src, const at::Tensor& diff_dst,
                                     const at::Tensor& mean, const at::Tensor& variance,
                                     const std::optional<at::Tensor>& gamma, const at::Tensor& count,
                                     const at::Tensor& grad_sums, double epsilon,
                                     c10::string_view data_format) {
  const ChannelPlan plan =
      check_grad_input_args(src, diff_dst, mean, variance, gamma, count, grad_sums, epsilon, data_format);
  KernelOutput out = make_kernel_output(src, plan, output_allocator());
  if (src.numel() == 0) return out.result;

  // diff_src = a * dy + b * (x - mean) + c with, per channel, a = g * rstd,
  // b = -a * rstd^2 * sum_dy_xc / count and c = -a * sum_dy / count.
  const int64_t C = plan.channels;
  const at::Tensor gamma_d = to_kernel_channels(gamma, plan, at::kDouble, 1, src);
  const at::Tensor var_d = variance.contiguous();
  const at::Tensor count_d = count.contiguous();
  const at::Tensor sums_d = grad_sums.contiguous();
  at::Tensor coefficients = at::empty({3, C}, src.options().dtype(at::kDouble));
  const double* g = gamma_d.const_data_ptr<double>();
  const double* v = var_d.const_data_ptr<double>();
  const double* n = count_d.const_data_ptr<double>();
  const double* sum_dy = sums_d.const_data_ptr<double>();
  const double* sum_dy_xc = sum_dy + C;
  double* a = coefficients.mutable_data_ptr<double>();
  double* b = a + C;
  double* c = b + C;
  for (int64_t k = 0; k < C; ++k) {
    const double rstd = 1.0 / std::sqrt(v[k] + epsilon);
    // src is not empty, so a count below 1 means the arguments are inconsistent;
    // it still must not divide by zero.
    const double inv_n = n[k] >= 1 ? 1.0 / n[k] : 0.0;
    a[k] = g[k] * rstd;
    b[k] = -a[k] * rstd * rstd * sum_dy_xc[k] * inv_n;
    c[k] = -a[k] * sum_dy[k] * inv_n;
  }
  const auto acc = accumulate_type(src.scalar_type());
  const at::Tensor coefficients_acc = coefficients.to(acc);
  kernel_table().grad_input(to_kernel_layout(src, plan), to_kernel_layout(diff_dst, plan), out.buffer,
                            {plan.outer, plan.channels, plan.inner}, to_kernel_channels(mean, plan, acc, 0, src),
                            coefficients_acc[0], coefficients_acc[1], coefficients_acc[2]);
  finish_kernel_output(out, plan);
  return out.result;
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_bn_grad, CPU, m) {
  m.impl("batch_norm_local_stats", &batch_norm_local_stats_cpu);
  m.impl("batch_norm_grad_sums", &batch_norm_grad_sums_cpu);
  m.impl("batch_norm_grad_input", &batch_norm_grad_input_cpu);
}

}  // namespace torch_bn_grad::cpu
