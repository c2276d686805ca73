// The row kernels' elementwise pass: out = dy_scale * y + x_scale * (x - mean)
// + bias over a block of rows when channels are innermost (inner == 1,
// partition.h), row by row in memory order or, on segments of longer rows,
// four rows per chunk; rows of a few channels as one flat run.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>

#include <c10/macros/Macros.h>

#include "math/batch_norm_math.h"
#include "cpu/kernels/epilogue.h"
#include "cpu/kernels/partition.h"
#include "cpu/kernels/vec_io.h"

namespace torch_bn_grad::cpu {
namespace CPU_CAPABILITY {
namespace {  // internal linkage: see vec_io.h

template <typename T>
struct RowAffine {
  TBG_KERNEL_TYPES(T);

  // One chunk's coefficients (AffineArrays at channels [j, j + lanes)), as
  // vectors; a partial chunk's lanes past them are zero.
  struct ChunkCoefficients {
    Vec mean[P], x_scale[P], bias[P], dy_scale[P];
  };
  C10_ALWAYS_INLINE static ChunkCoefficients coefficients_at(math::AffineArrays<acc_t> c, int64_t j, bool with_dy,
                                                             int64_t lanes = K) {
    ChunkCoefficients k;
    for (int q = 0; q < P; ++q) {
      const int64_t n = IO::part_lanes(lanes, q);  // W (a full load) but in a partial chunk
      k.mean[q] = Vec::loadu(c.mean + j + q * W, n);
      k.x_scale[q] = Vec::loadu(c.x_scale + j + q * W, n);
      k.bias[q] = Vec::loadu(c.bias + j + q * W, n);
      if (with_dy) k.dy_scale[q] = Vec::loadu(c.dy_scale + j + q * W, n);
    }
    return k;
  }

  // affine() of a chunk (epilogue.h's affine_chunk, k its coefficients):
  // a full chunk, or (lanes < K) the partial chunk that ends a row: its
  // columns past the last full chunk a vector at a time as well, not one
  // element at a time (row_walk.h, PartialChunk, says what that gained).

  // affine() over whole rows of G chunks (G may be 0) and a partial chunk of
  // under K channels, one row after the other, every chunk's coefficients
  // held in registers for the whole block instead of reloaded each row.
  template <int G, typename E>
  static void few_chunk_rows(const T* x, const T* y, T* out, const Extent& e, const Block& blk,
                          math::AffineArrays<acc_t> c, const E& ep, bool stream) {
    const int64_t C = e.channels, tail = C - G * K;
    ChunkCoefficients k[G + 1];
    for (int g = 0; g < G; ++g) k[g] = coefficients_at(c, g * K, y != nullptr);
    if (tail > 0) k[G] = coefficients_at(c, G * K, y != nullptr, tail);
    for (int64_t o = blk.o0; o < blk.o1; ++o) {
      for (int g = 0; g < G; ++g) affine_chunk(x, y, out, o * C + g * K, k[g], ep.columns(g * K), ep, stream);
      if (tail > 0) affine_chunk(x, y, out, o * C + G * K, k[G], ep.columns(G * K, tail), ep, false, tail);
    }
  }

  // affine() over whole rows of C channels, C not a multiple of K, whose
  // pattern repeats every G chunks (G = C / gcd(C, K): 16 half-precision
  // channels two rows a chunk, 24 four rows in three, 40 four in five):
  // the block is one flat run of whole chunks, each lane's coefficients
  // those of its channel, loaded once a block, instead of a masked partial
  // chunk in every row. Only for epilogues whose hooks address elements by
  // offset (E::kSegmentChunks).
  template <int G, typename E>
  static void tiled_rows(const T* x, const T* y, T* out, const Extent& e, const Block& blk,
                         math::AffineArrays<acc_t> c, const E& ep, bool stream) {
    const int64_t C = e.channels;
    alignas(64) acc_t tile[4][G * K];  // mean, dy_scale, x_scale, bias: lane l holds channel l % C
    for (int64_t l = 0; l < G * K; ++l) {
      const int64_t k = l % C;
      tile[0][l] = c.mean[k];
      tile[1][l] = y ? c.dy_scale[k] : acc_t(0);
      tile[2][l] = c.x_scale[k];
      tile[3][l] = c.bias[k];
    }
    const math::AffineArrays<acc_t> tiled{tile[0], tile[1], tile[2], tile[3]};
    ChunkCoefficients k[G];
    for (int g = 0; g < G; ++g) k[g] = coefficients_at(tiled, g * K, y != nullptr);
    const auto bound = ep.columns(0);
    const int64_t end = blk.o1 * C;
    int64_t off = blk.o0 * C;
    // Streaming stores need every chunk on a cache line.
    stream = stream && off * static_cast<int64_t>(sizeof(T)) % static_cast<int64_t>(kCacheLineBytes) == 0;
    for (; off + G * K <= end; off += G * K)
      for (int g = 0; g < G; ++g) affine_chunk(x, y, out, off + g * K, k[g], bound, ep, stream);
    for (int g = 0; off < end; ++g, off += K) {
      const int64_t lanes = std::min(K, end - off);
      affine_chunk(x, y, out, off, k[g], ep.columns(0, lanes), ep, stream, lanes);
    }
  }

