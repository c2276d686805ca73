// Autograd of batch_norm_masked_forward and the fused
// batch_norm_masked_act_forward, in C++, as batch_norm_autograd.cpp
// does it for the plain forward: recording a masked training step through a
// Python autograd.Function would cost interpreter time on every call, a large
// share of a small padded layer's step. The gradient is the masked backward
// operator (padded positions get 0 and are never read), whose own Autograd
// kernel (Python, _library/masked_autograd.py) records it for higher orders. The
// fused forward's gradient is the fused backward operator (its gate, then the
// same sums); under double backward its gate is times_act_grad's (act_grad.h)
// in differentiable ops, then the masked backward operator.
// Forward-mode AD: batch_norm_masked_forward_jvp (forward_ad.h), and the
// fused operator's gate on it; a backward that follows a forward with
// tangents (forward over reverse) is not provided.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/autograd/variable.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>

#include "autograd/act_grad.h"
#include "autograd/autograd_node.h"
#include "autograd/backward_refusal.h"
#include "autograd/channel_algebra.h"
#include "autograd/forward_ad.h"
#include "autograd/forward_grad.h"
#include "library/operators.h"

namespace torch_bn_grad {
namespace {

using torch::autograd::SavedVariable;
using torch::autograd::variable_list;


std::optional<at::ScalarType> dtype_of(const OptionalTensor& t) {
  return given(t) ? std::optional<at::ScalarType>(t->scalar_type()) : std::nullopt;
}

// Gradients with respect to (src, mask, gamma, beta, mean, variance[,
// residual]) of (dst, mean, variance, count) = batch_norm_masked_forward(...)
// (or batch_norm_masked_act_forward), the plain forward's formulas
// (forward_grad.h) over valid positions: dst's gradient through the backward
// operator (the fused one's gate first); with batch statistics, their own
// gradients add batch_statistics_grad at valid positions (the valid count
// per channel); frozen statistics take frozen_statistics_grads, and as the
// returned statistics are the given ones, their gradients add.
struct MaskedForwardNode : public torch::autograd::Node {
  SavedVariable src, mask, gamma, beta, mean, variance, count, dst, residual;
  double epsilon = 0, slope = 0;
  bool batch_statistics = true;
  bool fused = false;  // batch_norm_masked_act_forward: `activation`, `slope`, a residual edge
  std::string activation = "identity";
  std::optional<at::ScalarType> gamma_dtype, beta_dtype, mean_dtype, variance_dtype;

  std::string name() const override {
    return fused ? "BatchNormMaskedActForwardBackward" : "BatchNormMaskedForwardBackward";
  }

