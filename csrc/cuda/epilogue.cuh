// What the elementwise and gradient-sum kernels do per element besides plain
// batch norm: the hooks of the fused batch_norm_act operators, with the
// activation formulas of activation_math.h (the CPU's). `PlainEpilogue`, every
// hook a no-op, is plain batch norm. Element i is the offset in the
// [outer, channels, inner] array, k its channel; extra operands (output,
// residual, dz) are read and written per element.
#pragma once

#include <ATen/OpMathType.h>

#include <cstdint>

#include "math/activation_math.h"
#include "math/batch_norm_math.h"

namespace torch_bn_grad::cuda {

struct PlainEpilogue {
  // Backward, after the loads: x becomes the value the kernel centres, d = dz.
  template <typename A>
  __device__ __forceinline__ void apply(int64_t, int64_t, A&, A&) const {}
  template <typename A>
  __device__ __forceinline__ void store_dz(int64_t, A) const {}
  // Forward, before the store.
  template <typename A>
  __device__ __forceinline__ A post(int64_t, A v) const { return v; }
};

// The forward: act(out + r).
template <typename T, typename Act>
struct ForwardActEpilogue : PlainEpilogue {
  using A = at::opmath_type<T>;
  const T* r;  // residual, or null
  A slope;
  template <typename V>
  __device__ __forceinline__ V post(int64_t i, V v) const {
    if (r != nullptr) v += static_cast<A>(r[i]);
    return Act::template forward<act::ScalarOps>(v, static_cast<V>(slope));
  }
};

// Writes dz (diff_residual) when asked for.
template <typename T>
struct DzEpilogue : PlainEpilogue {
  T* dz;
  template <typename A>
  __device__ __forceinline__ void store_dz(int64_t i, A d) const {
    if (dz != nullptr) dz[i] = static_cast<T>(d);
  }
};

// act' from the output y. kFromOutput: the kernel's x is the output, made
// u = act^-1(y) - r (the memory-saving backward).
template <typename T, typename Act, bool kFromOutput>
struct OutputGateEpilogue : DzEpilogue<T> {
  using A = at::opmath_type<T>;
  const T* y;  // normal mode
  const T* r;  // kFromOutput: the residual, or null
  A slope;
  __device__ __forceinline__ void apply(int64_t i, int64_t, A& x, A& d) const {
    A g = x;
    if constexpr (kFromOutput) {
      x = Act::template inverse<act::ScalarOps>(x, slope);
      if (r != nullptr) x -= static_cast<A>(r[i]);
    } else if constexpr (Act::kNeedsGate) {
      g = static_cast<A>(y[i]);
    }
    if constexpr (Act::kNeedsGate) d *= Act::template grad_from_output<act::ScalarOps>(g, slope);
  }
};

// act' from z = x_scale * (x - mean) + bias + r, the forward's coefficients.
template <typename T, typename Act>
struct InputGateEpilogue : DzEpilogue<T> {
  using A = at::opmath_type<T>;
  math::AffineArrays<A> forward;
  const T* r;
  A slope;
  __device__ __forceinline__ void apply(int64_t i, int64_t k, A& x, A& d) const {
    A z = (x - forward.mean[k]) * forward.x_scale[k] + forward.bias[k];
    if (r != nullptr) z += static_cast<A>(r[i]);
    d *= Act::template grad<act::ScalarOps>(z, slope);
  }
};

}  // namespace torch_bn_grad::cuda