  // Chunks in tiled_rows' period for rows of C channels (0: the row walk):
  // where C is no multiple of K and the period is at most five chunks (40
  // and 80 half-precision channels, 40 float32). Coefficients that do not
  // fit in registers are spilled, and reloading them still beats a masked
  // partial chunk a row: on AVX2 (16 registers), 24 half-precision channels
  // (18 coefficient vectors) eval took 0.3x-0.6x the time tiled; five chunks
  // (30 vectors, AVX512) 32x40x28x28 eval 0.6x-0.8x, and three with y (24)
  // the 24-channel backward level or faster (A/B builds in
  // alternating processes, 2 threads).
  // K is a power of two, so the period of a C that is no multiple of it is
  // odd: 1, 3 or 5 chunks, the three affine() instantiates.
  static int tile_chunks(int64_t C) {
    static_assert((K & (K - 1)) == 0, "a chunk of a power of two lanes");
    const int64_t g = C / std::gcd(C, K);
    return C % K != 0 && (g == 1 || g == 3 || g == 5) ? static_cast<int>(g) : 0;
  }

  // out = dy_scale * y + x_scale * (x - mean) + bias over the block; y may be
  // null (the forward's normalization, dy_scale unused). The epilogue turns
  // y into dz in the backward, or activates out in the forward.
  // Streamed outputs (partition.h) are fenced here, once a block.
  template <typename E = PlainEpilogue<T>>
  static void affine(const T* x, const T* y, T* out, const Extent& e, const Block& blk,
                     const math::AffineArrays<acc_t>& arrays, const E& ep = E{}) {
    const int operands = y ? 3 : 2;
    const int tiles = E::kSegmentChunks && blk.s0 == 0 && blk.s1 == e.channels ? tile_chunks(e.channels) : 0;
    const bool stream = tiles ? streams_pass(out, e, sizeof(T), operands) : streams_output(out, e, sizeof(T), operands);
    if (tiles == 1) tiled_rows<1>(x, y, out, e, blk, arrays, ep, stream);
    else if (tiles == 3) tiled_rows<3>(x, y, out, e, blk, arrays, ep, stream);
    else if (tiles == 5) tiled_rows<5>(x, y, out, e, blk, arrays, ep, stream);
    else affine_rows(x, y, out, e, blk, arrays, ep, stream);
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
    // Whole rows of up to four chunks (64 float32 channels) keep
    // their coefficients in registers for the whole block:
    // channels_last 32-64 channels and rows of 32-64 channels, float32 and
    // bfloat16, took 0.83x-1.0x the time forward and backward, eval
    // 0.74x-0.99x (A/B in one process, 2 threads).
    // Rows narrower than a chunk (channels_last 16 and 24 half-precision
    // channels: MobileNet's, EfficientNet's; tiled_rows takes them where
    // the epilogue allows, so silu's backward) are one partial chunk each,
    // whose coefficients the row-by-row walk reloaded (masked) every row;
    // in registers, channels_last 32x24x56x56 eval took 0.41x-0.83x
    // (bfloat16) and 0.44x-0.49x (float16) the time, 32x16x112x112
    // 0.53x-0.71x and 0.38x-0.46x (A/B builds in alternating
    // processes, two each, 2 threads). Half precision takes rows of up to
    // four chunks too (128 channels) where there is no second
    // input: channels_last 32x112x14x14 (three chunks and a partial one)
    // eval 0.70x-0.92x the time, forward 0.76x-0.98x; 32x128x28x28 eval
    // 0.83x-0.92x (bfloat16 and float16, the same A/B). The backward's
    // coefficients of four half-precision chunks (dy_scale too: eight
    // vectors a chunk) fill more registers than there are, and its float16
    // 32x128x28x28 took 1.15x-1.2x the time, so it keeps two.
    const int few_chunks = y != nullptr && P == 2 ? 2 : 4;
    if (c0 == 0 && c1 == C && C / K <= few_chunks) {
      switch (C / K) {
        case 0: return few_chunk_rows<0>(x, y, out, e, blk, c, ep, stream);
        case 1: return few_chunk_rows<1>(x, y, out, e, blk, c, ep, stream);
        case 2: return few_chunk_rows<2>(x, y, out, e, blk, c, ep, stream);
        case 3: return few_chunk_rows<3>(x, y, out, e, blk, c, ep, stream);
        case 4: return few_chunk_rows<4>(x, y, out, e, blk, c, ep, stream);
      }
    }
    // Whole rows are walked one after the other, in memory order (one read
    // and one write stream), each chunk's coefficients reloaded every row
    // from L1: four rows per chunk jumped between lines of four rows, which
    // cost the prefetchers more than the loads it saved (rows of 4 KB:
    // 4096x1024 float32 eval 1.07x the time four at a time, in both orders
    // of an A/B in one process). Segments (a column block of longer rows)
    // over 1 KB do better four rows per chunk: walked one after the other,
    // 32x2048x7x7 channels_last float32 forward took 1.2x and backward 1.13x
    // the time (separate processes alternating, 2 threads).
    constexpr int64_t kSequentialSegmentBytes = 1024;
    const bool sequential =
        c1 - c0 == C || (c1 - c0) * static_cast<int64_t>(sizeof(T)) <= kSequentialSegmentBytes;
    int64_t o = blk.o0;
    if (!sequential)
      for (; o + kAffineRows <= blk.o1; o += kAffineRows) row_group<kAffineRows>(x, y, out, C, o, c0, c1, c, ep, stream);
    rows_in_order(x, y, out, C, o, blk.o1, c0, c1, c, ep, stream);
  }

