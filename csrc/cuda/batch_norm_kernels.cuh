// Kernels of the CUDA operators, and the host-side planning of their launches.
//
// Every data tensor is a contiguous [outer, channels, inner] array (see
// ChannelPlan). The work is cut in one of two ways:
//
// * Planes, when a channel's row segment (`inner` elements) spans at least a
//   128-byte line: block (k, s) reads split s of channel k, a range of rows by
//   a range of inner positions, so per-channel values are block constants.
// * Columns, otherwise (channels_last / NXC has inner == 1): the data is read
//   as `outer` rows of channels * inner columns; a thread owns N adjacent
//   columns over a range of rows, so a warp reads contiguous row segments
//   whatever the channel count.
//
// and run in one of two structures:
//
// * Two kernels plus an elementwise pass: reductions write one partial per
//   block (planes) or per column and row split (columns), and a second kernel
//   merges each channel's partials in a fixed order and derives the
//   coefficients; the elementwise pass then reads the data again.
// * Persistent single read, for the training forward and backward when a
//   whole channel (planes) or a tile of adjacent channels over all rows
//   (columns with inner == 1) fits in one block's registers: one kernel loads
//   the data once, reduces it in the block, derives the coefficients with the
//   second stage's code and writes the output from the registers.
//
// There are no atomics, and the partition and structure depend only on the
// shape and on whether the pointers allow 16-byte vectors, so results are
// bitwise reproducible from run to run.
//
// Statistics: each thread runs Welford's update per column lane; states are
// merged with Chan et al.'s pairwise formula (in registers, across a warp with
// shuffles, across warps or rows in shared memory, and per channel in float64
// in the second stage). The backward's sums, sum(dy) and sum(dy * (x - mean)),
// are centred by construction. Accumulation is in at::opmath_type: float32 for
// float32, float16 and bfloat16 data, float64 for float64.
#pragma once

#include <ATen/OpMathType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <type_traits>

namespace torch_bn_grad::cuda {

// Threads per block of every data kernel; the reductions rely on it.
constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// ------------------------------------------------------------------ memory
// N consecutive elements, moved with one instruction when N * sizeof(T) == 16.
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <int N, typename T, typename A>
__device__ __forceinline__ void load(const T* p, A (&out)[N]) {
  const Pack<T, N> pack = *reinterpret_cast<const Pack<T, N>*>(p);
#pragma unroll
  for (int j = 0; j < N; ++j) out[j] = static_cast<A>(pack.v[j]);
}

template <int N, typename T, typename A>
__device__ __forceinline__ void store(T* p, const A (&in)[N]) {
  Pack<T, N> pack;
#pragma unroll
  for (int j = 0; j < N; ++j) pack.v[j] = static_cast<T>(in[j]);
  *reinterpret_cast<Pack<T, N>*>(p) = pack;
}

// ------------------------------------------------------------------ states
// Count, mean and centred second moment of a set of values.
template <typename A>
struct Moments {
  A mean;
  A m2;
  int64_t count;
};

// Chan et al.: exact for the union of two disjoint sets, no cancellation.
template <typename A>
__device__ __forceinline__ Moments<A> merge(const Moments<A>& a, const Moments<A>& b) {
  const int64_t n = a.count + b.count;
  if (n == 0) return a;
  const A f = static_cast<A>(b.count) / static_cast<A>(n);
  const A d = b.mean - a.mean;
  return {a.mean + d * f, a.m2 + b.m2 + d * d * static_cast<A>(a.count) * f, n};
}

template <typename A>
__device__ __forceinline__ Moments<A> shfl_down(const Moments<A>& m, int offset) {
  return {__shfl_down_sync(kFullMask, m.mean, offset), __shfl_down_sync(kFullMask, m.m2, offset),
          __shfl_down_sync(kFullMask, m.count, offset)};
}

// Moments of N column lanes that have seen the same number of values, so
// that Welford's update needs one division per N values.
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

template <typename A, int N>
__device__ __forceinline__ LaneMoments<A, N> merge(const LaneMoments<A, N>& a,
                                                   const LaneMoments<A, N>& b) {
  LaneMoments<A, N> r;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const Moments<A> m = merge(Moments<A>{a.mean[j], a.m2[j], a.count},
                               Moments<A>{b.mean[j], b.m2[j], b.count});
    r.mean[j] = m.mean;
    r.m2[j] = m.m2;
  }
  r.count = a.count + b.count;
  return r;
}

