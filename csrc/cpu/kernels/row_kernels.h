// The row kernels: blocks of rows over up to kColumnBlock channels when
// channels are innermost (inner == 1, partition.h). A block is walked row by
// row (contiguous memory) with vector lanes running across channels, and each
// channel's compensated sums (exact_sum.h) kept in L1.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include <c10/macros/Macros.h>

#include "batch_norm_math.h"
#include "cpu/kernels/epilogue.h"
#include "cpu/kernels/exact_sum.h"
#include "cpu/kernels/partition.h"
#include "cpu/kernels/vec_io.h"

namespace torch_bn_grad::cpu {
namespace CPU_CAPABILITY {
namespace {  // internal linkage: see vec_io.h

template <typename T>
struct RowKernels {
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
    for (int64_t j = 0; j < nc; j += span) {
      sum_x[j / span] = segment_total(sx, j, span);
      const acc_t c = exact_centre<acc_t>(sum_x[j / span] / count, *std::max_element(max_abs + j, max_abs + j + span));
      std::fill(centre + j, centre + j + span, c);
    }
    ColumnSums sd(nc);
    squares_pass(x, e, blk, centre, sd);
    for (int64_t j = 0; j < nc; j += span)
      out.at((blk.s0 + j) / span, blk.slot) =
          math::centred_moments(count, sum_x[j / span], centre[j], segment_total(sd, j, span));
  }

  // Sum of columns [j, j + n) of `s` in float64, in a fixed order: lanes of
  // eight (vectors of double) across the columns, then a fixed tree.
  static double segment_total(const ColumnSums& s, int64_t j, int64_t n) {
    if (n == 1) return s.value(j);
    using VecD = at::vec::Vectorized<double>;
    constexpr int64_t D = VecD::size();
    alignas(64) double lanes[D] = {};
    for (int64_t i = 0; i < n; i += D) {
      const int64_t m = std::min(D, n - i);
      for (int64_t l = 0; l < m; ++l) lanes[l] += static_cast<double>(s.sum[j + i + l]) + static_cast<double>(s.err[j + i + l]);
    }
    for (int64_t half = D / 2; half >= 1; half /= 2)
      for (int64_t l = 0; l < half; ++l) lanes[l] += lanes[l + half];
    return lanes[0];
  }

  // Statistics pass 1 over the block: exact sums of x (plain runs of
  // kRowRun rows, each added exactly) and max |x|, per column.
  static void sum_max_pass(const T* x, const Extent& e, const Block& blk, ColumnSums& sx, acc_t* max_abs) {
    const int64_t C = e.channels;
    const int64_t c0 = blk.s0, nc = blk.s1 - blk.s0, vec_end = nc - nc % K;
    for (int64_t r0 = blk.o0; r0 < blk.o1; r0 += kRowRun) {
      const int64_t r1 = std::min(blk.o1, r0 + kRowRun);
      for_chunk_groups(vec_end, true, [&](int64_t j, auto group) {
        constexpr int N = decltype(group)::value * P;
        Vec a[N], mx[N];
        for (int q = 0; q < N; ++q) {
          a[q] = Vec(acc_t(0));
          mx[q] = Vec::loadu(max_abs + j + q * W);
        }
        for (int64_t o = r0; o < r1; ++o) {
          Vec v[N];
          IO::template load_chunks<decltype(group)::value>(x + o * C + c0 + j, v);
          for (int q = 0; q < N; ++q) {
            a[q] = a[q] + v[q];
            mx[q] = at::vec::clamp_min(v[q].abs(), mx[q]);  // a plain max: see exact_centre
          }
        }
        for (int q = 0; q < N; ++q) {
          sx.add(j + q * W, a[q]);
          mx[q].store(max_abs + j + q * W);
        }
      });
      for (int64_t o = r0; o < r1; ++o) {
        const T* row = x + o * C + c0;
        for (int64_t j = vec_end; j < nc; ++j) {
          const acc_t a = static_cast<acc_t>(row[j]);
          sx.add(j, a);
          max_abs[j] = std::max(max_abs[j], std::abs(a));
        }
      }
    }
  }

