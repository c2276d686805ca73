// Vector loads and stores of the CPU kernels, and the loop helpers their inner
// loops share.
//
// The headers of this folder are included by the per-ISA kernel source only,
// and everything in them lives in namespace CPU_CAPABILITY (as at::vec does)
// and has internal linkage, as if written in that source.
#pragma once

#include <ATen/OpMathType.h>
#include <c10/macros/Macros.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace torch_bn_grad::cpu {
namespace CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

// f(std::integral_constant<int, 0>{}), ..., f(std::integral_constant<int, N - 1>{}).
template <int N, typename F>
inline void static_for(const F& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) {
    (f(std::integral_constant<int, I>{}), ...);
  }(std::make_integer_sequence<int, N>{});
}

// Requests the cache lines of p[0, n) (for writing when kWrite).
template <bool kWrite, typename T>
inline void prefetch_lines(const T* p, int64_t n) {
  constexpr uintptr_t kLine = 64;
  const uintptr_t end = reinterpret_cast<uintptr_t>(p + n);
  for (uintptr_t a = reinterpret_cast<uintptr_t>(p) & ~(kLine - 1); a < end; a += kLine)
    __builtin_prefetch(reinterpret_cast<const void*>(a), kWrite ? 1 : 0, 3);
}

// How far ahead the reductions that read memory as it comes (the
// statistics' first pass, the grad sums) request their data: on this VM the
// hardware prefetchers left those loads waiting (row_walk.h and
// plane_kernels.h say where the requests go and what they gained).
constexpr int64_t kPrefetchAheadBytes = 8192;

// Requests the line of p[off + ahead] when off + ahead < end.
template <typename T>
C10_ALWAYS_INLINE void prefetch_line_ahead(const T* p, int64_t off, int64_t ahead, int64_t end) {
  if (off + ahead < end) __builtin_prefetch(p + off + ahead, 0, 3);
}

// Orders the streaming stores made so far before any later store: called
// when a thread's part of a pass that streamed its output is done.
inline void stream_fence() {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  _mm_sfence();
#endif
}

// Loads and stores `T` data in chunks of one full vector of T, as kParts
// vectors of the accumulation type.
template <typename T>
struct Io {
  using acc_t = at::opmath_type<T>;
  using Vec = Vectorized<acc_t>;
  static constexpr int64_t kWidth = Vec::size();
  static constexpr int64_t kChunk = Vectorized<T>::size();
  static constexpr int kParts = static_cast<int>(kChunk / kWidth);

