// CPU implementations of the split-stage operators (see ops.cpp): the
// per-process pieces of a batch norm whose statistics span several processes.
// They run the same kernels as the fused operators; per-channel values are
// float64 in logical channel order, which for 1-D statistics is also the
// kernels' channel order.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

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
    double* rows = stats.mutable_data_ptr<double>();
    kernel_table().batch_moments(to_kernel_layout(src, plan), plan.extent(), rows + plan.channels,
                                 rows + 2 * plan.channels);
    stats[0].fill_(static_cast<double>(count));
  }
  return stats;
}

at::Tensor batch_norm_grad_sums_cpu(const at::Tensor& src, const at::Tensor& diff_dst,
                                    const at::Tensor& mean, c10::string_view data_format) {
  const ChannelPlan plan = check_grad_sums_args(src, diff_dst, mean, data_format);
  at::Tensor sums = at::zeros({2, plan.channels}, src.options().dtype(at::kDouble));
  if (plan.reduced_count() > 0 && plan.channels > 0) {
    const at::Tensor mean_c = mean.contiguous();
    double* rows = sums.mutable_data_ptr<double>();
    kernel_table().grad_sums(to_kernel_layout(src, plan), to_kernel_layout(diff_dst, plan), plan.extent(),
                             mean_c.const_data_ptr<double>(), rows, rows + plan.channels);
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

  // The coefficients (math::backward_coefficients) are derived by the kernels.
  const at::Tensor mean_c = mean.contiguous(), var_c = variance.contiguous(), count_c = count.contiguous(),
                   sums_c = grad_sums.contiguous();
  std::vector<double> gamma_d(plan.channels);
  load_kernel_channels(gamma, plan, 1, src, gamma_d.data());
  kernel_table().grad_input(to_kernel_layout(src, plan), to_kernel_layout(diff_dst, plan), out.buffer,
                            plan.extent(), mean_c.const_data_ptr<double>(), var_c.const_data_ptr<double>(),
                            gamma_d.data(), count_c.const_data_ptr<double>(), sums_c.const_data_ptr<double>(),
                            epsilon);
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
