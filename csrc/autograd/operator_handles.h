// The forward operators and the fused backward as typed dispatcher handles
// (dispatch_handles.h), for the C++ code that calls them: the Autograd
// kernels and the composite overloads (.update, .frozen).
#pragma once

#include <array>

#include "autograd/dispatch_handles.h"

namespace torch_bn_grad {

inline const auto& forward_op() {
  static const auto op = typed_operator<Outputs3(const at::Tensor&, const OptionalTensor&, const OptionalTensor&,
                                                 const OptionalTensor&, const OptionalTensor&, double,
                                                 c10::string_view)>("torch_bn_grad::batch_norm_forward");
  return op;
}

inline const auto& act_forward_op() {
  static const auto op = typed_operator<Outputs3(
      const at::Tensor&, const OptionalTensor&, const OptionalTensor&, const OptionalTensor&, const OptionalTensor&,
      const OptionalTensor&, double, c10::string_view, double, c10::string_view, bool)>(
      "torch_bn_grad::batch_norm_act_forward");
  return op;
}

inline const auto& act_forward_sign_bits_op() {
  static const auto op = typed_operator<Outputs4(
      const at::Tensor&, const OptionalTensor&, const OptionalTensor&, const OptionalTensor&, const OptionalTensor&,
      const OptionalTensor&, double, c10::string_view, double, c10::string_view)>(
      "torch_bn_grad::batch_norm_act_forward_sign_bits");
  return op;
}

inline const auto& act_forward_update_op() {
  static const auto op = typed_operator<Outputs3(
      const at::Tensor&, const OptionalTensor&, const OptionalTensor&, const OptionalTensor&, const OptionalTensor&,
      const OptionalTensor&, double, double, c10::string_view, double, c10::string_view, bool)>(
      "torch_bn_grad::batch_norm_act_forward", "update");
  return op;
}

inline const auto& act_forward_sign_bits_update_op() {
  static const auto op = typed_operator<Outputs4(
      const at::Tensor&, const OptionalTensor&, const OptionalTensor&, const OptionalTensor&, const OptionalTensor&,
      const OptionalTensor&, double, double, c10::string_view, double, c10::string_view)>(
      "torch_bn_grad::batch_norm_act_forward_sign_bits", "update");
  return op;
}

inline const auto& act_forward_frozen_op() {
  static const auto op = typed_operator<at::Tensor(
      const at::Tensor&, const OptionalTensor&, const OptionalTensor&, const at::Tensor&, const at::Tensor&,
      const OptionalTensor&, double, c10::string_view, double, c10::string_view, bool)>(
      "torch_bn_grad::batch_norm_act_forward", "frozen");
  return op;
}

inline const auto& act_backward_op() {
  static const auto op = typed_operator<Outputs4(
      const at::Tensor&, const OptionalTensor&, const OptionalTensor&, const OptionalTensor&, const at::Tensor&,
      const at::Tensor&, const OptionalTensor&, const OptionalTensor&, double, c10::string_view, double,
      c10::string_view, bool, bool, std::array<bool, 4>, const OptionalTensor&)>(
      "torch_bn_grad::batch_norm_act_backward");
  return op;
}

}  // namespace torch_bn_grad