// The lanes of one channel (planes) folded into one state, in lane order.
template <typename A, int N>
__device__ __forceinline__ Moments<A> fold(const LaneMoments<A, N>& s) {
  Moments<A> m{s.mean[0], s.m2[0], s.count};
#pragma unroll
  for (int j = 1; j < N; ++j) m = merge(m, Moments<A>{s.mean[j], s.m2[j], s.count});
  return m;
}

// The backward's two sums.
template <typename A>
struct GradSums {
  A dy;
  A dy_xc;  // sum(dy * (x - mean))
};

template <typename A>
__device__ __forceinline__ GradSums<A> merge(const GradSums<A>& a, const GradSums<A>& b) {
  return {a.dy + b.dy, a.dy_xc + b.dy_xc};
}

template <typename A>
__device__ __forceinline__ GradSums<A> shfl_down(const GradSums<A>& s, int offset) {
  return {__shfl_down_sync(kFullMask, s.dy, offset), __shfl_down_sync(kFullMask, s.dy_xc, offset)};
}

template <typename A, int N>
struct LaneGradSums {
  A dy[N];
  A dy_xc[N];
};

template <typename A, int N>
__device__ __forceinline__ void add(LaneGradSums<A, N>& s, const A (&x)[N], const A (&dy)[N],
                                    const A (&mean)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
    s.dy[j] += dy[j];
    s.dy_xc[j] += dy[j] * (x[j] - mean[j]);
  }
}

template <typename A, int N>
__device__ __forceinline__ LaneGradSums<A, N> merge(const LaneGradSums<A, N>& a,
                                                    const LaneGradSums<A, N>& b) {
  LaneGradSums<A, N> r;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    r.dy[j] = a.dy[j] + b.dy[j];
    r.dy_xc[j] = a.dy_xc[j] + b.dy_xc[j];
  }
  return r;
}

template <typename A, int N>
__device__ __forceinline__ GradSums<A> fold(const LaneGradSums<A, N>& s) {
  GradSums<A> r{s.dy[0], s.dy_xc[0]};
#pragma unroll
  for (int j = 1; j < N; ++j) r = merge(r, GradSums<A>{s.dy[j], s.dy_xc[j]});
  return r;
}

// ------------------------------------------------------------------ reductions
// Fixed-order trees: the same inputs give the same bits on every run.
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

// ------------------------------------------------------------------ partitions
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

