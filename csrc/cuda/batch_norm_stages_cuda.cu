// CUDA implementations of the split-stage operators and of the compile
// lowering's statistics stage (see library/schemas.cpp), like
// csrc/cpu/batch_norm_stages_cpu.cpp: the same partial reductions and
// elementwise pass as the fused operators, with the per-channel rows written
// as float64 and the coefficients derived on the device from tensors (no host
// reads). With 1-D statistics the kernel channel order is the logical one.
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <limits>
#include <tuple>

#include "dtypes.h"
#include "args/batch_norm_args.h"
#include "cuda/coefficient_kernels.cuh"
#include "cuda/launch.cuh"
#include "library/signatures.h"
#include "math/batch_norm_math.h"
#include "math/extent.h"

namespace torch_bn_grad::cuda {

at::Tensor batch_norm_local_stats_cuda(TBG_PARAMS(batch_norm_local_stats)) {
  const ChannelPlan plan = check_local_stats_args(src, data_format);
  const c10::cuda::CUDAGuard guard(src.device());
  const Extent e = plan.extent();
  at::Tensor rows = at::zeros({3, e.channels}, src.options().dtype(at::kDouble));
  if (src.numel() == 0) return rows;
  const at::Tensor x = to_kernel_layout(src, plan);
  TBG_DISPATCH_DATA_DTYPE(src.scalar_type(), "batch_norm_local_stats_cuda", [&] {
    using A = Acc<scalar_t>;
    const Partials<Moments<double>> partials = moment_partials<scalar_t>(x, e);
    launch_channel_groups(e.channels, partials.per_channel, [&](auto group, dim3 grid) {
      stats_rows_kernel<A, decltype(group)::value><<<grid, kThreads, 0, stream()>>>(
          partials.data, partials.per_channel, e.channels, rows.mutable_data_ptr<double>());
    });
  });
  return rows;
}

// batch_norm_forward's statistics and coefficients without its elementwise
// pass: the same partials and forward_coefficients_kernel.
Outputs4 batch_norm_stats_affine_cuda(TBG_PARAMS(batch_norm_stats_affine)) {
  const ChannelPlan plan = check_forward_args(src, gamma, beta, std::nullopt, std::nullopt, epsilon, data_format);
  const c10::cuda::CUDAGuard guard(src.device());
  const auto acc = accumulation_dtype(src.scalar_type());
  const Extent e = plan.extent();
  at::Tensor mean_k = channel_vector(plan, src, acc), var_k = channel_vector(plan, src, acc),
             x_scale = channel_vector(plan, src, acc), bias = channel_vector(plan, src, acc);
  if (src.numel() == 0) {
    // An empty batch: NaN, as a mean over nothing.
    for (at::Tensor* t : {&mean_k, &var_k, &x_scale, &bias}) t->fill_(std::numeric_limits<double>::quiet_NaN());
  } else {
    const at::Tensor x = to_kernel_layout(src, plan);
    const at::Tensor gamma_d = optional_channels(gamma, plan, src);
    const at::Tensor beta_d = optional_channels(beta, plan, src);
    TBG_DISPATCH_DATA_DTYPE(src.scalar_type(), "batch_norm_stats_affine_cuda", [&] {
      using A = Acc<scalar_t>;
      const Partials<Moments<double>> partials = moment_partials<scalar_t>(x, e);
      ForwardCoefficientArgs<A> args{};
      args.partials = partials.data;
      args.per_channel = partials.per_channel;
      args.gamma = channel_in(gamma_d);
      args.beta = channel_in(beta_d);
      args.epsilon = epsilon;
      args.channels = e.channels;
      args.variance_out = var_k.mutable_data_ptr<A>();
      args.affine = {mean_k.mutable_data_ptr<A>(), nullptr, x_scale.mutable_data_ptr<A>(),
                     bias.mutable_data_ptr<A>()};
      forward_coefficients(args);
    });
  }
  const auto result = [&](const at::Tensor& v) { return from_kernel_channels(v, plan, acc, src); };
  return {result(mean_k), result(var_k), result(x_scale), result(bias)};
}

at::Tensor batch_norm_grad_sums_cuda(TBG_PARAMS(batch_norm_grad_sums)) {
  const ChannelPlan plan = check_grad_sums_args(src, diff_dst, mean, data_format);
  const c10::cuda::CUDAGuard guard(src.device());
  const Extent e = plan.extent();
  at::Tensor rows = at::zeros({2, e.channels}, src.options().dtype(at::kDouble));
  if (src.numel() == 0) return rows;
  const at::Tensor x = to_kernel_layout(src, plan);
  const at::Tensor dy = to_kernel_layout(diff_dst, plan);
  // The sums are taken about the mean rounded to the accumulation type, then
  // re-centred on the given mean.
  const at::Tensor mean_d = mean.contiguous();
  const at::Tensor centre = mean_d.to(accumulation_dtype(src.scalar_type()));
  TBG_DISPATCH_DATA_DTYPE(src.scalar_type(), "batch_norm_grad_sums_cuda", [&] {
    using A = Acc<scalar_t>;
    const Partials<GradSums<double>> partials = grad_sum_partials<scalar_t>(x, dy, centre, e);
    launch_channel_groups(e.channels, partials.per_channel, [&](auto group, dim3 grid) {
      grad_sums_rows_kernel<A, decltype(group)::value><<<grid, kThreads, 0, stream()>>>(
          partials.data, partials.per_channel, mean_d.const_data_ptr<double>(), centre.const_data_ptr<A>(),
          e.channels, rows.mutable_data_ptr<double>());
    });
  });
  return rows;
}

at::Tensor batch_norm_grad_input_cuda(TBG_PARAMS(batch_norm_grad_input)) {
  const ChannelPlan plan =
      check_grad_input_args(src, diff_dst, mean, variance, gamma, count, grad_sums, epsilon, data_format);
  const c10::cuda::CUDAGuard guard(src.device());
  KernelOutput out = make_kernel_output(src, plan);
  if (src.numel() == 0) return out.result;
  const auto acc = accumulation_dtype(src.scalar_type());
  const Extent e = plan.extent();
  const at::Tensor x = to_kernel_layout(src, plan);
  const at::Tensor dy = to_kernel_layout(diff_dst, plan);
  const at::Tensor mean_d = mean.contiguous();
  const at::Tensor gamma_d = optional_channels(gamma, plan, src);
  const at::Tensor variance_d = variance.contiguous();
  const at::Tensor count_d = count.contiguous();
  const at::Tensor sums_d = grad_sums.contiguous();
  const at::Tensor scratch = channel_vectors(plan, src, acc, 4);  // mean, dy_scale, x_scale, bias
  TBG_DISPATCH_DATA_DTYPE(src.scalar_type(), "batch_norm_grad_input_cuda", [&] {
    using A = Acc<scalar_t>;
    const dim3 grid(static_cast<unsigned>(ceil_div(e.channels, kThreads)));
    A* const v = scratch.mutable_data_ptr<A>();
    const int64_t C = e.channels;
    const AffineOutputs<A> affine{v, v + C, v + 2 * C, v + 3 * C};
    grad_input_coefficients_kernel<A><<<grid, kThreads, 0, stream()>>>(
        mean_d.const_data_ptr<double>(), variance_d.const_data_ptr<double>(), optional_data(gamma_d),
        count_d.const_data_ptr<double>(), sums_d.const_data_ptr<double>(), epsilon, e.channels, affine);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const math::AffineArrays<A> coef{v, v + C, v + 2 * C, v + 3 * C};
    apply_affine<scalar_t, true>(x, dy.const_data_ptr<scalar_t>(), out.buffer, e, coef);
  });
  finish_kernel_output(out, plan);
  return out.result;
}

}  // namespace torch_bn_grad::cuda
