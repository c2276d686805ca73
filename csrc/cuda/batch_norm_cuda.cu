// CUDA implementations of the fused operators. Same contract and per-channel
// math (batch_norm_math.h) as csrc/cpu/batch_norm_cpu.cpp: validate, view the
// data as [outer, channels, inner], reduce, derive the per-channel
// coefficients in float64 on the device, then run one elementwise pass; or,
// for the training forward and backward of shapes a block can hold, all of it
// in one persistent kernel that reads the data once. The kernels and their
// launches are in the headers of this folder (csrc/README.md).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>

#include "batch_norm_args.h"
#include "batch_norm_math.h"
#include "cuda/coefficient_kernels.cuh"
#include "cuda/launch.cuh"

namespace torch_bn_grad::cuda {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_forward_cuda(
    const at::Tensor& src, const std::optional<at::Tensor>& gamma,
    const std::optional<at::Tensor>& beta, const std::optional<at::Tensor>& mean,
    const std::optional<at::Tensor>& variance, double epsilon, c10::string_view data_format) {
  const ChannelPlan plan = check_forward_args(src, gamma, beta, mean, variance, epsilon, data_format);
  const c10::cuda::CUDAGuard guard(src.device());
  const auto acc = accumulate_type(src.scalar_type());
  const Extent e = plan.extent();
  const bool batch_statistics = !mean.has_value();

  // Per-channel vectors in kernel order, of the accumulation type; var_k is
  // only needed as an output (batch statistics).
  at::Tensor mean_k = channel_vector(plan, src, acc);
  at::Tensor var_k = batch_statistics ? channel_vector(plan, src, acc) : at::Tensor();
  KernelOutput out = make_kernel_output(src, plan);
  if (src.numel() > 0) {
    const at::Tensor x = to_kernel_layout(src, plan);
    const ChannelValues gamma_v = channel_values(gamma, plan, src);
    const ChannelValues beta_v = channel_values(beta, plan, src);
    at::Tensor x_scale = channel_vector(plan, src, acc);
    at::Tensor bias = channel_vector(plan, src, acc);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "batch_norm_forward_cuda", [&] {
      using A = Acc<scalar_t>;
      ForwardCoefficientArgs<A> args{};
      args.gamma = gamma_v.in;
      args.beta = beta_v.in;
      args.epsilon = epsilon;
      args.channels = e.channels;
      args.affine = {mean_k.mutable_data_ptr<A>(), nullptr, x_scale.mutable_data_ptr<A>(),
                     bias.mutable_data_ptr<A>()};
      if (batch_statistics) {
        args.variance_out = var_k.mutable_data_ptr<A>();
        if (persistent_forward<scalar_t>(x, out.buffer, e, args)) return;
      }
      Partials<Moments<double>> partials;  // these stay alive until the kernels are queued
      ChannelValues mean_v, var_v;
      if (batch_statistics) {
        partials = moment_partials<scalar_t>(x, e);
        args.partials = partials.data;
        args.per_channel = partials.per_channel;
      } else {
        mean_v = channel_values(mean, plan, src);
        var_v = channel_values(variance, plan, src);
        args.mean = mean_v.in;
        args.variance = var_v.in;
      }
      forward_coefficients(args);

      const math::AffineArrays<A> c{mean_k.const_data_ptr<A>(), nullptr, x_scale.const_data_ptr<A>(),
                                    bias.const_data_ptr<A>()};
      apply_affine<scalar_t, false>(x, nullptr, out.buffer, e, c);
    });
    finish_kernel_output(out, plan);
  } else if (batch_statistics) {
    // Empty batch: NaN statistics, as a mean over nothing.
    mean_k.fill_(std::numeric_limits<double>::quiet_NaN());
    var_k.fill_(std::numeric_limits<double>::quiet_NaN());
  }

