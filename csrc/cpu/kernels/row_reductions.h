// The row kernels' reductions: a block's per-channel statistics and
// gradient sums when channels are innermost (inner == 1, partition.h), or
// over the segment rows of short planes. Vector lanes run across channels,
// and each channel's compensated sums (exact_sum.h) are kept in L1.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "batch_norm_math.h"
#include "cpu/kernels/channel_finish.h"
#include "cpu/kernels/epilogue.h"
#include "cpu/kernels/exact_sum.h"
#include "cpu/kernels/partition.h"
#include "cpu/kernels/vec_io.h"

namespace torch_bn_grad::cpu {
namespace CPU_CAPABILITY {
namespace {  // internal linkage: see vec_io.h

template <typename T>
struct RowReductions {
  using IO = Io<T>;
  using acc_t = typename IO::acc_t;
  using Vec = typename IO::Vec;
  static constexpr int64_t W = IO::kWidth, K = IO::kChunk;  // lanes of Vec, elements of a chunk
  static constexpr int P = IO::kParts;                       // Vecs of a chunk

  // Compensated per-channel accumulators of a block, in L1.
  struct ColumnSums {
    alignas(64) acc_t sum[kColumnBlock];
    alignas(64) acc_t err[kColumnBlock];
    explicit ColumnSums(int64_t n) {
      std::fill(sum, sum + n, acc_t(0));
      std::fill(err, err + n, acc_t(0));
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
    void add(int64_t j, acc_t v) { add_exact(sum[j], err[j], v); }
    double value(int64_t j) const { return static_cast<double>(sum[j]) + static_cast<double>(err[j]); }
  };

  // Chunks of one vector (float32, float64) are walked kGroup at a time, so
  // that each row's loads feed kGroup independent accumulator chains instead
  // of one: float32 statistics 1.1x-1.35x faster on 64-256 channels
  // (channels_last, A/B in one process), the grad sums of 64 channels 1.5x.
  // The grad sums of rows wider than one group, which then read lines of 8
  // rows of two tensors at once, and half-precision chunks (two vectors
  // already) gained nothing, so they keep one chunk at a time.
  static constexpr int kGroup = P == 1 ? 4 : 1;
  template <typename F>
  static void for_chunk_groups(int64_t vec_end, bool groups, const F& f) {
    int64_t j = 0;
    if (groups)
      for (; j + kGroup * K <= vec_end; j += kGroup * K) f(j, std::integral_constant<int, kGroup>{});
    for (; j < vec_end; j += K) f(j, std::integral_constant<int, 1>{});
  }

  // The reductions that read memory as it comes (pass 1 of the statistics,
  // the grad sums) request their lines ahead of the loads: on this VM the
  // hardware prefetchers left those loads waiting (a profile of the grad
  // sums of 32x1024x14x14 channels_last float16 had a third of its samples
  // on the instructions after two loads). Walking rows, each chunk asks for
  // the line kPrefetchAheadBytes (vec_io.h) on in each stream; walking chunks of kRowRun
  // rows, each chunk group asks for the same columns of the next run's rows.
  // Measured here (2 threads, old and new builds in alternating processes):
  // backward 0.55x-0.67x the time on channels_last half precision of
  // 256-1024 channels and 4096x1024 float16, 0.83x-0.87x on float32 of
  // 128-1024 channels; forward 0.87x on 1024-channel rows of float32,
  // 0.86x on 32x256x56x56 float16. Rows cut into column blocks (2048
  // channels) and 64-channel rows were level, and so were requests in the
  // second statistics pass (block in cache), the elementwise pass and the
  // chunk walk of the grad sums (in one process, with and without).
  static constexpr int64_t kRowAhead = kPrefetchAheadBytes / static_cast<int64_t>(sizeof(T));

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
    std::fill(max_abs, max_abs + nc, acc_t(0));
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
  // many channels and few rows it was most of the statistics' time (a
  // 2x4096 float32 forward: exact_centre and centred_moments one column at a
  // time, 5 ns a column). Columns [j, j + n) of acc_t (or float64) arrays as
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

