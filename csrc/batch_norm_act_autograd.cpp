// Autograd of the fused batch_norm_act_forward, in C++: a training step pays
// no Python overhead for it (it used to be a Python autograd Function).
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
// any order). That route needs src, so memory_saving refuses it.
//
// A plain Node, as batch_norm_autograd.cpp's (torch::autograd::Function is
// refused under torch.func transforms).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <string>

namespace torch_bn_grad {
namespace {

using torch::autograd::SavedVariable;
using torch::autograd::variable_list;
using OptionalTensor = std::optional<at::Tensor>;
using Outputs3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Outputs4 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using Outputs5 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

const auto& act_forward_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("torch_bn_grad::batch_norm_act_forward", "")
          .typed<Outputs3(const at::Tensor&, const OptionalTensor&, const OptionalTensor&, const OptionalTensor&,
                          const OptionalTensor&, const OptionalTensor&, double, c10::string_view, double,
                          c10::string_view, bool)>();
  return op;
}

const auto& act_forward_sign_bits_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("torch_bn_grad::batch_norm_act_forward_sign_bits", "")
          .typed<Outputs4(const at::Tensor&, const OptionalTensor&, const OptionalTensor&, const OptionalTensor&,
                          const OptionalTensor&, const OptionalTensor&, double, c10::string_view, double,
                          c10::string_view)>();
  return op;
}

const auto& act_backward_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("torch_bn_grad::batch_norm_act_backward", "")
          .typed<Outputs4(const at::Tensor&, const OptionalTensor&, const OptionalTensor&, const OptionalTensor&,
                          const at::Tensor&, const at::Tensor&, const OptionalTensor&, const OptionalTensor&, double,
                          c10::string_view, double, c10::string_view, bool, bool, std::array<bool, 4>,
                          const OptionalTensor&)>();
  return op;
}

const auto& forward_grad_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("torch_bn_grad::batch_norm_forward_grad", "")
          .typed<Outputs5(const at::Tensor&, const OptionalTensor&, const at::Tensor&, const at::Tensor&,
                          const OptionalTensor&, const OptionalTensor&, const OptionalTensor&, double,
                          c10::string_view, bool, std::optional<at::ScalarType>, std::array<bool, 5>)>();
  return op;
}

bool given(const OptionalTensor& t) { return t.has_value() && t->defined(); }
OptionalTensor optional(const at::Tensor& t) { return t.defined() ? OptionalTensor(t) : std::nullopt; }
at::Tensor or_undefined(const OptionalTensor& t) { return given(t) ? *t : at::Tensor(); }

// Half-precision parameters meet float32 statistics: the fused operator takes one dtype.
OptionalTensor in_dtype(const at::Tensor& t, at::ScalarType dtype) {
  if (!t.defined()) return std::nullopt;
  return t.scalar_type() == dtype ? t : t.to(dtype);
}

