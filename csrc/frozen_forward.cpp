// The .frozen overloads (batch_norm_forward, batch_norm_act_forward: frozen
// statistics, dst alone) on CUDA, whose forward kernels return copies of the
// statistics: the operator, its copies dropped. (The CPU kernels have
// entries of their own, which make no copies.)
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <tuple>

#include "autograd/operator_handles.h"
#include "autograd/dispatch_handles.h"

namespace torch_bn_grad {
namespace {

at::Tensor forward_frozen(const at::Tensor& src, const OptionalTensor& gamma, const OptionalTensor& beta,
                          const at::Tensor& mean, const at::Tensor& variance, double epsilon,
                          c10::string_view data_format) {
  return std::get<0>(forward_op().call(src, gamma, beta, mean, variance, epsilon, data_format));
}

at::Tensor act_forward_frozen(const at::Tensor& src, const OptionalTensor& gamma, const OptionalTensor& beta,
                              const at::Tensor& mean, const at::Tensor& variance, const OptionalTensor& residual,
                              double epsilon, c10::string_view activation, double negative_slope,
                              c10::string_view data_format, bool memory_saving) {
  return std::get<0>(act_forward_op().call(src, gamma, beta, mean, variance, residual, epsilon, activation,
                                           negative_slope, data_format, memory_saving));
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_bn_grad, CUDA, m) {
  m.impl("batch_norm_forward.frozen", &forward_frozen);
  m.impl("batch_norm_act_forward.frozen", &act_forward_frozen);
}

}  // namespace torch_bn_grad
