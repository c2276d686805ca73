// The Autograd kernel of batch_norm_act_backward: the operator is not
// differentiable itself (batch_norm_act_forward's formula differentiates to
// any order), so a graph through it raises when it is differentiated.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>

#include "autograd/operator_handles.h"
#include "autograd/backward_refusal.h"
#include "autograd/forward_ad.h"

namespace torch_bn_grad {
namespace {

Outputs4 batch_norm_act_backward_autograd(const at::Tensor& diff_dst, const OptionalTensor& src,
                                          const OptionalTensor& dst, const OptionalTensor& residual,
                                          const at::Tensor& mean, const at::Tensor& variance,
                                          const OptionalTensor& gamma, const OptionalTensor& beta, double epsilon,
                                          c10::string_view activation, double negative_slope,
                                          c10::string_view data_format, bool training, bool from_output,
                                          std::array<bool, 4> output_mask, const OptionalTensor& dst_positive) {
  return call_refusing_derivatives(
      "batch_norm_act_backward", "batch_norm_act_forward (or functional.batch_norm_act)",
      [&] {
        return act_backward_op().call(diff_dst, src, dst, residual, mean, variance, gamma, beta, epsilon, activation,
                                      negative_slope, data_format, training, from_output, output_mask, dst_positive);
      },
      diff_dst, src, dst, residual, mean, variance, gamma, beta);
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_bn_grad, Autograd, m) {
  m.impl("batch_norm_act_backward", &batch_norm_act_backward_autograd);
}

}  // namespace torch_bn_grad
