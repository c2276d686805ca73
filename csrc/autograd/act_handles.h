// The fused operators as typed dispatcher handles (dispatch_handles.h), for
// their Autograd kernels: the forward's (batch_norm_act_autograd.cpp) and the
// backward's (batch_norm_act_backward_autograd.cpp).
#pragma once

#include <array>

#include "autograd/dispatch_handles.h"

namespace torch_bn_grad {

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

inline const auto& act_backward_op() {
  static const auto op = typed_operator<Outputs4(
      const at::Tensor&, const OptionalTensor&, const OptionalTensor&, const OptionalTensor&, const at::Tensor&,
      const at::Tensor&, const OptionalTensor&, const OptionalTensor&, double, c10::string_view, double,
      c10::string_view, bool, bool, std::array<bool, 4>, const OptionalTensor&)>(
      "torch_bn_grad::batch_norm_act_backward");
  return op;
}

}  // namespace torch_bn_grad
