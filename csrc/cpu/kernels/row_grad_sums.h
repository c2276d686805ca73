// The row kernels' gradient sums: a block's exact sum(dy) and
// sum(dy * (x - mean)) per channel when channels are innermost, or over the
// segment rows of short planes (row_walk.h), chunk by chunk or row by row.
#pragma once

#include <algorithm>
#include <cstdint>

#include "math/batch_norm_math.h"
#include "cpu/kernels/epilogue.h"
#include "cpu/kernels/row_walk.h"

namespace torch_bn_grad::cpu {
namespace CPU_CAPABILITY {
namespace {  // internal linkage: see vec_io.h

template <typename T>
struct RowGradSums : RowWalk<T> {
  TORCH_BN_GRAD_ROW_WALK_NAMES(T);

  // The block's exact sum(dy) and sum(dy * (x - mean)) of each of its
  // channels (`span` columns each, as in stats); with an epilogue, of dz and
  // of the value it centres. Segments (span > 1) take epilogues whose hooks
  // hold no per-channel data (E::kSegmentChunks).
  template <typename E = PlainEpilogue<T>>
  static void grad_sums(const T* x, const T* dy, const Extent& e, const Block& blk, const acc_t* mean,
                        Partials<math::GradSums<double>>& out, const E& ep = E{}, int64_t span = 1) {
    const int64_t c0 = blk.s0, nc = blk.s1 - blk.s0;
    // The block's columns' means: the channels' own, or each segment's
    // channel mean repeated over its columns; copied when the block ends in
    // a partial chunk, whose lanes past the block read zero means.
    alignas(64) acc_t column_mean[kColumnBlock];
    const acc_t* m = mean + c0;
    if (span > 1 || nc % K != 0) {
      if (span > 1)
        for (int64_t j = 0; j < nc; j += span) std::fill(column_mean + j, column_mean + j + span, mean[(c0 + j) / span]);
      else
        std::copy(mean + c0, mean + c0 + nc, column_mean);
      std::fill(column_mean + nc, column_mean + padded(nc), acc_t(0));
      m = column_mean;
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

  // Whether the grad sums walk the block row by row (grad_sums_by_rows):
  // whole wide rows of a tensor that streams from memory (32 MB or more,
  // the L3 of the Zen 4 VM it was tuned on), or of more than 8 MB with rows under 4 KB. By
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
    const int64_t c0 = blk.s0, nc = blk.s1 - blk.s0;
    const bool one_group = nc - nc % K <= kGroup * K;
    for (int64_t r0 = blk.o0; r0 < blk.o1; r0 += kRowRun) {
      const int64_t r1 = std::min(blk.o1, r0 + kRowRun);
      for_block_chunks(nc, one_group, [&](int64_t j, auto group) {
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
            load_group(dy + off, chunk_of(group), dv);
            load_group(x + off, chunk_of(group), xv);
            ep.columns(c0 + j + g * K, lanes_of(group)).apply(off, lanes_of(group), xv, dv);
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
    }
  }

  // The grad sums by rows: each row of a run read whole, in memory order (two
  // sequential streams), its chunks added into the run's sums held in L1.
  // Each column's terms meet in the same order as by chunks: bitwise equal.
  template <typename E>
  static void grad_sums_by_rows(const T* x, const T* dy, const Extent& e, const Block& blk, const acc_t* m,
                                ColumnSums& sum_dy, ColumnSums& sum_dy_xc, const E& ep) {
    const int64_t C = e.channels;
    const int64_t c0 = blk.s0, nc = blk.s1 - blk.s0;
    alignas(64) acc_t run_dy[kColumnBlock];
    alignas(64) acc_t run_dy_xc[kColumnBlock];
    const int64_t end = e.outer * C;
    auto row = [&](int64_t o, bool first) {
      for_each_chunk(nc, [&](int64_t j, auto chunk) {
        const int64_t off = o * C + c0 + j;
        prefetch_line_ahead(dy, off, kRowAhead, end);
        prefetch_line_ahead(x, off, kRowAhead, end);
        Vec xv[P], dv[P];
        load_group(dy + off, chunk, dv);
        load_group(x + off, chunk, xv);
        ep.columns(c0 + j, lanes_of(chunk)).apply(off, lanes_of(chunk), xv, dv);
        for (int q = 0; q < P; ++q) {
          acc_t* a = run_dy + j + q * W;
          acc_t* b = run_dy_xc + j + q * W;
          const Vec a0 = first ? Vec(acc_t(0)) : Vec::loadu(a), b0 = first ? Vec(acc_t(0)) : Vec::loadu(b);
          (a0 + dv[q]).store(a);
          at::vec::fmadd(dv[q], xv[q] - Vec::loadu(m + j + q * W), b0).store(b);
        }
      });
    };
    for_rows_of_runs(blk, row, [&](int64_t, int64_t) {
      for (int64_t j = 0; j < padded(nc); j += W) {
        sum_dy.add(j, Vec::loadu(run_dy + j));
        sum_dy_xc.add(j, Vec::loadu(run_dy_xc + j));
      }
    });
  }
};

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace torch_bn_grad::cpu
