// The data dtypes every operator takes, listed once (TBG_DATA_DTYPES), and
// what is read off that list: the one dtype dispatch, the argument checks'
// predicates and the accumulation dtype of per-channel values.
//
// A dtype is dispatched once per call, at the edge between a tensor and its
// typed kernel (the CPU kernel tables' entry points, the CUDA operators' host
// code); kernels below take scalar_t as a template parameter and never look
// at a ScalarType. Each case of the dispatch instantiates the kernels it
// calls, so the list is also the set of instantiations. The functions are
// host code for the operators' checks and plans: the per-ISA kernel units use
// the macro alone (an inline function they emitted would carry their ISA),
// and the CUDA device code reads the list itself (cuda/channel_values.cuh's
// element types). Adding a dtype: docs/design.md, "Adding a dtype".
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/core/ScalarType.h>

#include <iterator>
#include <string>

// X(Name, ...) for each data dtype, Name as in c10::ScalarType::Name.
#define TBG_DATA_DTYPES(X, ...) \
  X(Double, __VA_ARGS__) X(Float, __VA_ARGS__) X(Half, __VA_ARGS__) X(BFloat16, __VA_ARGS__)

#define TBG_DATA_DTYPE_CASE(Name, ...) AT_DISPATCH_CASE(at::ScalarType::Name, __VA_ARGS__)

// Calls the lambda (the trailing arguments) with scalar_t bound to the C++
// type of `type`, one of the data dtypes; `name` names the call in the
// NotImplementedError another dtype raises (the checks refuse it first).
#define TBG_DISPATCH_DATA_DTYPE(type, name, ...) \
  AT_DISPATCH_SWITCH(type, name, TBG_DATA_DTYPES(TBG_DATA_DTYPE_CASE, __VA_ARGS__))

namespace torch_bn_grad {

#define TBG_DATA_DTYPE_ENTRY(Name, unused) at::ScalarType::Name,
inline constexpr at::ScalarType kDataDtypes[] = {TBG_DATA_DTYPES(TBG_DATA_DTYPE_ENTRY, 0)};
#undef TBG_DATA_DTYPE_ENTRY

// Whether src (and every data tensor of a call) may have dtype `t`.
constexpr bool is_data_dtype(at::ScalarType t) {
  for (const at::ScalarType d : kDataDtypes) {
    if (d == t) return true;
  }
  return false;
}

// The dtype the kernels compute a data dtype in (at::opmath_type, the
// kernels' acc_t / Acc<T>): float32 for float16 and bfloat16, the dtype
// itself otherwise. The training operators' statistics have this dtype.
inline at::ScalarType accumulation_dtype(at::ScalarType data) { return at::toOpMathType(data); }

// A data dtype narrower than its accumulation dtype (float16, bfloat16).
inline bool is_half_dtype(at::ScalarType t) { return is_data_dtype(t) && accumulation_dtype(t) != t; }

// The parameter-dtype rule: with data of dtype `data`, a per-channel tensor
// (gamma, beta, mean, variance) has the data's dtype or its accumulation
// dtype (float32 parameters for half-precision data).
inline bool is_param_dtype(at::ScalarType param, at::ScalarType data) {
  return param == data || param == accumulation_dtype(data);
}

// A dtype as Python users write it: torch.float32, torch.bfloat16, ...
inline std::string dtype_name(at::ScalarType t) { return "torch." + std::string(c10::getDtypeNames(t).first); }

// The data dtypes for an error message: "torch.float64, torch.float32, ... or torch.bfloat16".
inline std::string data_dtype_names() {
  std::string names;
  constexpr size_t n = std::size(kDataDtypes);
  for (size_t i = 0; i < n; ++i) {
    names += (i == 0 ? "" : (i + 1 == n ? " or " : ", ")) + dtype_name(kDataDtypes[i]);
  }
  return names;
}

}  // namespace torch_bn_grad
