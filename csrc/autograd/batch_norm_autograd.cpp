// Autograd of batch_norm_forward, in C++: a training step pays no Python
// overhead for it.
//
// The gradient of the forward operator is one function,
// `batch_norm_forward_grad`, also an operator (CompositeImplicitAutograd), so
// that Python's BatchNormFunction calls the very same formula and gradients of
// any order flow through the differentiable operators it is made of
// (batch_norm_backward has its own autograd formula).
#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/autograd/variable.h>

#include <array>
#include <optional>
#include <string>

#include "autograd/autograd_node.h"
#include "autograd/buffer_versions.h"
#include "autograd/channel_algebra.h"
#include "autograd/forward_ad.h"
#include "autograd/forward_grad.h"
#include "library/operators.h"

namespace torch_bn_grad {
namespace {

using torch::autograd::variable_list;

// The backward operator. Without grad mode nothing is recorded, so its
// (Python) autograd kernel is skipped; with it (double backward) it records,
// and with tangents (forward over reverse) it computes theirs.
Outputs3 call_backward_op(TBG_PARAMS(batch_norm_backward)) {
  const bool forward_ad = has_tangent(src) || has_tangent(diff_dst) || has_tangent(mean) || has_tangent(variance) ||
                          has_tangent(gamma);
  if (!at::GradMode::is_enabled() && !forward_ad) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return op::batch_norm_backward().call(src, diff_dst, mean, variance, gamma, epsilon, data_format, training,
                                          output_mask);
  }
  return op::batch_norm_backward().call(src, diff_dst, mean, variance, gamma, epsilon, data_format, training,
                                          output_mask);
}

}  // namespace

// Gradients of (dst, mean, variance) = batch_norm_forward(src, gamma, beta, ...)
// with respect to (src, gamma, beta, mean, variance); undefined where not asked.
//
// Batch statistics (training): diff_src, diff_gamma, diff_beta come from the
// backward operator; gradients reaching the returned mean and variance add
// batch_statistics_grad to diff_src. Frozen statistics: frozen_statistics_grads
// (forward_grad.h); the returned statistics are the inputs themselves, so
// their gradients add.
Outputs5 batch_norm_forward_grad(TBG_PARAMS(batch_norm_forward_grad)) {
  const auto [need_src, need_gamma, need_beta, need_mean, need_variance] = output_mask;
  const bool frozen = !training;
  const at::Tensor dy = grad_dst.has_value() && grad_dst->defined() ? *grad_dst : at::zeros_like(src);
  // Half-precision parameters beside float32 statistics: gamma in its own dtype
  // (backward_param_dtype), but in the statistics' where the frozen statistics'
  // gradients are computed from diff_gamma and diff_beta.
  const bool stats_grads = frozen && (need_mean || need_variance);
  OptionalTensor gamma_in = gamma;
  if (gamma.has_value() && gamma->defined() && gamma->scalar_type() != mean.scalar_type()) {
    gamma_in = to_dtype(*gamma, stats_grads ? mean.scalar_type() : backward_param_dtype(*gamma, mean));
  }
  const std::array<bool, 3> mask = {need_src, need_gamma || (frozen && need_variance),
                                    need_beta || (frozen && need_mean)};
  auto [diff_src, diff_gamma, diff_beta] = call_backward_op(src, dy, mean, variance, gamma_in,
                                                            epsilon, data_format, training, mask);
  const bool has_grad_mean = grad_mean.has_value() && grad_mean->defined();
  const bool has_grad_variance = grad_variance.has_value() && grad_variance->defined();
  const auto acc = accumulation_dtype(src);
  at::Tensor mean_grad, variance_grad;

  if (training) {
    if (need_src && (has_grad_mean || has_grad_variance)) {
      const c10::Scalar count(per_channel_count(src, mean));  // symbolic under torch.compile
      diff_src = diff_src + batch_statistics_grad(src, mean, has_grad_mean ? *grad_mean : at::Tensor(),
                                                  has_grad_variance ? *grad_variance : at::Tensor(), count,
                                                  data_format)
                                .to(src.scalar_type());
    }
  } else if (need_mean || need_variance) {
    std::tie(mean_grad, variance_grad) =
        frozen_statistics_grads(gamma, variance, epsilon, diff_gamma, diff_beta, acc, need_mean, need_variance);
    if (need_mean) {
      if (has_grad_mean) mean_grad = mean_grad + grad_mean->to(acc);
      mean_grad = mean_grad.to(mean.scalar_type());
    }
    if (need_variance) {
      if (has_grad_variance) variance_grad = variance_grad + grad_variance->to(acc);
      variance_grad = variance_grad.to(variance.scalar_type());
    }
  }
  return {need_src ? diff_src : at::Tensor(), need_gamma ? to_dtype(diff_gamma, param_dtype) : at::Tensor(),
          need_beta ? to_dtype(diff_beta, param_dtype) : at::Tensor(), mean_grad, variance_grad};
}

namespace {

// The autograd node of batch_norm_forward. A plain Node, as ATen's own are
// (torch::autograd::Function is refused under torch.func transforms); the
// dispatcher calls this kernel once per torch.func level, as it calls ATen's.
struct ForwardNode : public torch::autograd::Node {
  torch::autograd::SavedVariable src, gamma, mean, variance;
  double epsilon = 0;
  std::string data_format;
  bool batch_statistics = true;
  std::optional<at::ScalarType> param_dtype;

  std::string name() const override { return "BatchNormForwardBackward"; }

