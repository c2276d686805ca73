// The row kernels' statistics: a block's per-channel (count, mean, m2)
// partials when channels are innermost, or over the segment rows of short
// planes (row_walk.h), from the exact sums of d = x - centre and of d^2
// about a centre near each channel's mean: in one pass over the block, the
// centre from its first rows, or in two (the exact sums of x and max |x|,
// then d's sums while the block is in cache).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "math/batch_norm_math.h"
#include "cpu/kernels/channel_finish.h"
#include "cpu/kernels/row_walk.h"

namespace torch_bn_grad::cpu {
namespace CPU_CAPABILITY {
namespace {  // internal linkage: see vec_io.h

template <typename T>
struct RowStatistics : RowWalk<T> {
  TORCH_BN_GRAD_ROW_WALK_NAMES(T);

  // The block's (count, mean, m2) partial of each of its channels. A channel
  // is `span` adjacent columns (Blocks::segments; 1 otherwise), its column
  // sums added in float64 (segment_total). Tall blocks take one pass unless
  // a channel's centre turns out too far from its mean; others, and those,
  // two.
  static void stats(const T* x, const Extent& e, const Block& blk, Partials<math::Moments<double>>& out,
                    int64_t span = 1) {
    if (one_pass(e, blk, span) && shifted_stats(x, e, blk, out, span, true)) return;
    shifted_stats(x, e, blk, out, span, false);
  }

  // Blocks of four heads or more (centre_rows) take one pass: the second
  // pass's read of the block, from L2 (1 MB of float32 a block: partition.h),
  // was a fifth of a 4096x1024 float32 forward. Against two passes (2
  // threads, Zen 4, in one process alternating, two processes): forward
  // 0.80x-0.93x the time on 4096x1024 (float32, float16, bfloat16, float64),
  // 512x2048, 256x4096 and channels_last 32x64x56x56 .. 32x2048x7x7 float32,
  // 32x2048x7x7 float16; level on 32x256x56x56 and 32x512x28x28 float32,
  // whose blocks of 256 and 128 columns are small. NCHW 7x7 planes at batch
  // 32 (segment rows, blocks of 32 rows, heads of 8) 0.84x-0.90x, where the
  // same path read both ways took 0.95x-0.98x; at batch 16 with heads of half
  // the block, no gain beyond that. Half precision of 12 MB or more, whose
  // first of two passes walks rows (stats_walk_rows), against that (same
  // set-up, two runs): forward 0.68x-0.86x the time on channels_last
  // 32x512x28x28 and 32x1024x14x14, 8192x1024 and 16384x512 (float16,
  // bfloat16), 0.76x-0.97x on 32x256x56x56, 0.97x-0.99x on 64x256x56x56
  // (memory-bound either way), where unaffected cases moved by up to 9%; a
  // one pass walking rows (two run sums in L1) was 0.87x-1.08x.
  static bool one_pass(const Extent&, const Block& blk, int64_t span) {
    return blk.o1 - blk.o0 >= 4 * centre_rows(span);
  }

  // The rows of a block's head, whose mean is one pass's centre: whole runs
  // holding kCentreValues values of each channel (32 rows of one column, 8
  // of a 7x7 plane's segment). A mean of 32 values lies about a sixth of a
  // deviation from the block's mean on normal data, so a centre is too far
  // (more than one deviation: close_centre) about once in 10^8 channels.
  static constexpr int64_t kCentreValues = 32;
  static int64_t centre_rows(int64_t span) { return ceil_div(ceil_div(kCentreValues, span), kRowRun) * kRowRun; }

