// The last_block_coefficients variant (docs/design.md, "CUDA variants"): the
// first stage's kernel (reduce_kernels.cuh) also does the second stage's
// work, so the two-kernel path takes two launches a direction, not three.
// The blocks sharing blockIdx.x (a plane's channel, or a tile of columns
// with inner == 1) count themselves done on a counter of their own once their
// partials are stored; the last to finish merges those channels' partials in
// the coefficient kernel's order (the same tree over the same groups) and
// stores the coefficients with the coefficient kernel's function, so the bits
// are the same. The counters come zeroed (stream_counters.h) and are left
// zeroed for the next kernel.
#pragma once

#include <cstdint>

#include "cuda/block_reduce.cuh"
#include "cuda/coefficient_kernels.cuh"

namespace torch_bn_grad::cuda {

// The first stage alone: the default.
struct NoFinish {
  static constexpr bool kOn = false;
};

// The first stage, then the second in the last block of each blockIdx.x.
// Args: ForwardCoefficientArgs or BackwardCoefficientArgs, partials included.
template <typename Args>
struct LastBlockFinish {
  static constexpr bool kOn = true;
  Args args;
  unsigned* counters;  // one per blockIdx.x, zero
};

// Called by every thread of the block after its partials are stored: true in
// every thread of the last of the gridDim.y blocks of this blockIdx.x, which
// resets their counter. The fence before the count makes this block's
// partials visible to the last block; the one after it orders that block's
// reads after every other block's count.
__device__ __forceinline__ bool last_of_blocks(unsigned* counters) {
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0 && threadIdx.y == 0) {
    const unsigned done = atomicAdd(counters + blockIdx.x, 1u);
    last = done == gridDim.y - 1;
    if (last) counters[blockIdx.x] = 0;
  }
  __syncthreads();
  if (last) __threadfence();
  return last;
}

// The largest gridDim.y of a columns kernel whose last block finishes its
// tile: its threads merge a channel each, in warp_reduce's tree, which costs
// a thread about gridDim.y + kWarp merges; a merge of more partials is left to
// the coefficient kernel's parallel warps.
constexpr int64_t kLastBlockColumnPartials = 2 * kWarp;

// The last block of a plane's channel k: its gridDim.y partials merged by a
// warp or, from kBlockMergeMinPartials partials on, by the block, as the
// coefficient kernels merge them; the coefficients stored in one thread.
template <typename Args, typename S>
__device__ __forceinline__ void merge_last_channel(const Args& args, const S* partials, int64_t k) {
  __shared__ S shared[kThreads / kWarp];
  const int64_t per_channel = gridDim.y;
  const int tid = static_cast<int>(threadIdx.y * blockDim.x + threadIdx.x);
  S m{};
  if (per_channel >= kBlockMergeMinPartials) {
    m = merge_partials<kThreads>(partials, per_channel, k, tid, shared, CoherentLoad{});
  } else if (tid < kWarp) {
    m = merge_partials<kWarp>(partials, per_channel, k, tid, shared, CoherentLoad{});
  }
  if (tid == 0) store_merged(args, k, m);
}

// The last block of a tile of columns (inner == 1): channels [first, first +
// count), a thread each, merged from their gridDim.y (below
// kBlockMergeMinPartials) partials as a coefficient kernel's warp merges them
// (warp_tree of each lane's rank_partials), the coefficients stored by that
// thread.
template <typename Args, typename S>
__device__ __forceinline__ void merge_last_columns(const Args& args, const S* partials, int64_t first,
                                                   int64_t count) {
  const int64_t per_channel = gridDim.y;
  const int tid = static_cast<int>(threadIdx.y * blockDim.x + threadIdx.x);
  for (int64_t k = first + tid; k < first + count; k += kThreads) {
    const S m = warp_tree(0, [&](int lane) {
      return rank_partials<kWarp>(partials, per_channel, k, lane, CoherentLoad{});
    });
    store_merged(args, k, m);
  }
}

// Both steps, called by every thread of a first-stage kernel whose F is a
// LastBlockFinish once its partials are stored: the last block of a plane's
// channel, or of a tile's channels. Not inlined: a function per kind of
// partials and accumulation type, shared by the kernels of every data type,
// vector width and epilogue, rather than a copy in each.
template <typename Args, typename S>
__device__ __noinline__ void finish_last_channel(const Args& args, unsigned* counters, const S* partials) {
  if (last_of_blocks(counters)) merge_last_channel(args, partials, blockIdx.x);
}

template <typename Args, typename S>
__device__ __noinline__ void finish_last_columns(const Args& args, unsigned* counters, const S* partials,
                                                 int64_t first, int64_t count) {
  if (last_of_blocks(counters)) merge_last_columns(args, partials, first, count);
}

}  // namespace torch_bn_grad::cuda