  // The walk of both statistics passes: for each run of kRowRun rows, each
  // group of full chunks gets chunk(j, group, r0, r1), which sums the run's
  // rows of it in registers; then the columns past the last full chunk get
  // tail(value, j), row by row. `from_memory` (pass 1): each group first
  // requests its columns of the next run's rows.
  template <typename Chunk, typename Tail>
  static void for_runs(const T* x, const Extent& e, const Block& blk, bool from_memory, const Chunk& chunk,
                       const Tail& tail) {
    const int64_t C = e.channels;
    const int64_t c0 = blk.s0, nc = blk.s1 - blk.s0, vec_end = nc - nc % K;
    const int64_t end = e.outer * C;
    for (int64_t r0 = blk.o0; r0 < blk.o1; r0 += kRowRun) {
      const int64_t r1 = std::min(blk.o1, r0 + kRowRun);
      for_chunk_groups(vec_end, true, [&](int64_t j, auto group) {
        if (from_memory)
          for (int64_t o = r0; o < r1; ++o)
            for (int g = 0; g < decltype(group)::value; ++g) prefetch_line_ahead(x, o * C + c0 + j + g * K, kRowRun * C, end);
        chunk(j, group, r0, r1);
      });
      for (int64_t o = r0; o < r1; ++o)
        for (int64_t j = vec_end; j < nc; ++j) tail(static_cast<acc_t>(x[o * C + c0 + j]), j);
    }
  }

  // Statistics pass 1 over the block: exact sums of x (plain runs of
  // kRowRun rows, each added exactly) and max |x|, per column.
  static void sum_max_pass(const T* x, const Extent& e, const Block& blk, ColumnSums& sx, acc_t* max_abs) {
    if (stats_walk_rows(e, blk)) {
      sum_max_by_rows(x, e, blk, sx, max_abs);
      return;
    }
    const T* base = x + blk.s0;
    const int64_t C = e.channels;
    auto chunk = [&](int64_t j, auto group, int64_t r0, int64_t r1) {
      constexpr int N = decltype(group)::value * P;
      Vec a[N], mx[N];
      for (int q = 0; q < N; ++q) {
        a[q] = Vec(acc_t(0));
        mx[q] = Vec::loadu(max_abs + j + q * W);
      }
      for (int64_t o = r0; o < r1; ++o) {
        Vec v[N];
        IO::template load_chunks<decltype(group)::value>(base + o * C + j, v);
        for (int q = 0; q < N; ++q) {
          a[q] = a[q] + v[q];
          mx[q] = at::vec::clamp_min(v[q].abs(), mx[q]);  // a plain max: see exact_centre
        }
      }
      for (int q = 0; q < N; ++q) {
        sx.add(j + q * W, a[q]);
        mx[q].store(max_abs + j + q * W);
      }
    };
    for_runs(x, e, blk, /*from_memory=*/true, chunk, [&](acc_t a, int64_t j) {
      sx.add(j, a);
      max_abs[j] = std::max(max_abs[j], std::abs(a));
    });
  }

  // Whether pass 1 walks the block row by row (sum_max_by_rows): half
  // precision (chunks of one line, walked one at a time: a run reads one
  // line of each of 8 rows, whose misses the loads wait on), whole rows of
  // 512 bytes or more (whole_wide_rows), and a tensor that comes from
  // memory rather than the L3. Measured here (2 threads, old and new walks in
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
    const int64_t c0 = blk.s0, nc = blk.s1 - blk.s0, vec_end = nc - nc % K;
    alignas(64) acc_t run[kColumnBlock];
    const int64_t end = e.outer * C;
    auto row = [&](int64_t o, bool first) {
      for (int64_t j = 0; j < vec_end; j += K) {
        Vec v[P];
        prefetch_line_ahead(x, o * C + c0 + j, kRowAhead, end);
        IO::load(x + o * C + c0 + j, v);
        for (int q = 0; q < P; ++q) {
          acc_t* a = run + j + q * W;
          acc_t* mx = max_abs + j + q * W;
          ((first ? Vec(acc_t(0)) : Vec::loadu(a)) + v[q]).store(a);
          at::vec::clamp_min(v[q].abs(), Vec::loadu(mx)).store(mx);
        }
      }
    };
    for_rows_of_runs(blk, row, [&](int64_t r0, int64_t r1) {
      for (int64_t j = 0; j < vec_end; j += W) sx.add(j, Vec::loadu(run + j));
      for (int64_t o = r0; o < r1; ++o)
        for (int64_t j = vec_end; j < nc; ++j) {
          const acc_t a = static_cast<acc_t>(x[o * C + c0 + j]);
          sx.add(j, a);
          max_abs[j] = std::max(max_abs[j], std::abs(a));
        }
    });
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