  variable_list apply(variable_list&& grads) override {
    const size_t inputs = fused ? 7 : 6;
    std::array<bool, 7> needs{};
    for (size_t input = 0; input < inputs; ++input) needs[input] = task_should_compute_output(input);
    const auto self = getptr();
    const at::Tensor x = src.unpack(self), valid = mask.unpack(self), g = gamma.unpack(self);
    const at::Tensor m = mean.unpack(self), v = variance.unpack(self);
    const at::Tensor& grad_dst = grads[0];
    const at::Tensor& grad_mean = grads[1];
    const at::Tensor& grad_variance = grads[2];
    const bool frozen_stats = !batch_statistics && (needs[4] || needs[5]);
    at::Tensor diff_src, diff_gamma, diff_beta, diff_mean, diff_variance, diff_residual;
    if (grad_dst.defined()) {
      const std::array<bool, 3> wanted = {needs[0], needs[2] || frozen_stats, needs[3] || frozen_stats};
      // Half-precision parameters beside float32 statistics: in their own dtype
      // (backward_param_dtype), but in the statistics' where the frozen
      // statistics' gradients or the differentiable gate compute with them.
      const at::Tensor b = fused ? beta.unpack(self) : at::Tensor();
      const at::ScalarType param_dtype = frozen_stats || at::GradMode::is_enabled()
                                             ? m.scalar_type()
                                             : backward_param_dtype(g.defined() ? g : b, m);
      const OptionalTensor g_stats = g.defined() ? OptionalTensor(to_dtype(g, param_dtype)) : std::nullopt;
      at::Tensor ds, dg, db;
      if (!fused) {
        std::tie(ds, dg, db) = op::batch_norm_masked_backward().call(x, valid, grad_dst, m, v, g_stats, epsilon,
                                                                     batch_statistics, wanted);
      } else {
        const at::Tensor y = dst.unpack(self), r = residual.unpack(self);
        const OptionalTensor b_stats = b.defined() ? OptionalTensor(to_dtype(b, param_dtype)) : std::nullopt;
        if (at::GradMode::is_enabled()) {  // double backward: a gate in differentiable ops
          const at::Tensor dz = times_act_grad(grad_dst, {activation, slope, epsilon, "NCX"}, x, y, r, m, v,
                                               or_undefined(g_stats), or_undefined(b_stats));
          std::tie(ds, dg, db) = op::batch_norm_masked_backward().call(x, valid, dz, m, v, g_stats, epsilon,
                                                                       batch_statistics, wanted);
          if (needs[6]) diff_residual = at::where(valid.unsqueeze(1), dz, 0);
        } else {
          std::tie(ds, dg, db, diff_residual) = op::batch_norm_masked_act_backward().call(
              x, valid, optional(y), optional(r), grad_dst, m, v, g_stats, b_stats, epsilon, activation, slope,
              batch_statistics, {wanted[0], wanted[1], wanted[2], needs[6]});
        }
      }
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
    variable_list out = {diff_src,
                         at::Tensor(),
                         diff_gamma,
                         diff_beta,
                         needs[4] && diff_mean.defined() ? to_dtype(diff_mean, mean_dtype) : at::Tensor(),
                         needs[5] && diff_variance.defined() ? to_dtype(diff_variance, variance_dtype) : at::Tensor()};
    if (fused) out.push_back(needs[6] ? diff_residual : at::Tensor());
    return out;
  }

  void release_variables() override {
    for (SavedVariable* saved : {&src, &mask, &gamma, &beta, &mean, &variance, &count, &dst, &residual})
      saved->reset_data();
  }

  static at::Tensor or_undefined(const OptionalTensor& t) { return given(t) ? *t : at::Tensor(); }
};

// Forward-mode AD of both forward operators: the masked batch norm's tangents
// over the valid positions (forward_ad.h), then for the fused one
// t_dst = act'(z) * (t_batch_norm + t_residual) at valid positions, 0 at padded ones.
void set_masked_forward_tangents(const Outputs4& outputs, const at::Tensor& src, const at::Tensor& mask,
                                 const OptionalTensor& gamma, const OptionalTensor& beta, const OptionalTensor& mean,
                                 const OptionalTensor& variance, const OptionalTensor* residual,
                                 const ActArgs& args) {
  const auto& [dst, mean_used, variance_used, count] = outputs;
  const at::Tensor valid = mask.unsqueeze(1);
  auto [t_dst, t_mean, t_variance] = batch_norm_masked_forward_jvp(
      src, valid, count, gamma, mean_used, variance_used, !given(mean), args.epsilon, tangent_of(src),
      tangent_of(gamma), tangent_of(beta), tangent_of(mean), tangent_of(variance));
  if (residual) {
    if (has_tangent(*residual)) t_dst = plus(t_dst, at::where(valid, tangent_of(*residual), 0));
    if (t_dst.defined()) {
      t_dst = at::where(valid, times_act_grad(t_dst, args, primal_of(src), dst, primal_of(*residual), mean_used,
                                              variance_used, primal_of(gamma), primal_of(beta)), 0);
    }
  }
  set_tangent(dst, t_dst);
  set_tangent(mean_used, t_mean);
  set_tangent(variance_used, t_variance);
}

// The autograd formula of both forward operators: `call()` runs the operator
// below autograd; `residual` (an edge) and the activation only for the fused one.
template <class Call>
Outputs4 masked_forward_autograd(const at::Tensor& src, const at::Tensor& mask,
                                 const OptionalTensor& gamma, const OptionalTensor& beta, const OptionalTensor& mean,
                                 const OptionalTensor& variance, const OptionalTensor* residual, double epsilon,
                                 c10::string_view activation, double slope, const Call& call) {
  const OptionalTensor no_residual;
  const OptionalTensor& r = residual ? *residual : no_residual;
  const bool forward_ad = has_tangent(src) || has_tangent(gamma) || has_tangent(beta) || has_tangent(mean) ||
                          has_tangent(variance) || has_tangent(r);
  NodePtr<MaskedForwardNode> node;
  if (torch::autograd::compute_requires_grad(src, gamma, beta, mean, variance, r)) {
    node = make_node<MaskedForwardNode>();
    if (residual) node->set_next_edges(torch::autograd::collect_next_edges(src, mask, gamma, beta, mean, variance, r));
    else node->set_next_edges(torch::autograd::collect_next_edges(src, mask, gamma, beta, mean, variance));
  }
  auto outputs = [&] {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call();
  }();
  if (forward_ad) {
    set_masked_forward_tangents(outputs, src, mask, gamma, beta, mean, variance, residual ? &r : nullptr,
                                {activation, slope, epsilon, "NCX"});
  }
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
    if (residual) {
      // What the gate reads: dst (relu, leaky_relu), or z's other operands (silu).
      node->fused = true;
      node->activation = std::string(activation);
      node->slope = slope;
      if (activation == "relu" || activation == "leaky_relu") node->dst = SavedVariable(dst, true);
      if (activation == "silu") {
        node->beta = SavedVariable(given(beta) ? *beta : at::Tensor(), false);
        node->residual = SavedVariable(given(r) ? *r : at::Tensor(), false);
      }
    }
  }
  return outputs;
}

}  // namespace

Outputs4 batch_norm_masked_forward_autograd(TBG_PARAMS(batch_norm_masked_forward)) {
  return masked_forward_autograd(src, mask, gamma, beta, mean, variance, nullptr, epsilon, "identity", 0.0, [&] {
    return op::batch_norm_masked_forward().call(src, mask, gamma, beta, mean, variance, epsilon);
  });
}

Outputs4 batch_norm_masked_act_forward_autograd(TBG_PARAMS(batch_norm_masked_act_forward)) {
  return masked_forward_autograd(src, mask, gamma, beta, mean, variance, &residual, epsilon, activation,
                                 negative_slope, [&] {
                                   return op::batch_norm_masked_act_forward().call(
                                       src, mask, gamma, beta, mean, variance, residual, epsilon, activation,
                                       negative_slope);
                                 });
}

Outputs4 batch_norm_masked_act_backward_autograd(TBG_PARAMS(batch_norm_masked_act_backward)) {
  return call_refusing_derivatives(
      "batch_norm_masked_act_backward", "batch_norm_masked_act_forward (or the masked BatchNormAct modules)",
      [&] {
        return op::batch_norm_masked_act_backward().call(src, mask, dst, residual, diff_dst, mean, variance, gamma,
                                                         beta, epsilon, activation, negative_slope, training,
                                                         output_mask);
      },
      src, mask, dst, residual, diff_dst, mean, variance, gamma, beta);
}

}  // namespace torch_bn_grad