  variable_list apply(variable_list&& grads) override {
    // One edge per input, an empty one for an absent optional tensor.
    std::array<bool, 5> needs{};
    for (size_t input = 0; input < 5; ++input) needs[input] = task_should_compute_output(input);
    const auto self = getptr();
    const at::Tensor gamma_value = gamma.unpack(self);
    auto [diff_src, diff_gamma, diff_beta, diff_mean, diff_variance] = batch_norm_forward_grad(
        src.unpack(self), gamma_value.defined() ? OptionalTensor(gamma_value) : std::nullopt, mean.unpack(self),
        variance.unpack(self), grads[0], grads[1], grads[2], epsilon, data_format, batch_statistics,
        param_dtype, needs);
    return {diff_src, diff_gamma, diff_beta, diff_mean, diff_variance};
  }

  void release_variables() override {
    src.reset_data();
    gamma.reset_data();
    mean.reset_data();
    variance.reset_data();
  }
};

// The Autograd kernel of batch_norm_forward and of its .update overload:
// `call` runs the operator below autograd; the node, the saved tensors and the
// tangents are batch_norm_forward's.
template <class Call>
Outputs3 forward_with_autograd(const at::Tensor& src, const OptionalTensor& gamma, const OptionalTensor& beta,
                               const OptionalTensor& mean, const OptionalTensor& variance, double epsilon,
                               c10::string_view data_format, const Call& call) {
  NodePtr<ForwardNode> node;
  if (torch::autograd::compute_requires_grad(src, gamma, beta, mean, variance)) {
    node = make_node<ForwardNode>();
    node->set_next_edges(torch::autograd::collect_next_edges(src, gamma, beta, mean, variance));
  }
  auto outputs = [&] {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call();
  }();
  if (has_tangent(src) || has_tangent(gamma) || has_tangent(beta) || has_tangent(mean) || has_tangent(variance)) {
    const auto& [dst, mean_used, variance_used] = outputs;
    const auto [t_dst, t_mean, t_variance] = batch_norm_forward_jvp(
        src, gamma, mean_used, variance_used, !given(mean), epsilon, data_format, tangent_of(src),
        tangent_of(gamma), tangent_of(beta), tangent_of(mean), tangent_of(variance));
    set_tangent(dst, t_dst);
    set_tangent(mean_used, t_mean);
    set_tangent(variance_used, t_variance);
  }
  if (node) {
    auto& [dst, mean_used, variance_used] = outputs;
    torch::autograd::set_history(dst, node);
    torch::autograd::set_history(mean_used, node);
    torch::autograd::set_history(variance_used, node);
    const bool batch_statistics = !given(mean);
    node->src = torch::autograd::SavedVariable(src, false);
    node->gamma = torch::autograd::SavedVariable(given(gamma) ? *gamma : at::Tensor(), false);
    // Frozen statistics are saved as given, so that double backward reaches them.
    node->mean = batch_statistics ? torch::autograd::SavedVariable(mean_used, true)
                                  : torch::autograd::SavedVariable(*mean, false);
    node->variance = batch_statistics ? torch::autograd::SavedVariable(variance_used, true)
                                      : torch::autograd::SavedVariable(*variance, false);
    node->epsilon = epsilon;
    node->data_format = std::string(data_format);
    node->batch_statistics = batch_statistics;
    const OptionalTensor param = given(gamma) ? gamma : beta;
    if (given(param)) node->param_dtype = param->scalar_type();
  }
  return outputs;
}

}  // namespace

Outputs3 batch_norm_forward_autograd(TBG_PARAMS(batch_norm_forward)) {
  return forward_with_autograd(src, gamma, beta, mean, variance, epsilon, data_format, [&] {
    return op::batch_norm_forward().call(src, gamma, beta, mean, variance, epsilon, data_format);
  });
}

// The .frozen overload: below autograd where nothing records (an eval step),
// else batch_norm_forward's formula, whose dst it returns.
at::Tensor batch_norm_forward_frozen_autograd(TBG_PARAMS(batch_norm_forward_frozen)) {
  if (autograd_records(src, gamma, beta, mean, variance)) {
    return std::get<0>(batch_norm_forward_autograd(src, gamma, beta, mean, variance, epsilon, data_format));
  }
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op::batch_norm_forward_frozen().call(src, gamma, beta, mean, variance, epsilon, data_format);
}

// The forward's autograd, then the buffers' versions bumped (an empty batch's
// too: whether it is empty may be symbolic here).
Outputs3 batch_norm_forward_update_autograd(TBG_PARAMS(batch_norm_forward_update)) {
  Outputs3 outputs = forward_with_autograd(src, gamma, beta, std::nullopt, std::nullopt, epsilon, data_format, [&] {
    return op::batch_norm_forward_update().call(src, gamma, beta, running_mean, running_var, momentum, epsilon,
                                                data_format);
  });
  bump_versions(running_mean, running_var);
  return outputs;
}

namespace {

// The running statistics are buffers, never differentiated: `call` runs the
// update below autograd, and the version counters are bumped unless the
// update cannot have changed them.
template <class Call>
void update_below_autograd(const OptionalTensor& running_mean, const OptionalTensor& running_var, bool may_change,
                           const Call& call) {
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    call();
  }
  if (may_change) bump_versions(running_mean, running_var);
}

}  // namespace

void batch_norm_update_running_stats_autograd(TBG_PARAMS(batch_norm_update_running_stats)) {
  update_below_autograd(running_mean, running_var, count != 0, [&] {
    op::batch_norm_update_running_stats().call(running_mean, running_var, mean, variance, count, momentum);
  });
}

// The count held by a tensor: bumped whatever it holds (reading it could wait for the device).
void batch_norm_update_running_stats_counted_autograd(TBG_PARAMS(batch_norm_update_running_stats_counted)) {
  update_below_autograd(running_mean, running_var, true, [&] {
    op::batch_norm_update_running_stats_counted().call(running_mean, running_var, mean, variance, count, momentum);
  });
}

}  // namespace torch_bn_grad
