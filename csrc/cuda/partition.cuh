// The CUDA partitions of an [outer, channels, inner] array over a grid, as
// the kernels see them: which vectors of the data each thread reads. Filled
// on the host by launch_plan.cuh.
//
// * Planes, when a channel's row segment (`inner` elements) spans at least a
//   128-byte line: block (k, s) reads split s of channel k, a range of rows by
//   a range of inner positions, so per-channel values are block constants.
// * Columns, otherwise (channels_last / NXC has inner == 1): the data is read
//   as `outer` rows of channels * inner columns; a thread owns N adjacent
//   columns over a range of rows, so a warp reads contiguous row segments
//   whatever the channel count.
// * Persistent planes and columns: a block holds a whole channel (planes) or a
//   tile of adjacent channels over all rows (columns, inner == 1) in its
//   threads' registers, R vectors a thread.
#pragma once

#include <cstdint>

#include "cuda/block_reduce.cuh"

namespace torch_bn_grad::cuda {

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// Planes: grid (channels, splits), block (bx, by) with bx * by == kThreads;
// split s covers rows [o0, o1) and inner vectors [i0, i1) of channel
// blockIdx.x. Inner extents are in vectors of the kernel's N elements.
struct PlaneGrid {
  int64_t outer;
  int64_t channels;
  int64_t inner;
  int64_t rows_per_split;
  int64_t inner_per_split;
  int64_t inner_splits;
};

// Calls f(v) for each vector v (an offset in vectors) of this block's split
// that this thread handles, rows outermost.
template <typename F>
__device__ __forceinline__ void for_each_in_split(const PlaneGrid& g, const F& f) {
  const int64_t k = blockIdx.x;
  // 32-bit: both are below 65536, and 64-bit division is a slow call.
  const unsigned inner_splits = static_cast<unsigned>(g.inner_splits);
  const int64_t o0 = static_cast<int64_t>(blockIdx.y / inner_splits) * g.rows_per_split;
  const int64_t o1 = min64(g.outer, o0 + g.rows_per_split);
  const int64_t i0 = static_cast<int64_t>(blockIdx.y % inner_splits) * g.inner_per_split;
  const int64_t i1 = min64(g.inner, i0 + g.inner_per_split);
  for (int64_t o = o0 + threadIdx.y; o < o1; o += blockDim.y) {
    const int64_t row = (o * g.channels + k) * g.inner;
    for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) f(row + i);
  }
}

// Columns: grid (column tiles, row splits), block (bx, by); thread x of tile
// blockIdx.x owns column vector blockIdx.x * bx + x and walks rows
// [blockIdx.y * rows_per_split, ...) with stride by.
struct ColumnGrid {
  int64_t outer;
  int64_t columns;  // per row, in vectors
  int64_t inner;    // columns (elements) per channel
  int64_t rows_per_split;
};

__device__ __forceinline__ int64_t owned_column() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

// With inner == 1 a column is a channel: the channels of tile blockIdx.x, N
// per column vector, from the first on.
template <int N>
__device__ __forceinline__ int64_t tile_channels_first() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x * N;
}

template <int N>
__device__ __forceinline__ int64_t tile_channels_count(const ColumnGrid& g) {
  return min64(g.columns * N - tile_channels_first<N>(), static_cast<int64_t>(blockDim.x) * N);
}

// Four rows a trip, with no bounds test between them, so that their loads are
// in flight together (one at a time leaves the reductions at about half the
// elementwise pass's bandwidth); the order is that of one row a
// trip, so are the results.
template <typename F>
__device__ __forceinline__ void for_each_row(const ColumnGrid& g, int64_t column, const F& f) {
  constexpr int kRowsPerTrip = 4;
  const int64_t o0 = static_cast<int64_t>(blockIdx.y) * g.rows_per_split;
  const int64_t o1 = min64(g.outer, o0 + g.rows_per_split);
  const int64_t step = blockDim.y;
  int64_t o = o0 + threadIdx.y;
  for (; o + (kRowsPerTrip - 1) * step < o1; o += kRowsPerTrip * step) {
#pragma unroll
    for (int u = 0; u < kRowsPerTrip; ++u) f((o + u * step) * g.columns + column);
  }
  for (; o < o1; o += step) f(o * g.columns + column);
}

// Persistent planes: grid (channels), block (kThreads); block k holds all of
// channel k, its vector v (rows outermost) in slot v / kThreads of thread
// v % kThreads. Extents are in vectors of the kernel's N elements; a channel
// has at most kThreads * R of them, so 32 bits index it.
struct PersistentPlane {
  int64_t channels;
  unsigned inner;
  unsigned vectors;  // outer * inner
};

// Calls f(r, v) for each slot r < R of this thread that holds a vector, v
// being the vector's offset (in vectors) in the whole array.
template <int R, typename F>
__device__ __forceinline__ void for_each_held(const PersistentPlane& h, const F& f) {
  const int64_t k = blockIdx.x;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const unsigned v = threadIdx.x + r * kThreads;
    if (v < h.vectors) f(r, (static_cast<int64_t>(v / h.inner) * h.channels + k) * h.inner + v % h.inner);
  }
}

// Persistent columns (inner == 1, so a column is a channel): grid (column
// tiles), block (bx, by); thread x of tile blockIdx.x holds column vector
// owned_column(), channels N * owned_column() + j, of every row, row
// y + r * by in slot r.
struct PersistentColumns {
  int64_t outer;
  int64_t columns;  // per row, in vectors
};

template <int R, typename F>
__device__ __forceinline__ void for_each_held(const PersistentColumns& h, int64_t column, const F& f) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t o = threadIdx.y + static_cast<int64_t>(r) * blockDim.y;
    if (o < h.outer) f(r, o * h.columns + column);
  }
}

}  // namespace torch_bn_grad::cuda
