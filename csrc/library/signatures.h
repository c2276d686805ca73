// Each operator's parameters, written once, as its schema (library/schemas.cpp)
// names them: `TBG_PARAMS(batch_norm_forward)` is batch_norm_forward's C++
// parameter list, which its kernels, its argument check and its handle's
// signature (library/operators.h) are declared with. Backend headers only:
// the kernels' and the checks' units include it.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <array>
#include <cstdint>
#include <optional>
#include <tuple>

namespace torch_bn_grad {

using OptionalTensor = std::optional<at::Tensor>;
using Outputs3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Outputs4 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using Outputs5 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// An optional tensor argument that holds a tensor.
inline bool given(const OptionalTensor& t) { return t.has_value() && t->defined(); }
// A saved tensor as an optional argument: none where it is undefined.
inline OptionalTensor optional(const at::Tensor& t) { return t.defined() ? OptionalTensor(t) : std::nullopt; }

#define TBG_PARAMS(name) TBG_PARAMS_##name

// clang-format off
#define TBG_PARAMS_batch_norm_forward \
  const at::Tensor &src, const OptionalTensor &gamma, const OptionalTensor &beta, const OptionalTensor &mean, \
  const OptionalTensor &variance, double epsilon, c10::string_view data_format
#define TBG_PARAMS_batch_norm_forward_frozen \
  const at::Tensor &src, const OptionalTensor &gamma, const OptionalTensor &beta, const at::Tensor &mean, \
  const at::Tensor &variance, double epsilon, c10::string_view data_format
#define TBG_PARAMS_batch_norm_forward_update \
  const at::Tensor &src, const OptionalTensor &gamma, const OptionalTensor &beta, \
  const OptionalTensor &running_mean, const OptionalTensor &running_var, double momentum, double epsilon, \
  c10::string_view data_format
#define TBG_PARAMS_batch_norm_backward \
  const at::Tensor &src, const at::Tensor &diff_dst, const at::Tensor &mean, const at::Tensor &variance, \
  const OptionalTensor &gamma, double epsilon, c10::string_view data_format, bool training, \
  std::array<bool, 3> output_mask
#define TBG_PARAMS_batch_norm_forward_grad \
  const at::Tensor &src, const OptionalTensor &gamma, const at::Tensor &mean, const at::Tensor &variance, \
  const OptionalTensor &grad_dst, const OptionalTensor &grad_mean, const OptionalTensor &grad_variance, \
  double epsilon, c10::string_view data_format, bool training, std::optional<at::ScalarType> param_dtype, \
  std::array<bool, 5> output_mask
#define TBG_PARAMS_batch_norm_forward_jvp \
  const at::Tensor &src, const OptionalTensor &gamma, const at::Tensor &mean, const at::Tensor &variance, \
  bool training, double epsilon, c10::string_view data_format, const OptionalTensor &src_t, \
  const OptionalTensor &gamma_t, const OptionalTensor &beta_t, const OptionalTensor &mean_t, \
  const OptionalTensor &variance_t
#define TBG_PARAMS_batch_norm_act_forward \
  const at::Tensor &src, const OptionalTensor &gamma, const OptionalTensor &beta, const OptionalTensor &mean, \
  const OptionalTensor &variance, const OptionalTensor &residual, double epsilon, c10::string_view activation, \
  double negative_slope, c10::string_view data_format, bool memory_saving
#define TBG_PARAMS_batch_norm_act_forward_frozen \
  const at::Tensor &src, const OptionalTensor &gamma, const OptionalTensor &beta, const at::Tensor &mean, \
  const at::Tensor &variance, const OptionalTensor &residual, double epsilon, c10::string_view activation, \
  double negative_slope, c10::string_view data_format, bool memory_saving
#define TBG_PARAMS_batch_norm_act_forward_update \
  const at::Tensor &src, const OptionalTensor &gamma, const OptionalTensor &beta, \
  const OptionalTensor &running_mean, const OptionalTensor &running_var, const OptionalTensor &residual, \
  double momentum, double epsilon, c10::string_view activation, double negative_slope, \
  c10::string_view data_format, bool memory_saving
#define TBG_PARAMS_batch_norm_act_forward_sign_bits \
  const at::Tensor &src, const OptionalTensor &gamma, const OptionalTensor &beta, const OptionalTensor &mean, \
  const OptionalTensor &variance, const OptionalTensor &residual, double epsilon, c10::string_view activation, \
  double negative_slope, c10::string_view data_format
#define TBG_PARAMS_batch_norm_act_forward_sign_bits_update \
  const at::Tensor &src, const OptionalTensor &gamma, const OptionalTensor &beta, \
  const OptionalTensor &running_mean, const OptionalTensor &running_var, const OptionalTensor &residual, \
  double momentum, double epsilon, c10::string_view activation, double negative_slope, \
  c10::string_view data_format
#define TBG_PARAMS_batch_norm_act_backward \
  const at::Tensor &diff_dst, const OptionalTensor &src, const OptionalTensor &dst, \
  const OptionalTensor &residual, const at::Tensor &mean, const at::Tensor &variance, \
  const OptionalTensor &gamma, const OptionalTensor &beta, double epsilon, c10::string_view activation, \
  double negative_slope, c10::string_view data_format, bool training, bool from_output, \
  std::array<bool, 4> output_mask, const OptionalTensor &dst_positive
#define TBG_PARAMS_batch_norm_update_running_stats \
  const OptionalTensor &running_mean, const OptionalTensor &running_var, const at::Tensor &mean, \
  const at::Tensor &variance, int64_t count, double momentum
#define TBG_PARAMS_batch_norm_update_running_stats_counted \
  const OptionalTensor &running_mean, const OptionalTensor &running_var, const at::Tensor &mean, \
  const at::Tensor &variance, const at::Tensor &count, double momentum
#define TBG_PARAMS_batch_norm_masked_forward \
  const at::Tensor &src, const at::Tensor &mask, const OptionalTensor &gamma, const OptionalTensor &beta, \
  const OptionalTensor &mean, const OptionalTensor &variance, double epsilon
#define TBG_PARAMS_batch_norm_masked_backward \
  const at::Tensor &src, const at::Tensor &mask, const at::Tensor &diff_dst, const at::Tensor &mean, \
  const at::Tensor &variance, const OptionalTensor &gamma, double epsilon, bool training, \
  std::array<bool, 3> output_mask
#define TBG_PARAMS_batch_norm_masked_act_forward \
  const at::Tensor &src, const at::Tensor &mask, const OptionalTensor &gamma, const OptionalTensor &beta, \
  const OptionalTensor &mean, const OptionalTensor &variance, const OptionalTensor &residual, double epsilon, \
  c10::string_view activation, double negative_slope
#define TBG_PARAMS_batch_norm_masked_act_backward \
  const at::Tensor &src, const at::Tensor &mask, const OptionalTensor &dst, const OptionalTensor &residual, \
  const at::Tensor &diff_dst, const at::Tensor &mean, const at::Tensor &variance, const OptionalTensor &gamma, \
  const OptionalTensor &beta, double epsilon, c10::string_view activation, double negative_slope, \
  bool training, std::array<bool, 4> output_mask
#define TBG_PARAMS_batch_norm_local_stats const at::Tensor &src, c10::string_view data_format
#define TBG_PARAMS_batch_norm_stats_affine \
  const at::Tensor &src, const OptionalTensor &gamma, const OptionalTensor &beta, double epsilon, \
  c10::string_view data_format
#define TBG_PARAMS_batch_norm_grad_sums \
  const at::Tensor &src, const at::Tensor &diff_dst, const at::Tensor &mean, c10::string_view data_format
#define TBG_PARAMS_batch_norm_grad_input \
  const at::Tensor &src, const at::Tensor &diff_dst, const at::Tensor &mean, const at::Tensor &variance, \
  const OptionalTensor &gamma, const at::Tensor &count, const at::Tensor &grad_sums, double epsilon, \
  c10::string_view data_format

}  // namespace torch_bn_grad
