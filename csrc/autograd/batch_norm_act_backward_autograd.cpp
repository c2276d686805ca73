// The Autograd kernel of batch_norm_act_backward: the operator is not
// differentiable itself (batch_norm_act_forward's formula differentiates to
// any order), so a graph through it raises when it is differentiated.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include <array>

#include "autograd/operator_handles.h"
#include "autograd/autograd_node.h"
#include "autograd/backward_refusal.h"
#include "autograd/forward_ad.h"

namespace torch_bn_grad {
namespace {

using torch::autograd::variable_list;

Outputs4 batch_norm_act_backward_autograd(const at::Tensor& diff_dst, const OptionalTensor& src,
                                          const OptionalTensor& dst, const OptionalTensor& residual,
                                          const at::Tensor& mean, const at::Tensor& variance,
                                          const OptionalTensor& gamma, const OptionalTensor& beta, double epsilon,
                                          c10::string_view activation, double negative_slope,
                                          c10::string_view data_format, bool training, bool from_output,
                                          std::array<bool, 4> output_mask, const OptionalTensor& dst_positive) {
  TORCH_CHECK_NOT_IMPLEMENTED(
      !(has_tangent(diff_dst) || has_tangent(src) || has_tangent(dst) || has_tangent(residual) ||
        has_tangent(mean) || has_tangent(variance) || has_tangent(gamma) || has_tangent(beta)),
      "batch_norm_act_backward has no forward-mode derivative; differentiate batch_norm_act_forward (or "
      "functional.batch_norm_act) instead, whose derivatives (jvp, jacfwd, hessian) are implemented");
  NodePtr<BackwardRefusal> node;
  if (torch::autograd::compute_requires_grad(diff_dst, src, dst, residual, mean, variance, gamma, beta)) {
    node = make_node<BackwardRefusal>();
    node->op = "batch_norm_act_backward";
    node->forward = "batch_norm_act_forward (or functional.batch_norm_act)";
    node->set_next_edges(
        torch::autograd::collect_next_edges(diff_dst, src, dst, residual, mean, variance, gamma, beta));
  }
  auto outputs = [&] {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return act_backward_op().call(diff_dst, src, dst, residual, mean, variance, gamma, beta, epsilon, activation,
                                  negative_slope, data_format, training, from_output, output_mask, dst_positive);
  }();
  if (node) {
    auto& [a, b, c, d] = outputs;
    for (at::Tensor* out : {&a, &b, &c, &d}) {
      if (out->defined()) torch::autograd::set_history(*out, node);
    }
  }
  return outputs;
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_bn_grad, Autograd, m) {
  m.impl("batch_norm_act_backward", &batch_norm_act_backward_autograd);
}

}  // namespace torch_bn_grad
