// The .frozen overloads (batch_norm_forward, batch_norm_act_forward: frozen
// statistics, dst alone) on CUDA, whose forward kernels return copies of the
// statistics: the operator, its copies dropped. (The CPU kernels have
// entries of their own, which make no copies.)
#include <ATen/core/Tensor.h>

#include <tuple>

#include "library/operators.h"

namespace torch_bn_grad::cuda {

at::Tensor batch_norm_forward_frozen_cuda(TBG_PARAMS(batch_norm_forward_frozen)) {
  return std::get<0>(op::batch_norm_forward().call(src, gamma, beta, mean, variance, epsilon, data_format));
}

at::Tensor batch_norm_act_forward_frozen_cuda(TBG_PARAMS(batch_norm_act_forward_frozen)) {
  return std::get<0>(op::batch_norm_act_forward().call(src, gamma, beta, mean, variance, residual, epsilon,
                                                       activation, negative_slope, data_format, memory_saving));
}

}  // namespace torch_bn_grad::cuda
