// The running-statistics update on a GPU in one kernel (the ATen route takes
// three, five for half-precision buffers: a lerp each, the variance's Bessel
// product and the casts). Called by
// composite/running_stats.cpp, the one home of the update's rules, when its tensors
// qualify (composite/running_stats.cpp: one_cuda_kernel_applies).
#pragma once

#include <ATen/core/Tensor.h>

namespace torch_bn_grad::cuda {

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

}  // namespace torch_bn_grad::cuda
