// Vector loads and stores of the CPU kernels, and the loop helpers their inner
// loops share.
//
// The headers of this folder are included by the per-ISA kernel source only,
// and everything in them lives in namespace CPU_CAPABILITY (as at::vec does)
// and has internal linkage, as if written in that source.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>

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
  // The first n (< kChunk) elements; the other lanes read as zero.
  static void load_partial(const T* p, int64_t n, Vec (&v)[kParts]) {
    if constexpr (kParts == 1) {
      v[0] = Vec::loadu(p, n);
    } else {
      std::tie(v[0], v[1]) = at::vec::convert_to_float<T>(Vectorized<T>::loadu(p, n));
    }
  }
  static void store_partial(T* p, int64_t n, const Vec (&v)[kParts]) {
    if constexpr (kParts == 1) {
      v[0].store(p, n);
    } else {
      at::vec::convert_from_float<T>(v[0], v[1]).store(p, n);
    }
  }
};

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace torch_bn_grad::cpu
