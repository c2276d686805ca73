// Host-side planning of the CUDA launches: picks the partition (planes or
// columns, partition.cuh), the vector width and the grid of a shape, and
// whether the persistent single-read variant applies. It fills the grids and
// guarantees what the kernels rely on: blocks of kThreads threads with
// power-of-two extents, gridDim.y < 65536, and every element in exactly one
// thread's loop. The partition depends only on the shape and on whether the
// pointers allow 16-byte vectors, never on the GPU.
#pragma once

#include <ATen/OpMathType.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <type_traits>

#include "cuda/partition.cuh"
#include "math/extent.h"

namespace torch_bn_grad::cuda {

// Bytes of one tensor that a block reads: enough to amortize the block and its
// partial, few enough to fill the GPU at moderate sizes. A function of the
// shape only, so the partition (and the rounding) does not depend on the GPU.
constexpr int64_t kBytesPerBlock = 64 * 1024;
// Planes when a channel's row segment covers a 128-byte line; shorter segments
// are read as columns, which keeps each warp on contiguous memory.
constexpr int64_t kPlaneMinBytes = 128;
constexpr int64_t kMaxGridY = 65535;
constexpr int64_t kMaxGridX = std::numeric_limits<int32_t>::max();

// Smallest power of two >= n, at most cap.
inline int pow2_at_least(int64_t n, int cap) {
  int p = 1;
  while (p < n && p < cap) p *= 2;
  return p;
}

template <typename T>
bool use_planes(const Extent& e) {
  return e.inner * static_cast<int64_t>(sizeof(T)) >= kPlaneMinBytes;
}

// Elements per vector: 16 bytes when every pointer is 16-byte aligned and runs
// of `run` contiguous elements are whole vectors, else 1.
template <typename T>
int vector_width(int64_t run, std::initializer_list<const void*> pointers) {
  constexpr int kVector = 16 / sizeof(T);
  if (run % kVector != 0) return 1;
  for (const void* p : pointers) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return 1;
  }
  return kVector;
}

// Calls f(std::integral_constant<int, N>) for the vector width picked above.
template <typename T, typename F>
void with_vector_width(int width, const F& f) {
  if (width == 1) {
    f(std::integral_constant<int, 1>{});
  } else {
    f(std::integral_constant<int, 16 / sizeof(T)>{});
  }
}

struct PlaneLaunch {
  PlaneGrid g;
  dim3 grid;
  dim3 block;
  int64_t partials_per_channel() const { return grid.y; }
};

inline PlaneLaunch plan_planes(const Extent& e, int width, int64_t element_size) {
  TORCH_CHECK(e.channels <= kMaxGridX, "batch_norm (CUDA): too many channels (", e.channels, ")");
  PlaneGrid g{};
  g.outer = e.outer;
  g.channels = e.channels;
  g.inner = e.inner / width;
  // At most 32768 wanted, so that rows x inner splits stays below 65536.
  const int64_t want = std::clamp<int64_t>(
      ceil_div(e.outer * e.inner * element_size, kBytesPerBlock), 1, 32768);
  if (e.outer >= want) {
    g.rows_per_split = ceil_div(e.outer, want);
    g.inner_per_split = g.inner;
  } else {
    g.rows_per_split = 1;
    g.inner_per_split = ceil_div(g.inner, ceil_div(want, e.outer));
  }
  g.inner_splits = ceil_div(g.inner, g.inner_per_split);
  const int64_t splits = ceil_div(e.outer, g.rows_per_split) * g.inner_splits;
  TORCH_INTERNAL_ASSERT(splits <= kMaxGridY);
  const int bx = pow2_at_least(g.inner_per_split, kThreads);
  return {g, dim3(static_cast<unsigned>(e.channels), static_cast<unsigned>(splits)),
          dim3(bx, kThreads / bx)};
}

struct ColumnLaunch {
  ColumnGrid g;
  dim3 grid;
  dim3 block;
  int64_t partials_per_channel() const { return g.inner * grid.y; }
};

inline ColumnLaunch plan_columns(const Extent& e, int width, int64_t element_size) {
  ColumnGrid g{};
  g.outer = e.outer;
  g.columns = e.channels * e.inner / width;
  g.inner = e.inner;
  // Up to a warp across columns and the rest of the block down the rows, or
  // wider when there are fewer rows than that.
  const int bx = pow2_at_least(g.columns, std::max(kWarp, kThreads / pow2_at_least(e.outer, kThreads)));
  const int by = kThreads / bx;
  g.rows_per_split = std::max({static_cast<int64_t>(by),
                               ceil_div(kBytesPerBlock, bx * width * element_size),
                               ceil_div(e.outer, kMaxGridY)});
  const int64_t tiles = ceil_div(g.columns, bx);
  TORCH_CHECK(tiles <= kMaxGridX, "batch_norm (CUDA): too many columns (", e.channels * e.inner, ")");
  return {g, dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(ceil_div(e.outer, g.rows_per_split))),
          dim3(bx, by)};
}