  // Rows [o0, o1) one after the other: one call a block, row_group's body
  // inlined into the row loop (a call a row cost rows of a few chunks, the
  // 128-256 channels of channels_last layers, its prologue and epilogue).
  template <typename E>
  static void rows_in_order(const T* x, const T* y, T* out, int64_t C, int64_t o0, int64_t o1, int64_t c0,
                            int64_t c1, math::AffineArrays<acc_t> c, const E& ep, bool stream) {
    for (int64_t o = o0; o < o1; ++o) row_group<1>(x, y, out, C, o, c0, c1, c, ep, stream);
  }

  // Each chunk's coefficients are loaded once for kAffineRows rows of a
  // segment: with three or four coefficient vectors per data vector, L1
  // loads, not memory, bounded the single-row loop there.
  static constexpr int64_t kAffineRows = 4;

  // affine() of channels [c0, c1) of rows [o, o + R), chunk by chunk. A
  // function of its own, every operand by value: as a lambda capturing them
  // by reference (not always inlined) it reloaded each of them through the
  // closure on every chunk.
  template <int64_t R, typename E>
  C10_ALWAYS_INLINE static void row_group(const T* x, const T* y, T* out, int64_t C, int64_t o, int64_t c0, int64_t c1,
                        math::AffineArrays<acc_t> c, const E& ep, bool stream) {
    int64_t j = c0;
    for (; j + K <= c1; j += K) {
      const auto bound = ep.columns(j);
      const ChunkCoefficients k = coefficients_at(c, j, y != nullptr);
      for (int64_t r = 0; r < R; ++r) affine_chunk(x, y, out, (o + r) * C + j, k, bound, ep, stream);
    }
    if (j == c1) return;
    const int64_t lanes = c1 - j;
    const auto bound = ep.columns(j, lanes);
    const ChunkCoefficients k = coefficients_at(c, j, y != nullptr, lanes);
    for (int64_t r = 0; r < R; ++r) affine_chunk(x, y, out, (o + r) * C + j, k, bound, ep, false, lanes);
  }
};

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace torch_bn_grad::cpu