template <typename F>
__device__ __forceinline__ void for_each_row(const ColumnGrid& g, int64_t column, const F& f) {
  const int64_t o0 = static_cast<int64_t>(blockIdx.y) * g.rows_per_split;
  const int64_t o1 = min64(g.outer, o0 + g.rows_per_split);
  for (int64_t o = o0 + threadIdx.y; o < o1; o += blockDim.y) f(o * g.columns + column);
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

// ------------------------------------------------------------------ launch planning (host)
// Fills the grids above and guarantees what the kernels rely on: blocks of
// kThreads threads with power-of-two extents, gridDim.y < 65536, and every
// element in exactly one thread's loop.

// Bytes of one tensor that a block reads: enough to amortize the block and its
// partial, few enough to fill the GPU at moderate sizes. A function of the
// shape only, so the partition (and the rounding) does not depend on the GPU.
constexpr int64_t kBytesPerBlock = 64 * 1024;
// Planes when a channel's row segment covers a 128-byte line; shorter segments
// are read as columns, which keeps each warp on contiguous memory.
constexpr int64_t kPlaneMinBytes = 128;
constexpr int64_t kMaxGridY = 65535;
constexpr int64_t kMaxGridX = std::numeric_limits<int32_t>::max();

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Smallest power of two >= n, at most cap.
inline int pow2_at_least(int64_t n, int cap) {
  int p = 1;
  while (p < n && p < cap) p *= 2;
  return p;
}

struct Extent {
  int64_t outer;
  int64_t channels;
  int64_t inner;
};

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

template <typename G>
struct PersistentLaunch {
  G g;
  dim3 grid;
  dim3 block;
};

// Planes: when the channel's outer * inner elements fit in one block.
template <typename T>
std::optional<PersistentLaunch<PersistentPlane>> plan_persistent_plane(const Extent& e, int width) {
  if (e.outer * e.inner > kThreads * kPersistentItems<T>) return std::nullopt;
  TORCH_CHECK(e.channels <= kMaxGridX, "batch_norm (CUDA): too many channels (", e.channels, ")");
  const PersistentPlane h{e.channels, static_cast<unsigned>(e.inner / width),
                          static_cast<unsigned>(e.outer * e.inner / width)};
  return PersistentLaunch<PersistentPlane>{h, dim3(static_cast<unsigned>(e.channels)), dim3(kThreads)};
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
  return PersistentLaunch<PersistentColumns>{h, dim3(static_cast<unsigned>(tiles)), dim3(bx, by)};
}

// ------------------------------------------------------------------ first stage
// Partials are stored so that each channel's are contiguous: planes at
// k * splits + s, columns at (k * inner + i) * row_splits + r.

template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    plane_moments_kernel(const T* __restrict__ x, PlaneGrid g, Moments<at::opmath_type<T>>* partials) {
  using A = at::opmath_type<T>;
  __shared__ Moments<A> shared[kThreads / kWarp];
  LaneMoments<A, N> lanes{};
  for_each_in_split(g, [&](int64_t v) {
    A xv[N];
    load<N>(x + v * N, xv);
    add(lanes, xv);
  });
  const Moments<A> m = block_reduce(fold(lanes), shared);
  if (threadIdx.x == 0 && threadIdx.y == 0) {
    partials[static_cast<int64_t>(blockIdx.x) * gridDim.y + blockIdx.y] = m;
  }
}

template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    column_moments_kernel(const T* __restrict__ x, ColumnGrid g, Moments<at::opmath_type<T>>* partials) {
  using A = at::opmath_type<T>;
  __shared__ LaneMoments<A, N> shared[kThreads / 2];
  const int64_t column = owned_column();
  LaneMoments<A, N> lanes{};
  if (column < g.columns) {
    for_each_row(g, column, [&](int64_t v) {
      A xv[N];
      load<N>(x + v * N, xv);
      add(lanes, xv);
    });
  }
  column_reduce(lanes, shared);
  if (threadIdx.y == 0 && column < g.columns) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      partials[(column * N + j) * gridDim.y + blockIdx.y] = {lanes.mean[j], lanes.m2[j], lanes.count};
    }
  }
}

template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    plane_grad_sums_kernel(const T* __restrict__ x, const T* __restrict__ dy,
                           const at::opmath_type<T>* __restrict__ mean, PlaneGrid g,
                           GradSums<at::opmath_type<T>>* partials) {
  using A = at::opmath_type<T>;
  __shared__ GradSums<A> shared[kThreads / kWarp];
  A m[N];
#pragma unroll
  for (int j = 0; j < N; ++j) m[j] = mean[blockIdx.x];
  LaneGradSums<A, N> lanes{};
  for_each_in_split(g, [&](int64_t v) {
    A xv[N], dv[N];
    load<N>(x + v * N, xv);
    load<N>(dy + v * N, dv);
    add(lanes, xv, dv, m);
  });
  const GradSums<A> s = block_reduce(fold(lanes), shared);
  if (threadIdx.x == 0 && threadIdx.y == 0) {
    partials[static_cast<int64_t>(blockIdx.x) * gridDim.y + blockIdx.y] = s;
  }
}

template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    column_grad_sums_kernel(const T* __restrict__ x, const T* __restrict__ dy,
                            const at::opmath_type<T>* __restrict__ mean, ColumnGrid g,
                            GradSums<at::opmath_type<T>>* partials) {
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
      add(lanes, xv, dv, m);
    });
  }
  column_reduce(lanes, shared);
  if (threadIdx.y == 0 && column < g.columns) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      partials[(column * N + j) * gridDim.y + blockIdx.y] = {lanes.dy[j], lanes.dy_xc[j]};
    }
  }
}

// ------------------------------------------------------------------ second stage
// One warp per channel: lane l merges partials l, l + 32, ... in float64, then
// the lanes are merged in a fixed tree. Lane 0 derives the coefficients in
// float64, as the CPU operators do, and rounds each once.
constexpr int kChannelsPerBlock = kThreads / kWarp;

