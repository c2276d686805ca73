// The running-statistics update on a GPU in one kernel (the ATen route takes
// three: a lerp each and the variance's Bessel product). Called by
// running_stats.cpp, the one home of the update's rules, when its tensors
// qualify (running_stats.cpp: one_cuda_kernel_applies).
#pragma once

#include <ATen/core/Tensor.h>

namespace torch_bn_grad::cuda {

// running_mean and running_var (either may be null) lerped towards `mean` and
// `variance * factor` by `momentum`, with at::lerp's and at::mul's roundings,
// on the current stream. All of one dtype (float32 or float64), contiguous,
// with mean.numel() elements, on one CUDA device.
void update_running_stats(const at::Tensor* running_mean, const at::Tensor* running_var, const at::Tensor& mean,
                          const at::Tensor& variance, double factor, double momentum);

}  // namespace torch_bn_grad::cuda
