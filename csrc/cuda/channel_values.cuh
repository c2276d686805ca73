// Per-channel vectors (gamma, beta, given statistics, diff_gamma, diff_beta)
// as the coefficient kernels read and write them: in the caller's tensor and
// dtype, converted to and from float64 per element on the device. A small
// layer's call is mostly host time, and each ATen cast to or from float64
// would be a kernel launch of its own. Vectors whose kernel channel order
// differs from the logical one (broadcast statistics over a permuted layout)
// take the float64 copy of to_kernel_channels instead.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>
#include <optional>

#include "dtypes.h"
#include "args/batch_norm_args.h"

namespace torch_bn_grad::cuda {

// A data dtype, as the device code tells the element types apart.
#define TBG_CHANNEL_TYPE(Name, unused) k##Name,
enum class ChannelType : int8_t { TBG_DATA_DTYPES(TBG_CHANNEL_TYPE, 0) };
#undef TBG_CHANNEL_TYPE

// The element type the kernels convert from and to, if `dtype` is one of them.
inline std::optional<ChannelType> channel_type(at::ScalarType dtype) {
  switch (dtype) {
#define TBG_CHANNEL_TYPE_CASE(Name, unused) \
  case at::ScalarType::Name: return ChannelType::k##Name;
    TBG_DATA_DTYPES(TBG_CHANNEL_TYPE_CASE, 0)
#undef TBG_CHANNEL_TYPE_CASE
    default: return std::nullopt;
  }
}

// Element i of a T vector in float64, through T's accumulation type (exact).
template <typename T>
__device__ __forceinline__ double widened(const void* data, int64_t i) {
  return static_cast<double>(static_cast<at::opmath_type<T>>(static_cast<const T*>(data)[i]));
}

// v stored as element k of a T vector: rounded once to T's accumulation
// type, then to T, as ATen's casts from float64.
template <typename T>
__device__ __forceinline__ void narrowed(void* data, int64_t k, double v) {
  static_cast<T*>(data)[k] = static_cast<T>(static_cast<at::opmath_type<T>>(v));
}

// A read-only per-channel vector; null data: absent.
struct ChannelIn {
  const void* data = nullptr;
  int64_t stride = 1;
  ChannelType type = ChannelType::kDouble;

  __device__ __forceinline__ double at(int64_t k, double absent) const {
    if (data == nullptr) return absent;
    const int64_t i = k * stride;
    switch (type) {
#define TBG_CHANNEL_READ(Name, unused) \
  case ChannelType::k##Name: return widened<c10::impl::ScalarTypeToCPPTypeT<at::ScalarType::Name>>(data, i);
      TBG_DATA_DTYPES(TBG_CHANNEL_READ, 0)
#undef TBG_CHANNEL_READ
    }
    return absent;  // not reached: every ChannelType is a case
  }
};

// A written per-channel vector, contiguous; null data: not wanted.
struct ChannelOut {
  void* data = nullptr;
  ChannelType type = ChannelType::kDouble;

  __device__ __forceinline__ bool wanted() const { return data != nullptr; }
  __device__ __forceinline__ void set(int64_t k, double v) const {
    switch (type) {
#define TBG_CHANNEL_WRITE(Name, unused) \
  case ChannelType::k##Name: narrowed<c10::impl::ScalarTypeToCPPTypeT<at::ScalarType::Name>>(data, k, v); break;
      TBG_DATA_DTYPES(TBG_CHANNEL_WRITE, 0)
#undef TBG_CHANNEL_WRITE
    }
  }
};

// A float64 kernel-order vector (or undefined: absent) as kernels read it.
inline ChannelIn channel_in(const at::Tensor& float64) {
  return float64.defined() ? ChannelIn{float64.const_data_ptr<double>(), 1, ChannelType::kDouble} : ChannelIn{};
}

// A float64 kernel-order vector (or undefined: not wanted) as kernels write it.
inline ChannelOut channel_out(const at::Tensor& float64) {
  return float64.defined() ? ChannelOut{float64.mutable_data_ptr<double>(), ChannelType::kDouble} : ChannelOut{};
}

// `t` as the kernels read it, and the tensor that holds its data (keep it
// alive until the kernels are queued).
struct ChannelValues {
  at::Tensor storage;
  ChannelIn in;
};

inline ChannelValues channel_values(const std::optional<at::Tensor>& t, const ChannelPlan& plan,
                                    const at::Tensor& like) {
  if (!t.has_value()) return {};
  if (plan.kept_kernel == plan.kept_logical) {
    const auto type = channel_type(t->scalar_type());
    if (type && t->dim() == 1) return {*t, ChannelIn{t->const_data_ptr(), t->stride(0), *type}};  // no view to make
    if (type) {
      at::Tensor v = t->reshape({plan.channels});  // a view for every stats_shape of strided channels
      return {v, ChannelIn{v.const_data_ptr(), v.stride(0), *type}};
    }
  }
  at::Tensor v = to_kernel_channels(t, plan, at::kDouble, 0, like);
  return {v, channel_in(v)};
}

// A per-channel result of `dtype`: the kernel writes the result itself when
// the orders agree, else a float64 vector that `finish` converts.
struct ChannelResult {
  at::Tensor storage;
  ChannelOut out;
  bool in_place = false;

  at::Tensor finish(const ChannelPlan& plan, at::ScalarType dtype, const at::Tensor& like) const {
    return in_place ? storage : from_kernel_channels(storage, plan, dtype, like);
  }
};

inline ChannelResult channel_result(const ChannelPlan& plan, at::ScalarType dtype, const at::Tensor& like) {
  const auto type = channel_type(dtype);
  if (plan.kept_kernel == plan.kept_logical && type) {
    at::Tensor r = at::empty(plan.stats_shape, like.options().dtype(dtype));
    return {r, ChannelOut{r.mutable_data_ptr(), *type}, true};
  }
  at::Tensor v = at::empty({plan.channels}, like.options().dtype(at::kDouble));
  return {v, channel_out(v), false};
}

}  // namespace torch_bn_grad::cuda
