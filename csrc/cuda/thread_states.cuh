// What each CUDA thread accumulates over the values it reads, before the block
// reductions (block_reduce.cuh) merge the threads' states:
//
// * LaneMoments: Welford's running (mean, m2) of N column lanes that have
//   seen the same number of values (one division per N values).
// * LaneGradSums: the backward's two sums of N column lanes.
//
// merge() combines two threads' lanes, fold() a thread's lanes of one channel
// (planes) into one state.
// Merges are math::merge (batch_norm_math.h), the CPU's formulas.
#pragma once

#include <cstdint>

#include "batch_norm_math.h"

namespace torch_bn_grad::cuda {

// Counts travel as int64 on the device.
template <typename A>
using Moments = math::Moments<A, int64_t>;
using math::GradSums;

template <typename A, int N>
struct LaneMoments {
  A mean[N];
  A m2[N];
  int64_t count;
};

template <typename A, int N>
__device__ __forceinline__ void add(LaneMoments<A, N>& s, const A (&x)[N]) {
  ++s.count;
  const A inv = A(1) / static_cast<A>(s.count);
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const A d = x[j] - s.mean[j];
    s.mean[j] += d * inv;
    s.m2[j] += d * (x[j] - s.mean[j]);
  }
}

// Lane j's state as Moments, and back (all lanes share the count).
template <typename A, int N>
__device__ __forceinline__ Moments<A> lane(const LaneMoments<A, N>& s, int j) {
  return {s.count, s.mean[j], s.m2[j]};
}

template <typename A, int N>
__device__ __forceinline__ void set_lane(LaneMoments<A, N>& s, int j, const Moments<A>& m) {
  s.mean[j] = m.mean;
  s.m2[j] = m.m2;
  s.count = m.count;
}

template <typename A, int N>
struct LaneGradSums {
  A sum_dy[N];
  A sum_dy_xc[N];
};

template <typename A, int N>
__device__ __forceinline__ void add(LaneGradSums<A, N>& s, const A (&x)[N], const A (&dy)[N],
                                    const A (&mean)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
    s.sum_dy[j] += dy[j];
    s.sum_dy_xc[j] += dy[j] * (x[j] - mean[j]);
  }
}

template <typename A, int N>
__device__ __forceinline__ GradSums<A> lane(const LaneGradSums<A, N>& s, int j) {
  return {s.sum_dy[j], s.sum_dy_xc[j]};
}

template <typename A, int N>
__device__ __forceinline__ void set_lane(LaneGradSums<A, N>& s, int j, const GradSums<A>& g) {
  s.sum_dy[j] = g.sum_dy;
  s.sum_dy_xc[j] = g.sum_dy_xc;
}

// Two threads' lanes merged lane by lane (LaneMoments or LaneGradSums).
template <template <typename, int> class Lanes, typename A, int N>
__device__ __forceinline__ Lanes<A, N> merge(const Lanes<A, N>& a, const Lanes<A, N>& b) {
  Lanes<A, N> r;
#pragma unroll
  for (int j = 0; j < N; ++j) set_lane(r, j, math::merge(lane(a, j), lane(b, j)));
  return r;
}

// A thread's lanes of one channel (planes) folded into one state, in lane order.
template <template <typename, int> class Lanes, typename A, int N>
__device__ __forceinline__ auto fold(const Lanes<A, N>& s) {
  auto r = lane(s, 0);
#pragma unroll
  for (int j = 1; j < N; ++j) r = math::merge(r, lane(s, j));
  return r;
}

}  // namespace torch_bn_grad::cuda