__device__ __forceinline__ int64_t warp_channel() {
  return (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
}

template <typename A>
struct ForwardCoefficientArgs {
  // Batch statistics: `per_channel` partials per channel. Null when frozen.
  const Moments<A>* partials;
  int64_t per_channel;
  // Frozen statistics (unused with partials).
  const double* mean;
  const double* variance;
  const double* gamma;  // null: 1
  const double* beta;   // null: 0
  double epsilon;
  int64_t channels;
  A* mean_out;
  A* variance_out;  // batch statistics only
  A* scale;         // gamma / sqrt(variance + epsilon)
  A* shift;         // beta
};

// Channel k's statistics and coefficients from its mean and variance.
template <typename A>
__device__ __forceinline__ void store_forward_coefficients(const ForwardCoefficientArgs<A>& a, int64_t k,
                                                           double mean, double variance) {
  const double g = a.gamma != nullptr ? a.gamma[k] : 1.0;
  a.mean_out[k] = static_cast<A>(mean);
  if (a.variance_out != nullptr) a.variance_out[k] = static_cast<A>(variance);
  a.scale[k] = static_cast<A>(g / sqrt(variance + a.epsilon));
  a.shift[k] = static_cast<A>(a.beta != nullptr ? a.beta[k] : 0.0);
}

template <typename A>
__global__ void __launch_bounds__(kThreads) forward_coefficients_kernel(ForwardCoefficientArgs<A> a) {
  const int64_t k = warp_channel();
  if (k >= a.channels) return;  // whole warps: kThreads is a multiple of kWarp
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  double mean, variance;
  if (a.partials != nullptr) {
    Moments<double> m{0, 0, 0};
    for (int64_t i = lane; i < a.per_channel; i += kWarp) {
      const Moments<A> p = a.partials[k * a.per_channel + i];
      m = merge(m, Moments<double>{p.mean, p.m2, p.count});
    }
    m = warp_reduce(m);
    mean = m.mean;
    variance = m.m2 / static_cast<double>(m.count);
  } else {
    mean = a.mean[k];
    variance = a.variance[k];
  }
  if (lane == 0) store_forward_coefficients(a, k, mean, variance);
}

template <typename A>
struct BackwardCoefficientArgs {
  // `per_channel` partials per channel; null when the sums are not needed or
  // the batch is empty (the sums are then 0).
  const GradSums<A>* partials;
  int64_t per_channel;
  const double* variance;
  const double* gamma;  // null: 1
  double epsilon;
  int64_t channels;
  int64_t reduced;  // M, elements per channel
  bool training;
  // diff_src = a * dy + b * (x - mean) + c; null when diff_src is not needed.
  A* a;
  A* b;
  A* c;
  double* diff_gamma;  // null when masked
  double* diff_beta;   // null when masked
};

// Channel k's coefficients and parameter gradients from its two sums.
template <typename A>
__device__ __forceinline__ void store_backward_coefficients(const BackwardCoefficientArgs<A>& p, int64_t k,
                                                            const GradSums<double>& s) {
  const double rstd = 1.0 / sqrt(p.variance[k] + p.epsilon);
  if (p.a != nullptr) {
    const double a = (p.gamma != nullptr ? p.gamma[k] : 1.0) * rstd;
    double b = 0, c = 0;
    if (p.training && p.reduced > 0) {
      const double m = static_cast<double>(p.reduced);
      b = -a * rstd * rstd * s.dy_xc / m;
      c = -a * s.dy / m;
    }
    p.a[k] = static_cast<A>(a);
    p.b[k] = static_cast<A>(b);
    p.c[k] = static_cast<A>(c);
  }
  if (p.diff_gamma != nullptr) p.diff_gamma[k] = rstd * s.dy_xc;
  if (p.diff_beta != nullptr) p.diff_beta[k] = s.dy;
}

template <typename A>
__global__ void __launch_bounds__(kThreads) backward_coefficients_kernel(BackwardCoefficientArgs<A> p) {
  const int64_t k = warp_channel();
  if (k >= p.channels) return;  // whole warps
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  GradSums<double> s{0, 0};
  if (p.partials != nullptr) {
    for (int64_t i = lane; i < p.per_channel; i += kWarp) {
      const GradSums<A> q = p.partials[k * p.per_channel + i];
      s = merge(s, GradSums<double>{q.dy, q.dy_xc});
    }
    s = warp_reduce(s);
  }
  if (lane == 0) store_backward_coefficients(p, k, s);
}

// ------------------------------------------------------------------ elementwise
// out = p * y + q * (x - mean) + r per channel. The forward passes no y
// (q = scale, r = shift); the backward's diff_src has y = dy.
template <typename A>
struct Affine {
  const A* mean;
  const A* p;  // unused without y
  const A* q;
  const A* r;
};

template <typename A, bool kHasY>
__device__ __forceinline__ A affine(A x, A y, A mean, A p, A q, A r) {
  const A t = (x - mean) * q + r;
  if constexpr (kHasY) return p * y + t;
  return t;
}

template <typename T, int N, bool kHasY>
__global__ void __launch_bounds__(kThreads)
    plane_affine_kernel(const T* __restrict__ x, const T* __restrict__ y, T* __restrict__ out,
                        PlaneGrid g, Affine<at::opmath_type<T>> c) {
  using A = at::opmath_type<T>;
  const int64_t k = blockIdx.x;
  const A mean = c.mean[k], q = c.q[k], r = c.r[k];
  const A p = kHasY ? c.p[k] : A(0);
  for_each_in_split(g, [&](int64_t v) {
    A xv[N], yv[N] = {}, res[N];
    load<N>(x + v * N, xv);
    if constexpr (kHasY) load<N>(y + v * N, yv);
#pragma unroll
    for (int j = 0; j < N; ++j) res[j] = affine<A, kHasY>(xv[j], yv[j], mean, p, q, r);
    store<N>(out + v * N, res);
  });
}

template <typename T, int N, bool kHasY>
__global__ void __launch_bounds__(kThreads)
    column_affine_kernel(const T* __restrict__ x, const T* __restrict__ y, T* __restrict__ out,
                         ColumnGrid g, Affine<at::opmath_type<T>> c) {
  using A = at::opmath_type<T>;
  const int64_t column = owned_column();
  if (column >= g.columns) return;
  A mean[N], p[N], q[N], r[N];
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int64_t k = (column * N + j) / g.inner;
    mean[j] = c.mean[k];
    p[j] = kHasY ? c.p[k] : A(0);
    q[j] = c.q[k];
    r[j] = c.r[k];
  }
  for_each_row(g, column, [&](int64_t v) {
    A xv[N], yv[N] = {}, res[N];
    load<N>(x + v * N, xv);
    if constexpr (kHasY) load<N>(y + v * N, yv);
#pragma unroll
    for (int j = 0; j < N; ++j) res[j] = affine<A, kHasY>(xv[j], yv[j], mean[j], p[j], q[j], r[j]);
    store<N>(out + v * N, res);
  });
}