  if (!batch_statistics) {
    return {out.result, mean->clone(at::MemoryFormat::Contiguous),
            variance->clone(at::MemoryFormat::Contiguous)};
  }
  return {out.result, from_kernel_channels(mean_k, plan, acc, src),
          from_kernel_channels(var_k, plan, acc, src)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_backward_cuda(
    const at::Tensor& src, const at::Tensor& diff_dst, const at::Tensor& mean,
    const at::Tensor& variance, const std::optional<at::Tensor>& gamma, double epsilon,
    c10::string_view data_format, bool training, std::array<bool, 3> output_mask) {
  const ChannelPlan plan =
      check_backward_args(src, diff_dst, mean, variance, gamma, epsilon, data_format);
  const c10::cuda::CUDAGuard guard(src.device());
  const auto acc = accumulate_type(src.scalar_type());
  const Extent e = plan.extent();
  const int64_t M = plan.reduced_count();
  const bool need_sums = training || output_mask[1] || output_mask[2];
  const bool need_diff_src = output_mask[0] && src.numel() > 0;

  const auto stats_dtype = mean.scalar_type();
  KernelOutput out;
  if (output_mask[0]) out = make_kernel_output(src, plan);
  const ChannelResult dg = output_mask[1] ? channel_result(plan, stats_dtype, src) : ChannelResult{};
  const ChannelResult db = output_mask[2] ? channel_result(plan, stats_dtype, src) : ChannelResult{};

  if (e.channels > 0 && (need_diff_src || output_mask[1] || output_mask[2])) {
    const at::Tensor x = to_kernel_layout(src, plan);
    const at::Tensor mean_k = to_kernel_channels(mean, plan, acc, 0, src);
    const ChannelValues var_v = channel_values(variance, plan, src);
    const ChannelValues gamma_v = channel_values(gamma, plan, src);
    at::Tensor dy;
    if (need_diff_src || (need_sums && M > 0)) dy = to_kernel_layout(diff_dst, plan);
    at::Tensor dy_scale, x_scale, bias;
    if (need_diff_src) {
      dy_scale = channel_vector(plan, src, acc);
      x_scale = channel_vector(plan, src, acc);
      bias = channel_vector(plan, src, acc);
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "batch_norm_backward_cuda", [&] {
      using A = Acc<scalar_t>;
      BackwardCoefficientArgs<A> args{};
      args.mean = mean_k.const_data_ptr<A>();
      args.variance = var_v.in;
      args.gamma = gamma_v.in;
      args.epsilon = epsilon;
      args.channels = e.channels;
      args.reduced = M;
      args.training = training;
      if (need_diff_src) {
        args.affine = {nullptr, dy_scale.mutable_data_ptr<A>(), x_scale.mutable_data_ptr<A>(),
                       bias.mutable_data_ptr<A>()};
      }
      args.diff_gamma = dg.out;
      args.diff_beta = db.out;
      Partials<GradSums<double>> partials;  // alive until the kernels are queued
      if (need_sums && M > 0) {
        scalar_t* dst = need_diff_src ? out.buffer.mutable_data_ptr<scalar_t>() : nullptr;
        if (persistent_backward<scalar_t>(x, dy, mean_k, dst, e, args)) return;
        partials = grad_sum_partials<scalar_t>(x, dy, mean_k, e);
        args.partials = partials.data;
        args.per_channel = partials.per_channel;
      }
      backward_coefficients(args);

      if (need_diff_src) {
        const math::AffineArrays<A> coef{mean_k.const_data_ptr<A>(), dy_scale.const_data_ptr<A>(),
                                         x_scale.const_data_ptr<A>(), bias.const_data_ptr<A>()};
        apply_affine<scalar_t, true>(x, dy.const_data_ptr<scalar_t>(), out.buffer, e, coef);
      }
    });
    if (need_diff_src) finish_kernel_output(out, plan);
  }

  return {output_mask[0] ? out.result : at::empty({0}, src.options()),
          output_mask[1] ? dg.finish(plan, stats_dtype, src) : at::empty({0}, mean.options()),
          output_mask[2] ? db.finish(plan, stats_dtype, src) : at::empty({0}, mean.options())};
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_bn_grad, CUDA, m) {
  m.impl("batch_norm_forward", &batch_norm_forward_cuda);
  m.impl("batch_norm_backward", &batch_norm_backward_cuda);
}

}  // namespace torch_bn_grad::cuda