  // Statistics pass 2 over the block: exact sums of (x - centre)^2 per column.
  static void squares_pass(const T* x, const Extent& e, const Block& blk, const acc_t* centre, ColumnSums& sd) {
    const T* base = x + blk.s0;
    const int64_t C = e.channels;
    auto chunk = [&](int64_t j, auto group, int64_t r0, int64_t r1) {
      constexpr int N = decltype(group)::value * P;
      Vec a[N], cv[N];
      for (int q = 0; q < N; ++q) {
        a[q] = Vec(acc_t(0));
        cv[q] = Vec::loadu(centre + j + q * W);
      }
      for (int64_t o = r0; o < r1; ++o) {
        Vec v[N];
        IO::template load_chunks<decltype(group)::value>(base + o * C + j, v);
        for (int q = 0; q < N; ++q) {
          const Vec d = v[q] - cv[q];
          a[q] = at::vec::fmadd(d, d, a[q]);
        }
      }
      for (int q = 0; q < N; ++q) sd.add_nonnegative(j + q * W, a[q]);
    };
    for_runs(x, e, blk, /*from_memory=*/false, chunk, [&](acc_t a, int64_t j) {
      const acc_t d = a - centre[j];
      add_exact_nonnegative(sd.sum[j], sd.err[j], d * d);
    });
  }

  // The block's exact sum(dy) and sum(dy * (x - mean)) of each of its
  // channels (`span` columns each, as in stats); with an epilogue, of dz and
  // of the value it centres. Segments (span > 1) take epilogues whose hooks
  // hold no per-channel data (E::kSegmentChunks).
  template <typename E = PlainEpilogue<T>>
  static void grad_sums(const T* x, const T* dy, const Extent& e, const Block& blk, const acc_t* mean,
                        Partials<math::GradSums<double>>& out, const E& ep = E{}, int64_t span = 1) {
    const int64_t c0 = blk.s0, nc = blk.s1 - blk.s0;
    // The block's columns' means: the channels' own, or each segment's
    // channel mean repeated over its columns.
    alignas(64) acc_t segment_mean[kColumnBlock];
    const acc_t* m = mean + c0;
    if (span > 1) {
      for (int64_t j = 0; j < nc; j += span) std::fill(segment_mean + j, segment_mean + j + span, mean[(c0 + j) / span]);
      m = segment_mean;
    }
    ColumnSums sum_dy(nc), sum_dy_xc(nc);
    if (grad_sums_walk_rows(e, blk)) grad_sums_by_rows(x, dy, e, blk, m, sum_dy, sum_dy_xc, ep);
    else grad_sums_by_chunks(x, dy, e, blk, m, sum_dy, sum_dy_xc, ep);
    if (span == 1) {  // a column a channel: each field's columns are adjacent in its slot
      double* dy_sums = out.field(blk.slot, 0) + c0;
      double* dy_xc_sums = out.field(blk.slot, 1) + c0;
      for (int64_t j = 0; j < nc; ++j) {
        dy_sums[j] = sum_dy.value(j);
        dy_xc_sums[j] = sum_dy_xc.value(j);
      }
      return;
    }
    const int64_t k0 = c0 / span;  // blocks hold whole segments
    for (int64_t i = 0, j = 0; j < nc; ++i, j += span)
      out.set(k0 + i, blk.slot, {segment_total(sum_dy, j, span), segment_total(sum_dy_xc, j, span)});
  }