// ------------------------------------------------------------------ persistent
// One kernel per operator for a block's worth of data (plan_persistent_*):
// load once into registers, reduce in the block in a fixed order, derive the
// coefficients with the second stage's code (its argument structs, partials
// unused), and write the output from the registers. Those coefficients go to
// the global per-channel vectors, and the block reads them back after a
// __syncthreads(), which makes the writes visible to all of its threads.
// Each thread issues all of its loads before any arithmetic, so that they are
// in flight together.

template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    plane_persistent_forward_kernel(const T* __restrict__ x, T* __restrict__ out, PersistentPlane h,
                                    ForwardCoefficientArgs<at::opmath_type<T>> a) {
  using A = at::opmath_type<T>;
  constexpr int R = kPersistentItems<T> / N;
  __shared__ Moments<A> shared[kThreads / kWarp];
  const int64_t k = blockIdx.x;
  A xs[R][N];
  LaneMoments<A, N> lanes{};
  for_each_held<R>(h, [&](int r, int64_t v) { load<N>(x + v * N, xs[r]); });
  for_each_held<R>(h, [&](int r, int64_t) { add(lanes, xs[r]); });
  const Moments<A> m = block_reduce(fold(lanes), shared);
  if (threadIdx.x == 0) store_forward_coefficients(a, k, m.mean, m.m2 / static_cast<double>(m.count));
  __syncthreads();
  const A mean = a.mean_out[k], q = a.scale[k], shift = a.shift[k];
  for_each_held<R>(h, [&](int r, int64_t v) {
    A res[N];
#pragma unroll
    for (int j = 0; j < N; ++j) res[j] = affine<A, false>(xs[r][j], A(0), mean, A(0), q, shift);
    store<N>(out + v * N, res);
  });
}

