// CUDA implementations of the fused operators. Same contract and per-channel
// math (batch_norm_math.h) as csrc/cpu/batch_norm_cpu.cpp: validate, view the
// data as [outer, channels, inner], reduce, derive the per-channel
// coefficients in float64 on the device, then run one elementwise pass; or,
// for the training forward and backward of shapes a block can hold, all of it
// in one persistent kernel that reads the data once. The forward's driver is
// shared with the fused batch_norm_act operators (forward.cuh); the kernels
// and their launches are in the headers of this folder (csrc/README.md).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <limits>
#include <optional>

#include "dtypes.h"
#include "args/batch_norm_args.h"
#include "cuda/coefficient_kernels.cuh"
#include "cuda/forward.cuh"
#include "cuda/launch.cuh"
#include "cuda/running_stats_cuda.h"
#include "cuda/running_update.cuh"
#include "library/signatures.h"
#include "math/batch_norm_math.h"

namespace torch_bn_grad::cuda {

Outputs3 batch_norm_forward_cuda(TBG_PARAMS(batch_norm_forward)) {
  const ChannelPlan plan = check_forward_args(src, gamma, beta, mean, variance, epsilon, data_format);
  return forward_cuda(plan, src, gamma, beta, mean, variance, epsilon,
                      [](auto, const auto& run) { run(PlainEpilogue{}); });
}

std::optional<Outputs3> forward_updating(const ChannelPlan& plan, const at::Tensor& src, const OptionalTensor& gamma,
                                         const OptionalTensor& beta, double epsilon, const RunningBuffers& buffers) {
  const std::optional<RunningUpdate> running = running_update_for(plan, src, buffers);
  if (!running) return std::nullopt;
  return forward_cuda(plan, src, gamma, beta, std::nullopt, std::nullopt, epsilon,
                      [](auto, const auto& run) { run(PlainEpilogue{}); }, *running);
}

Outputs3 batch_norm_backward_cuda(TBG_PARAMS(batch_norm_backward)) {
  const ChannelPlan plan =
      check_backward_args(src, diff_dst, mean, variance, gamma, epsilon, data_format);
  const c10::cuda::CUDAGuard guard(src.device());
  const auto acc = accumulation_dtype(src.scalar_type());
  const Extent e = plan.extent();
  const int64_t M = plan.reduced_count();
  const bool need_sums = training || output_mask[1] || output_mask[2];
  const bool need_diff_src = output_mask[0] && src.numel() > 0;

  const auto grad_dtype = param_grad_dtype(mean, gamma);
  KernelOutput out;
  if (output_mask[0]) out = make_kernel_output(src, plan);
  const ChannelResult dg = output_mask[1] ? channel_result(plan, grad_dtype, src) : ChannelResult{};
  const ChannelResult db = output_mask[2] ? channel_result(plan, grad_dtype, src) : ChannelResult{};

  if (e.channels > 0 && (need_diff_src || output_mask[1] || output_mask[2])) {
    const at::Tensor x = to_kernel_layout(src, plan);
    const at::Tensor mean_k = to_kernel_channels(mean, plan, acc, 0, src);
    const ChannelValues var_v = channel_values(variance, plan, src);
    const ChannelValues gamma_v = channel_values(gamma, plan, src);
    at::Tensor dy;
    if (need_diff_src || (need_sums && M > 0)) dy = to_kernel_layout(diff_dst, plan);
    // dy_scale, x_scale and bias
    const at::Tensor scratch = need_diff_src ? channel_vectors(plan, src, acc, 3) : at::Tensor();
    TBG_DISPATCH_DATA_DTYPE(src.scalar_type(), "batch_norm_backward_cuda", [&] {
      using A = Acc<scalar_t>;
      A* const dy_scale = need_diff_src ? scratch.mutable_data_ptr<A>() : nullptr;
      auto args = backward_coefficient_args(mean_k.const_data_ptr<A>(), var_v.in, gamma_v.in, epsilon, e.channels, M,
                                            training, dy_scale, dg.out, db.out);
      Partials<GradSums<double>> partials;  // alive until the kernels are queued
      if (need_sums && M > 0) {
        scalar_t* dst = need_diff_src ? out.buffer.mutable_data_ptr<scalar_t>() : nullptr;
        if (persistent_backward<scalar_t>(x, dy, mean_k, dst, e, args)) return;
        partials = grad_sum_partials<scalar_t>(x, dy, mean_k, e, &args);
      }
      if (!partials.finished) backward_coefficients(args);

      if (need_diff_src) {
        const math::AffineArrays<A> coef{mean_k.const_data_ptr<A>(), dy_scale, dy_scale + e.channels,
                                         dy_scale + 2 * e.channels};
        apply_affine<scalar_t, true>(x, dy.const_data_ptr<scalar_t>(), out.buffer, e, coef);
      }
    });
    if (need_diff_src) finish_kernel_output(out, plan);
  }

  return {output_mask[0] ? out.result : at::empty({0}, src.options()),
          output_mask[1] ? dg.finish(plan, grad_dtype, src) : at::empty({0}, mean.options().dtype(grad_dtype)),
          output_mask[2] ? db.finish(plan, grad_dtype, src) : at::empty({0}, mean.options().dtype(grad_dtype))};
}

}  // namespace torch_bn_grad::cuda
