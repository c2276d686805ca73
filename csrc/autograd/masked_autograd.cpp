// Autograd of batch_norm_masked_forward, in C++, as batch_norm_autograd.cpp
// does it for the plain forward: recording a masked training step through a
// Python autograd.Function cost about 45 us of interpreter a call, a large
// share of a small padded layer's step. The gradient is the masked backward
// operator (padded positions get 0 and are never read), whose own Autograd
// kernel (Python, _masked_autograd.py) records it for higher orders.
// Forward-mode AD is not provided: a tangent raises.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>

#include "autograd/autograd_node.h"
#include "autograd/channel_algebra.h"
#include "autograd/dispatch_handles.h"
#include "autograd/forward_ad.h"
#include "autograd/forward_grad.h"

namespace torch_bn_grad {
namespace {

using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

const auto& masked_forward_op() {
  static const auto op = typed_operator<Outputs4(const at::Tensor&, const at::Tensor&, const OptionalTensor&,
                                                 const OptionalTensor&, const OptionalTensor&, const OptionalTensor&,
                                                 double)>("torch_bn_grad::batch_norm_masked_forward");
  return op;
}

const auto& masked_backward_op() {
  static const auto op =
      typed_operator<Outputs3(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, const OptionalTensor&, double, bool, std::array<bool, 3>)>(
          "torch_bn_grad::batch_norm_masked_backward");
  return op;
}


std::optional<at::ScalarType> dtype_of(const OptionalTensor& t) {
  return given(t) ? std::optional<at::ScalarType>(t->scalar_type()) : std::nullopt;
}

// Gradients with respect to (src, mask, gamma, beta, mean, variance) of
// (dst, mean, variance, count) = batch_norm_masked_forward(...), the plain
// forward's formulas (forward_grad.h) over valid positions: dst's gradient
// through the backward operator; with batch statistics, their own gradients
// add batch_statistics_grad at valid positions (the valid count per
// channel); frozen statistics take frozen_statistics_grads, and as the
// returned statistics are the given ones, their gradients add.
struct MaskedForwardNode : public torch::autograd::Node {
  SavedVariable src, mask, gamma, mean, variance, count;
  double epsilon = 0;
  bool batch_statistics = true;
  std::optional<at::ScalarType> gamma_dtype, beta_dtype, mean_dtype, variance_dtype;

  std::string name() const override { return "BatchNormMaskedForwardBackward"; }

  variable_list apply(variable_list&& grads) override {
    std::array<bool, 6> needs{};
    for (size_t input = 0; input < 6; ++input) needs[input] = task_should_compute_output(input);
    const auto self = getptr();
    const at::Tensor x = src.unpack(self), valid = mask.unpack(self), g = gamma.unpack(self);
    const at::Tensor m = mean.unpack(self), v = variance.unpack(self);
    const at::Tensor& grad_dst = grads[0];
    const at::Tensor& grad_mean = grads[1];
    const at::Tensor& grad_variance = grads[2];
    const bool frozen_stats = !batch_statistics && (needs[4] || needs[5]);
    at::Tensor diff_src, diff_gamma, diff_beta, diff_mean, diff_variance;
    if (grad_dst.defined()) {
      const std::array<bool, 3> wanted = {needs[0], needs[2] || frozen_stats, needs[3] || frozen_stats};
      // Half-precision parameters with float32 statistics: the backward takes them in the statistics' dtype.
      const OptionalTensor g_stats = g.defined() ? OptionalTensor(to_dtype(g, m.scalar_type())) : std::nullopt;
      auto [ds, dg, db] =
          masked_backward_op().call(x, valid, grad_dst, m, v, g_stats, epsilon, batch_statistics, wanted);
      if (needs[0]) diff_src = ds;
      if (needs[2]) diff_gamma = to_dtype(dg, gamma_dtype);
      if (needs[3]) diff_beta = to_dtype(db, beta_dtype);
      if (frozen_stats) {
        std::tie(diff_mean, diff_variance) = frozen_statistics_grads(
            g_stats, v, epsilon, dg, db, accumulation_dtype(x), needs[4], needs[5]);
      }
    }
    if (batch_statistics && needs[0] && (grad_mean.defined() || grad_variance.defined())) {
      const at::Tensor term = batch_statistics_grad(x, m, grad_mean, grad_variance, count.unpack(self), "NCX");
      diff_src = plus(diff_src, at::where(valid.unsqueeze(1), term, 0).to(x.scalar_type()));
    }
    if (!batch_statistics) {  // the returned statistics are the given ones
      diff_mean = plus(diff_mean, grad_mean);
      diff_variance = plus(diff_variance, grad_variance);
    }
    return {diff_src,
            at::Tensor(),
            diff_gamma,
            diff_beta,
            needs[4] && diff_mean.defined() ? to_dtype(diff_mean, mean_dtype) : at::Tensor(),
            needs[5] && diff_variance.defined() ? to_dtype(diff_variance, variance_dtype) : at::Tensor()};
  }

  void release_variables() override {
    src.reset_data();
    mask.reset_data();
    gamma.reset_data();
    mean.reset_data();
    variance.reset_data();
    count.reset_data();
  }
};

Outputs4 batch_norm_masked_forward_autograd(const at::Tensor& src, const at::Tensor& mask,
                                            const OptionalTensor& gamma, const OptionalTensor& beta,
                                            const OptionalTensor& mean, const OptionalTensor& variance,
                                            double epsilon) {
  TORCH_CHECK(!(has_tangent(src) || has_tangent(gamma) || has_tangent(beta) || has_tangent(mean) ||
                has_tangent(variance)),
              "batch_norm_masked_forward: forward-mode AD is not implemented for the masked batch norm");
  NodePtr<MaskedForwardNode> node;
  if (torch::autograd::compute_requires_grad(src, gamma, beta, mean, variance)) {
    node = make_node<MaskedForwardNode>();
    node->set_next_edges(torch::autograd::collect_next_edges(src, mask, gamma, beta, mean, variance));
  }
  auto outputs = [&] {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return masked_forward_op().call(src, mask, gamma, beta, mean, variance, epsilon);
  }();
  if (node) {
    auto& [dst, mean_used, variance_used, count] = outputs;
    torch::autograd::set_history(dst, node);
    torch::autograd::set_history(mean_used, node);
    torch::autograd::set_history(variance_used, node);
    const bool batch_statistics = !given(mean);
    node->src = SavedVariable(src, false);
    node->mask = SavedVariable(mask, false);
    node->gamma = SavedVariable(given(gamma) ? *gamma : at::Tensor(), false);
    // Frozen statistics are saved as given, so that double backward reaches them.
    node->mean = batch_statistics ? SavedVariable(mean_used, true) : SavedVariable(*mean, false);
    node->variance = batch_statistics ? SavedVariable(variance_used, true) : SavedVariable(*variance, false);
    node->count = SavedVariable(count, false);
    node->epsilon = epsilon;
    node->batch_statistics = batch_statistics;
    node->gamma_dtype = dtype_of(gamma);
    node->beta_dtype = dtype_of(beta);
    node->mean_dtype = dtype_of(mean);
    node->variance_dtype = dtype_of(variance);
  }
  return outputs;
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_bn_grad, Autograd, m) {
  m.impl("batch_norm_masked_forward", &batch_norm_masked_forward_autograd);
}

}  // namespace torch_bn_grad