// The per-channel values of the N channels that column group `column` owns.
template <typename A, int N>
__device__ __forceinline__ void load_columns(const A* __restrict__ values, int64_t column, A (&out)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) out[j] = values[column * N + j];
}

template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    column_persistent_forward_kernel(const T* __restrict__ x, T* __restrict__ out, PersistentColumns h,
                                     ForwardCoefficientArgs<at::opmath_type<T>> a) {
  using A = at::opmath_type<T>;
  constexpr int R = kPersistentItems<T> / N;
  __shared__ LaneMoments<A, N> shared[kThreads / 2];
  const int64_t column = owned_column();
  const bool owner = column < h.columns;
  A xs[R][N];
  LaneMoments<A, N> lanes{};
  if (owner) {
    for_each_held<R>(h, column, [&](int r, int64_t v) { load<N>(x + v * N, xs[r]); });
    for_each_held<R>(h, column, [&](int r, int64_t) { add(lanes, xs[r]); });
  }
  column_reduce(lanes, shared);
  if (owner && threadIdx.y == 0) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const double variance = lanes.m2[j] / static_cast<double>(lanes.count);
      store_forward_coefficients(a, column * N + j, lanes.mean[j], variance);
    }
  }
  __syncthreads();
  if (!owner) return;
  A mean[N], q[N], shift[N];
  load_columns(a.mean_out, column, mean);
  load_columns(a.scale, column, q);
  load_columns(a.shift, column, shift);
  for_each_held<R>(h, column, [&](int r, int64_t v) {
    A res[N];
#pragma unroll
    for (int j = 0; j < N; ++j) res[j] = affine<A, false>(xs[r][j], A(0), mean[j], A(0), q[j], shift[j]);
    store<N>(out + v * N, res);
  });
}

// `out` is null when only the parameters' gradients are wanted.
template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    plane_persistent_backward_kernel(const T* __restrict__ x, const T* __restrict__ dy,
                                     const at::opmath_type<T>* __restrict__ mean, T* __restrict__ out,
                                     PersistentPlane h, BackwardCoefficientArgs<at::opmath_type<T>> p) {
  using A = at::opmath_type<T>;
  constexpr int R = kPersistentItems<T> / N;
  __shared__ GradSums<A> shared[kThreads / kWarp];
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
  for_each_held<R>(h, [&](int r, int64_t) { add(lanes, xs[r], ds[r], m); });
  const GradSums<A> s = block_reduce(fold(lanes), shared);
  if (threadIdx.x == 0) store_backward_coefficients(p, k, GradSums<double>{s.dy, s.dy_xc});
  if (out == nullptr) return;
  __syncthreads();
  const A ca = p.a[k], cb = p.b[k], cc = p.c[k];
  for_each_held<R>(h, [&](int r, int64_t v) {
    A res[N];
#pragma unroll
    for (int j = 0; j < N; ++j) res[j] = affine<A, true>(xs[r][j], ds[r][j], m[j], ca, cb, cc);
    store<N>(out + v * N, res);
  });
}

template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    column_persistent_backward_kernel(const T* __restrict__ x, const T* __restrict__ dy,
                                      const at::opmath_type<T>* __restrict__ mean, T* __restrict__ out,
                                      PersistentColumns h, BackwardCoefficientArgs<at::opmath_type<T>> p) {
  using A = at::opmath_type<T>;
  constexpr int R = kPersistentItems<T> / N;
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
    for_each_held<R>(h, column, [&](int r, int64_t) { add(lanes, xs[r], ds[r], m); });
  }
  column_reduce(lanes, shared);
  if (owner && threadIdx.y == 0) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      store_backward_coefficients(p, column * N + j, GradSums<double>{lanes.dy[j], lanes.dy_xc[j]});
    }
  }
  if (out == nullptr) return;
  __syncthreads();
  if (!owner) return;
  A ca[N], cb[N], cc[N];
  load_columns(p.a, column, ca);
  load_columns(p.b, column, cb);
  load_columns(p.c, column, cc);
  for_each_held<R>(h, column, [&](int r, int64_t v) {
    A res[N];
#pragma unroll
    for (int j = 0; j < N; ++j) res[j] = affine<A, true>(xs[r][j], ds[r][j], m[j], ca[j], cb[j], cc[j]);
    store<N>(out + v * N, res);
  });
}

}  // namespace torch_bn_grad::cuda
