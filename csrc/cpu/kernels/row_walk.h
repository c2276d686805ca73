// What the row kernels' reductions (row_statistics.h, row_grad_sums.h)
// share, when channels are innermost (inner == 1, partition.h) or over the
// segment rows of short planes: vector lanes across channels, each channel's
// compensated sums (exact_sum.h) kept in L1, and the two walks of a block
// (chunk by chunk over runs of kRowRun rows, or row by row).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cpu/kernels/exact_sum.h"
#include "cpu/kernels/partition.h"
#include "cpu/kernels/vec_io.h"

// The names of RowWalk<T> that a reduction deriving from it uses, declared
// in its scope (a dependent base's names are not found unqualified).
#define TORCH_BN_GRAD_ROW_WALK_NAMES(T)    \
  using Walk = RowWalk<T>;                 \
  using typename Walk::acc_t;              \
  using typename Walk::ColumnSums;         \
  using typename Walk::IO;                 \
  using typename Walk::Vec;                \
  using Walk::K;                           \
  using Walk::kGroup;                      \
  using Walk::kRowAhead;                   \
  using Walk::chunk_of;                    \
  using Walk::lanes_of;                    \
  using Walk::load_group;                  \
  using Walk::padded;                      \
  using typename Walk::PartialChunk;       \
  using Walk::P;                           \
  using Walk::W;                           \
  using Walk::for_block_chunks;            \
  using Walk::for_each_chunk;              \
  using Walk::for_rows_of_runs;            \
  using Walk::segment_total;               \
  using Walk::whole_wide_rows

namespace torch_bn_grad::cpu {
namespace CPU_CAPABILITY {
namespace {  // internal linkage: see vec_io.h

template <typename T>
struct RowWalk {
  TBG_KERNEL_TYPES(T);

  // Compensated per-channel accumulators of a block, in L1.
  struct ColumnSums {
    alignas(64) acc_t sum[kColumnBlock];
    alignas(64) acc_t err[kColumnBlock];
    // Columns [0, n) and the lanes of the block's partial chunk past them
    // (padded(n)), which sum zeros.
    explicit ColumnSums(int64_t n) {
      std::fill(sum, sum + padded(n), acc_t(0));
      std::fill(err, err + padded(n), acc_t(0));
    }
    void add(int64_t j, const Vec& v) {
      Vec s = Vec::loadu(sum + j), r = Vec::loadu(err + j);
      add_exact(s, r, v);
      s.store(sum + j);
      r.store(err + j);
    }
    void add_nonnegative(int64_t j, const Vec& v) {
      Vec s = Vec::loadu(sum + j), r = Vec::loadu(err + j);
      add_exact_nonnegative(s, r, v);
      s.store(sum + j);
      r.store(err + j);
    }
    double value(int64_t j) const { return static_cast<double>(sum[j]) + static_cast<double>(err[j]); }
  };

  // A block's columns past its last full chunk (nc % K of them) are read as
  // one partial chunk, whose lanes past the block load as zero
  // (Io::load_partial), and summed as the full chunks are, a vector at a
  // time. One element at a time (a compensated add each, and for float16 a
  // conversion in software), they had made channels_last 32x24x56x56
  // float16 statistics and grad sums several times slower than native's;
  // with partial chunks (and row_affine.h's) its forward took 0.16x and
  // backward 0.15x the time, NCHW 32x2048x7x7 float16 (segment blocks of
  // 980 columns, 20 past the last full chunk) 0.83x and 0.84x (A/B
  // builds in alternating processes, 2 threads).
  // Per-column arrays are kColumnBlock (a multiple of K) long, so that the
  // chunk's lanes past the block land in columns no one reads.
  struct PartialChunk {
    static constexpr int value = 1;  // one chunk, as a group of one
    int64_t lanes;
  };
  static int64_t padded(int64_t nc) { return ceil_div(nc, K) * K; }
  // One chunk of a group: the partial chunk itself, or a full one; and its lanes.
  template <typename Group>
  static constexpr auto chunk_of(Group group) {
    if constexpr (std::is_same_v<Group, PartialChunk>) return group;
    else return std::integral_constant<int, 1>{};
  }
  template <typename Group>
  static constexpr int64_t lanes_of(Group group) {
    if constexpr (std::is_same_v<Group, PartialChunk>) return group.lanes;
    else return K;
  }
  // A group's Group::value chunks at p, or the partial chunk's lanes.
  template <typename Group>
  C10_ALWAYS_INLINE static void load_group(const T* p, Group group, Vec (&v)[Group::value * P]) {
    if constexpr (std::is_same_v<Group, PartialChunk>) IO::load_partial(p, group.lanes, v);
    else IO::template load_chunks<Group::value>(p, v);
  }

