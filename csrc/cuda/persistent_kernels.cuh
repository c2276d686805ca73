// The persistent single-read variant of the training forward and backward:
// one kernel per operator for a block's worth of data (plan_persistent_*):
// load once into registers, reduce in the block in a fixed order, derive the
// coefficients with the second stage's code (its argument structs, partials
// unused), and write the output from the registers. Those coefficients go to
// the global per-channel vectors, and the block reads them back after a
// __syncthreads(), which makes the writes visible to all of its threads.
// Each thread issues all of its loads before any arithmetic, so that they are
// in flight together. R: a thread's slots per tensor, at most
// kPersistentItems<T> / N (launch_plan.cuh picks the level). The epilogue E
// (epilogue.cuh) makes them the fused batch_norm_act operators' kernels too:
// the forward activates each value before its store; the backward gates each
// loaded pair once (dz from dy), sums the gated values and stores dz with the
// output.
#pragma once

#include <ATen/OpMathType.h>

#include <cstdint>

#include "math/batch_norm_math.h"
#include "cuda/affine_kernels.cuh"
#include "cuda/block_reduce.cuh"
#include "cuda/coefficient_kernels.cuh"
#include "cuda/epilogue.cuh"
#include "cuda/launch_plan.cuh"
#include "cuda/partition.cuh"
#include "cuda/thread_states.cuh"
#include "cuda/vector_io.cuh"

namespace torch_bn_grad::cuda {

template <typename T, int N, int R, typename E>
__global__ void __launch_bounds__(kThreads)
    plane_persistent_forward_kernel(const T* __restrict__ x, T* __restrict__ out, PersistentPlane h,
                                    ForwardCoefficientArgs<at::opmath_type<T>> a, E ep) {
  using A = at::opmath_type<T>;
  __shared__ ShiftedSums<A> shared[kThreads / kWarp];
  const int64_t k = blockIdx.x;
  A xs[R][N], centre[N];
  LaneMoments<A, N> lanes{};
  for_each_held<R>(h, [&](int r, int64_t v) { load<N>(x + v * N, xs[r]); });
  centre_all(x + k * static_cast<int64_t>(h.inner) * N, centre);
  for_each_held<R>(h, [&](int r, int64_t) { add(lanes, xs[r], centre); });
  const ShiftedSums<A> s = block_reduce(fold(lanes), shared);
  if (threadIdx.x == 0) {
    const Moments<double> m = partial_of(s, centre[0]);
    store_merged(a, k, m);
  }
  __syncthreads();
  const A mean = a.affine.mean[k], x_scale = a.affine.x_scale[k], bias = a.affine.bias[k];
  for_each_held<R>(h, [&](int r, int64_t v) {
    A res[N];
#pragma unroll
    for (int j = 0; j < N; ++j) res[j] = ep.post(v * N + j, affine<A, false>(xs[r][j], A(0), mean, A(0), x_scale, bias));
    store<N>(out + v * N, res);
  });
}

template <typename T, int N, int R, typename E>
__global__ void __launch_bounds__(kThreads)
    column_persistent_forward_kernel(const T* __restrict__ x, T* __restrict__ out, PersistentColumns h,
                                     ForwardCoefficientArgs<at::opmath_type<T>> a, E ep) {
  using A = at::opmath_type<T>;
  __shared__ LaneMoments<A, N> shared[kThreads / 2];
  const int64_t column = owned_column();
  const bool owner = column < h.columns;
  A xs[R][N], centre[N] = {};
  LaneMoments<A, N> lanes{};
  if (owner) {
    for_each_held<R>(h, column, [&](int r, int64_t v) { load<N>(x + v * N, xs[r]); });
    load<N>(x + column * N, centre);  // row 0 of the thread's channels
    for_each_held<R>(h, column, [&](int r, int64_t) { add(lanes, xs[r], centre); });
  }
  column_reduce(lanes, shared);
  if (owner && threadIdx.y == 0) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const Moments<double> m = partial_of(lane(lanes, j), centre[j]);
      store_merged(a, column * N + j, m);
    }
  }
  __syncthreads();
  if (!owner) return;
  A mean[N], x_scale[N], bias[N];
  load_columns(a.affine.mean, column, mean);
  load_columns(a.affine.x_scale, column, x_scale);
  load_columns(a.affine.bias, column, bias);
  for_each_held<R>(h, column, [&](int r, int64_t v) {
    A res[N];
#pragma unroll
    for (int j = 0; j < N; ++j) {
      res[j] = ep.post(v * N + j, affine<A, false>(xs[r][j], A(0), mean[j], A(0), x_scale[j], bias[j]));
    }
    store<N>(out + v * N, res);
  });
}

