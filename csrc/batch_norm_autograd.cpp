// Autograd of batch_norm_forward, in C++: a training step pays no Python
// overhead for it.
//
// The gradient of the forward operator is one function,
// `batch_norm_forward_grad`, also an operator (CompositeImplicitAutograd), so
// that Python's BatchNormFunction calls the very same formula and gradients of
// any order flow through the differentiable operators it is made of
// (batch_norm_backward has its own autograd formula).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <string>

namespace torch_bn_grad {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptionalTensor = std::optional<at::Tensor>;
using Outputs3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Outputs5 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

const auto& forward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("torch_bn_grad::batch_norm_forward", "")
                             .typed<Outputs3(const at::Tensor&, const OptionalTensor&, const OptionalTensor&,
                                             const OptionalTensor&, const OptionalTensor&, double,
                                             c10::string_view)>();
  return op;
}

const auto& backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("torch_bn_grad::batch_norm_backward", "")
                             .typed<Outputs3(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                             const at::Tensor&, const OptionalTensor&, double, c10::string_view,
                                             bool, std::array<bool, 3>)>();
  return op;
}

// The backward operator. Without grad mode nothing is recorded, so its
// (Python) autograd kernel is skipped; with it (double backward) it records.
Outputs3 call_backward_op(const at::Tensor& src, const at::Tensor& diff_dst, const at::Tensor& mean,
                          const at::Tensor& variance, const OptionalTensor& gamma, double epsilon,
                          c10::string_view data_format, bool training, std::array<bool, 3> mask) {
  if (!at::GradMode::is_enabled()) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return backward_op().call(src, diff_dst, mean, variance, gamma, epsilon, data_format, training, mask);
  }
  return backward_op().call(src, diff_dst, mean, variance, gamma, epsilon, data_format, training, mask);
}

// Per-channel values of `stats` shaped to broadcast against `src`: 1-D
// statistics on the channel axis of data_format; the broadcast form (same
// rank as src) already broadcasts.
at::Tensor broadcastable(const at::Tensor& stats, const at::Tensor& src, c10::string_view data_format) {
  if (stats.dim() == src.dim() || data_format != "NCX") return stats;  // NXC: channels are the last dim
  std::vector<c10::SymInt> shape(src.dim(), 1);
  shape[1] = stats.sym_numel();
  return stats.reshape_symint(shape);
}

at::ScalarType accumulation_dtype(const at::Tensor& src) {
  const auto t = src.scalar_type();
  return (t == at::kHalf || t == at::kBFloat16) ? at::kFloat : t;
}

at::Tensor to_dtype(const at::Tensor& t, std::optional<at::ScalarType> dtype) {
  return (t.defined() && dtype.has_value() && t.scalar_type() != *dtype) ? t.to(*dtype) : t;
}

// Gradients of (dst, mean, variance) = batch_norm_forward(src, gamma, beta, ...)
// with respect to (src, gamma, beta, mean, variance); undefined where not asked.
//
// Batch statistics (training): diff_src, diff_gamma, diff_beta come from the
// backward operator; gradients reaching the returned mean and variance add
// grad_mean / M + grad_variance * 2 (x - mean) / M to diff_src.
// Frozen statistics: dst = (x - mean) * g * r + beta with r = (variance + eps)^-1/2
// gives d/dmean = -g r sum(dy) and d/dvariance = -g r^3 / 2 * sum(dy * (x - mean)), which is
// -g r^2 / 2 * diff_gamma;
// the returned statistics are the inputs themselves, so their gradients add.
Outputs5 batch_norm_forward_grad(const at::Tensor& src, const OptionalTensor& gamma, const at::Tensor& mean,
                                 const at::Tensor& variance, const OptionalTensor& grad_dst,
                                 const OptionalTensor& grad_mean, const OptionalTensor& grad_variance,
                                 double epsilon, c10::string_view data_format, bool training,
                                 std::optional<at::ScalarType> param_dtype, std::array<bool, 5> output_mask) {
  const auto [need_src, need_gamma, need_beta, need_mean, need_variance] = output_mask;
  const bool frozen = !training;
  const at::Tensor dy = grad_dst.has_value() && grad_dst->defined() ? *grad_dst : at::zeros_like(src);
  // Half-precision parameters meet float32 statistics: gamma in the statistics' dtype.
  OptionalTensor gamma_in_stats_dtype = gamma;
  if (gamma.has_value() && gamma->defined() && gamma->scalar_type() != mean.scalar_type()) {
    gamma_in_stats_dtype = gamma->to(mean.scalar_type());
  }
  const std::array<bool, 3> mask = {need_src, need_gamma || (frozen && need_variance),
                                    need_beta || (frozen && need_mean)};
  auto [diff_src, diff_gamma, diff_beta] = call_backward_op(src, dy, mean, variance, gamma_in_stats_dtype,
                                                            epsilon, data_format, training, mask);
  const bool has_grad_mean = grad_mean.has_value() && grad_mean->defined();
  const bool has_grad_variance = grad_variance.has_value() && grad_variance->defined();
  const auto acc = accumulation_dtype(src);
  at::Tensor mean_grad, variance_grad;

  if (training) {
    if (need_src && (has_grad_mean || has_grad_variance)) {
      // Symbolic under torch.compile: M = numel(src) / numel(mean), at least 1.
      const c10::Scalar count((src.sym_numel() / mean.sym_numel().max(1)).max(1));
      at::Tensor extra = at::zeros({}, src.options().dtype(acc));
      if (has_grad_mean) extra = extra + broadcastable(grad_mean->to(acc), src, data_format) / count;
      if (has_grad_variance) {
        const at::Tensor centred = src.to(acc) - broadcastable(mean.to(acc), src, data_format);
        extra = extra + broadcastable(grad_variance->to(acc), src, data_format) * centred * 2 / count;
      }
      diff_src = diff_src + extra.to(src.scalar_type());
    }
  } else if (need_mean || need_variance) {
    const at::Tensor rstd = (variance.to(acc) + epsilon).rsqrt();
    const at::Tensor g = gamma.has_value() && gamma->defined() ? gamma->to(acc) : at::ones_like(rstd);
    if (need_mean) {
      mean_grad = -(g * rstd) * diff_beta.to(acc);
      if (has_grad_mean) mean_grad = mean_grad + grad_mean->to(acc);
      mean_grad = mean_grad.to(mean.scalar_type());
    }
    if (need_variance) {
      variance_grad = -0.5 * g * rstd * rstd * diff_gamma.to(acc);
      if (has_grad_variance) variance_grad = variance_grad + grad_variance->to(acc);
      variance_grad = variance_grad.to(variance.scalar_type());
    }
  }
  return {need_src ? diff_src : at::Tensor(), need_gamma ? to_dtype(diff_gamma, param_dtype) : at::Tensor(),
          need_beta ? to_dtype(diff_beta, param_dtype) : at::Tensor(), mean_grad, variance_grad};
}

