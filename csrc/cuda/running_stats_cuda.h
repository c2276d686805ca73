// The running-statistics update on a GPU in one kernel (the ATen route takes
// three, five for half-precision buffers: a lerp each, the variance's Bessel
// product and the casts). Called by
// composite/running_stats.cpp, the one home of the update's rules, when its tensors
// qualify (composite/running_stats.cpp: one_cuda_kernel_applies).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include "args/batch_norm_args.h"
#include "library/signatures.h"

namespace torch_bn_grad::cuda {

// Whether buffers (either may be absent) take the update kernels with batch
// statistics of dtype `stats` on `device`: contiguous, `channels` elements
// each, on `device`, of one data dtype whose accumulation dtype is `stats`.
bool buffers_take_kernel(const OptionalTensor& running_mean, const OptionalTensor& running_var,
                         const at::Device& device, at::ScalarType stats, int64_t channels);

// running_mean and running_var (either may be null) lerped towards `mean` and
// `variance * factor` by `momentum`, with at::lerp's and at::mul's roundings,
// on the current stream. The buffers of one floating dtype R, the batch
// statistics of opmath(R) (float32 for float16/bfloat16 buffers), all
// contiguous, with mean.numel() elements, on one CUDA device.
void update_running_stats(const at::Tensor* running_mean, const at::Tensor* running_var, const at::Tensor& mean,
                          const at::Tensor& variance, double factor, double momentum);

// The same with the element count read on the device from `count` (a float64
// scalar on mean's GPU: a masked batch's valid count, never brought to the
// host): factor count / (count - 1) (1 for count 1), and no change at count 0.
void update_running_stats(const at::Tensor* running_mean, const at::Tensor* running_var, const at::Tensor& mean,
                          const at::Tensor& variance, const at::Tensor& count, double momentum);

// The buffers a training forward updates in its own kernels (the fused_update
// variant, config/cuda_variants.h), with the variance's factor of its count.
struct RunningBuffers {
  const OptionalTensor& running_mean;
  const OptionalTensor& running_var;
  double factor;
  double momentum;
};

// The training forwards (batch_norm_forward, batch_norm_act_forward) of a
// checked plan with the update in their coefficient or persistent kernel:
// one launch fewer than the forward, then update_running_stats, with equal
// results. nullopt, with nothing done, where the buffers do not take the
// kernel (buffers_take_kernel) or the statistics' kernel order is not theirs.
std::optional<Outputs3> forward_updating(const ChannelPlan& plan, const at::Tensor& src, const OptionalTensor& gamma,
                                         const OptionalTensor& beta, double epsilon, const RunningBuffers& buffers);
std::optional<Outputs3> act_forward_updating(const ActPlan& checked, const at::Tensor& src,
                                             const OptionalTensor& gamma, const OptionalTensor& beta,
                                             const OptionalTensor& residual, double epsilon, double negative_slope,
                                             const RunningBuffers& buffers);

}  // namespace torch_bn_grad::cuda
