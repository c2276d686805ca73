// Forward-mode AD (torch.func.jvp, jacfwd, hessian, torch.autograd.forward_ad)
// of batch_norm_forward, for the operators' C++ autograd kernels. The
// tangents are made of differentiable at:: operators, so reverse mode can
// differentiate them again (jacrev of jacfwd); the backward operator's own
// jvp (forward over reverse: hessian) is Python's (torch_bn_grad/_library/autograd.py).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/string_view.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <optional>
#include <tuple>

#include "library/operators.h"

namespace torch_bn_grad {

// The forward-mode gradient of an optional input (undefined when it has none).
at::Tensor tangent_of(const std::optional<at::Tensor>& t);
bool has_tangent(const std::optional<at::Tensor>& t);
// Its primal (the tensor without its tangent); undefined stays undefined.
at::Tensor primal_of(const std::optional<at::Tensor>& t);

// Tangents of batch_norm_forward's (dst, mean, variance), in src's and the
// statistics' dtypes, given its inputs, the statistics it used (mean_used,
// variance_used: the batch's in training, the given ones frozen) and the
// inputs' tangents (absent or undefined: zero); also the kernel of the
// operator batch_norm_forward_jvp. With r = (variance + eps)^-1/2 and
// x_hat = (x - mean) r:
//   training: t_mean = E[t_x], t_variance = 2 E[(x - mean)(t_x - t_mean)]
//   frozen:   t_mean, t_variance are the given statistics' tangents
//   t_dst = gamma (t_x - t_mean) r - gamma x_hat r^2 t_variance / 2 + t_gamma x_hat + t_beta.
// An undefined result is a zero tangent.
// Outputs3 batch_norm_forward_jvp(TBG_PARAMS(batch_norm_forward_jvp)): library/operators.h.

// The same for batch_norm_masked_forward (NCX data): over the valid positions,
// `valid` the mask broadcast against src, `count` their number per channel (a
// 0-dim tensor); t_dst is 0 at padded positions, whose values are never read.
std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_masked_forward_jvp(
    const at::Tensor& src, const at::Tensor& valid, const at::Tensor& count, const std::optional<at::Tensor>& gamma,
    const at::Tensor& mean_used, const at::Tensor& variance_used, bool training, double epsilon,
    const std::optional<at::Tensor>& src_t, const std::optional<at::Tensor>& gamma_t,
    const std::optional<at::Tensor>& beta_t, const std::optional<at::Tensor>& mean_t,
    const std::optional<at::Tensor>& variance_t);

// Sets `output`'s forward-mode gradient to `tangent` (nothing when undefined).
void set_tangent(const at::Tensor& output, const at::Tensor& tangent);

// Whether autograd records a call with these inputs (tensors or optional
// ones): one requires grad, or carries a forward-mode tangent.
template <class... Inputs>
bool autograd_records(const Inputs&... inputs) {
  return torch::autograd::compute_requires_grad(inputs...) || (has_tangent(inputs) || ...);
}

}  // namespace torch_bn_grad