  // Statistics pass 2 over the block: exact sums of (x - centre)^2 per column.
  static void squares_pass(const T* x, const Extent& e, const Block& blk, const acc_t* centre, ColumnSums& sd) {
    const int64_t C = e.channels;
    const int64_t c0 = blk.s0, nc = blk.s1 - blk.s0, vec_end = nc - nc % K;
    for (int64_t r0 = blk.o0; r0 < blk.o1; r0 += kRowRun) {
      const int64_t r1 = std::min(blk.o1, r0 + kRowRun);
      for_chunk_groups(vec_end, true, [&](int64_t j, auto group) {
        constexpr int N = decltype(group)::value * P;
        Vec a[N], cv[N];
        for (int q = 0; q < N; ++q) {
          a[q] = Vec(acc_t(0));
          cv[q] = Vec::loadu(centre + j + q * W);
        }
        for (int64_t o = r0; o < r1; ++o) {
          Vec v[N];
          IO::template load_chunks<decltype(group)::value>(x + o * C + c0 + j, v);
          for (int q = 0; q < N; ++q) {
            const Vec d = v[q] - cv[q];
            a[q] = at::vec::fmadd(d, d, a[q]);
          }
        }
        for (int q = 0; q < N; ++q) sd.add_nonnegative(j + q * W, a[q]);
      });
      for (int64_t o = r0; o < r1; ++o) {
        const T* row = x + o * C + c0;
        for (int64_t j = vec_end; j < nc; ++j) {
          const acc_t d = static_cast<acc_t>(row[j]) - centre[j];
          add_exact_nonnegative(sd.sum[j], sd.err[j], d * d);
        }
      }
    }
  }

  // The block's exact sum(dy) and sum(dy * (x - mean)) of each of its
  // channels (`span` columns each, as in stats); with an epilogue, of dz and
  // of the value it centres. Segments (span > 1) take epilogues whose hooks
  // hold no per-channel data (E::kSegmentChunks).
  template <typename E = PlainEpilogue<T>>
  static void grad_sums(const T* x, const T* dy, const Extent& e, const Block& blk, const acc_t* mean,
                        Partials<math::GradSums<double>>& out, const E& ep = E{}, int64_t span = 1) {
    const int64_t C = e.channels;
    const int64_t c0 = blk.s0, nc = blk.s1 - blk.s0, vec_end = nc - nc % K;
    // The block's columns' means: the channels' own, or each segment's
    // channel mean repeated over its columns.
    alignas(64) acc_t segment_mean[kColumnBlock];
    const acc_t* m = mean + c0;
    if (span > 1) {
      for (int64_t j = 0; j < nc; j += span) std::fill(segment_mean + j, segment_mean + j + span, mean[(c0 + j) / span]);
      m = segment_mean;
    }
    ColumnSums sum_dy(nc), sum_dy_xc(nc);
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
      for (int64_t o = r0; o < r1; ++o) {
        const int64_t off = o * C + c0;
        for (int64_t j = vec_end; j < nc; ++j) {
          acc_t d = static_cast<acc_t>(dy[off + j]), xa = static_cast<acc_t>(x[off + j]);
          ep.scalar(off + j, c0 + j, xa, d);
          sum_dy.add(j, d);
          sum_dy_xc.add(j, d * (xa - m[j]));
        }
      }
    }
    for (int64_t j = 0; j < nc; j += span)
      out.at((c0 + j) / span, blk.slot) = {segment_total(sum_dy, j, span), segment_total(sum_dy_xc, j, span)};
  }

  // One chunk's coefficients (AffineArrays at channel j), as vectors.
  struct ChunkCoefficients {
    Vec mean[P], x_scale[P], bias[P], dy_scale[P];
  };
  C10_ALWAYS_INLINE static ChunkCoefficients coefficients_at(math::AffineArrays<acc_t> c, int64_t j,
                                                             bool with_dy) {
    ChunkCoefficients k;
    for (int q = 0; q < P; ++q) {
      k.mean[q] = Vec::loadu(c.mean + j + q * W);
      k.x_scale[q] = Vec::loadu(c.x_scale + j + q * W);
      k.bias[q] = Vec::loadu(c.bias + j + q * W);
      if (with_dy) k.dy_scale[q] = Vec::loadu(c.dy_scale + j + q * W);
    }
    return k;
  }

