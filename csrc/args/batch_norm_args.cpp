#include "args/batch_norm_args.h"
#include "args/channel_plan.h"
#include "dtypes.h"

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/ExpandUtils.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

namespace torch_bn_grad {
namespace {

constexpr int64_t kMaxRank = 8;

void check_data_dtype(const char* op, const char* name, const at::Tensor& t) {
  const auto dt = t.scalar_type();
  TORCH_CHECK_TYPE(is_data_dtype(dt), op, ": ", name, " must have dtype ", data_dtype_names(), ", got ",
                   dtype_name(dt));
}

void check_epsilon(const char* op, double epsilon) {
  TORCH_CHECK_VALUE(std::isfinite(epsilon) && epsilon >= 0, op,
                    ": epsilon must be finite and >= 0, got ", epsilon);
}

void check_data_format(const char* op, c10::string_view data_format) {
  TORCH_CHECK_VALUE(data_format == "NCX" || data_format == "NXC", op,
                    ": data_format must be 'NCX' or 'NXC', got '", std::string(data_format), "'");
}

void check_same_device(const char* op, const char* name, const at::Tensor& t,
                       const at::Tensor& src) {
  TORCH_CHECK_VALUE(t.device() == src.device(), op, ": ", name, " must be on src's device (",
                    src.device(), "), got ", t.device());
}

// Per-channel tensors share one dtype, is_param_dtype's: src's, or float32
// for half-precision src.
void check_param_dtype(const char* op, const char* name, const at::Tensor& t,
                       const at::Tensor& src, const at::Tensor* first, const char* first_name) {
  const auto dt = t.scalar_type();
  const auto sdt = src.scalar_type();
  if (is_half_dtype(sdt)) {
    TORCH_CHECK_TYPE(is_param_dtype(dt, sdt), op, ": ", name, " must have dtype ",
                     dtype_name(accumulation_dtype(sdt)), " or ", dtype_name(sdt), " (src's dtype is ",
                     dtype_name(sdt), "), got ", dtype_name(dt));
  } else {
    TORCH_CHECK_TYPE(is_param_dtype(dt, sdt), op, ": ", name, " must have src's dtype ", dtype_name(sdt),
                     ", got ", dtype_name(dt));
  }
  if (first != nullptr) {
    TORCH_CHECK_TYPE(dt == first->scalar_type(), op, ": ", name, " must have ", first_name, "'s dtype ",
                     dtype_name(first->scalar_type()), ", got ", dtype_name(dt));
  }
}

// `t` has the shape of `shape_of` (named `shape_name`) and, where `dtype_of`
// is given, its dtype.
void check_param(const char* op, const char* name, const at::Tensor& t, const at::Tensor& src,
                 const std::vector<int64_t>& stats_shape, const char* shape_name, const at::Tensor* dtype_of,
                 const char* dtype_name_of) {
  check_same_device(op, name, t, src);
  check_param_dtype(op, name, t, src, dtype_of, dtype_name_of);
  TORCH_CHECK_VALUE(t.sizes().vec() == stats_shape, op, ": ", name, " must have shape ",
                    c10::IntArrayRef(stats_shape), " (like ", shape_name != nullptr ? shape_name : "the statistics",
                    "), got ", t.sizes());
}

void check_src(const char* op, const at::Tensor& src, double epsilon, c10::string_view data_format) {
  check_data_dtype(op, "src", src);
  TORCH_CHECK_VALUE(src.dim() >= 1 && src.dim() <= kMaxRank, op, ": src must have rank 1 to ",
                    kMaxRank, ", got rank ", src.dim(), " (shape ", src.sizes(), ")");
  check_epsilon(op, epsilon);
  check_data_format(op, data_format);
}

// A data tensor that must match src's device, dtype and shape.
void check_same_like_src(const char* op, const char* name, const at::Tensor& t, const at::Tensor& src) {
  check_same_device(op, name, t, src);
  TORCH_CHECK_TYPE(t.scalar_type() == src.scalar_type(), op, ": ", name, " must have src's dtype ",
                   dtype_name(src.scalar_type()), ", got ", dtype_name(t.scalar_type()));
  TORCH_CHECK_VALUE(t.sizes() == src.sizes(), op, ": ", name, " must have src's shape ", src.sizes(),
                    ", got ", t.sizes());
}

// Validates src (and diff_dst, when given) and gamma of a split-stage
// operator, which takes the 1-D channel form only, and returns the plan.
ChannelPlan check_stage_args(const char* op, const at::Tensor& src, const at::Tensor* diff_dst,
                             const std::optional<at::Tensor>& gamma, double epsilon,
                             c10::string_view data_format) {
  check_src(op, src, epsilon, data_format);
  TORCH_CHECK_VALUE(src.dim() >= 2, op, ": src must have rank 2 to ", kMaxRank,
                    " (the split stages take 1-D statistics), got shape ", src.sizes());
  if (diff_dst != nullptr) check_same_like_src(op, "diff_dst", *diff_dst, src);
  std::vector<int64_t> stats_shape;
  const auto kept = kept_dims(op, src, nullptr, nullptr, data_format, stats_shape);
  if (gamma.has_value()) check_param(op, "gamma", *gamma, src, stats_shape, nullptr, nullptr, nullptr);
  return build_plan(src, kept, std::move(stats_shape));
}

// A float64 per-channel tensor of a split-stage operator: shape (C,) when
// `rows` is 0, else `rows` packed rows (rows, C); on src's device.
void check_stage_stats(const char* op, const char* name, const at::Tensor& t, const at::Tensor& src,
                       const ChannelPlan& plan, int64_t rows) {
  check_same_device(op, name, t, src);
  TORCH_CHECK_TYPE(t.scalar_type() == at::kDouble, op, ": ", name, " must have dtype float64, got ",
                   dtype_name(t.scalar_type()));
  const std::vector<int64_t> expected =
      rows == 0 ? std::vector<int64_t>{plan.channels} : std::vector<int64_t>{rows, plan.channels};
  TORCH_CHECK_VALUE(t.sizes().vec() == expected, op, ": ", name, " must have shape ",
                    c10::IntArrayRef(expected), " (C = ", plan.channels, "), got ", t.sizes());
}

// The backward operators' per-channel arguments checked against the data:
// mean (its shape decides the form), variance, gamma and beta when given;
// then the plan. The statistics share a dtype and the parameters share one
// (param_grad_dtype's), each by the parameter-dtype rule: a half-precision
// model's parameters beside its float32 batch statistics need no casts.
ChannelPlan check_backward_statistics(const char* op, const at::Tensor& data, const at::Tensor& mean,
                                      const at::Tensor& variance, const std::optional<at::Tensor>& gamma,
                                      const std::optional<at::Tensor>& beta, c10::string_view data_format) {
  std::vector<int64_t> stats_shape;
  check_same_device(op, "mean", mean, data);
  check_param_dtype(op, "mean", mean, data, nullptr, nullptr);
  const auto kept = kept_dims(op, data, &mean, "mean", data_format, stats_shape);
  check_param(op, "variance", variance, data, stats_shape, "mean", &mean, "mean");
  if (gamma.has_value()) check_param(op, "gamma", *gamma, data, stats_shape, "mean", nullptr, nullptr);
  if (beta.has_value()) {
    check_param(op, "beta", *beta, data, stats_shape, "mean", gamma.has_value() ? &*gamma : nullptr, "gamma");
  }
  return build_plan(data, kept, std::move(stats_shape));
}

}  // namespace

void check_running_stats_device(const at::Tensor& src, const std::optional<at::Tensor>& running_mean,
                                const std::optional<at::Tensor>& running_var) {
  const char* op = "batch_norm_forward.update";
  if (running_mean.has_value()) check_same_device(op, "running_mean", *running_mean, src);
  if (running_var.has_value()) check_same_device(op, "running_var", *running_var, src);
}

ChannelPlan check_backward_args(const at::Tensor& src, const at::Tensor& diff_dst,
                                const at::Tensor& mean, const at::Tensor& variance,
                                const std::optional<at::Tensor>& gamma, double epsilon,
                                c10::string_view data_format) {
  const char* op = "batch_norm_backward";
  check_src(op, src, epsilon, data_format);
  check_same_like_src(op, "diff_dst", diff_dst, src);
  return check_backward_statistics(op, src, mean, variance, gamma, std::nullopt, data_format);
}

namespace {
ChannelPlan forward_plan(const char* op, const at::Tensor& src, const std::optional<at::Tensor>& gamma,
                         const std::optional<at::Tensor>& beta, const std::optional<at::Tensor>& mean,
                         const std::optional<at::Tensor>& variance, double epsilon, c10::string_view data_format) {
  check_src(op, src, epsilon, data_format);
  TORCH_CHECK_VALUE(mean.has_value() == variance.has_value(), op,
                    ": mean and variance must be given together (frozen statistics) or both "
                    "omitted (batch statistics), got mean=",
                    mean.has_value() ? "tensor" : "None", " and variance=",
                    variance.has_value() ? "tensor" : "None");
  // The first per-channel tensor given fixes the shape, dtype and reduced axes.
  const std::pair<const char*, const std::optional<at::Tensor>*> params[] = {
      {"mean", &mean}, {"variance", &variance}, {"gamma", &gamma}, {"beta", &beta}};
  const at::Tensor* first = nullptr;
  const char* first_name = nullptr;
  for (const auto& [name, t] : params) {
    if (t->has_value()) {
      first = &t->value();
      first_name = name;
      break;
    }
  }
  std::vector<int64_t> stats_shape;
  if (first != nullptr) {
    check_same_device(op, first_name, *first, src);
    check_param_dtype(op, first_name, *first, src, nullptr, nullptr);
  }
  const auto kept = kept_dims(op, src, first, first_name, data_format, stats_shape);
  for (const auto& [name, t] : params) {
    if (t->has_value() && &t->value() != first) {
      check_param(op, name, t->value(), src, stats_shape, first_name, first, first_name);
    }
  }
  return build_plan(src, kept, std::move(stats_shape));
}

// The activation's name and negative_slope (finite, >= 0: leaky_relu's
// backward reads act' from the output's sign).
act::Kind check_activation(const char* op, c10::string_view activation, double negative_slope) {
  act::Kind kind = act::Kind::identity;
  bool known = false;
  for (int i = 0; i < 4; ++i) {
    if (activation == act::kind_names[i]) {
      kind = static_cast<act::Kind>(i);
      known = true;
    }
  }
  TORCH_CHECK_VALUE(known, op, ": activation must be 'identity', 'relu', 'leaky_relu' or 'silu', got '",
                    std::string(activation), "'");
  TORCH_CHECK_VALUE(std::isfinite(negative_slope) && negative_slope >= 0, op,
                    ": negative_slope must be finite and >= 0, got ", negative_slope);
  return kind;
}
}  // namespace

ChannelPlan check_forward_args(const at::Tensor& src, const std::optional<at::Tensor>& gamma,
                               const std::optional<at::Tensor>& beta,
                               const std::optional<at::Tensor>& mean,
                               const std::optional<at::Tensor>& variance, double epsilon,
                               c10::string_view data_format) {
  return forward_plan("batch_norm_forward", src, gamma, beta, mean, variance, epsilon, data_format);
}

namespace {
// The masked operators' extra checks: src of rank 2 or more, 1-D statistics
// (no broadcast form), and the mask.
void check_masked_args(const char* op, const at::Tensor& src, const at::Tensor& mask, const ChannelPlan& plan) {
  TORCH_CHECK_VALUE(src.dim() >= 2, op, ": src must have rank 2 to ", kMaxRank, " (N, C, *), got shape ",
                    src.sizes());
  TORCH_CHECK_VALUE(plan.stats_shape.size() == 1, op, ": the per-channel tensors must be 1-D of length C = ",
                    src.size(1), ", got shape ", c10::IntArrayRef(plan.stats_shape));
  check_same_device(op, "mask", mask, src);
  TORCH_CHECK_TYPE(mask.scalar_type() == at::kBool, op, ": mask must have dtype torch.bool (True: a valid "
                   "position), got ", dtype_name(mask.scalar_type()));
  std::vector<int64_t> expected = src.sizes().vec();
  expected.erase(expected.begin() + 1);
  TORCH_CHECK_VALUE(mask.sizes().vec() == expected, op, ": mask must have shape ", c10::IntArrayRef(expected),
                    " (src's shape ", src.sizes(), " without the channel dim 1), got ", mask.sizes());
}
}  // namespace

namespace {
ChannelPlan masked_forward_plan(const char* op, const at::Tensor& src, const at::Tensor& mask,
                                const std::optional<at::Tensor>& gamma, const std::optional<at::Tensor>& beta,
                                const std::optional<at::Tensor>& mean, const std::optional<at::Tensor>& variance,
                                double epsilon) {
  TORCH_CHECK_VALUE(src.dim() >= 2, op, ": src must have rank 2 to ", kMaxRank, " (N, C, *), got shape ",
                    src.sizes());
  ChannelPlan plan = forward_plan(op, src, gamma, beta, mean, variance, epsilon, "NCX");
  check_masked_args(op, src, mask, plan);
  return plan;
}

ChannelPlan masked_backward_plan(const char* op, const at::Tensor& src, const at::Tensor& mask,
                                 const at::Tensor& diff_dst, const at::Tensor& mean, const at::Tensor& variance,
                                 const std::optional<at::Tensor>& gamma, const std::optional<at::Tensor>& beta,
                                 double epsilon) {
  check_src(op, src, epsilon, "NCX");
  TORCH_CHECK_VALUE(src.dim() >= 2, op, ": src must have rank 2 to ", kMaxRank, " (N, C, *), got shape ",
                    src.sizes());
  check_same_like_src(op, "diff_dst", diff_dst, src);
  ChannelPlan plan = check_backward_statistics(op, src, mean, variance, gamma, beta, "NCX");
  check_masked_args(op, src, mask, plan);
  return plan;
}
}  // namespace

ChannelPlan check_masked_forward_args(const at::Tensor& src, const at::Tensor& mask,
                                      const std::optional<at::Tensor>& gamma, const std::optional<at::Tensor>& beta,
                                      const std::optional<at::Tensor>& mean,
                                      const std::optional<at::Tensor>& variance, double epsilon) {
  return masked_forward_plan("batch_norm_masked_forward", src, mask, gamma, beta, mean, variance, epsilon);
}

ChannelPlan check_masked_backward_args(const at::Tensor& src, const at::Tensor& mask, const at::Tensor& diff_dst,
                                       const at::Tensor& mean, const at::Tensor& variance,
                                       const std::optional<at::Tensor>& gamma, double epsilon) {
  return masked_backward_plan("batch_norm_masked_backward", src, mask, diff_dst, mean, variance, gamma, std::nullopt,
                              epsilon);
}

ActPlan check_masked_act_forward_args(const at::Tensor& src, const at::Tensor& mask,
                                      const std::optional<at::Tensor>& gamma, const std::optional<at::Tensor>& beta,
                                      const std::optional<at::Tensor>& mean,
                                      const std::optional<at::Tensor>& variance,
                                      const std::optional<at::Tensor>& residual, double epsilon,
                                      c10::string_view activation, double negative_slope) {
  const char* op = "batch_norm_masked_act_forward";
  ActPlan p{masked_forward_plan(op, src, mask, gamma, beta, mean, variance, epsilon), act::Kind::identity};
  if (residual.has_value()) check_same_like_src(op, "residual", *residual, src);
  p.kind = check_activation(op, activation, negative_slope);
  return p;
}

ActPlan check_masked_act_backward_args(const at::Tensor& src, const at::Tensor& mask,
                                       const std::optional<at::Tensor>& dst,
                                       const std::optional<at::Tensor>& residual, const at::Tensor& diff_dst,
                                       const at::Tensor& mean, const at::Tensor& variance,
                                       const std::optional<at::Tensor>& gamma, const std::optional<at::Tensor>& beta,
                                       double epsilon, c10::string_view activation, double negative_slope) {
  const char* op = "batch_norm_masked_act_backward";
  const act::Kind kind = check_activation(op, activation, negative_slope);
  ActPlan p{masked_backward_plan(op, src, mask, diff_dst, mean, variance, gamma, beta, epsilon), kind};
  const bool gate_from_dst = kind == act::Kind::relu || kind == act::Kind::leaky_relu;
  TORCH_CHECK_VALUE(!gate_from_dst || dst.has_value(), op, ": dst must be given for activation='",
                    std::string(activation), "', got None");
  if (dst.has_value()) check_same_like_src(op, "dst", *dst, src);
  if (residual.has_value()) check_same_like_src(op, "residual", *residual, src);
  return p;
}

ActPlan check_act_forward_args(const at::Tensor& src, const std::optional<at::Tensor>& gamma,
                               const std::optional<at::Tensor>& beta, const std::optional<at::Tensor>& mean,
                               const std::optional<at::Tensor>& variance,
                               const std::optional<at::Tensor>& residual, double epsilon,
                               c10::string_view activation, double negative_slope, c10::string_view data_format) {
  const char* op = "batch_norm_act_forward";
  ActPlan p{forward_plan(op, src, gamma, beta, mean, variance, epsilon, data_format), act::Kind::identity};
  if (residual.has_value()) check_same_like_src(op, "residual", *residual, src);
  p.kind = check_activation(op, activation, negative_slope);
  return p;
}

ActPlan check_act_backward_args(TBG_PARAMS(batch_norm_act_backward)) {
  const char* op = "batch_norm_act_backward";
  const act::Kind kind = check_activation(op, activation, negative_slope);
  TORCH_CHECK_VALUE(!from_output || act::invertible(kind, negative_slope), op,
                    ": from_output needs an invertible activation ('identity', or 'leaky_relu' with "
                    "negative_slope > 0), got activation='", std::string(activation), "', negative_slope=",
                    negative_slope);
  const bool gate_from_dst = kind == act::Kind::relu || kind == act::Kind::leaky_relu;
  // Empty sign bits (the forward could not write them for this layout) are absent.
  const bool bits_given = dst_positive.has_value() && dst_positive->numel() > 0;
  TORCH_CHECK_VALUE(!bits_given || (gate_from_dst && !from_output), op,
                    ": dst_positive is read for activation 'relu' or 'leaky_relu' without from_output, got "
                    "activation='", std::string(activation), "', from_output=", from_output ? "True" : "False");
  // What the kernels read: the data (src, or dst from the output), and dst
  // (or its sign bits) for act' of relu/leaky_relu.
  const bool needs_dst = from_output || (gate_from_dst && !bits_given);
  TORCH_CHECK_VALUE(from_output || src.has_value(), op, ": src must be given unless from_output=True, got None");
  TORCH_CHECK_VALUE(!needs_dst || dst.has_value(), op, ": dst must be given for activation='",
                    std::string(activation), "'", from_output ? " with from_output=True" : "", ", got None");
  const at::Tensor& data = from_output ? *dst : *src;
  check_src(op, data, epsilon, data_format);
  check_same_like_src(op, "diff_dst", diff_dst, data);
  if (!from_output && dst.has_value()) check_same_like_src(op, "dst", *dst, data);
  if (residual.has_value()) check_same_like_src(op, "residual", *residual, data);
  ChannelPlan plan = check_backward_statistics(op, data, mean, variance, gamma, beta, data_format);
  if (bits_given) {
    const at::Tensor& bits = *dst_positive;
    check_same_device(op, "dst_positive", bits, data);
    TORCH_CHECK_TYPE(bits.scalar_type() == at::kByte, op, ": dst_positive must have dtype torch.uint8, got ",
                     dtype_name(bits.scalar_type()));
    const int64_t bytes = sign_bits_bytes(plan.extent());
    TORCH_CHECK_VALUE(bits.dim() == 1 && bits.size(0) == bytes && bits.is_contiguous(), op,
                      ": dst_positive must be a contiguous 1-D tensor of ", bytes,
                      " bytes (batch_norm_act_forward_sign_bits' for this src) or empty, got shape ",
                      bits.sizes());
  }
  return {std::move(plan), kind, bits_given};
}

ChannelPlan check_local_stats_args(const at::Tensor& src, c10::string_view data_format) {
  return check_stage_args("batch_norm_local_stats", src, nullptr, std::nullopt, 0.0, data_format);
}

ChannelPlan check_grad_sums_args(const at::Tensor& src, const at::Tensor& diff_dst, const at::Tensor& mean,
                                 c10::string_view data_format) {
  const char* op = "batch_norm_grad_sums";
  ChannelPlan plan = check_stage_args(op, src, &diff_dst, std::nullopt, 0.0, data_format);
  check_stage_stats(op, "mean", mean, src, plan, 0);
  return plan;
}

ChannelPlan check_grad_input_args(const at::Tensor& src, const at::Tensor& diff_dst, const at::Tensor& mean,
                                  const at::Tensor& variance, const std::optional<at::Tensor>& gamma,
                                  const at::Tensor& count, const at::Tensor& grad_sums, double epsilon,
                                  c10::string_view data_format) {
  const char* op = "batch_norm_grad_input";
  ChannelPlan plan = check_stage_args(op, src, &diff_dst, gamma, epsilon, data_format);
  check_stage_stats(op, "mean", mean, src, plan, 0);
  check_stage_stats(op, "variance", variance, src, plan, 0);
  check_stage_stats(op, "count", count, src, plan, 0);
  check_stage_stats(op, "grad_sums", grad_sums, src, plan, 2);
  return plan;
}

}  // namespace torch_bn_grad
