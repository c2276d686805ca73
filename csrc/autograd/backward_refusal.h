// The Autograd kernel of a fused backward operator, which is not
// differentiable itself (its forward operator's formula differentiates to
// any order): a gradient flowing into it raises instead of being dropped
// silently, and so does a tangent.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <string>
#include <tuple>

#include "autograd/autograd_node.h"
#include "autograd/forward_ad.h"

namespace torch_bn_grad {

struct BackwardRefusal : public torch::autograd::Node {
  std::string op, forward;  // e.g. "batch_norm_act_backward", "batch_norm_act_forward"
  std::string name() const override { return "BackwardRefusal(" + op + ")"; }
  torch::autograd::variable_list apply(torch::autograd::variable_list&&) override {
    TORCH_CHECK_NOT_IMPLEMENTED(false, op, " is not differentiable itself; differentiate ", forward,
                                " instead, whose autograd formula supports double backward");
  }
};

// The operator `op` run by `call()` below autograd, its outputs recorded on a
// BackwardRefusal where any of `inputs` requires grad; a tangent on them raises.
// `forward` names what to differentiate instead.
template <class Call, class... Inputs>
auto call_refusing_derivatives(const char* op, const char* forward, const Call& call, const Inputs&... inputs) {
  TORCH_CHECK_NOT_IMPLEMENTED(!(has_tangent(inputs) || ...), op, " has no forward-mode derivative; differentiate ",
                              forward, " instead");
  NodePtr<BackwardRefusal> node;
  if (torch::autograd::compute_requires_grad(inputs...)) {
    node = make_node<BackwardRefusal>();
    node->op = op;
    node->forward = forward;
    node->set_next_edges(torch::autograd::collect_next_edges(inputs...));
  }
  auto outputs = [&] {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call();
  }();
  if (node) {
    std::apply([&](auto&... out) { ((out.defined() ? torch::autograd::set_history(out, node) : void()), ...); },
               outputs);
  }
  return outputs;
}

}  // namespace torch_bn_grad
