// Autograd of the fused batch_norm_act_forward, in C++: a training step pays
// no Python overhead for it.
//
// First-order gradients run the fused backward operator. What the node saves:
// * relu, leaky_relu: src and the output dst (act' from dst's sign), never z;
//   in eager CPU calls also dst's sign bits, which the backward reads instead
//   of dst (1/32 of the traffic of a float32 dst);
// * identity: src; silu: src and residual (z is recomputed);
// * memory_saving: dst and residual only (the backward runs from_output).
// Double backward, and gradients reaching the returned statistics or frozen
// statistics that require grad, take a composite route instead: dz = dy * act'(z)
// in differentiable at:: ops, then batch_norm_forward_grad (differentiable to
// any order). That route needs src, so memory_saving refuses it. The fused
// backward operator's own Autograd kernel refuses to be differentiated.
//
// A plain Node, as batch_norm_autograd.cpp's (torch::autograd::Function is
// refused under torch.func transforms).
#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <array>
#include <optional>
#include <string>

#include "autograd/act_grad.h"
#include "autograd/autograd_node.h"
#include "autograd/backward_refusal.h"
#include "autograd/buffer_versions.h"
#include "autograd/channel_algebra.h"
#include "autograd/forward_ad.h"
#include "autograd/forward_grad.h"
#include "library/operators.h"

namespace torch_bn_grad {
namespace {

using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

at::Tensor or_undefined(const OptionalTensor& t) { return given(t) ? *t : at::Tensor(); }

// A parameter in `dtype` (backward_param_dtype's), absent when undefined.
OptionalTensor in_dtype(const at::Tensor& t, at::ScalarType dtype) {
  if (!t.defined()) return std::nullopt;
  return to_dtype(t, dtype);
}

// Whether the forward may return dst's sign bits: plain CPU tensors in eager
// mode. Under tracing (fake, functional or batched tensors, torch.func
// transforms, Python dispatch modes) the graph keeps the plain operators,
// which inductor's rewrites know.
bool eager_cpu(const at::Tensor& t) {
  static const c10::DispatchKeySet traced({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
                                           c10::DispatchKey::Functionalize, c10::DispatchKey::FuncTorchBatched,
                                           c10::DispatchKey::FuncTorchGradWrapper,
                                           c10::DispatchKey::FuncTorchDynamicLayerFrontMode,
                                           c10::DispatchKey::FuncTorchDynamicLayerBackMode});
  return t.device().is_cpu() && !t.key_set().has_any(traced) &&
         !c10::impl::tls_local_dispatch_key_set().included_.has_any(traced);
}

struct ActForwardNode : public torch::autograd::Node {
  SavedVariable src, dst, dst_positive, residual, mean, variance, gamma, beta;
  double epsilon = 0, slope = 0;
  std::string activation, data_format;
  bool training = true, memory_saving = false, has_residual = false;
  bool inputs_had_tangents = false;  // forward over reverse: the backward must carry tangents

  std::string name() const override { return "BatchNormActForwardBackward"; }

  variable_list apply(variable_list&& grads) override {
    // Edges: src, gamma, beta, mean, variance, residual (empty for an absent optional).
    std::array<bool, 6> needs{};
    for (size_t input = 0; input < 6; ++input) needs[input] = task_should_compute_output(input);
    const bool frozen_stats_grad = !training && (needs[3] || needs[4]);
    if (at::GradMode::is_enabled() || frozen_stats_grad || grads[1].defined() || grads[2].defined() ||
        inputs_had_tangents || has_tangent(grads[0])) {
      return composite(grads, needs);
    }
    variable_list out(6);
    if (!grads[0].defined()) return out;
    const auto self = getptr();
    const at::Tensor g = gamma.unpack(self), b = beta.unpack(self);
    const std::array<bool, 4> mask = {needs[0], needs[1] && g.defined(), needs[2] && b.defined(),
                                      needs[5] && has_residual};
    if (!(mask[0] || mask[1] || mask[2] || mask[3])) return out;
    const at::Tensor m = mean.unpack(self), v = variance.unpack(self);
    const at::ScalarType param_dtype = backward_param_dtype(g.defined() ? g : b, m);
    auto [diff_src, diff_gamma, diff_beta, diff_residual] = [&] {
      at::AutoDispatchBelowADInplaceOrView below_autograd;  // grad mode is off: nothing to record
      return op::batch_norm_act_backward().call(
          grads[0], optional(src.unpack(self)), optional(dst.unpack(self)), optional(residual.unpack(self)), m, v,
          in_dtype(g, param_dtype), in_dtype(b, param_dtype), epsilon, activation, slope, data_format,
          training, memory_saving, mask, optional(dst_positive.unpack(self)));
    }();
    if (mask[0]) out[0] = diff_src;
    if (mask[1]) out[1] = to_dtype(diff_gamma, g.scalar_type());
    if (mask[2]) out[2] = to_dtype(diff_beta, b.scalar_type());
    if (mask[3]) out[5] = diff_residual;
    return out;
  }

