// The row kernels' statistics: a block's per-channel (count, mean, m2)
// partials when channels are innermost, or over the segment rows of short
// planes (row_walk.h), in two passes: the exact sums of x and max |x|, then
// the exact sums of (x - centre)^2 while the block is in cache.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "math/batch_norm_math.h"
#include "cpu/kernels/channel_finish.h"
#include "cpu/kernels/row_walk.h"

namespace torch_bn_grad::cpu {
namespace CPU_CAPABILITY {
namespace {  // internal linkage: see vec_io.h

template <typename T>
struct RowStatistics : RowWalk<T> {
  TORCH_BN_GRAD_ROW_WALK_NAMES(T);

  // The block's (count, mean, m2) partial of each of its channels: pass 1
  // takes the exact sums of x and max |x| per column, pass 2 (block in
  // cache) the exact sums of (x - centre)^2. A channel is `span` adjacent
  // columns (Blocks::segments; 1 otherwise), its column sums added in
  // float64 (segment_total).
  static void stats(const T* x, const Extent& e, const Block& blk, Partials<math::Moments<double>>& out,
                    int64_t span = 1) {
    const int64_t nc = blk.s1 - blk.s0;
    const double rows = static_cast<double>(blk.o1 - blk.o0);
    ColumnSums sx(nc);
    alignas(64) acc_t max_abs[kColumnBlock];
    alignas(64) acc_t centre[kColumnBlock];
    alignas(64) double sum_x[kColumnBlock];  // per channel (segment) of the block
    std::fill(max_abs, max_abs + padded(nc), acc_t(0));
    sum_max_pass(x, e, blk, sx, max_abs);
    const double count = rows * static_cast<double>(span);
    if (span == 1) {
      column_centres(sx, max_abs, count, nc, sum_x, centre);
    } else {
      // i: the block's i-th channel, columns [j, j + span) (no division a column).
      for (int64_t i = 0, j = 0; j < nc; ++i, j += span) {
        sum_x[i] = segment_total(sx, j, span);
        const acc_t c = exact_centre<acc_t>(sum_x[i] / count, *std::max_element(max_abs + j, max_abs + j + span));
        std::fill(centre + j, centre + j + span, c);
      }
    }
    std::fill(centre + nc, centre + padded(nc), acc_t(0));  // the partial chunk's lanes past the block
    ColumnSums sd(nc);
    squares_pass(x, e, blk, centre, sd);
    if (span == 1) {
      column_moments(count, sum_x, centre, sd, nc, blk, out);
      return;
    }
    const int64_t k0 = blk.s0 / span;
    for (int64_t i = 0, j = 0; j < nc; ++i, j += span)
      out.set(k0 + i, blk.slot, math::centred_moments<double>(count, sum_x[i], centre[j], segment_total(sd, j, span)));
  }

  // The per-column work of stats (one column a channel) a vector of float64
  // lanes at a time, lane for lane the values of the one-channel forms: on layers of
  // many channels and few rows, one column at a time, it is most of the
  // statistics' time (exact_centre and centred_moments of a 2x4096 float32
  // forward). Columns [j, j + n) of acc_t (or float64) arrays as
  // lanes, the lanes past n zero.
  template <typename A>
  static VecD column_lanes(const A* a, int64_t j, int64_t n) {
    alignas(64) double lanes[kLanes] = {};
    if (n == kLanes) {
      for (int64_t l = 0; l < kLanes; ++l) lanes[l] = static_cast<double>(a[j + l]);  // a constant count vectorizes
    } else {
      for (int64_t l = 0; l < n; ++l) lanes[l] = static_cast<double>(a[j + l]);
    }
    return VecD::loadu(lanes);
  }
  static VecD column_sums(const ColumnSums& s, int64_t j, int64_t n) {
    return column_lanes(s.sum, j, n) + column_lanes(s.err, j, n);  // ColumnSums::value, lane for lane
  }