  // affine() of the full chunk at offset `off`, whose columns' hooks are `bound`.
  template <typename Bound, typename E>
  C10_ALWAYS_INLINE static void affine_chunk(const T* x, const T* y, T* out, int64_t off, const ChunkCoefficients& k,
                                             const Bound& bound, const E& ep, bool stream) {
    Vec xv[P], yv[P];
    IO::load(x + off, xv);
    if (y) {
      IO::load(y + off, yv);
      bound.apply(off, K, xv, yv);
      ep.store_dz(off, K, yv);
    }
    for (int q = 0; q < P; ++q) {
      xv[q] = at::vec::fmadd(xv[q] - k.mean[q], k.x_scale[q], k.bias[q]);
      if (y) xv[q] = at::vec::fmadd(k.dy_scale[q], yv[q], xv[q]);
      ep.post(xv[q]);
    }
    if (stream) IO::store_stream(out + off, xv);
    else IO::store(out + off, xv);
    ep.stored(out, off, K, xv);
  }

  // affine() of channels [k0, k1) of the row starting at offset `row`, one element at a time.
  template <typename E>
  static void affine_scalars(const T* x, const T* y, T* out, int64_t row, int64_t k0, int64_t k1,
                             math::AffineArrays<acc_t> c, const E& ep) {
    for (int64_t k = k0; k < k1; ++k) {
      out[row + k] = scalar(x, y, row + k, k, c, ep);
      ep.scalar_stored(row + k, out[row + k]);
    }
  }

  // affine() over whole rows of G chunks (and a tail of under K channels),
  // one row after the other, every chunk's coefficients held in registers
  // for the whole block instead of reloaded each row.
  template <int G, typename E>
  static void few_chunk_rows(const T* x, const T* y, T* out, const Extent& e, const Block& blk,
                          math::AffineArrays<acc_t> c, const E& ep, bool stream) {
    const int64_t C = e.channels;
    ChunkCoefficients k[G];
    for (int g = 0; g < G; ++g) k[g] = coefficients_at(c, g * K, y != nullptr);
    for (int64_t o = blk.o0; o < blk.o1; ++o) {
      for (int g = 0; g < G; ++g) affine_chunk(x, y, out, o * C + g * K, k[g], ep.columns(g * K), ep, stream);
      affine_scalars(x, y, out, o * C, G * K, C, c, ep);
    }
  }

  // out = dy_scale * y + x_scale * (x - mean) + bias over the block; y may be
  // null (the forward's normalization, dy_scale unused). The epilogue turns
  // y into dz in the backward, or activates out in the forward.
  // Streamed outputs (partition.h) are fenced here, once a block.
  template <typename E = PlainEpilogue<T>>
  static void affine(const T* x, const T* y, T* out, const Extent& e, const Block& blk,
                     const math::AffineArrays<acc_t>& arrays, const E& ep = E{}) {
    const bool stream = streams_output(out, e, sizeof(T), y ? 3 : 2);
    affine_rows(x, y, out, e, blk, arrays, ep, stream);
    if (stream) stream_fence();
  }

