// The first stage of the two-kernel path: each block reduces its split of
// the data (partition.cuh) to partials, each thread accumulating its values
// (thread_states.cuh) before the block merges them (block_reduce.cuh). The
// second stage (coefficient_kernels.cuh) merges each channel's partials.
// The gradient sums take an epilogue (epilogue.cuh): the fused activation's dz.
// F is NoFinish, or for the last_block_coefficients variant a LastBlockFinish
// (last_block.cuh): the last block of each channel (planes) or tile of
// columns (inner == 1 only) then stores the second stage's coefficients.
//
// Partials are float64 (thread_states.cuh's partial_of) and stored so that
// each channel's are contiguous: planes at k * splits + s, columns at
// (k * inner + i) * row_splits + r.
#pragma once

#include <ATen/OpMathType.h>

#include <cstdint>

#include "cuda/block_reduce.cuh"
#include "cuda/epilogue.cuh"
#include "cuda/last_block.cuh"
#include "cuda/partition.cuh"
#include "cuda/thread_states.cuh"
#include "cuda/vector_io.cuh"

namespace torch_bn_grad::cuda {

template <typename T, int N, typename F>
__global__ void __launch_bounds__(kThreads)
    plane_moments_kernel(const T* __restrict__ x, PlaneGrid g, Moments<double>* partials, F finish) {
  using A = at::opmath_type<T>;
  __shared__ ShiftedSums<A> shared[kThreads / kWarp];
  A centre[N];
  centre_all(x + static_cast<int64_t>(blockIdx.x) * g.inner * N, centre);
  LaneMoments<A, N> lanes{};
  for_each_in_split(g, [&](int64_t v) {
    A xv[N];
    load<N>(x + v * N, xv);
    add(lanes, xv, centre);
  });
  const ShiftedSums<A> m = block_reduce(fold(lanes), shared);
  if (threadIdx.x == 0 && threadIdx.y == 0) {
    partials[static_cast<int64_t>(blockIdx.x) * gridDim.y + blockIdx.y] = partial_of(m, centre[0]);
  }
  if constexpr (F::kOn) finish_last_channel(finish.args, finish.counters, partials);
}

template <typename T, int N, typename F>
__global__ void __launch_bounds__(kThreads)
    column_moments_kernel(const T* __restrict__ x, ColumnGrid g, Moments<double>* partials, F finish) {
  using A = at::opmath_type<T>;
  __shared__ LaneMoments<A, N> shared[kThreads / 2];
  const int64_t column = owned_column();
  A centre[N] = {};
  LaneMoments<A, N> lanes{};
  if (column < g.columns) {
    load<N>(x + column * N, centre);  // row 0 of the thread's columns
    for_each_row(g, column, [&](int64_t v) {
      A xv[N];
      load<N>(x + v * N, xv);
      add(lanes, xv, centre);
    });
  }
  column_reduce(lanes, shared);
  if (threadIdx.y == 0 && column < g.columns) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      partials[(column * N + j) * gridDim.y + blockIdx.y] = partial_of(lane(lanes, j), centre[j]);
    }
  }
  if constexpr (F::kOn) {
    finish_last_columns(finish.args, finish.counters, partials, tile_channels_first<N>(), tile_channels_count<N>(g));
  }
}

template <typename T, int N, typename E, typename F>
__global__ void __launch_bounds__(kThreads)
    plane_grad_sums_kernel(const T* __restrict__ x, const T* __restrict__ dy,
                           const at::opmath_type<T>* __restrict__ mean, PlaneGrid g,
                           GradSums<double>* partials, E ep, F finish) {
  using A = at::opmath_type<T>;
  __shared__ ExactGradSums<A> shared[kThreads / kWarp];
  A m[N];
#pragma unroll
  for (int j = 0; j < N; ++j) m[j] = mean[blockIdx.x];
  LaneGradSums<A, N> lanes{};
  for_each_in_split(g, [&](int64_t v) {
    A xv[N], dv[N];
    load<N>(x + v * N, xv);
    load<N>(dy + v * N, dv);
#pragma unroll
    for (int j = 0; j < N; ++j) ep.apply(v * N + j, blockIdx.x, xv[j], dv[j]);
    add(lanes, xv, dv, m);
  });
  const ExactGradSums<A> s = block_reduce(fold(lanes), shared);
  if (threadIdx.x == 0 && threadIdx.y == 0) {
    partials[static_cast<int64_t>(blockIdx.x) * gridDim.y + blockIdx.y] = partial_of(s);
  }
  if constexpr (F::kOn) finish_last_channel(finish.args, finish.counters, partials);
}

template <typename T, int N, typename E, typename F>
__global__ void __launch_bounds__(kThreads)
    column_grad_sums_kernel(const T* __restrict__ x, const T* __restrict__ dy,
                            const at::opmath_type<T>* __restrict__ mean, ColumnGrid g,
                            GradSums<double>* partials, E ep, F finish) {
  using A = at::opmath_type<T>;
  __shared__ LaneGradSums<A, N> shared[kThreads / 2];
  const int64_t column = owned_column();
  LaneGradSums<A, N> lanes{};
  if (column < g.columns) {
    A m[N];
#pragma unroll
    for (int j = 0; j < N; ++j) m[j] = mean[(column * N + j) / g.inner];
    for_each_row(g, column, [&](int64_t v) {
      A xv[N], dv[N];
      load<N>(x + v * N, xv);
      load<N>(dy + v * N, dv);
#pragma unroll
      for (int j = 0; j < N; ++j) ep.apply(v * N + j, (column * N + j) / g.inner, xv[j], dv[j]);
      add(lanes, xv, dv, m);
    });
  }
  column_reduce(lanes, shared);
  if (threadIdx.y == 0 && column < g.columns) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      partials[(column * N + j) * gridDim.y + blockIdx.y] = partial_of(lane(lanes, j));
    }
  }
  if constexpr (F::kOn) {
    finish_last_columns(finish.args, finish.counters, partials, tile_channels_first<N>(), tile_channels_count<N>(g));
  }
}

}  // namespace torch_bn_grad::cuda