  // Pass 1's sums and each column's centre (exact_centre) from them.
  static void column_centres(const ColumnSums& sx, const acc_t* max_abs, double count, int64_t nc, double* sum_x,
                             acc_t* centre) {
    for (int64_t j = 0; j < nc; j += kLanes) {
      const int64_t n = std::min(kLanes, nc - j);
      const VecD sum = column_sums(sx, j, n);
      alignas(64) double c[kLanes];
      exact_centre_lanes<acc_t>(sum / VecD(count), column_lanes(max_abs, j, n)).store(c);
      sum.store(sum_x + j, static_cast<int>(n));
      for (int64_t l = 0; l < n; ++l) centre[j + l] = static_cast<acc_t>(c[l]);
    }
  }

  // The block's partials (count, mean, m2) of its columns, into their slot.
  static void column_moments(double count, const double* sum_x, const acc_t* centre, const ColumnSums& sd, int64_t nc,
                             const Block& blk, Partials<math::Moments<double>>& out) {
    double* counts = out.field(blk.slot, 0) + blk.s0;
    double* means = out.field(blk.slot, 1) + blk.s0;
    double* m2s = out.field(blk.slot, 2) + blk.s0;
    for (int64_t j = 0; j < nc; j += kLanes) {
      const int n = static_cast<int>(std::min(kLanes, nc - j));
      const math::Moments<VecD> m = math::centred_moments<VecD>(
          VecD(count), column_lanes(sum_x, j, n), column_lanes(centre, j, n), column_sums(sd, j, n));
      m.count.store(counts + j, n);
      m.mean.store(means + j, n);
      m.m2.store(m2s + j, n);
    }
  }

  // The walk of both statistics passes: for each run of kRowRun rows, each
  // group of chunks (the partial chunk last: row_walk.h) gets
  // chunk(j, group, r0, r1), which sums the run's rows of it in registers.
  // `from_memory` (pass 1): each group first requests its columns of the
  // next run's rows.
  template <typename Chunk>
  static void for_runs(const T* x, const Extent& e, const Block& blk, bool from_memory, const Chunk& chunk) {
    const int64_t C = e.channels;
    const int64_t c0 = blk.s0, nc = blk.s1 - blk.s0;
    const int64_t end = e.outer * C;
    for (int64_t r0 = blk.o0; r0 < blk.o1; r0 += kRowRun) {
      const int64_t r1 = std::min(blk.o1, r0 + kRowRun);
      for_block_chunks(nc, true, [&](int64_t j, auto group) {
        if (from_memory)
          for (int64_t o = r0; o < r1; ++o)
            for (int g = 0; g < decltype(group)::value; ++g) prefetch_line_ahead(x, o * C + c0 + j + g * K, kRowRun * C, end);
        chunk(j, group, r0, r1);
      });
    }
  }

  // A statistics pass by chunks of columns (for_runs): each of a chunk's N
  // column vectors has a sum a[q] from zero and a value c[q] loaded from
  // `column`; add(a[q], c[q], v) takes each row's vector v, and then
  // finish(j + q * W, a[q], c[q]) the run's results.
  template <typename Add, typename Finish>
  static void column_pass(const T* x, const Extent& e, const Block& blk, bool from_memory, const acc_t* column,
                          const Add& add, const Finish& finish) {
    const T* base = x + blk.s0;
    const int64_t C = e.channels;
    for_runs(x, e, blk, from_memory, [&](int64_t j, auto group, int64_t r0, int64_t r1) {
      constexpr int N = decltype(group)::value * P;
      Vec a[N], c[N];
      for (int q = 0; q < N; ++q) {
        a[q] = Vec(acc_t(0));
        c[q] = Vec::loadu(column + j + q * W);
      }
      for (int64_t o = r0; o < r1; ++o) {
        Vec v[N];
        load_group(base + o * C + j, group, v);
        for (int q = 0; q < N; ++q) add(a[q], c[q], v[q]);
      }
      for (int q = 0; q < N; ++q) finish(j + q * W, a[q], c[q]);
    });
  }

