// CPU implementations of the operators: validate, lay the data out as
// [outer, channels, inner], and run the kernels of the running CPU's
// instruction set. Per-channel tensors travel as float64 vectors.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>
#include <limits>

#include "batch_norm_args.h"
#include "cpu/kernels/kernel_table.h"
#include "cpu/output_cache.h"

namespace torch_bn_grad::cpu {
namespace {

at::Tensor channel_vector(const ChannelPlan& plan, const at::Tensor& like) {
  return at::empty({plan.channels}, like.options().dtype(at::kDouble));
}

// A contiguous copy of a small per-channel tensor: a plain memcpy where it
// can be (clone's dispatch costs more than copying a few channels).
at::Tensor contiguous_copy(const at::Tensor& t) {
  if (!t.is_contiguous()) return t.clone(at::MemoryFormat::Contiguous);
  at::Tensor copy = at::empty(t.sizes(), t.options());
  std::memcpy(copy.mutable_data_ptr(), t.const_data_ptr(), t.nbytes());
  return copy;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_forward_cpu(
    const at::Tensor& src, const std::optional<at::Tensor>& gamma,
    const std::optional<at::Tensor>& beta, const std::optional<at::Tensor>& mean,
    const std::optional<at::Tensor>& variance, double epsilon, c10::string_view data_format) {
  const ChannelPlan plan = check_forward_args(src, gamma, beta, mean, variance, epsilon, data_format);
  const Extent e = plan.extent();
  const at::Tensor x = to_kernel_layout(src, plan);
  const at::Tensor gamma_d = to_kernel_channels(gamma, plan, at::kDouble, 1, src);
  const at::Tensor beta_d = to_kernel_channels(beta, plan, at::kDouble, 0, src);
  KernelOutput out = make_kernel_output(src, plan, output_allocator());

  if (mean.has_value()) {
    if (src.numel() > 0) {
      kernel_table().forward_frozen(x, out.buffer, e, to_kernel_channels(mean, plan, at::kDouble, 0, src),
                                    to_kernel_channels(variance, plan, at::kDouble, 0, src), gamma_d,
                                    beta_d, epsilon);
      finish_kernel_output(out, plan);
    }
    return {out.result, contiguous_copy(*mean), contiguous_copy(*variance)};
  }

  at::Tensor mean_d = channel_vector(plan, src);
  at::Tensor var_d = channel_vector(plan, src);
  if (plan.reduced_count() == 0) {
    mean_d.fill_(std::numeric_limits<double>::quiet_NaN());
    var_d.fill_(std::numeric_limits<double>::quiet_NaN());
  } else if (src.numel() > 0) {
    kernel_table().forward_batch(x, out.buffer, e, gamma_d, beta_d, epsilon, mean_d, var_d);
    finish_kernel_output(out, plan);
  }
  const auto stats_dtype = accumulate_type(src.scalar_type());
  return {out.result, from_kernel_channels(mean_d, plan, stats_dtype, src),
          from_kernel_channels(var_d, plan, stats_dtype, src)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_backward_cpu(
    const at::Tensor& src, const at::Tensor& diff_dst, const at::Tensor& mean,
    const at::Tensor& variance, const std::optional<at::Tensor>& gamma, double epsilon,
    c10::string_view data_format, bool training, std::array<bool, 3> output_mask) {
  const ChannelPlan plan =
      check_backward_args(src, diff_dst, mean, variance, gamma, epsilon, data_format);
  const auto stats_dtype = mean.scalar_type();
  // The kernel writes every channel; only an empty src leaves the sums at zero.
  const auto channel_sums = [&](bool wanted) {
    if (!wanted) return at::Tensor();
    at::Tensor v = channel_vector(plan, src);
    if (src.numel() == 0) v.zero_();
    return v;
  };
  at::Tensor diff_gamma_d = channel_sums(output_mask[1]);
  at::Tensor diff_beta_d = channel_sums(output_mask[2]);
  KernelOutput out;
  if (output_mask[0]) out = make_kernel_output(src, plan, output_allocator());

  if (src.numel() > 0 && (output_mask[0] || output_mask[1] || output_mask[2])) {
    kernel_table().backward(to_kernel_layout(src, plan), to_kernel_layout(diff_dst, plan), out.buffer,
                            plan.extent(), to_kernel_channels(mean, plan, at::kDouble, 0, src),
                            to_kernel_channels(variance, plan, at::kDouble, 0, src),
                            to_kernel_channels(gamma, plan, at::kDouble, 1, src), epsilon, training,
                            diff_gamma_d, diff_beta_d);
    if (output_mask[0]) finish_kernel_output(out, plan);
  }
  return {output_mask[0] ? out.result : at::empty({0}, src.options()),
          output_mask[1] ? from_kernel_channels(diff_gamma_d, plan, stats_dtype, src) : at::empty({0}, mean.options()),
          output_mask[2] ? from_kernel_channels(diff_beta_d, plan, stats_dtype, src) : at::empty({0}, mean.options())};
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_bn_grad, CPU, m) {
  m.impl("batch_norm_forward", &batch_norm_forward_cpu);
  m.impl("batch_norm_backward", &batch_norm_backward_cpu);
}

}  // namespace torch_bn_grad::cpu