// `out` is null when only the parameters' gradients are wanted.
template <typename T, int N, int R, typename E>
__global__ void __launch_bounds__(kThreads)
    plane_persistent_backward_kernel(const T* __restrict__ x, const T* __restrict__ dy,
                                     const at::opmath_type<T>* __restrict__ mean, T* __restrict__ out,
                                     PersistentPlane h, BackwardCoefficientArgs<at::opmath_type<T>> p, E ep) {
  using A = at::opmath_type<T>;
  __shared__ ExactGradSums<A> shared[kThreads / kWarp];
  const int64_t k = blockIdx.x;
  A m[N];
#pragma unroll
  for (int j = 0; j < N; ++j) m[j] = mean[k];
  A xs[R][N], ds[R][N];
  LaneGradSums<A, N> lanes{};
  for_each_held<R>(h, [&](int r, int64_t v) {
    load<N>(x + v * N, xs[r]);
    load<N>(dy + v * N, ds[r]);
  });
  for_each_held<R>(h, [&](int r, int64_t v) {
#pragma unroll
    for (int j = 0; j < N; ++j) ep.apply(v * N + j, k, xs[r][j], ds[r][j]);
    add(lanes, xs[r], ds[r], m);
  });
  const ExactGradSums<A> s = block_reduce(fold(lanes), shared);
  if (threadIdx.x == 0) store_backward_coefficients(p, k, partial_of(s));
  if (out == nullptr) return;
  __syncthreads();
  const A dy_scale = p.affine.dy_scale[k], x_scale = p.affine.x_scale[k], bias = p.affine.bias[k];
  for_each_held<R>(h, [&](int r, int64_t v) {
    A res[N];
#pragma unroll
    for (int j = 0; j < N; ++j) {
      ep.store_dz(v * N + j, ds[r][j]);
      res[j] = affine<A, true>(xs[r][j], ds[r][j], m[j], dy_scale, x_scale, bias);
    }
    store<N>(out + v * N, res);
  });
}

template <typename T, int N, int R, typename E>
__global__ void __launch_bounds__(kThreads)
    column_persistent_backward_kernel(const T* __restrict__ x, const T* __restrict__ dy,
                                      const at::opmath_type<T>* __restrict__ mean, T* __restrict__ out,
                                      PersistentColumns h, BackwardCoefficientArgs<at::opmath_type<T>> p, E ep) {
  using A = at::opmath_type<T>;
  __shared__ LaneGradSums<A, N> shared[kThreads / 2];
  const int64_t column = owned_column();
  const bool owner = column < h.columns;
  A m[N] = {}, xs[R][N], ds[R][N];
  LaneGradSums<A, N> lanes{};
  if (owner) {
    load_columns(mean, column, m);
    for_each_held<R>(h, column, [&](int r, int64_t v) {
      load<N>(x + v * N, xs[r]);
      load<N>(dy + v * N, ds[r]);
    });
    for_each_held<R>(h, column, [&](int r, int64_t v) {
#pragma unroll
      for (int j = 0; j < N; ++j) ep.apply(v * N + j, column * N + j, xs[r][j], ds[r][j]);
      add(lanes, xs[r], ds[r], m);
    });
  }
  column_reduce(lanes, shared);
  if (owner && threadIdx.y == 0) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      store_backward_coefficients(p, column * N + j, partial_of(lane(lanes, j)));
    }
  }
  if (out == nullptr) return;
  __syncthreads();
  if (!owner) return;
  A dy_scale[N], x_scale[N], bias[N];
  load_columns(p.affine.dy_scale, column, dy_scale);
  load_columns(p.affine.x_scale, column, x_scale);
  load_columns(p.affine.bias, column, bias);
  for_each_held<R>(h, column, [&](int r, int64_t v) {
    A res[N];
#pragma unroll
    for (int j = 0; j < N; ++j) {
      ep.store_dz(v * N + j, ds[r][j]);
      res[j] = affine<A, true>(xs[r][j], ds[r][j], m[j], dy_scale[j], x_scale[j], bias[j]);
    }
    store<N>(out + v * N, res);
  });
}

}  // namespace torch_bn_grad::cuda
