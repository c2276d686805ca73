// CPU implementations of the split-stage operators (see library/schemas.cpp): the
// per-process pieces of a batch norm whose statistics span several processes,
// and the statistics stage of the torch.compile lowering.
// They run the same kernels as the fused operators; per-channel values are
// float64 in logical channel order, which for 1-D statistics is also the
// kernels' channel order.
#include <ATen/ATen.h>

#include <limits>
#include <tuple>

#include "dtypes.h"
#include "args/batch_norm_args.h"
#include "cpu/aligned_array.h"
#include "cpu/kernels/kernel_table.h"
#include "cpu/output_cache.h"
#include "library/signatures.h"
#include "math/batch_norm_math.h"

namespace torch_bn_grad::cpu {

at::Tensor batch_norm_local_stats_cpu(TBG_PARAMS(batch_norm_local_stats)) {
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

namespace {

// The per-channel vectors are computed in float64 and rounded once to the
// accumulation type A, exactly as the forward kernel's coefficients are.
template <typename A>
void stats_affine_channels(const ChannelPlan& plan, const double* gamma, const double* beta, double epsilon,
                           double* mean, double* var, double* scale, double* bias) {
  const double count = static_cast<double>(plan.reduced_count());
  for (int64_t k = 0; k < plan.channels; ++k) {
    var[k] = math::variance_of(math::Moments<double, double>{count, mean[k], var[k]});
    const math::ChannelAffine<A> c =
        math::channel_affine<A>(mean[k], math::forward_coefficients(var[k], gamma[k], beta[k], epsilon));
    scale[k] = static_cast<double>(c.x_scale);
    bias[k] = static_cast<double>(c.bias);
  }
}

}  // namespace

Outputs4 batch_norm_stats_affine_cpu(TBG_PARAMS(batch_norm_stats_affine)) {
  const ChannelPlan plan = check_forward_args(src, gamma, beta, std::nullopt, std::nullopt, epsilon, data_format);
  const int64_t C = plan.channels;
  // Per-channel float64 vectors: gamma, beta, mean, variance (m2 until finished), scale, bias.
  const auto host = aligned_array<double>(6 * C, std::numeric_limits<double>::quiet_NaN());
  double *gamma_d = host.get(), *beta_d = gamma_d + C, *mean_d = beta_d + C, *var_d = mean_d + C,
         *scale_d = var_d + C, *bias_d = scale_d + C;
  load_kernel_channels(gamma, plan, 1, src, gamma_d);
  load_kernel_channels(beta, plan, 0, src, beta_d);
  const auto stats_dtype = accumulation_dtype(src.scalar_type());
  if (plan.reduced_count() > 0 && C > 0) {
    kernel_table().batch_moments(to_kernel_layout(src, plan), plan.extent(), mean_d, var_d);
    if (stats_dtype == at::kDouble) {
      stats_affine_channels<double>(plan, gamma_d, beta_d, epsilon, mean_d, var_d, scale_d, bias_d);
    } else {
      stats_affine_channels<float>(plan, gamma_d, beta_d, epsilon, mean_d, var_d, scale_d, bias_d);
    }
  }
  const auto result = [&](const double* v) { return kernel_channels_result(v, plan, stats_dtype, src); };
  return {result(mean_d), result(var_d), result(scale_d), result(bias_d)};
}

at::Tensor batch_norm_grad_sums_cpu(TBG_PARAMS(batch_norm_grad_sums)) {
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

at::Tensor batch_norm_grad_input_cpu(TBG_PARAMS(batch_norm_grad_input)) {
  const ChannelPlan plan =
      check_grad_input_args(src, diff_dst, mean, variance, gamma, count, grad_sums, epsilon, data_format);
  KernelOutput out = make_kernel_output(src, plan, output_allocator());
  if (src.numel() == 0) return out.result;

  // The coefficients (math::backward_coefficients) are derived by the kernels.
  const at::Tensor mean_c = mean.contiguous(), var_c = variance.contiguous(), count_c = count.contiguous(),
                   sums_c = grad_sums.contiguous();
  const auto gamma_d = aligned_array_for_overwrite<double>(plan.channels);
  load_kernel_channels(gamma, plan, 1, src, gamma_d.get());
  kernel_table().grad_input(to_kernel_layout(src, plan), to_kernel_layout(diff_dst, plan), out.buffer,
                            plan.extent(), mean_c.const_data_ptr<double>(), var_c.const_data_ptr<double>(),
                            gamma_d.get(), count_c.const_data_ptr<double>(), sums_c.const_data_ptr<double>(),
                            epsilon);
  finish_kernel_output(out, plan);
  return out.result;
}

}  // namespace torch_bn_grad::cpu