  at::Tensor dz_of(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& y, const at::Tensor& r,
                   const at::Tensor& m, const at::Tensor& v, const at::Tensor& g, const at::Tensor& b) const {
    return times_act_grad(dy, {activation, slope, epsilon, data_format}, x, y, r, m, v, g, b);
  }

  variable_list composite(const variable_list& grads, const std::array<bool, 6>& needs) {
    TORCH_CHECK_NOT_IMPLEMENTED(!memory_saving,
                                "batch_norm_act: double backward (create_graph=True) and gradients of the "
                                "statistics need src, which memory_saving=True does not keep; use "
                                "memory_saving=False");
    const auto self = getptr();
    const at::Tensor x = src.unpack(self), m = mean.unpack(self), v = variance.unpack(self);
    const at::Tensor g = gamma.unpack(self), b = beta.unpack(self);
    at::Tensor dz;
    if (grads[0].defined()) dz = dz_of(grads[0], x, dst.unpack(self), residual.unpack(self), m, v, g, b);
    const at::Tensor& param = g.defined() ? g : b;
    auto [diff_src, diff_gamma, diff_beta, diff_mean, diff_variance] = batch_norm_forward_grad(
        x, optional(g), m, v, optional(dz), optional(grads[1]), optional(grads[2]), epsilon, data_format, training,
        param.defined() ? std::optional<at::ScalarType>(param.scalar_type()) : std::nullopt,
        {needs[0], needs[1], needs[2], needs[3], needs[4]});
    return {diff_src, diff_gamma, diff_beta, diff_mean, diff_variance,
            needs[5] && has_residual ? dz : at::Tensor()};
  }

