// An operand's data pointer for the kernels, or null where the tensor is
// undefined (absent, or an output not asked for). Included by the per-ISA
// kernel sources only (see vec_io.h).
#pragma once

#include <ATen/core/Tensor.h>

namespace torch_bn_grad::cpu {
namespace CPU_CAPABILITY {
namespace {  // internal linkage: see vec_io.h

template <typename T>
const T* data_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<T>() : nullptr;
}
template <typename T>
T* out_or_null(at::Tensor& t) {
  return t.defined() ? t.mutable_data_ptr<T>() : nullptr;
}

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace torch_bn_grad::cpu
