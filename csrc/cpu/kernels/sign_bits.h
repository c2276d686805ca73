// The sign bits of the fused relu / leaky_relu forward: one bit an element,
// dst > 0, in the kernel's [outer, channels, inner] order, eight to a byte,
// least significant bit first (bit i is element i; sign_bits_bytes in
// extent.h). The backward reads act'(z) from them instead of from dst: 1/32
// of a float32 stream (1/16 of a half-precision one) instead of a whole one,
// in each of its two passes.
//
// The forward writes them in its elementwise pass, each thread its elements
// in order, from a byte boundary on (sign_bits_fit); elsewhere the backward
// reads dst.
#pragma once

#include <c10/macros/Macros.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu/kernels/partition.h"
#include "cpu/kernels/vec_io.h"  // and <immintrin.h>

namespace torch_bn_grad::cpu {
namespace CPU_CAPABILITY {
namespace {  // internal linkage: see vec_io.h

// Bit i of the result: lane i of v is > 0 (false for NaN).
template <typename A>
inline uint32_t positive_bits(const Vectorized<A>& v) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<A, float>) return _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GT_OQ);
  if constexpr (std::is_same_v<A, double>) return _mm512_cmp_pd_mask(v, _mm512_setzero_pd(), _CMP_GT_OQ);
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<A, float>)
    return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GT_OQ)));
  if constexpr (std::is_same_v<A, double>)
    return static_cast<uint32_t>(_mm256_movemask_pd(_mm256_cmp_pd(v, _mm256_setzero_pd(), _CMP_GT_OQ)));
#endif
  alignas(64) A lanes[Vectorized<A>::size()];
  v.store(lanes);
  uint32_t bits = 0;
  for (int i = 0; i < Vectorized<A>::size(); ++i) bits |= static_cast<uint32_t>(lanes[i] > A(0)) << i;
  return bits;
}

// Lane i: `set` where bit i of `bits` is 1, else `clear`.
template <typename A>
inline Vectorized<A> select_bits(uint32_t bits, const Vectorized<A>& set, const Vectorized<A>& clear) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<A, float>) return _mm512_mask_blend_ps(static_cast<__mmask16>(bits), clear, set);
  if constexpr (std::is_same_v<A, double>) return _mm512_mask_blend_pd(static_cast<__mmask8>(bits), clear, set);
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<A, float>) {
    const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), lane_bit),
                                          lane_bit);
    return _mm256_blendv_ps(clear, set, _mm256_castsi256_ps(on));
  }
  if constexpr (std::is_same_v<A, double>) {
    const __m256i lane_bit = _mm256_setr_epi64x(1, 2, 4, 8);
    const __m256i on = _mm256_cmpeq_epi64(_mm256_and_si256(_mm256_set1_epi64x(bits), lane_bit), lane_bit);
    return _mm256_blendv_pd(clear, set, _mm256_castsi256_pd(on));
  }
#endif
  alignas(64) A s[Vectorized<A>::size()], c[Vectorized<A>::size()];
  set.store(s);
  clear.store(c);
  for (int i = 0; i < Vectorized<A>::size(); ++i)
    if (!((bits >> i) & 1u)) s[i] = c[i];
  return Vectorized<A>::loadu(s);
}

// The n (<= 32) bits of elements [i, i + n) of a packed array of `bytes`
// bytes, fewer than 8 of them left from byte i / 8 on. Out of line: inlined
// into the chunk loops, its byte loop kept read_bits' word on the stack, and
// the fused channels_last 16x2048x7x7 backward took 1.2x-1.6x the time.
C10_NOINLINE uint32_t read_bits_near_end(const uint8_t* packed, int64_t bytes, int64_t i, int n) {
  uint64_t word = 0;
  for (int64_t b = i >> 3; b < bytes; ++b) word |= static_cast<uint64_t>(packed[b]) << (8 * (b - (i >> 3)));
  return static_cast<uint32_t>((word >> (i & 7)) & ((uint64_t(1) << n) - 1));
}

// The n (<= 32) bits of elements [i, i + n) of a packed array of `bytes`
// bytes; any i. (A copy of constant size: the compiler makes it a plain load.)
C10_ALWAYS_INLINE uint32_t read_bits(const uint8_t* packed, int64_t bytes, int64_t i, int n) {
  const int64_t first = i >> 3;
  if (C10_UNLIKELY(first + 8 > bytes)) return read_bits_near_end(packed, bytes, i, n);
  uint64_t word;
  std::memcpy(&word, packed + first, 8);
  return static_cast<uint32_t>((word >> (i & 7)) & ((uint64_t(1) << n) - 1));
}

