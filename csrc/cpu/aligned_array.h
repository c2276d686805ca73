// Per-channel host arrays aligned to a cache line. The kernels read them a
// vector at a time (the elementwise pass reloads its coefficients every row);
// with malloc's 16-byte alignment three AVX512 loads in four spanned two
// lines, and on data coming from memory the channels_last elementwise pass
// took 1.11x-1.15x native's time (0.96x-1.08x on lines).
#pragma once

#include <algorithm>
#include <cstddef>
#include <memory>
#include <new>
#include <type_traits>

namespace torch_bn_grad::cpu {
namespace {  // internal linkage: included by the per-ISA kernels too (see kernels/vec_io.h)

constexpr std::size_t kCacheLineBytes = 64;

struct CacheLineDelete {
  void operator()(void* p) const { ::operator delete[](p, std::align_val_t{kCacheLineBytes}); }
};

template <typename T>
using AlignedArray = std::unique_ptr<T[], CacheLineDelete>;

// n elements on a cache line, left uninitialized (callers set every one).
template <typename T>
AlignedArray<T> aligned_array_for_overwrite(std::size_t n) {
  static_assert(std::is_trivial_v<T>, "a plain element type");
  return AlignedArray<T>(static_cast<T*>(::operator new[](std::max<std::size_t>(n, 1) * sizeof(T),
                                                          std::align_val_t{kCacheLineBytes})));
}

// n elements on a cache line, each `value`.
template <typename T>
AlignedArray<T> aligned_array(std::size_t n, T value) {
  AlignedArray<T> a = aligned_array_for_overwrite<T>(n);
  std::fill_n(a.get(), n, value);
  return a;
}

}  // namespace
}  // namespace torch_bn_grad::cpu