// Persistent variant. A thread holds kPersistentItems<T> elements of each
// tensor, as accumulation-type values: 128 bytes, 32 registers (32 float32,
// float16 or bfloat16 values, 16 float64 ones), so the backward's x and dy
// stay far below the 255-register cap. A block thus holds 8192 elements (4096
// in float64), at most 32 KiB of data, half of kBytesPerBlock:
// where the variant applies, the two-kernel path would give each channel
// (planes) or tile (columns) about one block too, so one read of the data and
// two launches are saved without losing parallelism.
template <typename T>
constexpr int kPersistentItems = 128 / static_cast<int>(sizeof(at::opmath_type<T>));
// Narrowest row segment of a columns tile: one 32-byte sector, read whole.
constexpr int64_t kSectorBytes = 32;

// The persistent variant reads planes from one sector a row segment on, below
// use_planes' 128 bytes: a 7x7 plane of 16-bit values (98 bytes) is then read
// once in one launch, where the columns partition takes three launches and
// two reads.
template <typename T>
bool use_persistent_planes(const Extent& e) {
  return e.inner * static_cast<int64_t>(sizeof(T)) >= kSectorBytes;
}

// The registers a thread reserves follow its slots, used or not: the backward
// kernel at full size takes ~124 registers, two blocks per SM, so a layer of
// 512 channels of 32x7x7 would run in two waves of latency-bound blocks,
// slower than cuDNN. Shapes that fill fewer slots get a kernel compiled
// with a quarter or half of them, which fits 4-6 blocks per SM.
template <int Max>
constexpr int kPersistentSlotLevels[3] = {Max / 4 > 0 ? Max / 4 : 1, Max / 2 > 0 ? Max / 2 : 1, Max};

// The fewest slots of the levels that hold `needed` vectors per thread.
template <int Max>
int persistent_slots(int64_t needed) {
  for (int level : kPersistentSlotLevels<Max>) {
    if (needed <= level) return level;
  }
  return Max;
}

// Calls f(std::integral_constant<int, R>) for R = `slots`, one of the levels.
template <int Max, typename F>
void with_persistent_slots(int slots, const F& f) {
  constexpr int a = kPersistentSlotLevels<Max>[0], b = kPersistentSlotLevels<Max>[1];
  if (slots == a) {
    f(std::integral_constant<int, a>{});
  } else if (slots == b) {
    f(std::integral_constant<int, b>{});
  } else {
    f(std::integral_constant<int, Max>{});
  }
}

template <typename G>
struct PersistentLaunch {
  G g;
  dim3 grid;
  dim3 block;
  int64_t slots_needed;  // vectors per thread of each tensor
};

// Planes: when the channel's outer * inner elements fit in one block.
template <typename T>
std::optional<PersistentLaunch<PersistentPlane>> plan_persistent_plane(const Extent& e, int width) {
  if (e.outer * e.inner > kThreads * kPersistentItems<T>) return std::nullopt;
  TORCH_CHECK(e.channels <= kMaxGridX, "batch_norm (CUDA): too many channels (", e.channels, ")");
  const PersistentPlane h{e.channels, static_cast<unsigned>(e.inner / width),
                          static_cast<unsigned>(e.outer * e.inner / width)};
  return PersistentLaunch<PersistentPlane>{h, dim3(static_cast<unsigned>(e.channels)), dim3(kThreads),
                                           ceil_div(h.vectors, kThreads)};
}

// Columns: when inner == 1 and all rows fit in a tile whose rows are a sector
// wide. Threads go down the rows first (by: the smallest power of two that
// covers them, if the tile stays a sector wide), so tiles are as narrow, and
// blocks as many, as the rows allow.
template <typename T>
std::optional<PersistentLaunch<PersistentColumns>> plan_persistent_columns(const Extent& e, int width) {
  const int64_t vector_bytes = width * static_cast<int64_t>(sizeof(T));
  const int max_by = kThreads / static_cast<int>(ceil_div(kSectorBytes, vector_bytes));
  const int64_t max_rows = static_cast<int64_t>(max_by) * (kPersistentItems<T> / width);
  if (e.inner != 1 || e.outer > max_rows) return std::nullopt;
  const int by = pow2_at_least(e.outer, max_by);
  const int bx = kThreads / by;
  const PersistentColumns h{e.outer, e.channels / width};
  const int64_t tiles = ceil_div(h.columns, bx);
  TORCH_CHECK(tiles <= kMaxGridX, "batch_norm (CUDA): too many channels (", e.channels, ")");
  return PersistentLaunch<PersistentColumns>{h, dim3(static_cast<unsigned>(tiles)), dim3(bx, by),
                                             ceil_div(e.outer, by)};
}

}  // namespace torch_bn_grad::cuda
