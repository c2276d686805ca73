// CPU implementations of the operators: validate, lay the data out as
// [outer, channels, inner], compute the per-channel coefficients in float64,
// and run the kernels of the running CPU's instruction set.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "batch_norm_args.h"
#include "cpu/kernels/kernel_table.h"

namespace torch_bn_grad::cpu {
namespace {

Extent extent_of(const ChannelPlan& plan) { return {plan.outer, plan.channels, plan.inner}; }

at::Tensor channel_vector(const ChannelPlan& plan, const at::Tensor& like, at::ScalarType dtype) {
  return at::empty({plan.channels}, like.options().dtype(dtype));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_forward_cpu(
    const at::Tensor& src, const std::optional<at::Tensor>& gamma,
    const std::optional<at::Tensor>& beta, const std::optional<at::Tensor>& mean,
    const std::optional<at::Tensor>& variance, double epsilon, c10::string_view data_format) {
  const ChannelPlan plan = check_forward_args(src, gamma, beta, mean, variance, epsilon, data_format);
  const auto acc = accumulate_type(src.scalar_type());
  const Extent e = extent_of(plan);
  const int64_t C = plan.channels;
  const bool batch_statistics = !mean.has_value();
  const at::Tensor x = to_kernel_layout(src, plan);

  at::Tensor mean_d, var_d;  // float64, kernel channel order
  if (batch_statistics) {
    mean_d = channel_vector(plan, src, at::kDouble);
    var_d = channel_vector(plan, src, at::kDouble);
    if (plan.reduced_count() == 0) {
      mean_d.fill_(std::numeric_limits<double>::quiet_NaN());
      var_d.fill_(std::numeric_limits<double>::quiet_NaN());
    } else if (C > 0) {
      kernel_table().batch_stats(x, e, mean_d, var_d);
    }
  } else {
    mean_d = to_kernel_channels(mean, plan, at::kDouble, 0, src);
    var_d = to_kernel_channels(variance, plan, at::kDouble, 0, src);
  }

  // dst = (x - mean) * scale + shift with scale = gamma * rstd. The kernel
  // subtracts mean rounded to the accumulation type (mean_k); the rounding
  // error (mean - mean_k) * scale is folded into shift, in float64. With a
  // large mean (1000 + unit noise) this keeps dst's error at the level of its
  // own rounding instead of mean's (the difference x - mean_k is then exact).
  const at::Tensor gamma_d = to_kernel_channels(gamma, plan, at::kDouble, 1, src);
  const at::Tensor beta_d = to_kernel_channels(beta, plan, at::kDouble, 0, src);
  const at::Tensor mean_k = mean_d.to(acc);
  const at::Tensor mean_k_d = mean_k.to(at::kDouble);
  at::Tensor scale_d = channel_vector(plan, src, at::kDouble);
  at::Tensor shift_d = channel_vector(plan, src, at::kDouble);
  {
    const double* m = mean_d.const_data_ptr<double>();
    const double* mk = mean_k_d.const_data_ptr<double>();
    const double* v = var_d.const_data_ptr<double>();
    const double* g = gamma_d.const_data_ptr<double>();
    const double* bt = beta_d.const_data_ptr<double>();
    double* s = scale_d.mutable_data_ptr<double>();
    double* sh = shift_d.mutable_data_ptr<double>();
    for (int64_t k = 0; k < C; ++k) {
      s[k] = g[k] / std::sqrt(v[k] + epsilon);
      sh[k] = bt[k] - (m[k] - mk[k]) * s[k];
    }
  }
  KernelOutput out = make_kernel_output(src, plan);
  if (src.numel() > 0) {
    kernel_table().normalize(x, out.buffer, e, mean_k, scale_d.to(acc), shift_d.to(acc));
    finish_kernel_output(out, plan);
  }

  const auto stats_dtype = batch_statistics ? acc : mean->scalar_type();
  if (!batch_statistics) {
    return {out.result, mean->clone(at::MemoryFormat::Contiguous),
            variance->clone(at::MemoryFormat::Contiguous)};
  }
  return {out.result, from_kernel_channels(mean_d, plan, stats_dtype, src),
          from_kernel_channels(var_d, plan, stats_dtype, src)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_backward_cpu(
    const at::Tensor& src, const at::Tensor& diff_dst, const at::Tensor& mean,
    const at::Tensor& variance, const std::optional<at::Tensor>& gamma, double epsilon,
    c10::string_view data_format, bool training, std::array<bool, 3> output_mask) {
  const ChannelPlan plan =
      check_backward_args(src, diff_dst, mean, variance, gamma, epsilon, data_format);
  const auto acc = accumulate_type(src.scalar_type());
  const auto stats_dtype = mean.scalar_type();
  const Extent e = extent_of(plan);
  const int64_t C = plan.channels;
  const int64_t M = plan.reduced_count();
  const at::Tensor x = to_kernel_layout(src, plan);
  const at::Tensor mean_k = to_kernel_channels(mean, plan, acc, 0, src);
  const at::Tensor var_d = to_kernel_channels(variance, plan, at::kDouble, 0, src);
  const at::Tensor gamma_d = to_kernel_channels(gamma, plan, at::kDouble, 1, src);

  const bool need_sums = training || output_mask[1] || output_mask[2];
  at::Tensor sum_dy = at::zeros({C}, src.options().dtype(at::kDouble));
  at::Tensor sum_dy_xc = at::zeros({C}, src.options().dtype(at::kDouble));
  at::Tensor dy;
  if (output_mask[0] || need_sums) dy = to_kernel_layout(diff_dst, plan);
  if (need_sums && M > 0 && C > 0) kernel_table().grad_sums(x, dy, e, mean_k, sum_dy, sum_dy_xc);

  std::vector<double> rstd(C);
  const double* v = var_d.const_data_ptr<double>();
  for (int64_t k = 0; k < C; ++k) rstd[k] = 1.0 / std::sqrt(v[k] + epsilon);

  at::Tensor diff_src = at::empty({0}, src.options());
  if (output_mask[0]) {
    // diff_src = a * dy + b * (x - mean) + c with, per channel,
    // a = g * rstd, b = -a * rstd^2 * sum(dy * xc) / M, c = -a * sum(dy) / M
    // (b = c = 0 for frozen statistics).
    at::Tensor a = channel_vector(plan, src, at::kDouble);
    at::Tensor b = at::zeros({C}, src.options().dtype(at::kDouble));
    at::Tensor c = at::zeros({C}, src.options().dtype(at::kDouble));
    const double* g = gamma_d.const_data_ptr<double>();
    const double* sd = sum_dy.const_data_ptr<double>();
    const double* sx = sum_dy_xc.const_data_ptr<double>();
    double* pa = a.mutable_data_ptr<double>();
    double* pb = b.mutable_data_ptr<double>();
    double* pc = c.mutable_data_ptr<double>();
    for (int64_t k = 0; k < C; ++k) {
      pa[k] = g[k] * rstd[k];
      if (training && M > 0) {
        pb[k] = -pa[k] * rstd[k] * rstd[k] * sx[k] / static_cast<double>(M);
        pc[k] = -pa[k] * sd[k] / static_cast<double>(M);
      }
    }
    KernelOutput out = make_kernel_output(src, plan);
    if (src.numel() > 0) {
      kernel_table().grad_input(x, dy, out.buffer, e, mean_k, a.to(acc), b.to(acc), c.to(acc));
      finish_kernel_output(out, plan);
    }
    diff_src = out.result;
  }

  at::Tensor diff_gamma = at::empty({0}, mean.options());
  at::Tensor diff_beta = at::empty({0}, mean.options());
  if (output_mask[1]) {
    at::Tensor dg = channel_vector(plan, src, at::kDouble);
    const double* sx = sum_dy_xc.const_data_ptr<double>();
    double* p = dg.mutable_data_ptr<double>();
    for (int64_t k = 0; k < C; ++k) p[k] = rstd[k] * sx[k];
    diff_gamma = from_kernel_channels(dg, plan, stats_dtype, src);
  }
  if (output_mask[2]) diff_beta = from_kernel_channels(sum_dy, plan, stats_dtype, src);
  return {diff_src, diff_gamma, diff_beta};
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_bn_grad, CPU, m) {
  m.impl("batch_norm_forward", &batch_norm_forward_cpu);
  m.impl("batch_norm_backward", &batch_norm_backward_cpu);
}

}  // namespace torch_bn_grad::cpu
