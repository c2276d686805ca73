// What each CUDA thread accumulates over the values it reads, before the block
// reductions (block_reduce.cuh) merge the threads' states, with the scalar
// functions of compensated.h (the CPU's numerics: compensated sums, the
// second moment about a centre, moments by math::centred_moments):
//
// * LaneMoments: N column lanes' ShiftedSums (compensated sums of x - centre
//   and (x - centre)^2, each lane about its own centre, the first value of its
//   column or channel), the lanes having seen the same number of values.
// * LaneGradSums: the backward's two compensated sums of N column lanes.
//
// merge() combines two threads' lanes, fold() a thread's lanes of one channel
// (planes, all lanes about the channel's centre) into one state. Block
// partials leave as float64 moments and sums; the second stage merges those
// with math::merge (Chan's formula for moments), as the CPU merges its blocks.
#pragma once

#include <cstdint>

#include "math/batch_norm_math.h"
#include "math/compensated.h"

namespace torch_bn_grad::cuda {

// Counts travel as int64 on the device.
template <typename A>
using Moments = math::Moments<A, int64_t>;
using math::ExactGradSums;
using math::ExactSum;
using math::GradSums;
using math::ShiftedSums;

template <typename A, int N>
struct LaneMoments {
  ExactSum<A> d[N];
  ExactSum<A> d2[N];
  int64_t count;
};

template <typename A, int N>
__device__ __forceinline__ void add(LaneMoments<A, N>& s, const A (&x)[N], const A (&centre)[N]) {
  ++s.count;
#pragma unroll
  for (int j = 0; j < N; ++j) math::add_shifted(s.d[j], s.d2[j], x[j], centre[j]);
}

// Lane j's state as ShiftedSums, and back (all lanes share the count).
template <typename A, int N>
__device__ __forceinline__ ShiftedSums<A> lane(const LaneMoments<A, N>& s, int j) {
  return {s.count, s.d[j], s.d2[j]};
}

template <typename A, int N>
__device__ __forceinline__ void set_lane(LaneMoments<A, N>& s, int j, const ShiftedSums<A>& m) {
  s.d[j] = m.d;
  s.d2[j] = m.d2;
  s.count = m.count;
}

template <typename A, int N>
struct LaneGradSums {
  ExactSum<A> dy[N];
  ExactSum<A> dy_xc[N];
};

template <typename A, int N>
__device__ __forceinline__ void add(LaneGradSums<A, N>& s, const A (&x)[N], const A (&dy)[N],
                                    const A (&mean)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) math::add_grad(s.dy[j], s.dy_xc[j], x[j], dy[j], mean[j]);
}

template <typename A, int N>
__device__ __forceinline__ ExactGradSums<A> lane(const LaneGradSums<A, N>& s, int j) {
  return {s.dy[j], s.dy_xc[j]};
}

template <typename A, int N>
__device__ __forceinline__ void set_lane(LaneGradSums<A, N>& s, int j, const ExactGradSums<A>& g) {
  s.dy[j] = g.dy;
  s.dy_xc[j] = g.dy_xc;
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

// The value every lane is centred on: a channel's first value (planes; read
// by every thread of the block, one broadcast load) or the first row of a
// thread's columns. Half-precision data is centred in float, exactly.
template <typename T, int N, typename A>
__device__ __forceinline__ void centre_all(const T* first, A (&centre)[N]) {
  const A c = static_cast<A>(*first);
#pragma unroll
  for (int j = 0; j < N; ++j) centre[j] = c;
}

// A block's partials, in float64 (the second stage's merge_channel reads them).
template <typename A>
__device__ __forceinline__ Moments<double> partial_of(const ShiftedSums<A>& s, A centre) {
  return math::shifted_moments(s, centre);
}

template <typename A>
__device__ __forceinline__ GradSums<double> partial_of(const ExactGradSums<A>& s) {
  return math::grad_sums_of(s);
}

}  // namespace torch_bn_grad::cuda