// Writes the n (<= kMaxBits <= 32) bits of elements [i, i + n): the bits of
// [i & ~7, i), in the same byte, were written before by the same thread and
// are kept; the last byte's bits past i + n are cleared (they belong to no
// element, or to elements the same thread writes next). Only the bytes
// holding [i, i + n) are written, so a thread whose elements start on a byte
// shares none with another.
//
// The word goes from a register to memory in stores of constant size: one
// for a whole chunk on a byte, else 4-, 2- and 1-byte pieces. (A byte loop or
// a copy of variable size held it on the stack: inlined so, the fused
// channels_last 16x2048x7x7 forward took 1.3x the time. A masked byte store
// took 1.5x on 7x7 planes: the next chunk's read of its first byte could not
// be forwarded from it.)
template <int kMaxBits>
C10_ALWAYS_INLINE void write_bits(uint8_t* packed, int64_t i, uint32_t bits, int n) {
  static_assert(kMaxBits == 8 || kMaxBits == 16 || kMaxBits == 32);
  using Bits = std::conditional_t<kMaxBits == 8, uint8_t, std::conditional_t<kMaxBits == 16, uint16_t, uint32_t>>;
  uint8_t* p = packed + (i >> 3);
  const int shift = static_cast<int>(i & 7);
  if (shift == 0 && n == kMaxBits) {
    const Bits whole = static_cast<Bits>(bits);
    std::memcpy(p, &whole, sizeof(Bits));
    return;
  }
  const uint64_t kept = p[0] & ((1u << shift) - 1);
  uint64_t word = ((static_cast<uint64_t>(bits) & ((uint64_t(1) << n) - 1)) << shift) | kept;
  int bytes = (shift + n + 7) >> 3;  // 1 to 5
  if (bytes >= 4) {
    const uint32_t piece = static_cast<uint32_t>(word);
    std::memcpy(p, &piece, 4);
    p += 4, word >>= 32, bytes -= 4;
  }
  if (bytes >= 2) {
    const uint16_t piece = static_cast<uint16_t>(word);
    std::memcpy(p, &piece, 2);
    p += 2, word >>= 16, bytes -= 2;
  }
  if (bytes) *p = static_cast<uint8_t>(word);
}

// The bits of one chunk of type-T data, from its accumulation-type vectors.
template <typename T>
inline uint32_t chunk_positive_bits(const typename Io<T>::Vec (&v)[Io<T>::kParts]) {
  uint32_t bits = 0;
  for (int q = 0; q < Io<T>::kParts; ++q) bits |= positive_bits(v[q]) << (q * Io<T>::kWidth);
  return bits;
}

// Whether the elementwise pass writes the bits of type-T data in layout `e`:
// chunks of whole bytes (write_bits), each thread's elements starting on a
// byte. Lines (plane rows, or rows of channels) of a multiple of 8 elements
// start on a byte; so does a block row, at its line's start or (planes wider
// than a block, rows of more than kColumnBlock channels) a multiple of the
// block width into it. Other planes (7x7, 14x14) only where the pass walks
// them in memory order (short_planes; affine_all gives threads whole bytes),
// and only on large tensors: 16x2048x7x7 float32 backward 0.66x the time
// reading bits, forward 1.13x; at 8x1024x7x7, in cache, both were slower.
// Rows need a multiple of 8 channels: blocks of rows end mid-byte otherwise.
template <typename T>
bool sign_bits_fit(const Extent& e) {
  constexpr int64_t K = Io<T>::kChunk;
  if constexpr (K % 8 != 0 || K > 32) {
    return false;
  } else {
    const Blocks b(e);
    const int64_t line = b.planes ? e.inner : e.channels;
    if (line % 8 == 0) return b.n_span == 1 || b.span_step % 8 == 0;
    const int64_t bytes = e.outer * e.channels * e.inner * static_cast<int64_t>(sizeof(T));
    return b.planes && short_planes(b, e, sizeof(T)) && bytes >= kLargeTensorBytes;
  }
}

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace torch_bn_grad::cpu
