// The forward operators' host driver, one for batch_norm_forward and
// batch_norm_act_forward, which differ only in the epilogue of the
// elementwise pass (epilogue.cuh): the per-channel outputs, then either the
// persistent single-read kernel (batch statistics of a shape a block holds)
// or statistics, coefficients and the elementwise pass.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>

#include <limits>
#include <optional>
#include <tuple>

#include "dtypes.h"
#include "args/batch_norm_args.h"
#include "math/batch_norm_math.h"
#include "cuda/channel_values.cuh"
#include "cuda/coefficient_kernels.cuh"
#include "cuda/launch.cuh"
#include "cuda/running_update.cuh"

namespace torch_bn_grad::cuda {

template <typename T>
struct TypeTag {
  using type = T;
};

// dst and the statistics it was normalized with: the batch's (of the
// accumulation type), or copies of the given ones.
using ForwardResult = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// `with_epilogue(TypeTag<scalar_t>{}, f)` calls f(ep) once, with the
// epilogue of data type scalar_t. `running` (batch statistics only; the
// fused_update variant) names buffers the coefficient or persistent kernel
// updates with the batch's statistics.
template <typename WithEpilogue>
ForwardResult forward_cuda(const ChannelPlan& plan, const at::Tensor& src, const std::optional<at::Tensor>& gamma,
                           const std::optional<at::Tensor>& beta, const std::optional<at::Tensor>& mean,
                           const std::optional<at::Tensor>& variance, double epsilon,
                           const WithEpilogue& with_epilogue, const RunningUpdate& running = RunningUpdate{}) {
  const c10::cuda::CUDAGuard guard(src.device());
  const auto acc = accumulation_dtype(src.scalar_type());
  const Extent e = plan.extent();
  const bool batch_statistics = !mean.has_value();

  // Per-channel outputs in kernel order, of the accumulation type.
  at::Tensor mean_k = channel_vector(plan, src, acc);
  at::Tensor var_k = batch_statistics ? channel_vector(plan, src, acc) : at::Tensor();
  KernelOutput out = make_kernel_output(src, plan);
  if (src.numel() > 0) {
    const at::Tensor x = to_kernel_layout(src, plan);
    const ChannelValues gamma_v = channel_values(gamma, plan, src);
    const ChannelValues beta_v = channel_values(beta, plan, src);
    const at::Tensor scratch = channel_vectors(plan, src, acc, 2);  // x_scale, bias
    TBG_DISPATCH_DATA_DTYPE(src.scalar_type(), "batch_norm_forward_cuda", [&] {
      using A = Acc<scalar_t>;
      A* x_scale = scratch.mutable_data_ptr<A>();
      A* bias = x_scale + e.channels;
      ForwardCoefficientArgs<A> args{};
      args.gamma = gamma_v.in;
      args.beta = beta_v.in;
      args.epsilon = epsilon;
      args.channels = e.channels;
      args.affine = {mean_k.mutable_data_ptr<A>(), nullptr, x_scale, bias};
      with_epilogue(TypeTag<scalar_t>{}, [&](const auto& ep) {
        if (batch_statistics) {
          args.variance_out = var_k.mutable_data_ptr<A>();
          args.running = running;
          if (persistent_forward<scalar_t>(x, out.buffer, e, args, ep)) return;
        }
        Partials<Moments<double>> partials;  // these stay alive until the kernels are queued
        ChannelValues mean_v, var_v;
        if (batch_statistics) {
          partials = moment_partials<scalar_t>(x, e, &args);
        } else {
          mean_v = channel_values(mean, plan, src);
          var_v = channel_values(variance, plan, src);
          args.mean = mean_v.in;
          args.variance = var_v.in;
        }
        if (!partials.finished) forward_coefficients(args);
        const math::AffineArrays<A> c{mean_k.const_data_ptr<A>(), nullptr, x_scale, bias};
        apply_affine<scalar_t, false>(x, nullptr, out.buffer, e, c, ep);
      });
    });
    finish_kernel_output(out, plan);
  } else if (batch_statistics) {
    // Empty batch: NaN statistics, as a mean over nothing.
    mean_k.fill_(std::numeric_limits<double>::quiet_NaN());
    var_k.fill_(std::numeric_limits<double>::quiet_NaN());
  }

  if (!batch_statistics) {
    return {out.result, mean->clone(at::MemoryFormat::Contiguous), variance->clone(at::MemoryFormat::Contiguous)};
  }
  return {out.result, from_kernel_channels(mean_k, plan, acc, src), from_kernel_channels(var_k, plan, acc, src)};
}

}  // namespace torch_bn_grad::cuda
