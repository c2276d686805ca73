// This library's operators in C++: TBG_OPERATORS, the kernels each has (which
// library/registration.cpp registers), each kernel declared with its
// operator's signature (library/signatures.h), and each operator's typed
// dispatcher handle, which every C++ caller uses.
//
// A kernel is defined with its operator's parameters:
//   Outputs3 batch_norm_forward_cpu(TBG_PARAMS(batch_norm_forward)) { ... }
// and named after the operator (the schema name with '.' as '_'): `cpu::<name>_cpu`,
// `cuda::<name>_cuda`, `<name>_autograd`, and `<name>` for a composite one.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/string_view.h>

#include <string>

#include "library/signatures.h"

namespace torch_bn_grad {

// Every operator, a row: its name (the schema name, '.' as '_'), its schema name, what it
// returns, then the dispatch keys it has a kernel for, `_` where it has none (its Autograd
// kernel is then a Python formula, registered through autograd/python_autograd.cpp, or none);
// composite: CompositeImplicitAutograd (Implicit) or CompositeExplicitAutograd (Explicit).
//  name                                     schema name                                returns     CPU  CUDA  Autograd  composite
#define TBG_OPERATORS(X) \
  X(batch_norm_forward,                      "batch_norm_forward",                      Outputs3,   CPU, CUDA, Autograd, _)        \
  X(batch_norm_forward_frozen,               "batch_norm_forward.frozen",               at::Tensor, CPU, CUDA, Autograd, _)        \
  X(batch_norm_forward_update,               "batch_norm_forward.update",               Outputs3,   _,   _,    Autograd, Explicit) \
  X(batch_norm_backward,                     "batch_norm_backward",                     Outputs3,   CPU, CUDA, _,        _)        \
  X(batch_norm_forward_grad,                 "batch_norm_forward_grad",                 Outputs5,   _,   _,    _,        Implicit) \
  X(batch_norm_forward_jvp,                  "batch_norm_forward_jvp",                  Outputs3,   _,   _,    _,        Implicit) \
  X(batch_norm_act_forward,                  "batch_norm_act_forward",                  Outputs3,   CPU, CUDA, Autograd, _)        \
  X(batch_norm_act_forward_frozen,           "batch_norm_act_forward.frozen",           at::Tensor, CPU, CUDA, Autograd, _)        \
  X(batch_norm_act_forward_update,           "batch_norm_act_forward.update",           Outputs3,   _,   _,    Autograd, Explicit) \
  X(batch_norm_act_forward_sign_bits,        "batch_norm_act_forward_sign_bits",        Outputs4,   CPU, _,    Autograd, _)        \
  X(batch_norm_act_forward_sign_bits_update, "batch_norm_act_forward_sign_bits.update", Outputs4,   _,   _,    Autograd, Explicit) \
  X(batch_norm_act_backward,                 "batch_norm_act_backward",                 Outputs4,   CPU, CUDA, Autograd, _)        \
  X(batch_norm_update_running_stats,         "batch_norm_update_running_stats",         void,       _,   _,    Autograd, Explicit) \
  X(batch_norm_update_running_stats_counted, "batch_norm_update_running_stats.counted", void,       _,   _,    Autograd, Explicit) \
  X(batch_norm_masked_forward,               "batch_norm_masked_forward",               Outputs4,   CPU, CUDA, Autograd, _)        \
  X(batch_norm_masked_backward,              "batch_norm_masked_backward",              Outputs3,   CPU, CUDA, _,        _)        \
  X(batch_norm_masked_act_forward,           "batch_norm_masked_act_forward",           Outputs4,   CPU, _,    Autograd, _)        \
  X(batch_norm_masked_act_backward,          "batch_norm_masked_act_backward",          Outputs4,   CPU, _,    Autograd, _)        \
  X(batch_norm_local_stats,                  "batch_norm_local_stats",                  at::Tensor, CPU, CUDA, _,        _)        \
  X(batch_norm_stats_affine,                 "batch_norm_stats_affine",                 Outputs4,   CPU, CUDA, _,        _)        \
  X(batch_norm_grad_sums,                    "batch_norm_grad_sums",                    at::Tensor, CPU, CUDA, _,        _)        \
  X(batch_norm_grad_input,                   "batch_norm_grad_input",                   at::Tensor, CPU, CUDA, _,        _)
// clang-format on

// TBG_IF_<key>_<column>(code): `code` where the row's column names the key.
#define TBG_IF_CPU_CPU(...) __VA_ARGS__
#define TBG_IF_CPU__(...)
#define TBG_IF_CUDA_CUDA(...) __VA_ARGS__
#define TBG_IF_CUDA__(...)
#define TBG_IF_Autograd_Autograd(...) __VA_ARGS__
#define TBG_IF_Autograd__(...)
#define TBG_IF_Implicit_Implicit(...) __VA_ARGS__
#define TBG_IF_Implicit_Explicit(...)
#define TBG_IF_Implicit__(...)
#define TBG_IF_Explicit_Explicit(...) __VA_ARGS__
#define TBG_IF_Explicit_Implicit(...)
#define TBG_IF_Explicit__(...)

// Each operator's C++ signature, `signature::<name>`.
namespace signature {
#define TBG_SIGNATURE(name, schema, returns, ...) using name = returns(TBG_PARAMS(name));
TBG_OPERATORS(TBG_SIGNATURE)
#undef TBG_SIGNATURE
}  // namespace signature

// Every kernel, declared with its operator's signature.
#define TBG_DECLARE_KERNELS(name, schema, returns, cpu_key, cuda_key, autograd_key, composite_key) \
  TBG_IF_CPU_##cpu_key(namespace cpu { signature::name name##_cpu; })                            \
  TBG_IF_CUDA_##cuda_key(namespace cuda { signature::name name##_cuda; })                        \
  TBG_IF_Autograd_##autograd_key(signature::name name##_autograd;)                               \
  TBG_IF_Implicit_##composite_key(signature::name name;)                                          \
  TBG_IF_Explicit_##composite_key(signature::name name;)
TBG_OPERATORS(TBG_DECLARE_KERNELS)
#undef TBG_DECLARE_KERNELS

// The handle of `schema` ("name" or "name.overload" of this library), typed
// with `Signature`, its schema's C++ signature; throws if it is not registered.
template <class Signature>
c10::TypedOperatorHandle<Signature> find_operator(c10::string_view schema) {
  const auto dot = schema.find('.');
  const std::string name = "torch_bn_grad::" + std::string(schema.substr(0, dot));
  const std::string overload = dot == c10::string_view::npos ? "" : std::string(schema.substr(dot + 1));
  return c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str()).typed<Signature>();
}

// Each operator's handle, `op::<name>()`, looked up once (the lookup takes the
// dispatcher's lock): `op::batch_norm_forward().call(src, ...)` dispatches
// from the current dispatch key down, as a call from Python would.
namespace op {
#define TBG_HANDLE(name, schema, ...)                                                     \
  inline const c10::TypedOperatorHandle<signature::name>& name() {                        \
    static const auto handle = find_operator<signature::name>(schema);                    \
    return handle;                                                                        \
  }
TBG_OPERATORS(TBG_HANDLE)
#undef TBG_HANDLE
}  // namespace op

}  // namespace torch_bn_grad