  static void load(const T* p, Vec (&v)[kParts]) {
    if constexpr (kParts == 1) {
      v[0] = Vec::loadu(p);
    } else {
      std::tie(v[0], v[1]) = at::vec::convert_to_float<T>(Vectorized<T>::loadu(p));
    }
  }
  // G consecutive chunks as G * kParts vectors, in memory order.
  template <int G>
  static void load_chunks(const T* p, Vec (&v)[G * kParts]) {
    static_for<G>([&](auto g) {
      Vec part[kParts];
      load(p + g * kChunk, part);
      for (int q = 0; q < kParts; ++q) v[g * kParts + q] = part[q];
    });
  }
  static void store(T* p, const Vec (&v)[kParts]) {
    if constexpr (kParts == 1) {
      v[0].store(p);
    } else {
      at::vec::convert_from_float<T>(v[0], v[1]).store(p);
    }
  }
  // store() as a non-temporal (streaming) store, which writes the lines
  // without reading them first and leaves them out of the caches; p must be
  // aligned to the chunk. Without AVX2 or AVX512, a plain store.
  static void store_stream(T* p, const Vec (&v)[kParts]) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    if constexpr (kParts == 1) {
      stream(p, v[0]);
    } else {
      stream(p, at::vec::convert_from_float<T>(v[0], v[1]));
    }
#else
    store(p, v);
#endif
  }
  // The first n (< kChunk) elements; the other lanes read as zero.
  C10_ALWAYS_INLINE static void load_partial(const T* p, int64_t n, Vec (&v)[kParts]) {
    if constexpr (kParts == 1) {
      v[0] = Vec::loadu(p, n);
    } else {
      std::tie(v[0], v[1]) = at::vec::convert_to_float<T>(load_partial_chunk(p, n));
    }
  }
  // n (<= kChunk) elements: load() of a full chunk, else load_partial().
  C10_ALWAYS_INLINE static void load_lanes(const T* p, int64_t n, Vec (&v)[kParts]) {
    if (n == kChunk) load(p, v);
    else load_partial(p, n, v);
  }
  // Of a chunk's first `lanes` elements, how many fall in its part q (a Vec).
  static constexpr int64_t part_lanes(int64_t lanes, int q) {
    return lanes - q * kWidth < 0 ? 0 : (lanes - q * kWidth > kWidth ? kWidth : lanes - q * kWidth);
  }
  C10_ALWAYS_INLINE static void store_partial(T* p, int64_t n, const Vec (&v)[kParts]) {
    if constexpr (kParts == 1) {
      v[0].store(p, n);
    } else {
      at::vec::convert_from_float<T>(v[0], v[1]).store(p, n);
    }
  }

 private:
  // A partial chunk of 16-bit T. AVX2 has no 16-bit masked load, and ATen's
  // loadu(p, n) copies the elements into a zeroed stack buffer and reloads it
  // as a vector, a load that waits for those stores to retire (a failed store
  // forward: 17% of the float16 normalization of 14x14 planes, whose rows end
  // in a partial chunk). Here the whole 32-bit pairs come by a masked load,
  // an odd last element by a broadcast blended into its lane.
  static Vectorized<T> load_partial_chunk(const T* p, int64_t n) {
#if defined(CPU_CAPABILITY_AVX2)
    static_assert(sizeof(T) == 2 && kChunk == 16);
    const __m256i pairs = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n / 2)),
                                             _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i v = _mm256_maskload_epi32(reinterpret_cast<const int32_t*>(p), pairs);
    if (n % 2 != 0) {
      int16_t last;
      std::memcpy(&last, p + n - 1, sizeof last);
      const __m256i lane = _mm256_cmpeq_epi16(_mm256_set1_epi16(static_cast<int16_t>(n - 1)),
                                              _mm256_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
      v = _mm256_blendv_epi8(v, _mm256_set1_epi16(last), lane);
    }
    return Vectorized<T>(v);
#else
    return Vectorized<T>::loadu(p, n);
#endif
  }

#if defined(CPU_CAPABILITY_AVX512)
  static void stream(float* p, __m512 v) { _mm512_stream_ps(p, v); }
  static void stream(double* p, __m512d v) { _mm512_stream_pd(p, v); }
  static void stream(void* p, __m512i v) { _mm512_stream_si512(static_cast<__m512i*>(p), v); }
#elif defined(CPU_CAPABILITY_AVX2)
  static void stream(float* p, __m256 v) { _mm256_stream_ps(p, v); }
  static void stream(double* p, __m256d v) { _mm256_stream_pd(p, v); }
  static void stream(void* p, __m256i v) { _mm256_stream_si256(static_cast<__m256i*>(p), v); }
#endif
};

// f's lower and upper halves as float64 vectors, lanes in order.
C10_ALWAYS_INLINE void widen(const Vectorized<float>& f, Vectorized<double>& lo, Vectorized<double>& hi) {
#if defined(CPU_CAPABILITY_AVX512)
  lo = _mm512_cvtps_pd(_mm512_castps512_ps256(f));
  hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1)));
#elif defined(CPU_CAPABILITY_AVX2)
  lo = _mm256_cvtps_pd(_mm256_castps256_ps128(f));
  hi = _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1));
#else
  constexpr int64_t kHalf = Vectorized<double>::size();
  alignas(64) float lanes[2 * kHalf];
  alignas(64) double wide[2 * kHalf];
  f.store(lanes);
  for (int64_t i = 0; i < 2 * kHalf; ++i) wide[i] = lanes[i];
  lo = Vectorized<double>::loadu(wide);
  hi = Vectorized<double>::loadu(wide + kHalf);
#endif
}

// The names the kernels over T (plane_kernels.h, row_*.h) declare: T's Io,
// its accumulation type and vector, the lanes of a vector (W), the elements
// of a chunk (K) and its vectors (P).
#define TBG_KERNEL_TYPES(T)                                   \
  using IO = Io<T>;                                           \
  using acc_t = typename IO::acc_t;                           \
  using Vec = typename IO::Vec;                               \
  static constexpr int64_t W = IO::kWidth, K = IO::kChunk;    \
  static constexpr int P = IO::kParts

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace torch_bn_grad::cpu