bool given(const OptionalTensor& t) { return t.has_value() && t->defined(); }

// The autograd node of batch_norm_forward.
struct ForwardFunction : public torch::autograd::Function<ForwardFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& src, const OptionalTensor& gamma,
                               const OptionalTensor& beta, const OptionalTensor& mean,
                               const OptionalTensor& variance, double epsilon, c10::string_view data_format) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [dst, mean_used, variance_used] =
        forward_op().call(src, gamma, beta, mean, variance, epsilon, data_format);
    const bool batch_statistics = !given(mean);
    // Frozen statistics are saved as given, so that double backward reaches them.
    ctx->save_for_backward({src, given(gamma) ? *gamma : at::Tensor(),
                            batch_statistics ? mean_used : *mean,
                            batch_statistics ? variance_used : *variance});
    // Unused statistics outputs then get undefined gradients, not full-size zero work.
    ctx->set_materialize_grads(false);
    ctx->saved_data["epsilon"] = epsilon;
    ctx->saved_data["data_format"] = std::string(data_format);
    ctx->saved_data["batch_statistics"] = batch_statistics;
    // Which inputs are autograd edges (defined tensors), in order.
    ctx->saved_data["given"] = c10::List<bool>({true, given(gamma), given(beta), given(mean), given(variance)});
    const OptionalTensor param = given(gamma) ? gamma : beta;
    ctx->saved_data["param_dtype"] =
        given(param) ? static_cast<int64_t>(param->scalar_type()) : static_cast<int64_t>(-1);
    return {dst, mean_used, variance_used};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto present = ctx->saved_data["given"].toBoolList();
    // needs_input_grad counts edges, which exist for the given tensors only.
    std::array<bool, 5> needs{};
    for (size_t input = 0, edge = 0; input < 5; ++input) {
      if (present[input]) needs[input] = ctx->needs_input_grad(edge++);
    }
    const int64_t dtype_code = ctx->saved_data["param_dtype"].toInt();
    const std::optional<at::ScalarType> param_dtype =
        dtype_code < 0 ? std::nullopt : std::optional<at::ScalarType>(static_cast<at::ScalarType>(dtype_code));
    const OptionalTensor gamma = saved[1].defined() ? OptionalTensor(saved[1]) : std::nullopt;
    auto [diff_src, diff_gamma, diff_beta, diff_mean, diff_variance] = batch_norm_forward_grad(
        saved[0], gamma, saved[2], saved[3], grads[0], grads[1], grads[2], ctx->saved_data["epsilon"].toDouble(),
        ctx->saved_data["data_format"].toStringRef(), ctx->saved_data["batch_statistics"].toBool(), param_dtype,
        needs);
    return {diff_src, diff_gamma, diff_beta, diff_mean, diff_variance, at::Tensor(), at::Tensor()};
  }
};

Outputs3 batch_norm_forward_autograd(const at::Tensor& src, const OptionalTensor& gamma, const OptionalTensor& beta,
                                     const OptionalTensor& mean, const OptionalTensor& variance, double epsilon,
                                     c10::string_view data_format) {
  auto outputs = ForwardFunction::apply(src, gamma, beta, mean, variance, epsilon, data_format);
  return {outputs[0], outputs[1], outputs[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_bn_grad, Autograd, m) {
  m.impl("batch_norm_forward", &batch_norm_forward_autograd);
}

TORCH_LIBRARY_IMPL(torch_bn_grad, CompositeImplicitAutograd, m) {
  m.impl("batch_norm_forward_grad", &batch_norm_forward_grad);
}

}  // namespace torch_bn_grad