  // Chunks of one vector (float32, float64) are walked kGroup at a time, so
  // that each row's loads feed kGroup independent accumulator chains instead
  // of one: float32 statistics 1.1x-1.35x faster on 64-256 channels
  // (channels_last, A/B in one process), the grad sums of 64 channels 1.5x.
  // The grad sums of rows wider than one group, which then read lines of 8
  // rows of two tensors at once, and half-precision chunks (two vectors
  // already) gained nothing, so they keep one chunk at a time.
  // The two or three chunks left after the full groups (rows of 32 or 48
  // float32 channels under AVX512) make one last group: one chunk at a
  // time, a run was read every other line, twice, one chain a walk. Time
  // taken (1 thread, A/B builds in alternating processes, 10
  // rounds, bitwise equal): channels_last 64x48x24x24 grad sums 0.73x,
  // forward 0.88x; 64x32x24x24 0.94x and 0.96x; on 2 threads within the
  // VM's noise.
  static constexpr int kGroup = P == 1 ? 4 : 1;
  template <typename F>
  static void for_chunk_groups(int64_t vec_end, bool groups, const F& f) {
    int64_t j = 0;
    if (groups) {
      for (; j + kGroup * K <= vec_end; j += kGroup * K) f(j, std::integral_constant<int, kGroup>{});
      if constexpr (kGroup == 4) {
        const int64_t left = (vec_end - j) / K;
        if (left == 3) f(j, std::integral_constant<int, 3>{});
        if (left == 2) f(j, std::integral_constant<int, 2>{});
        if (left >= 2) j = vec_end;
      }
    }
    for (; j < vec_end; j += K) f(j, std::integral_constant<int, 1>{});
  }
  // Every chunk of a block of nc columns in order, one at a time (the row walks).
  template <typename F>
  static void for_each_chunk(int64_t nc, const F& f) {
    const int64_t vec_end = nc - nc % K;
    for (int64_t j = 0; j < vec_end; j += K) f(j, std::integral_constant<int, 1>{});
    if (vec_end < nc) f(vec_end, PartialChunk{nc - vec_end});
  }
  // for_chunk_groups over a block of nc columns, then its partial chunk.
  template <typename F>
  static void for_block_chunks(int64_t nc, bool groups, const F& f) {
    const int64_t vec_end = nc - nc % K;
    for_chunk_groups(vec_end, groups, f);
    if (vec_end < nc) f(vec_end, PartialChunk{nc - vec_end});
  }

  // The reductions that read memory as it comes (pass 1 of the statistics,
  // the grad sums) request their lines ahead of the loads: on this VM the
  // hardware prefetchers left those loads waiting (a profile of the grad
  // sums of 32x1024x14x14 channels_last float16 had a third of its samples
  // on the instructions after two loads). Walking rows, each chunk asks for
  // the line kPrefetchAheadBytes (vec_io.h) on in each stream; walking chunks of kRowRun
  // rows, each chunk group asks for the same columns of the next run's rows.
  // Measured (2 threads, A/B builds in alternating processes):
  // backward 0.55x-0.67x the time on channels_last half precision of
  // 256-1024 channels and 4096x1024 float16, 0.83x-0.87x on float32 of
  // 128-1024 channels; forward 0.87x on 1024-channel rows of float32,
  // 0.86x on 32x256x56x56 float16. Rows cut into column blocks (2048
  // channels) and 64-channel rows were level, and so were requests in the
  // second statistics pass (block in cache), the elementwise pass and the
  // chunk walk of the grad sums (in one process, with and without).
  static constexpr int64_t kRowAhead = kPrefetchAheadBytes / static_cast<int64_t>(sizeof(T));

  // Sum of columns [j, j + n) of `s` in float64, in a fixed order: lanes of
  // eight (vectors of double) across the columns, then a fixed tree.
  static double segment_total(const ColumnSums& s, int64_t j, int64_t n) {
    if (n == 1) return s.value(j);
    using VecD = at::vec::Vectorized<double>;
    constexpr int64_t D = VecD::size();
    alignas(64) double lanes[D] = {};
    int64_t i = 0;
    // Full groups: a loop of constant count, which the compiler vectorizes
    // (a variable one stayed scalar: 8% of a fused 16x2048x7x7 forward).
    for (; i + D <= n; i += D)
      for (int64_t l = 0; l < D; ++l) lanes[l] += s.value(j + i + l);
    for (int64_t l = 0; l < n - i; ++l) lanes[l] += s.value(j + i + l);
    for (int64_t half = D / 2; half >= 1; half /= 2)
      for (int64_t l = 0; l < half; ++l) lanes[l] += lanes[l + half];
    return lanes[0];
  }

  // The walk of the passes that go by rows (sum_max_by_rows,
  // grad_sums_by_rows): for each run of kRowRun rows, row(o, first) on each
  // of its rows in order (first: the run's first, whose sums start from
  // zero, as in registers), then run_end(r0, r1).
  template <typename Row, typename RunEnd>
  static void for_rows_of_runs(const Block& blk, const Row& row, const RunEnd& run_end) {
    for (int64_t r0 = blk.o0; r0 < blk.o1; r0 += kRowRun) {
      const int64_t r1 = std::min(blk.o1, r0 + kRowRun);
      for (int64_t o = r0; o < r1; ++o) row(o, o == r0);
      run_end(r0, r1);
    }
  }

  // Whether the block's rows are whole rows of 512 bytes or more, the rows
  // that the row walks (grad_sums_by_rows, sum_max_by_rows) can take.
  static bool whole_wide_rows(const Extent& e, const Block& blk) {
    constexpr int64_t kMinRowBytes = 512;
    return blk.s0 == 0 && blk.s1 == e.channels && e.channels * static_cast<int64_t>(sizeof(T)) >= kMinRowBytes &&
           e.channels - e.channels % K > kGroup * K;
  }
};

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace torch_bn_grad::cpu
