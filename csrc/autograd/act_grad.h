// The fused operators' activation gate in differentiable at:: ops: what
// their autograd formulas' composite routes (double backward, jvp) use for
// dz = dy * act'(z) (batch_norm_act_autograd.cpp, batch_norm_masked_autograd.cpp).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/string_view.h>

namespace torch_bn_grad {

// What act'(z) depends on besides the tensors.
struct ActArgs {
  c10::string_view activation;
  double slope;
  double epsilon;
  c10::string_view data_format;
};

// dy * act'(z) in differentiable ops, z = batch_norm(x; m, v, g, b) + r
// (relu, leaky_relu: act' from the detached output y, whose derivative is 0,
// torch's convention; silu from z, recomputed). Mirrors
// csrc/math/activation_math.h: a new activation adds its case here.
at::Tensor times_act_grad(const at::Tensor& dy, const ActArgs& a, const at::Tensor& x, const at::Tensor& y,
                          const at::Tensor& r, const at::Tensor& m, const at::Tensor& v, const at::Tensor& g,
                          const at::Tensor& b);

}  // namespace torch_bn_grad