  // Statistics pass 1 over the block: exact sums of x (plain runs of
  // kRowRun rows, each added exactly) and max |x|, per column.
  static void sum_max_pass(const T* x, const Extent& e, const Block& blk, ColumnSums& sx, acc_t* max_abs) {
    if (stats_walk_rows(e, blk)) {
      sum_max_by_rows(x, e, blk, sx, max_abs);
      return;
    }
    column_pass(
        x, e, blk, /*from_memory=*/true, max_abs,
        [](Vec& a, Vec& mx, const Vec& v) {
          a = a + v;
          mx = at::vec::clamp_min(v.abs(), mx);  // a plain max: see exact_centre
        },
        [&](int64_t j, const Vec& a, const Vec& mx) {
          sx.add(j, a);
          mx.store(max_abs + j);
        });
  }

  // Whether pass 1 walks the block row by row (sum_max_by_rows): half
  // precision (chunks of one line, walked one at a time: a run reads one
  // line of each of 8 rows, whose misses the loads wait on), whole rows of
  // 512 bytes or more (whole_wide_rows), and a tensor that comes from
  // memory rather than the L3. Measured (2 threads, A/B walks in
  // alternating processes, bitwise equal): channels_last forward of
  // 32x256x56x56 float16 / bfloat16 0.72x-0.78x the time, 32x512x28x28
  // float16 0.72x-0.80x, 12.8 MB tensors (32x256x28x28 float16,
  // 32x1024x14x14 and 16x512x28x28 bfloat16) 0.78x-0.94x; but 8 MB
  // (4096x1024 float16) 1.03x-1.15x and 1.6-3.2 MB 1.04x-1.11x, and float32
  // (whose chunk groups already read four lines of each row) level to 1.3x.
  static constexpr int64_t kStatsRowWalkBytes = int64_t{12} << 20;
  static bool stats_walk_rows(const Extent& e, const Block& blk) {
    return P > 1 && whole_wide_rows(e, blk) &&
           e.outer * e.channels * e.inner * static_cast<int64_t>(sizeof(T)) >= kStatsRowWalkBytes;
  }

  // Pass 1 by rows: each row of a run read whole, in memory order (one
  // sequential stream instead of a line of each of 8 rows), its chunks added
  // into the run's sums held in L1. Each column's terms meet in the same
  // order as by chunks: bitwise equal.
  static void sum_max_by_rows(const T* x, const Extent& e, const Block& blk, ColumnSums& sx, acc_t* max_abs) {
    const int64_t C = e.channels;
    const int64_t c0 = blk.s0, nc = blk.s1 - blk.s0;
    alignas(64) acc_t run[kColumnBlock];
    const int64_t end = e.outer * C;
    auto row = [&](int64_t o, bool first) {
      for_each_chunk(nc, [&](int64_t j, auto chunk) {
        Vec v[P];
        prefetch_line_ahead(x, o * C + c0 + j, kRowAhead, end);
        load_group(x + o * C + c0 + j, chunk, v);
        for (int q = 0; q < P; ++q) {
          acc_t* a = run + j + q * W;
          acc_t* mx = max_abs + j + q * W;
          ((first ? Vec(acc_t(0)) : Vec::loadu(a)) + v[q]).store(a);
          at::vec::clamp_min(v[q].abs(), Vec::loadu(mx)).store(mx);
        }
      });
    };
    for_rows_of_runs(blk, row, [&](int64_t, int64_t) {
      for (int64_t j = 0; j < padded(nc); j += W) sx.add(j, Vec::loadu(run + j));
    });
  }

  // Statistics pass 2 over the block: exact sums of (x - centre)^2 per column.
  static void squares_pass(const T* x, const Extent& e, const Block& blk, const acc_t* centre, ColumnSums& sd) {
    column_pass(
        x, e, blk, /*from_memory=*/false, centre,
        [](Vec& a, Vec& c, const Vec& v) {
          const Vec d = v - c;
          a = at::vec::fmadd(d, d, a);
        },
        [&](int64_t j, const Vec& a, const Vec&) { sd.add_nonnegative(j, a); });
  }
};

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace torch_bn_grad::cpu