// Per-channel values shaped to broadcast against src (1-D statistics on
// NCX's channel axis; NXC's channels are last, and the broadcast form already broadcasts).
at::Tensor broadcastable(const at::Tensor& stats, const at::Tensor& src, c10::string_view data_format) {
  if (stats.dim() == src.dim() || data_format != "NCX") return stats;
  std::vector<c10::SymInt> shape(src.dim(), 1);
  shape[1] = stats.sym_numel();
  return stats.reshape_symint(shape);
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

  std::string name() const override { return "BatchNormActForwardBackward"; }

  variable_list apply(variable_list&& grads) override {
    // Edges: src, gamma, beta, mean, variance, residual (empty for an absent optional).
    std::array<bool, 6> needs{};
    for (size_t input = 0; input < 6; ++input) needs[input] = task_should_compute_output(input);
    const bool frozen_stats_grad = !training && (needs[3] || needs[4]);
    if (at::GradMode::is_enabled() || frozen_stats_grad || grads[1].defined() || grads[2].defined()) {
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
    auto [diff_src, diff_gamma, diff_beta, diff_residual] = [&] {
      at::AutoDispatchBelowADInplaceOrView below_autograd;  // grad mode is off: nothing to record
      return act_backward_op().call(grads[0], optional(src.unpack(self)), optional(dst.unpack(self)),
                                    optional(residual.unpack(self)), m, v, in_dtype(g, m.scalar_type()),
                                    in_dtype(b, m.scalar_type()), epsilon, activation, slope, data_format,
                                    training, memory_saving, mask, optional(dst_positive.unpack(self)));
    }();
    if (mask[0]) out[0] = diff_src;
    if (mask[1]) out[1] = diff_gamma.to(g.scalar_type());
    if (mask[2]) out[2] = diff_beta.to(b.scalar_type());
    if (mask[3]) out[5] = diff_residual;
    return out;
  }

  // dz = dy * act'(z) in differentiable ops (relu, leaky_relu: act' from the
  // detached output, whose derivative is 0, torch's convention; silu from z).
  // Mirrors csrc/activation_math.h: a new activation adds its case here.
  at::Tensor dz_of(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& y, const at::Tensor& r,
                   const at::Tensor& m, const at::Tensor& v, const at::Tensor& g, const at::Tensor& b) const {
    if (activation == "identity") return dy;
    if (activation == "relu") return dy * y.detach().gt(0);
    if (activation == "leaky_relu") return at::where(y.detach().gt(0), dy, dy * slope);
    TORCH_CHECK(activation == "silu", "batch_norm_act: no double-backward formula for activation ", activation);
    const auto t = x.scalar_type();
    const auto acc = (t == at::kHalf || t == at::kBFloat16) ? at::kFloat : t;
    at::Tensor scale = (v.to(acc) + epsilon).rsqrt();
    if (g.defined()) scale = scale * g.to(acc);
    at::Tensor z = (x.to(acc) - broadcastable(m.to(acc), x, data_format)) * broadcastable(scale, x, data_format);
    if (b.defined()) z = z + broadcastable(b.to(acc), x, data_format);
    if (r.defined()) z = z + r.to(acc);
    const at::Tensor s = z.sigmoid();
    return (dy.to(acc) * (s * (1 + z * (1 - s)))).to(dy.scalar_type());
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
    auto [diff_src, diff_gamma, diff_beta, diff_mean, diff_variance] = forward_grad_op().call(
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

// Whether the forward returns dst's sign bits: when the caller asks
// (batch_norm_act_forward_sign_bits), or, for batch_norm_act_forward, when the
// backward can read them (relu, leaky_relu, eager CPU, not memory saving).
enum class SignBits { kAsked, kWhereUseful };

// The autograd formula of both forward operators; the sign bits, when
// returned, carry no gradient.
Outputs4 act_forward_autograd(const at::Tensor& src, const OptionalTensor& gamma, const OptionalTensor& beta,
                              const OptionalTensor& mean, const OptionalTensor& variance,
                              const OptionalTensor& residual, double epsilon, c10::string_view activation,
                              double negative_slope, c10::string_view data_format, bool memory_saving,
                              SignBits bits_wanted) {
  using torch::autograd::isFwGradDefined;
  TORCH_CHECK_NOT_IMPLEMENTED(
      !(isFwGradDefined(src) || isFwGradDefined(gamma) || isFwGradDefined(beta) || isFwGradDefined(mean) ||
        isFwGradDefined(variance) || isFwGradDefined(residual)),
      "batch_norm_act_forward: forward-mode AD (jvp, jacfwd) is not implemented");
  c10::intrusive_ptr<ActForwardNode> node;
  if (torch::autograd::compute_requires_grad(src, gamma, beta, mean, variance, residual)) {
    node = c10::make_intrusive<ActForwardNode>();
    node->set_next_edges(torch::autograd::collect_next_edges(src, gamma, beta, mean, variance, residual));
  }
  const bool gate_from_dst = activation == "relu" || activation == "leaky_relu";
  const bool sign_bits = bits_wanted == SignBits::kAsked ||
                         (node && gate_from_dst && !memory_saving && eager_cpu(src) &&
                          (!given(residual) || eager_cpu(*residual)));
  Outputs4 outputs = [&]() -> Outputs4 {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    if (sign_bits) {
      return act_forward_sign_bits_op().call(src, gamma, beta, mean, variance, residual, epsilon, activation,
                                             negative_slope, data_format);
    }
    auto [d, m, v] = act_forward_op().call(src, gamma, beta, mean, variance, residual, epsilon, activation,
                                           negative_slope, data_format, memory_saving);
    return {d, m, v, at::Tensor()};
  }();
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
  return outputs;
}

Outputs3 batch_norm_act_forward_autograd(const at::Tensor& src, const OptionalTensor& gamma,
                                         const OptionalTensor& beta, const OptionalTensor& mean,
                                         const OptionalTensor& variance, const OptionalTensor& residual,
                                         double epsilon, c10::string_view activation, double negative_slope,
                                         c10::string_view data_format, bool memory_saving) {
  auto [dst, mean_used, variance_used, unused] =
      act_forward_autograd(src, gamma, beta, mean, variance, residual, epsilon, activation, negative_slope,
                           data_format, memory_saving, SignBits::kWhereUseful);
  return {dst, mean_used, variance_used};
}

Outputs4 batch_norm_act_forward_sign_bits_autograd(const at::Tensor& src, const OptionalTensor& gamma,
                                                   const OptionalTensor& beta, const OptionalTensor& mean,
                                                   const OptionalTensor& variance, const OptionalTensor& residual,
                                                   double epsilon, c10::string_view activation,
                                                   double negative_slope, c10::string_view data_format) {
  return act_forward_autograd(src, gamma, beta, mean, variance, residual, epsilon, activation, negative_slope,
                              data_format, false, SignBits::kAsked);
}

// The backward operator is not differentiable itself: gradients flowing into
// it raise instead of being dropped silently.
struct ActBackwardRefusal : public torch::autograd::Node {
  std::string name() const override { return "BatchNormActBackwardBackward"; }
  variable_list apply(variable_list&&) override {
    TORCH_CHECK_NOT_IMPLEMENTED(false,
                                "batch_norm_act_backward is not differentiable itself; differentiate "
                                "batch_norm_act_forward (or functional.batch_norm_act) instead, whose autograd "
                                "formula supports double backward");
  }
};

Outputs4 batch_norm_act_backward_autograd(const at::Tensor& diff_dst, const OptionalTensor& src,
                                          const OptionalTensor& dst, const OptionalTensor& residual,
                                          const at::Tensor& mean, const at::Tensor& variance,
                                          const OptionalTensor& gamma, const OptionalTensor& beta, double epsilon,
                                          c10::string_view activation, double negative_slope,
                                          c10::string_view data_format, bool training, bool from_output,
                                          std::array<bool, 4> output_mask, const OptionalTensor& dst_positive) {
  c10::intrusive_ptr<ActBackwardRefusal> node;
  if (torch::autograd::compute_requires_grad(diff_dst, src, dst, residual, mean, variance, gamma, beta)) {
    node = c10::make_intrusive<ActBackwardRefusal>();
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
  m.impl("batch_norm_act_forward", &batch_norm_act_forward_autograd);
  m.impl("batch_norm_act_forward_sign_bits", &batch_norm_act_forward_sign_bits_autograd);
  m.impl("batch_norm_act_backward", &batch_norm_act_backward_autograd);
}

}  // namespace torch_bn_grad
