// The gradient of batch_norm_forward (and, through dz, of the fused
// operators' composite route), also registered as the operator
// torch_bn_grad::batch_norm_forward_grad (CompositeImplicitAutograd). C++
// callers call it directly: through the dispatcher, a call from a backward
// node under vmap (hessian of a fused operator) found no batching rule.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/string_view.h>

#include <array>
#include <optional>
#include <tuple>
#include <utility>

#include "autograd/channel_algebra.h"
#include "library/operators.h"

namespace torch_bn_grad {

// Gradients of (dst, mean, variance) = batch_norm_forward(src, gamma, beta, ...)
// with respect to (src, gamma, beta, mean, variance); undefined where
// output_mask is false (csrc/autograd/batch_norm_autograd.cpp):
// Outputs5 batch_norm_forward_grad(TBG_PARAMS(batch_norm_forward_grad)), declared in library/operators.h.

// What gradients reaching the returned batch statistics add to diff_src:
// grad_mean / count + grad_variance * 2 (x - mean) / count, in the
// accumulation dtype; an undefined gradient adds nothing. `count` (per
// channel) is a Scalar (symbolic under torch.compile) or a tensor (masked:
// the valid count, on the device).
template <class Count>
at::Tensor batch_statistics_grad(const at::Tensor& src, const at::Tensor& mean, const at::Tensor& grad_mean,
                                 const at::Tensor& grad_variance, const Count& count, c10::string_view data_format) {
  const auto acc = accumulation_dtype(src);
  at::Tensor extra = at::zeros({}, src.options().dtype(acc));
  if (grad_mean.defined()) extra = extra + broadcastable(grad_mean.to(acc), src, data_format) / count;
  if (grad_variance.defined()) {
    const at::Tensor centred = src.to(acc) - broadcastable(mean.to(acc), src, data_format);
    extra = extra + broadcastable(grad_variance.to(acc), src, data_format) * centred * 2 / count;
  }
  return extra;
}

// Frozen statistics: dst = (x - mean) * g * r + beta with r = (variance + eps)^-1/2
// gives d/dmean = -g r sum(dy) = -g r diff_beta and d/dvariance =
// -g r^3 / 2 * sum(dy * (x - mean)) = -g r^2 / 2 * diff_gamma, in `acc`;
// each undefined unless wanted.
inline std::pair<at::Tensor, at::Tensor> frozen_statistics_grads(
    const std::optional<at::Tensor>& gamma, const at::Tensor& variance, double epsilon, const at::Tensor& diff_gamma,
    const at::Tensor& diff_beta, at::ScalarType acc, bool need_mean, bool need_variance) {
  const at::Tensor rstd = (variance.to(acc) + epsilon).rsqrt();
  const at::Tensor g = gamma.has_value() && gamma->defined() ? gamma->to(acc) : at::ones_like(rstd);
  return {need_mean ? -(g * rstd) * diff_beta.to(acc) : at::Tensor(),
          need_variance ? -0.5 * g * rstd * rstd * diff_gamma.to(acc) : at::Tensor()};
}

}  // namespace torch_bn_grad
