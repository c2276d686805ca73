// The elementwise pass: out = dy_scale * y + x_scale * (x - mean) + bias per
// channel (math::ChannelAffine), over the planes or columns partition. The
// forward passes no y (x_scale = scale, bias = shift); the backward's
// diff_src has y = dy. The epilogue (epilogue.cuh) turns dy into dz, or
// activates the forward's output.
#pragma once

#include <ATen/OpMathType.h>

#include <cstdint>

#include "math/batch_norm_math.h"
#include "cuda/epilogue.cuh"
#include "cuda/partition.cuh"
#include "cuda/vector_io.cuh"

namespace torch_bn_grad::cuda {

template <typename A, bool kHasY>
__device__ __forceinline__ A affine(A x, A y, A mean, A dy_scale, A x_scale, A bias) {
  const A t = (x - mean) * x_scale + bias;
  if constexpr (kHasY) return dy_scale * y + t;
  return t;
}

template <typename T, int N, bool kHasY, typename E>
__global__ void __launch_bounds__(kThreads)
    plane_affine_kernel(const T* __restrict__ x, const T* __restrict__ y, T* __restrict__ out,
                        PlaneGrid g, math::AffineArrays<at::opmath_type<T>> c, E ep) {
  using A = at::opmath_type<T>;
  const int64_t k = blockIdx.x;
  const A mean = c.mean[k], x_scale = c.x_scale[k], bias = c.bias[k];
  const A dy_scale = kHasY ? c.dy_scale[k] : A(0);
  for_each_in_split(g, [&](int64_t v) {
    A xv[N], yv[N] = {}, res[N];
    load<N>(x + v * N, xv);
    if constexpr (kHasY) load<N>(y + v * N, yv);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      if constexpr (kHasY) {
        ep.apply(v * N + j, k, xv[j], yv[j]);
        ep.store_dz(v * N + j, yv[j]);
      }
      res[j] = ep.post(v * N + j, affine<A, kHasY>(xv[j], yv[j], mean, dy_scale, x_scale, bias));
    }
    store<N>(out + v * N, res);
  });
}

template <typename T, int N, bool kHasY, typename E>
__global__ void __launch_bounds__(kThreads)
    column_affine_kernel(const T* __restrict__ x, const T* __restrict__ y, T* __restrict__ out,
                         ColumnGrid g, math::AffineArrays<at::opmath_type<T>> c, E ep) {
  using A = at::opmath_type<T>;
  const int64_t column = owned_column();
  if (column >= g.columns) return;
  A mean[N], dy_scale[N], x_scale[N], bias[N];
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int64_t k = (column * N + j) / g.inner;
    mean[j] = c.mean[k];
    dy_scale[j] = kHasY ? c.dy_scale[k] : A(0);
    x_scale[j] = c.x_scale[k];
    bias[j] = c.bias[k];
  }
  for_each_row(g, column, [&](int64_t v) {
    A xv[N], yv[N] = {}, res[N];
    load<N>(x + v * N, xv);
    if constexpr (kHasY) load<N>(y + v * N, yv);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      if constexpr (kHasY) {
        ep.apply(v * N + j, (column * N + j) / g.inner, xv[j], yv[j]);
        ep.store_dz(v * N + j, yv[j]);
      }
      res[j] = ep.post(v * N + j, affine<A, kHasY>(xv[j], yv[j], mean[j], dy_scale[j], x_scale[j], bias[j]));
    }
    store<N>(out + v * N, res);
  });
}

}  // namespace torch_bn_grad::cuda
