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

namespace torch_bn_grad {

// Gradients of (dst, mean, variance) = batch_norm_forward(src, gamma, beta, ...)
// with respect to (src, gamma, beta, mean, variance); undefined where
// output_mask is false (csrc/autograd/batch_norm_autograd.cpp).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> batch_norm_forward_grad(
    const at::Tensor& src, const std::optional<at::Tensor>& gamma, const at::Tensor& mean,
    const at::Tensor& variance, const std::optional<at::Tensor>& grad_dst, const std::optional<at::Tensor>& grad_mean,
    const std::optional<at::Tensor>& grad_variance, double epsilon, c10::string_view data_format, bool training,
    std::optional<at::ScalarType> param_dtype, std::array<bool, 5> output_mask);

}  // namespace torch_bn_grad