  // Whether the block's rows are whole rows of 512 bytes or more, the rows
  // that the row walks (grad_sums_by_rows, sum_max_by_rows) can take.
  static bool whole_wide_rows(const Extent& e, const Block& blk) {
    constexpr int64_t kMinRowBytes = 512;
    return blk.s0 == 0 && blk.s1 == e.channels && e.channels * static_cast<int64_t>(sizeof(T)) >= kMinRowBytes &&
           e.channels - e.channels % K > kGroup * K;
  }

  // Whether the grad sums walk the block row by row (grad_sums_by_rows):
  // whole wide rows of a tensor that streams from memory (32 MB or more,
  // this machine's L3), or of more than 8 MB with rows under 4 KB. By
  // chunks, a run reads one 64-byte line of each of 8 rows of two tensors,
  // 16 streams that starved the loads of large tensors (half of the grad
  // sums' samples on the load of 4096x1024 float32, before the chunk walk's
  // prefetch), while by rows each chunk also loads and stores the run's sums
  // in L1, which costs more than it saves on data the caches hold. Measured
  // here (2 threads, in one process, 15 interleaved rounds, bitwise equal),
  // by chunks over by rows: 0.78x-0.91x the time on tensors of 8 MB or less
  // (64x1024 and 256x512 float32, channels_last 16x1024x7x7 and
  // 32x256x14x14 float32, 4096x1024 float16), 0.87x / 0.955x on the 4 KB
  // rows of 4096x1024 (16 MB) and channels_last 32x1024x14x14 (25.7 MB)
  // float32; but 1.07x-1.15x on 12.8 MB layers of 512 B to 2 KB rows
  // (channels_last 32x128x28x28 and 16x256x28x28 float32, 32x256x28x28 and
  // 32x1024x14x14 bfloat16), and 1.12x-1.15x on 51 MB ones (channels_last
  // 32x512x28x28 float32, 32x256x56x56 bfloat16; separate processes). When
  // the row walk came (A/B in one process): backward 0.89x-0.94x on
  // channels_last 128-1024 channels, fused BN+ReLU+add fwd+bwd 0.82x-0.93x
  // at 256-1024 channels. Rows cut into column blocks (2048 channels, 4 KB
  // pieces of 8 KB rows) lost (1.07x), and so did rows of 64 bfloat16 (1.05x).
  static bool grad_sums_walk_rows(const Extent& e, const Block& blk) {
    constexpr int64_t kStreamBytes = int64_t{32} << 20, kRowWalkBytes = int64_t{8} << 20, kChunkRowBytes = 4096;
    const int64_t row_bytes = e.channels * static_cast<int64_t>(sizeof(T)), bytes = e.outer * row_bytes;
    return whole_wide_rows(e, blk) && (bytes >= kStreamBytes || (bytes > kRowWalkBytes && row_bytes < kChunkRowBytes));
  }

  // The grad sums by chunks: for each run of kRowRun rows, chunk by chunk
  // (or a group of chunks, on rows of one group), the run's rows of the chunk
  // summed in registers.
  template <typename E>
  static void grad_sums_by_chunks(const T* x, const T* dy, const Extent& e, const Block& blk, const acc_t* m,
                                  ColumnSums& sum_dy, ColumnSums& sum_dy_xc, const E& ep) {
    const int64_t C = e.channels;
    const int64_t c0 = blk.s0, nc = blk.s1 - blk.s0, vec_end = nc - nc % K;
    const bool one_group = vec_end <= kGroup * K;
    for (int64_t r0 = blk.o0; r0 < blk.o1; r0 += kRowRun) {
      const int64_t r1 = std::min(blk.o1, r0 + kRowRun);
      for_chunk_groups(vec_end, one_group, [&](int64_t j, auto group) {
        constexpr int G = decltype(group)::value;
        Vec run_dy[G][P], run_dy_xc[G][P], mv[G][P];
        for (int g = 0; g < G; ++g)
          for (int q = 0; q < P; ++q) {
            run_dy[g][q] = run_dy_xc[g][q] = Vec(acc_t(0));
            mv[g][q] = Vec::loadu(m + j + g * K + q * W);
          }
        for (int64_t o = r0; o < r1; ++o) {
          for (int g = 0; g < G; ++g) {
            const int64_t off = o * C + c0 + j + g * K;
            Vec xv[P], dv[P];
            IO::load(dy + off, dv);
            IO::load(x + off, xv);
            ep.columns(c0 + j + g * K).apply(off, K, xv, dv);
            for (int q = 0; q < P; ++q) {
              run_dy[g][q] = run_dy[g][q] + dv[q];
              run_dy_xc[g][q] = at::vec::fmadd(dv[q], xv[q] - mv[g][q], run_dy_xc[g][q]);
            }
          }
        }
        for (int g = 0; g < G; ++g)
          for (int q = 0; q < P; ++q) {
            sum_dy.add(j + g * K + q * W, run_dy[g][q]);
            sum_dy_xc.add(j + g * K + q * W, run_dy_xc[g][q]);
          }
      });
      grad_sums_tail(x, dy, e, blk, m, r0, r1, sum_dy, sum_dy_xc, ep);
    }
  }