  // The block's partials from the exact sums of d = x - centre and of d^2
  // (math::shifted_moments): the centre exact_centre of the mean of the
  // block's head (centre_rows) and one pass over the block, or of the
  // whole block's mean and a second pass (block in cache). One pass: false
  // where a channel's centre is not close (the slot part written).
  static bool shifted_stats(const T* x, const Extent& e, const Block& blk, Partials<math::Moments<double>>& out,
                            int64_t span, bool one_pass) {
    const int64_t nc = blk.s1 - blk.s0;
    alignas(64) acc_t centre[kColumnBlock];
    Block first = blk;
    if (one_pass) first.o1 = blk.o0 + centre_rows(span);
    block_centres(x, e, first, span, centre);
    ColumnSums sd(nc), sd2(nc);
    shifted_squares_pass(x, e, blk, centre, /*from_memory=*/one_pass, sd, sd2);
    const double count = static_cast<double>(blk.o1 - blk.o0) * static_cast<double>(span);
    if (span == 1) return column_moments(count, centre, sd, sd2, nc, blk, out, one_pass);
    const int64_t k0 = blk.s0 / span;
    for (int64_t i = 0, j = 0; j < nc; ++i, j += span) {
      const double sum_d = segment_total(sd, j, span), sum_d2 = segment_total(sd2, j, span);
      if (one_pass && !close_centre(count, sum_d, sum_d2)) return false;
      math::Moments<double> m = math::shifted_moments(count, static_cast<double>(centre[j]), sum_d, sum_d2);
      m.mean = infinite_mean(m.mean, static_cast<double>(centre[j]));
      out.set(k0 + i, blk.slot, m);
    }
    return true;
  }

  // A centre that is infinite is the mean itself (exact_centre: sums of x
  // with an infinity in them), which d = x - centre would turn into NaN:
  // the block's mean stays infinite, as it is from sum(x).
  static VecD infinite_mean(const VecD& mean, const VecD& centre) {
    return VecD::blendv(mean, centre, centre.abs() == VecD(kInfinity));
  }
  static double infinite_mean(double mean, double centre) { return std::isinf(centre) ? centre : mean; }

  // Whether moments from sums about a centre keep all but one bit of m2: m2
  // = sum_d2 - count * offset^2, offset the mean's distance from the centre,
  // loses a bit for each doubling of sum_d2 / m2, so the centre is close
  // where count * offset^2 <= sum_d2 / 2 (offset^2 at most the variance) and
  // the sums are finite. On lanes, each lane's bits set where so.
  static VecD close_centre(const VecD& count, const VecD& sum_d, const VecD& sum_d2) {
    return (sum_d * (sum_d / count) <= VecD(0.5) * sum_d2) & (sum_d2 < VecD(kInfinity));
  }
  static bool close_centre(double count, double sum_d, double sum_d2) {
    return close_centre(VecD(count), VecD(sum_d), VecD(sum_d2)).zero_mask() == 0;
  }
  static constexpr double kInfinity = std::numeric_limits<double>::infinity();

  // Each channel's exact_centre, for each of its columns (and zero in the
  // partial chunk's lanes past the block), from the exact sums of the rows
  // of `rows` and their max |x|. The centre is a multiple of the data type's
  // spacing (not acc_t's), so that d = x - centre has no more bits than x
  // and a half-precision run of d sums as exactly as a run of x: the mean
  // comes from sum(d) (acc_t's centre made the float16 and bfloat16 means
  // of 16x4x64x64 channels_last ten times less accurate than native's).
  static void block_centres(const T* x, const Extent& e, const Block& rows, int64_t span, acc_t* centre) {
    const int64_t nc = rows.s1 - rows.s0;
    const double count = static_cast<double>(rows.o1 - rows.o0) * static_cast<double>(span);
    ColumnSums sx(nc);
    alignas(64) acc_t max_abs[kColumnBlock];
    std::fill(max_abs, max_abs + padded(nc), acc_t(0));
    sum_max_pass(x, e, rows, sx, max_abs);
    if (span == 1) {
      column_centres(sx, max_abs, count, nc, centre);
    } else {
      for (int64_t j = 0; j < nc; j += span) {
        const double max_abs_j = *std::max_element(max_abs + j, max_abs + j + span);
        const auto c = static_cast<acc_t>(exact_centre<T>(segment_total(sx, j, span) / count, max_abs_j));
        std::fill(centre + j, centre + j + span, c);
      }
    }
    std::fill(centre + nc, centre + padded(nc), acc_t(0));
  }

  // The per-column work of stats (one column a channel) a vector of float64
  // lanes at a time, lane for lane the values of the one-channel forms: on layers of
  // many channels and few rows, one column at a time, it is most of the
  // statistics' time (exact_centre and the moments of a 2x4096 float32
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

  // Each column's centre (exact_centre) from its sum of `count` values.
  static void column_centres(const ColumnSums& sx, const acc_t* max_abs, double count, int64_t nc, acc_t* centre) {
    for (int64_t j = 0; j < nc; j += kLanes) {
      const int64_t n = std::min(kLanes, nc - j);
      alignas(64) double c[kLanes];
      exact_centre_lanes<T>(column_sums(sx, j, n) / VecD(count), column_lanes(max_abs, j, n)).store(c);
      for (int64_t l = 0; l < n; ++l) centre[j + l] = static_cast<acc_t>(c[l]);
    }
  }

