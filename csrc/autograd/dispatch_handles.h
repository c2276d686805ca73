// This library's operators as typed dispatcher handles, for the C++ code that
// calls them (the Autograd kernels): looked up by name once, called without
// going through Python.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <tuple>

namespace torch_bn_grad {

using OptionalTensor = std::optional<at::Tensor>;
using Outputs3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Outputs4 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using Outputs5 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// An optional tensor argument that holds a tensor.
inline bool given(const OptionalTensor& t) { return t.has_value() && t->defined(); }

// The handle of `name` ("torch_bn_grad::...", overload `overload`), typed with
// `Signature`, which must be its schema's C++ signature; throws if the operator
// is not registered. Keep it in a function-local static: the lookup takes the
// dispatcher's lock.
template <class Signature>
c10::TypedOperatorHandle<Signature> typed_operator(const char* name, const char* overload = "") {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, overload).typed<Signature>();
}

}  // namespace torch_bn_grad