  // affine() without the fence, `stream` decided.
  template <typename E>
  static void affine_rows(const T* x, const T* y, T* out, const Extent& e, const Block& blk,
                          const math::AffineArrays<acc_t>& arrays, const E& ep, bool stream) {
    const int64_t C = e.channels;
    // Local copies, passed by value: the vector stores may alias anything,
    // the arrays' pointers included, unless their address never escapes.
    const math::AffineArrays<acc_t> c = arrays;
    const int64_t c0 = blk.s0, c1 = blk.s1;
    // Whole rows of up to kFewChunks chunks (64 float32 or bfloat16
    // channels) keep their coefficients in registers for the whole block:
    // channels_last 32-64 channels and rows of 32-64 channels, float32 and
    // bfloat16, took 0.83x-1.0x the time forward and backward, eval
    // 0.74x-0.99x (A/B in one process, 2 threads).
    constexpr int kFewChunks = P >= 4 ? 1 : 4 / P;
    if (c0 == 0 && c1 == C) {
      switch (C / K) {
        case 1: return few_chunk_rows<1>(x, y, out, e, blk, c, ep, stream);
        case 2: if constexpr (kFewChunks >= 2) return few_chunk_rows<2>(x, y, out, e, blk, c, ep, stream); break;
        case 3: if constexpr (kFewChunks >= 3) return few_chunk_rows<3>(x, y, out, e, blk, c, ep, stream); break;
        case 4: if constexpr (kFewChunks >= 4) return few_chunk_rows<4>(x, y, out, e, blk, c, ep, stream); break;
        default: break;
      }
    }
    // Narrow rows go one after the other: four rows per chunk jump between
    // lines of four rows, which costs the prefetchers more than the
    // coefficient loads it saves. Narrow means segments of up to 1 KB, or
    // whole rows of up to 2 KB, which make one sequential stream (eval
    // forward of 8192x512 float32 and of channels_last 1024-channel bfloat16
    // 0.7x the time, backward 0.85-0.9x); 2 KB segments of longer rows, and
    // 4 KB rows, did better four at a time.
    constexpr int64_t kSequentialSegmentBytes = 1024, kSequentialRowBytes = 2048;
    const int64_t segment_bytes = (c1 - c0) * static_cast<int64_t>(sizeof(T));
    const bool sequential = segment_bytes <= kSequentialSegmentBytes ||
                            (c1 - c0 == C && segment_bytes <= kSequentialRowBytes);
    int64_t o = blk.o0;
    if (!sequential)
      for (; o + kAffineRows <= blk.o1; o += kAffineRows) row_group<kAffineRows>(x, y, out, C, o, c0, c1, c, ep, stream);
    for (; o < blk.o1; ++o) row_group<1>(x, y, out, C, o, c0, c1, c, ep, stream);
  }

  // Each chunk's coefficients are loaded once for kAffineRows rows on wide
  // rows: with three or four coefficient vectors per data vector, L1 loads,
  // not memory, bounded the single-row loop there.
  static constexpr int64_t kAffineRows = 4;

  // affine() of channels [c0, c1) of rows [o, o + R), chunk by chunk. A
  // function of its own, every operand by value: as a lambda capturing them
  // by reference (not always inlined) it reloaded each of them through the
  // closure on every chunk.
  template <int64_t R, typename E>
  static void row_group(const T* x, const T* y, T* out, int64_t C, int64_t o, int64_t c0, int64_t c1,
                        math::AffineArrays<acc_t> c, const E& ep, bool stream) {
    int64_t j = c0;
    for (; j + K <= c1; j += K) {
      const auto bound = ep.columns(j);
      const ChunkCoefficients k = coefficients_at(c, j, y != nullptr);
      for (int64_t r = 0; r < R; ++r) affine_chunk(x, y, out, (o + r) * C + j, k, bound, ep, stream);
    }
    for (int64_t r = 0; r < R; ++r) affine_scalars(x, y, out, (o + r) * C, j, c1, c, ep);
  }

  // One element of affine(), of channel k, at offset i.
  template <typename E>
  static T scalar(const T* x, const T* y, int64_t i, int64_t k, math::AffineArrays<acc_t> c, const E& ep) {
    acc_t xa = static_cast<acc_t>(x[i]);
    acc_t d = y ? static_cast<acc_t>(y[i]) : acc_t(0);
    if (y) {
      ep.scalar(i, k, xa, d);
      ep.scalar_store_dz(i, d);
    }
    acc_t r = (xa - c.mean[k]) * c.x_scale[k] + c.bias[k];
    if (y) r += c.dy_scale[k] * d;
    return static_cast<T>(ep.scalar_post(r));
  }
};

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace torch_bn_grad::cpu
