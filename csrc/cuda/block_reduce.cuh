// The CUDA reductions of thread states (thread_states.cuh): across a warp with
// shuffles, across the warps of a block or the rows of a column tile in
// shared memory. Fixed-order trees, so that the same inputs give the same
// bits on every run.
#pragma once

#include <cstdint>
#include <cstring>

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

// warp_reduce's result in lane 0, computed by one thread from the lanes'
// states lane(i), i < kWarp: the same merges in the same tree (lane 0 ends with
// R(0, 1), where R(i, o) = merge(R(i, 2o), R(i + o, 2o)) and R(i, kWarp) is
// lane i's state), so the same bits. Depth first, so that only a few states
// are live at once.
template <int kStride = 1, typename Lane>
__device__ __forceinline__ auto warp_tree(int i, const Lane& lane) {
  if constexpr (kStride == kWarp) {
    return lane(i);
  } else {
    return merge(warp_tree<2 * kStride>(i, lane), warp_tree<2 * kStride>(i + kStride, lane));
  }
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

// The second stage merges each channel's partials with a group of kGroup
// threads: a warp (kWarp; kThreads / kWarp channels a block) or, where a
// channel has many partials, the whole block (kThreads): a columns partition
// of few channels gives each thousands (64 channels of 64x112x112: 3136),
// which one warp merges in longer than the data pass takes.
constexpr int kChannelsPerBlock = kThreads / kWarp;
constexpr int64_t kBlockMergeMinPartials = 8 * kWarp;

template <int kGroup>
__device__ __forceinline__ int64_t group_channel() {
  static_assert(kGroup == kWarp || kGroup == kThreads, "a channel's group is a warp or a block");
  return (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kGroup;
}

template <int kGroup>
__device__ __forceinline__ int group_rank() {
  return static_cast<int>(threadIdx.x) % kGroup;
}

// Partials as stored, read through the caches. PlainLoad is the coefficient
// kernels': they run after the kernel that wrote the partials. A block that
// reads partials other blocks of its own kernel wrote (last_block.cuh) reads
// them from L2 (CoherentLoad), which every block's stores reach, not from
// its SM's L1, which is not kept coherent with them.
struct PlainLoad {
  template <typename S>
  __device__ __forceinline__ S operator()(const S* p) const {
    return *p;
  }
};

struct CoherentLoad {
  template <typename S>
  __device__ __forceinline__ S operator()(const S* p) const {
    static_assert(sizeof(S) % sizeof(unsigned long long) == 0, "partials are made of 8-byte fields");
    constexpr int kWords = sizeof(S) / sizeof(unsigned long long);
    unsigned long long words[kWords];
    const auto* from = reinterpret_cast<const unsigned long long*>(p);
#pragma unroll
    for (int i = 0; i < kWords; ++i) words[i] = __ldcg(from + i);
    S s;
    memcpy(&s, words, sizeof(S));
    return s;
  }
};

// Thread `rank`'s state in merge_partials before its group's tree.
template <int kGroup, typename S, typename Load>
__device__ __forceinline__ S rank_partials(const S* partials, int64_t per_channel, int64_t k, int rank,
                                           const Load& load) {
  S m{};
  for (int64_t i = rank; i < per_channel; i += kGroup) m = math::merge(m, load(partials + k * per_channel + i));
  return m;
}

// Thread `rank` of channel k's group merges partials rank, rank + kGroup, ...
// in float64 (Chan's formula for moments), then the group's threads are merged
// in a fixed tree; the result is valid in rank 0. Every thread of the group
// must call it (the block's reduction synchronizes). A group of kThreads is the
// whole block, `rank` its thread's index in it.
template <int kGroup, typename S, typename Load = PlainLoad>
__device__ __forceinline__ S merge_partials(const S* partials, int64_t per_channel, int64_t k, int rank,
                                            S (&shared)[kThreads / kWarp], const Load& load = Load{}) {
  static_assert(kGroup == kWarp || kGroup == kThreads, "a channel's group is a warp or a block");
  const S m = rank_partials<kGroup>(partials, per_channel, k, rank, load);
  if constexpr (kGroup == kWarp) {
    return warp_reduce(m);
  } else {
    return block_reduce(m, shared);
  }
}

// merge_partials for the coefficient kernels, whose blocks are one-dimensional.
template <int kGroup, typename S>
__device__ __forceinline__ S merge_channel(const S* partials, int64_t per_channel, int64_t k,
                                           S (&shared)[kThreads / kWarp]) {
  return merge_partials<kGroup>(partials, per_channel, k, group_rank<kGroup>(), shared);
}

}  // namespace torch_bn_grad::cuda
