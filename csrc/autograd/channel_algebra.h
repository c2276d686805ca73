// Per-channel algebra in differentiable at:: operators, for the autograd
// formulas (batch_norm_autograd.cpp, batch_norm_act_autograd.cpp,
// forward_ad.cpp): how statistics broadcast against src, and how src-shaped
// values reduce back to them. The rule for which dims a channel spans is the
// contract's: 1-D statistics lie on data_format's channel axis (NCX: dim 1,
// NXC: the last), statistics of src's rank keep their non-1 dims.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/string_view.h>

#include <optional>

namespace torch_bn_grad {

// The dtype the autograd formulas compute in: src's accumulation dtype
// (dtypes.h), float32 for half-precision data.
at::ScalarType accumulation_dtype(const at::Tensor& src);

// a + b, an undefined tensor meaning zero (a gradient or tangent not given).
at::Tensor plus(const at::Tensor& a, const at::Tensor& b);

// `t` in `dtype` (as it is when undefined, already of it, or no dtype given).
at::Tensor to_dtype(const at::Tensor& t, std::optional<at::ScalarType> dtype);

// The dtype the first-order formulas pass the parameters (gamma, beta) to a
// backward operator in, beside statistics `mean`: their own, so that neither
// they nor the gradients it returns in it are cast (a half-precision model's
// parameters, float32 batch statistics); on CUDA the statistics' dtype (a cast
// each way) unless the param_dtype_grads variant is on.
at::ScalarType backward_param_dtype(const at::Tensor& param, const at::Tensor& mean);

// Per-channel values of `stats` shaped to broadcast against `src`.
at::Tensor broadcastable(const at::Tensor& stats, const at::Tensor& src, c10::string_view data_format);

// Per-channel sums of `values` (src's shape) over the positions each channel
// spans, shaped as `stats`.
at::Tensor sum_to_stats(const at::Tensor& values, const at::Tensor& stats, c10::string_view data_format);

// Elements each channel spans (at least 1), symbolic under torch.compile.
c10::SymInt per_channel_count(const at::Tensor& src, const at::Tensor& stats);

}  // namespace torch_bn_grad