  // The block's partials (count, mean, m2) of its columns, into their slot,
  // from the sums of d = x - centre and of d^2; `checked`: false (the slot
  // part written) where a column's centre is not close (close_centre).
  static bool column_moments(double count, const acc_t* centre, const ColumnSums& sd, const ColumnSums& sd2,
                             int64_t nc, const Block& blk, Partials<math::Moments<double>>& out, bool checked) {
    double* counts = out.field(blk.slot, 0) + blk.s0;
    double* means = out.field(blk.slot, 1) + blk.s0;
    double* m2s = out.field(blk.slot, 2) + blk.s0;
    for (int64_t j = 0; j < nc; j += kLanes) {
      const int n = static_cast<int>(std::min(kLanes, nc - j));
      const VecD sum_d = column_sums(sd, j, n), sum_d2 = column_sums(sd2, j, n);
      if (checked && close_centre(VecD(count), sum_d, sum_d2).zero_mask() != 0) return false;
      const VecD c = column_lanes(centre, j, n);
      const math::Moments<VecD> m = math::shifted_moments<VecD>(VecD(count), c, sum_d, sum_d2);
      m.count.store(counts + j, n);
      infinite_mean(m.mean, c).store(means + j, n);
      m.m2.store(m2s + j, n);
    }
    return true;
  }

  // The walk of both statistics passes: for each run of kRowRun rows, each
  // group of chunks (the partial chunk last: row_walk.h) gets
  // chunk(j, group, r0, r1), which sums the run's rows of it in registers.
  // `from_memory` (a block's first pass): each group first requests its
  // columns of the next run's rows.
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
  // column vectors has two sums a[q] and b[q] from zero and a value c[q]
  // loaded from `column`; add(a[q], b[q], c[q], v) takes each row's vector
  // v, and then finish(j + q * W, a[q], b[q], c[q]) the run's results (a
  // pass that needs one sum leaves b alone, and the compiler drops it).
  template <typename Add, typename Finish>
  static void column_pass(const T* x, const Extent& e, const Block& blk, bool from_memory, const acc_t* column,
                          const Add& add, const Finish& finish) {
    const T* base = x + blk.s0;
    const int64_t C = e.channels;
    for_runs(x, e, blk, from_memory, [&](int64_t j, auto group, int64_t r0, int64_t r1) {
      constexpr int N = decltype(group)::value * P;
      Vec a[N], b[N], c[N];
      for (int q = 0; q < N; ++q) {
        a[q] = Vec(acc_t(0));
        b[q] = Vec(acc_t(0));
        c[q] = Vec::loadu(column + j + q * W);
      }
      for (int64_t o = r0; o < r1; ++o) {
        Vec v[N];
        load_group(base + o * C + j, group, v);
        for (int q = 0; q < N; ++q) add(a[q], b[q], c[q], v[q]);
      }
      for (int q = 0; q < N; ++q) finish(j + q * W, a[q], b[q], c[q]);
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
        [](Vec& a, Vec&, Vec& mx, const Vec& v) {
          a = a + v;
          mx = at::vec::clamp_min(v.abs(), mx);  // a plain max: see exact_centre
        },
        [&](int64_t j, const Vec& a, const Vec&, const Vec& mx) {
          sx.add(j, a);
          mx.store(max_abs + j);
        });
  }

  // Whether pass 1 of two, and a head's sums, walk the block row by row
  // (sum_max_by_rows): half
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

  // The exact sums of d = x - centre and of d^2 per column (plain runs of
  // kRowRun rows, each added exactly): the one pass (from memory) or the
  // second.
  static void shifted_squares_pass(const T* x, const Extent& e, const Block& blk, const acc_t* centre,
                                   bool from_memory, ColumnSums& sd, ColumnSums& sd2) {
    column_pass(
        x, e, blk, from_memory, centre,
        [](Vec& a, Vec& b, const Vec& c, const Vec& v) {
          const Vec d = v - c;
          a = a + d;
          b = at::vec::fmadd(d, d, b);
        },
        [&](int64_t j, const Vec& a, const Vec& b, const Vec&) {
          sd.add(j, a);
          sd2.add_nonnegative(j, b);
        });
  }
};

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace torch_bn_grad::cpu