  void release_variables() override {
    for (SavedVariable* saved : {&src, &dst, &dst_positive, &residual, &mean, &variance, &gamma, &beta})
      saved->reset_data();
  }
};

// Forward-mode AD: t_dst = act'(z) * (t_batch_norm + t_residual), the
// statistics' tangents as batch_norm_forward's (forward_ad.h).
void set_act_forward_tangents(const Outputs4& outputs, const at::Tensor& src, const OptionalTensor& gamma,
                              const OptionalTensor& beta, const OptionalTensor& mean, const OptionalTensor& variance,
                              const OptionalTensor& residual, const ActArgs& args) {
  const auto& [dst, mean_used, variance_used, positive] = outputs;
  auto [t_normalized, t_mean, t_variance] = batch_norm_forward_jvp(
      src, gamma, mean_used, variance_used, !given(mean), args.epsilon, args.data_format, tangent_of(src),
      tangent_of(gamma), tangent_of(beta), tangent_of(mean), tangent_of(variance));
  at::Tensor t_z = t_normalized;
  if (has_tangent(residual)) t_z = t_z.defined() ? t_z + tangent_of(residual) : tangent_of(residual);
  if (t_z.defined()) {
    set_tangent(dst, times_act_grad(t_z, args, primal_of(src), dst, primal_of(residual), mean_used, variance_used,
                                    primal_of(gamma), primal_of(beta)));
  }
  set_tangent(mean_used, t_mean);
  set_tangent(variance_used, t_variance);
}

// Whether the forward returns dst's sign bits: when the caller asks
// (batch_norm_act_forward_sign_bits), or, for batch_norm_act_forward, when the
// backward can read them (relu, leaky_relu, eager CPU, not memory saving).
enum class SignBits { kAsked, kWhereUseful };

// The autograd formula of the forward operators and their .update overloads;
// the sign bits, when returned, carry no gradient. `call(sign_bits)` runs the
// operator below autograd, with dst's sign bits or an undefined fourth tensor.
template <class Call>
Outputs4 act_forward_autograd(const at::Tensor& src, const OptionalTensor& gamma, const OptionalTensor& beta,
                              const OptionalTensor& mean, const OptionalTensor& variance,
                              const OptionalTensor& residual, double epsilon, c10::string_view activation,
                              double negative_slope, c10::string_view data_format, bool memory_saving,
                              SignBits bits_wanted, const Call& call) {
  NodePtr<ActForwardNode> node;
  if (torch::autograd::compute_requires_grad(src, gamma, beta, mean, variance, residual)) {
    node = make_node<ActForwardNode>();
    node->set_next_edges(torch::autograd::collect_next_edges(src, gamma, beta, mean, variance, residual));
  }
  const bool gate_from_dst = activation == "relu" || activation == "leaky_relu";
  const bool sign_bits = bits_wanted == SignBits::kAsked ||
                         (node && gate_from_dst && !memory_saving && eager_cpu(src) &&
                          (!given(residual) || eager_cpu(*residual)));
  Outputs4 outputs = [&]() -> Outputs4 {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call(sign_bits);
  }();
  const bool forward_ad = has_tangent(src) || has_tangent(gamma) || has_tangent(beta) || has_tangent(mean) ||
                          has_tangent(variance) || has_tangent(residual);
  if (forward_ad) {
    set_act_forward_tangents(outputs, src, gamma, beta, mean, variance, residual,
                             {activation, negative_slope, epsilon, data_format});
  }
  if (!node) return outputs;
  auto& [dst, mean_used, variance_used, positive] = outputs;
  torch::autograd::set_history(dst, node);
  torch::autograd::set_history(mean_used, node);
  torch::autograd::set_history(variance_used, node);
  const bool training = !given(mean);
  // dst is kept with its sign bits too: double backward reads it.
  const bool keep_dst = memory_saving || gate_from_dst;
  const bool keep_residual = memory_saving || activation == "silu";
  if (!memory_saving) node->src = SavedVariable(src, false);
  if (keep_dst) node->dst = SavedVariable(dst, true);
  // Only gate_from_dst reads them; empty ones (layouts the CPU kernels cannot
  // write them for) make the backward read dst. (Their size is not looked at
  // here: under tracing it is not known.)
  if (gate_from_dst && positive.defined()) node->dst_positive = SavedVariable(positive, false);
  if (keep_residual) node->residual = SavedVariable(or_undefined(residual), false);
  // Batch statistics saved as returned, frozen ones as given, so that double
  // backward reaches whichever the data depends on.
  node->mean = training ? SavedVariable(mean_used, true) : SavedVariable(*mean, false);
  node->variance = training ? SavedVariable(variance_used, true) : SavedVariable(*variance, false);
  node->gamma = SavedVariable(or_undefined(gamma), false);
  node->beta = SavedVariable(or_undefined(beta), false);
  node->epsilon = epsilon;
  node->slope = negative_slope;
  node->activation = std::string(activation);
  node->data_format = std::string(data_format);
  node->training = training;
  node->memory_saving = memory_saving;
  node->has_residual = given(residual);
  // With tangents the backward takes the composite route, which carries them
  // (forward over reverse); the fused backward operator carries none.
  node->inputs_had_tangents = forward_ad;
  return outputs;
}

Outputs4 with_undefined_bits(const Outputs3& outputs) {
  const auto& [dst, mean_used, variance_used] = outputs;
  return {dst, mean_used, variance_used, at::Tensor()};
}

Outputs3 without_bits(const Outputs4& outputs) {
  const auto& [dst, mean_used, variance_used, unused] = outputs;
  return {dst, mean_used, variance_used};
}

}  // namespace

Outputs3 batch_norm_act_forward_autograd(TBG_PARAMS(batch_norm_act_forward)) {
  return without_bits(act_forward_autograd(
      src, gamma, beta, mean, variance, residual, epsilon, activation, negative_slope, data_format, memory_saving,
      SignBits::kWhereUseful, [&](bool sign_bits) {
        if (sign_bits) {
          return op::batch_norm_act_forward_sign_bits().call(src, gamma, beta, mean, variance, residual, epsilon,
                                                             activation, negative_slope, data_format);
        }
        return with_undefined_bits(op::batch_norm_act_forward().call(
            src, gamma, beta, mean, variance, residual, epsilon, activation, negative_slope, data_format,
            memory_saving));
      }));
}

Outputs4 batch_norm_act_forward_sign_bits_autograd(TBG_PARAMS(batch_norm_act_forward_sign_bits)) {
  return act_forward_autograd(src, gamma, beta, mean, variance, residual, epsilon, activation, negative_slope,
                              data_format, false, SignBits::kAsked, [&](bool) {
                                return op::batch_norm_act_forward_sign_bits().call(
                                    src, gamma, beta, mean, variance, residual, epsilon, activation, negative_slope,
                                    data_format);
                              });
}

// The .frozen overload: below autograd where nothing records (an eval step),
// else batch_norm_act_forward's formula, whose dst it returns.
at::Tensor batch_norm_act_forward_frozen_autograd(TBG_PARAMS(batch_norm_act_forward_frozen)) {
  if (autograd_records(src, gamma, beta, mean, variance, residual)) {
    return std::get<0>(batch_norm_act_forward_autograd(src, gamma, beta, mean, variance, residual, epsilon,
                                                       activation, negative_slope, data_format, memory_saving));
  }
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op::batch_norm_act_forward_frozen().call(src, gamma, beta, mean, variance, residual, epsilon, activation,
                                                  negative_slope, data_format, memory_saving);
}

// The .update overloads: the training forward's autograd (the update's
// operator with sign bits where the forward's would take them), then the
// buffers' versions bumped (an empty batch's too: whether it is empty may be
// symbolic here).
Outputs3 batch_norm_act_forward_update_autograd(TBG_PARAMS(batch_norm_act_forward_update)) {
  Outputs3 outputs = without_bits(act_forward_autograd(
      src, gamma, beta, std::nullopt, std::nullopt, residual, epsilon, activation, negative_slope, data_format,
      memory_saving, SignBits::kWhereUseful, [&](bool sign_bits) {
        if (sign_bits) {
          return op::batch_norm_act_forward_sign_bits_update().call(src, gamma, beta, running_mean, running_var,
                                                                    residual, momentum, epsilon, activation,
                                                                    negative_slope, data_format);
        }
        return with_undefined_bits(op::batch_norm_act_forward_update().call(
            src, gamma, beta, running_mean, running_var, residual, momentum, epsilon, activation, negative_slope,
            data_format, memory_saving));
      }));
  bump_versions(running_mean, running_var);
  return outputs;
}

Outputs4 batch_norm_act_forward_sign_bits_update_autograd(TBG_PARAMS(batch_norm_act_forward_sign_bits_update)) {
  Outputs4 outputs = act_forward_autograd(
      src, gamma, beta, std::nullopt, std::nullopt, residual, epsilon, activation, negative_slope, data_format,
      false, SignBits::kAsked, [&](bool) {
        return op::batch_norm_act_forward_sign_bits_update().call(src, gamma, beta, running_mean, running_var,
                                                                  residual, momentum, epsilon, activation,
                                                                  negative_slope, data_format);
      });
  bump_versions(running_mean, running_var);
  return outputs;
}

// The fused backward operator: not differentiable itself (batch_norm_act_forward's
// formula differentiates to any order), so a graph through it raises when it is
// differentiated.
Outputs4 batch_norm_act_backward_autograd(TBG_PARAMS(batch_norm_act_backward)) {
  return call_refusing_derivatives(
      "batch_norm_act_backward", "batch_norm_act_forward (or functional.batch_norm_act)",
      [&] {
        return op::batch_norm_act_backward().call(diff_dst, src, dst, residual, mean, variance, gamma, beta, epsilon,
                                                  activation, negative_slope, data_format, training, from_output,
                                                  output_mask, dst_positive);
      },
      diff_dst, src, dst, residual, mean, variance, gamma, beta);
}

}  // namespace torch_bn_grad
