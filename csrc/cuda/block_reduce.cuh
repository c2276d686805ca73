// The CUDA reductions of thread states (thread_states.cuh): across a warp with
// shuffles, across the warps of a block or the rows of a column tile in
// shared memory. Fixed-order trees, so that the same inputs give the same
// bits on every run.
#pragma once

#include <cstdint>

#include "cuda/thread_states.cuh"

namespace torch_bn_grad::cuda {

// Threads per block of every data kernel; the reductions rely on it.
constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;

template <typename A>
__device__ __forceinline__ Moments<A> shfl_down(const Moments<A>& m, int offset) {
  return {__shfl_down_sync(kFullMask, m.count, offset), __shfl_down_sync(kFullMask, m.mean, offset),
          __shfl_down_sync(kFullMask, m.m2, offset)};
}

template <typename A>
__device__ __forceinline__ GradSums<A> shfl_down(const GradSums<A>& s, int offset) {
  return {__shfl_down_sync(kFullMask, s.sum_dy, offset), __shfl_down_sync(kFullMask, s.sum_dy_xc, offset)};
}

template <typename A>
__device__ __forceinline__ ExactSum<A> shfl_down(const ExactSum<A>& s, int offset) {
  return {__shfl_down_sync(kFullMask, s.sum, offset), __shfl_down_sync(kFullMask, s.err, offset)};
}

template <typename A>
__device__ __forceinline__ ShiftedSums<A> shfl_down(const ShiftedSums<A>& s, int offset) {
  return {__shfl_down_sync(kFullMask, s.count, offset), shfl_down(s.d, offset), shfl_down(s.d2, offset)};
}

template <typename A>
__device__ __forceinline__ ExactGradSums<A> shfl_down(const ExactGradSums<A>& s, int offset) {
  return {shfl_down(s.dy, offset), shfl_down(s.dy_xc, offset)};
}

template <typename S>
__device__ __forceinline__ S warp_reduce(S s) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) s = merge(s, shfl_down(s, offset));
  return s;
}

// All kThreads threads of the block; the result is valid in thread (0, 0).
template <typename S>
__device__ __forceinline__ S block_reduce(S s, S (&shared)[kThreads / kWarp]) {
  const int tid = static_cast<int>(threadIdx.y * blockDim.x + threadIdx.x);
  s = warp_reduce(s);
  if (tid % kWarp == 0) shared[tid / kWarp] = s;
  __syncthreads();
  if (tid < kWarp) {
    s = tid < kThreads / kWarp ? shared[tid] : S{};
    s = warp_reduce(s);
  }
  return s;
}

// Merges the states of the threads that share threadIdx.x, over threadIdx.y
// (a power of two); the result is valid in the threads with threadIdx.y == 0.
template <typename S>
__device__ __forceinline__ void column_reduce(S& s, S (&shared)[kThreads / 2]) {
  const int tx = static_cast<int>(threadIdx.x);
  const int ty = static_cast<int>(threadIdx.y);
  const int bx = static_cast<int>(blockDim.x);
  for (int half = static_cast<int>(blockDim.y) / 2; half > 0; half /= 2) {
    if (ty >= half && ty < 2 * half) shared[(ty - half) * bx + tx] = s;
    __syncthreads();
    if (ty < half) s = merge(s, shared[ty * bx + tx]);
    __syncthreads();
  }
}

// One warp per channel (the second stage): the channel this thread's warp
// serves, kThreads / kWarp channels a block.
constexpr int kChannelsPerBlock = kThreads / kWarp;

__device__ __forceinline__ int64_t warp_channel() {
  return (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
}

// Lane l of a channel's warp merges partials l, l + 32, ... of that channel in
// float64 (Chan's formula for moments), then the lanes are merged in a fixed
// tree; the result is valid in lane 0.
template <typename S>
__device__ __forceinline__ Moments<double> merge_channel(const Moments<S>* partials, int64_t per_channel,
                                                         int64_t k, int lane) {
  Moments<double> m{0, 0, 0};
  for (int64_t i = lane; i < per_channel; i += kWarp) {
    const Moments<S> p = partials[k * per_channel + i];
    m = math::merge(m, Moments<double>{p.count, p.mean, p.m2});
  }
  return warp_reduce(m);
}

template <typename S>
__device__ __forceinline__ GradSums<double> merge_channel(const GradSums<S>* partials, int64_t per_channel,
                                                          int64_t k, int lane) {
  GradSums<double> s{0, 0};
  for (int64_t i = lane; i < per_channel; i += kWarp) {
    const GradSums<S> q = partials[k * per_channel + i];
    s = math::merge(s, GradSums<double>{q.sum_dy, q.sum_dy_xc});
  }
  return warp_reduce(s);
}

}  // namespace torch_bn_grad::cuda