  // The grad sums by rows: each row of a run read whole, in memory order (two
  // sequential streams), its chunks added into the run's sums held in L1.
  // Each column's terms meet in the same order as by chunks: bitwise equal.
  template <typename E>
  static void grad_sums_by_rows(const T* x, const T* dy, const Extent& e, const Block& blk, const acc_t* m,
                                ColumnSums& sum_dy, ColumnSums& sum_dy_xc, const E& ep) {
    const int64_t C = e.channels;
    const int64_t c0 = blk.s0, nc = blk.s1 - blk.s0, vec_end = nc - nc % K;
    alignas(64) acc_t run_dy[kColumnBlock];
    alignas(64) acc_t run_dy_xc[kColumnBlock];
    const int64_t end = e.outer * C;
    auto row = [&](int64_t o, bool first) {
      for (int64_t j = 0; j < vec_end; j += K) {
        const int64_t off = o * C + c0 + j;
        prefetch_line_ahead(dy, off, kRowAhead, end);
        prefetch_line_ahead(x, off, kRowAhead, end);
        Vec xv[P], dv[P];
        IO::load(dy + off, dv);
        IO::load(x + off, xv);
        ep.columns(c0 + j).apply(off, K, xv, dv);
        for (int q = 0; q < P; ++q) {
          acc_t* a = run_dy + j + q * W;
          acc_t* b = run_dy_xc + j + q * W;
          const Vec a0 = first ? Vec(acc_t(0)) : Vec::loadu(a), b0 = first ? Vec(acc_t(0)) : Vec::loadu(b);
          (a0 + dv[q]).store(a);
          at::vec::fmadd(dv[q], xv[q] - Vec::loadu(m + j + q * W), b0).store(b);
        }
      }
    };
    for_rows_of_runs(blk, row, [&](int64_t r0, int64_t r1) {
      for (int64_t j = 0; j < vec_end; j += W) {
        sum_dy.add(j, Vec::loadu(run_dy + j));
        sum_dy_xc.add(j, Vec::loadu(run_dy_xc + j));
      }
      grad_sums_tail(x, dy, e, blk, m, r0, r1, sum_dy, sum_dy_xc, ep);
    });
  }

  // The columns past the last full chunk, of rows [r0, r1), one element at a time.
  template <typename E>
  static void grad_sums_tail(const T* x, const T* dy, const Extent& e, const Block& blk, const acc_t* m, int64_t r0,
                             int64_t r1, ColumnSums& sum_dy, ColumnSums& sum_dy_xc, const E& ep) {
    const int64_t c0 = blk.s0, nc = blk.s1 - blk.s0;
    for (int64_t o = r0; o < r1; ++o) {
      const int64_t off = o * e.channels + c0;
      for (int64_t j = nc - nc % K; j < nc; ++j) {
        acc_t d = static_cast<acc_t>(dy[off + j]), xa = static_cast<acc_t>(x[off + j]);
        ep.scalar(off + j, c0 + j, xa, d);
        sum_dy.add(j, d);
        sum_dy_xc.add(j, d * (xa - m[j]));
      }
    }
  }
};

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace torch_bn_grad::cpu
