// The sign bits of the fused relu / leaky_relu forward: one bit an element,
// dst > 0, in the kernel's [outer, channels, inner] order, eight to a byte,
// least significant bit first, each line (a plane row, or a row of channels)
// starting on a byte (SignBitsLines in extent.h; BitIndex maps an element to
// its bit). The backward reads act'(z) from them instead of from dst: 1/32 of
// a float32 stream (1/16 of a half-precision one) instead of a whole one, in
// each of its two passes.
//
// The forward writes them in its elementwise pass, where every block row
// starts on a byte (sign_bits_fit); elsewhere the backward reads dst.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu/kernels/partition.h"
#include "extent.h"
#include "cpu/kernels/vec_io.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

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
// bytes; any i. (Copies of constant size: the compiler makes them plain
// loads and stores, where a variable size would call memcpy.)
inline uint32_t read_bits(const uint8_t* packed, int64_t bytes, int64_t i, int n) {
  const int64_t first = i >> 3;
  uint64_t word = 0;
  if (first + 8 <= bytes) {
    std::memcpy(&word, packed + first, 8);
  } else {
    for (int64_t b = first; b < bytes; ++b) word |= static_cast<uint64_t>(packed[b]) << (8 * (b - first));
  }
  word >>= (i & 7);
  return static_cast<uint32_t>(word & ((uint64_t(1) << n) - 1));
}

// Writes the n (<= 32) bits of elements [i, i + n), i a multiple of 8: whole
// bytes, the last one's bits past n cleared (they belong to no element, or to
// elements the same thread writes after them).
template <int kMaxBits>
inline void write_bits(uint8_t* packed, int64_t i, uint32_t bits, int n) {
  static_assert(kMaxBits % 8 == 0 && kMaxBits <= 32);
  uint8_t* p = packed + (i >> 3);
  if (n == kMaxBits) {
    std::memcpy(p, &bits, kMaxBits / 8);
    return;
  }
  bits &= (1u << n) - 1;
  for (int b = 0; b < (n + 7) / 8; ++b) p[b] = static_cast<uint8_t>(bits >> (8 * b));
}

// The bit of element i (kernel order) in the padded layout of SignBitsLines.
// Lines of a multiple of 8 elements need no padding: the bit is i. Otherwise
// i / line comes from a float64 product, exact after one correction step
// (i < 2^53), where a 64-bit division would cost every chunk tens of cycles.
struct BitIndex {
  int64_t line = 1, padded = 1;
  double inverse = 1.0;
  bool identity = true;

  BitIndex() = default;
  explicit BitIndex(const Extent& e) {
    const SignBitsLines lines(e);
    line = std::max<int64_t>(lines.line, 1);
    padded = std::max<int64_t>(lines.padded, 1);
    inverse = 1.0 / static_cast<double>(line);
    identity = line == padded;
  }
  // Element i's line q and its place r in it.
  struct Place {
    int64_t q, r;
  };
  Place place(int64_t i) const {
    int64_t q = static_cast<int64_t>(static_cast<double>(i) * inverse);
    int64_t r = i - q * line;
    if (r < 0) {
      --q;
      r += line;
    } else if (r >= line) {
      ++q;
      r -= line;
    }
    return {q, r};
  }
  int64_t operator()(int64_t i) const {
    if (identity) return i;
    const Place p = place(i);
    return p.q * padded + p.r;
  }
};

inline bool read_bit(const uint8_t* packed, int64_t i) { return (packed[i >> 3] >> (i & 7)) & 1u; }

// The n (<= 32) bits of elements [i, i + n) in the padded layout of `bit`,
// the elements possibly running across lines (a segment reduction's chunks,
// partition.h): one read per line they touch.
inline uint32_t read_element_bits(const uint8_t* packed, int64_t bytes, const BitIndex& bit, int64_t i, int n) {
  if (bit.identity) return read_bits(packed, bytes, i, n);
  BitIndex::Place p = bit.place(i);
  uint32_t bits = 0;
  for (int got = 0; got < n; ++p.q, p.r = 0) {
    const int take = static_cast<int>(std::min<int64_t>(n - got, bit.line - p.r));
    bits |= read_bits(packed, bytes, p.q * bit.padded + p.r, take) << got;
    got += take;
  }
  return bits;
}

// Sets bit i to `on`. The first bit of a byte clears the others (a line's
// elements are written in order, so its padding ends up zero); later bits
// keep the ones before them (one thread's own).
inline void write_bit(uint8_t* packed, int64_t i, bool on) {
  const uint8_t bit = static_cast<uint8_t>(1u << (i & 7));
  uint8_t& byte = packed[i >> 3];
  if ((i & 7) == 0) byte = on ? bit : 0;
  else byte = on ? (byte | bit) : (byte & ~bit);
}

// The bits of one chunk of type-T data, from its accumulation-type vectors.
template <typename T>
inline uint32_t chunk_positive_bits(const typename Io<T>::Vec (&v)[Io<T>::kParts]) {
  uint32_t bits = 0;
  for (int q = 0; q < Io<T>::kParts; ++q) bits |= positive_bits(v[q]) << (q * Io<T>::kWidth);
  return bits;
}

// Whether the elementwise pass writes the bits of type-T data in layout `e`:
// chunks of whole bytes (write_bits), and every block row starting on a
// byte, so that no byte is shared by two threads. Lines start on a byte; a
// block row starts at its line's start, or (planes wider than a block, rows
// of more than kColumnBlock channels) a multiple of the block width into it.
// Rows need a multiple of 8 channels besides: the row kernels take a row's
// last channels one by one, and mapping each of those to a padded bit cost
// a 60-channel layer twice its backward. Padded planes (7x7, 14x14) only pay
// on large tensors: 16x2048x7x7 float32 backward 0.66x the time reading
// bits, forward 1.13x; at 8x1024x7x7, in cache, both were slower.
template <typename T>
bool sign_bits_fit(const Extent& e) {
  constexpr int64_t K = Io<T>::kChunk;
  if constexpr (K % 8 != 0 || K > 32) {
    return false;
  } else {
    const Blocks b(e);
    if (!b.planes && e.channels % 8 != 0) return false;
    const SignBitsLines lines(e);
    const int64_t bytes = e.outer * e.channels * e.inner * static_cast<int64_t>(sizeof(T));
    if (lines.padded != lines.line && bytes < kLargeTensorBytes) return false;
    return b.n_span == 1 || b.span_step % 8 == 0;
  }
}

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace torch_bn_grad::cpu
