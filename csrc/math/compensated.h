// Compensated scalar sums and the shifted second moment, one value at a time:
// what each CUDA thread accumulates (cuda/thread_states.cuh), written once as
// __host__ __device__ functions so that a host compiler checks them too
// (tests/cuda/test_cuda_statistics_accuracy.py). The CPU kernels do the same with vectors
// (cpu/kernels/exact_sum.h), about the block mean rounded to an exact centre.
//
// * ExactSum {sum, err}: sum + err is the running sum, err collecting the
//   exact rounding error of every add (Knuth's TwoSum).
// * ShiftedSums {count, d, d2}: the compensated sums of d = x - centre and of
//   d^2 about a centre near the data (the channel's first value): for data
//   of a large common offset (mean 1e4, unit noise) d is exact (Sterbenz) and
//   small, d^2 is taken with its exact rounding error (an FMA), so the sums
//   carry about twice the accumulation type's precision and the moments
//   computed from them in float64 (math::shifted_moments, the identity of the
//   CPU's math::centred_moments) lose nothing to the offset. Sums about the
//   same centre merge by addition; moments of different centres merge with
//   Chan's formula (math::merge).
#pragma once

#include <cmath>
#include <cstdint>

#include "math/batch_norm_math.h"

namespace torch_bn_grad::math {

// a * b rounded once and never fused with a following add (nvcc contracts
// a * b + c into an FMA by default, which would break TwoSum's identity).
template <typename A>
TBG_HOST_DEVICE A mul_rn(A a, A b) {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(A) == sizeof(float)) {
    return __fmul_rn(a, b);
  } else {
    return __dmul_rn(a, b);
  }
#else
  // GCC contracts a * b + c into an FMA by default in C++ (-ffp-contract=fast)
  // where the ISA has one (the AVX2 and AVX512 kernels), depending on how the
  // caller is inlined; an empty asm on the product keeps it rounded, so that
  // the sums do not depend on the caller (the masked kernels' schedules).
  A p = a * b;
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  __asm__("" : "+x"(p));
#elif defined(__GNUC__) && defined(__aarch64__)
  __asm__("" : "+w"(p));
#endif
  return p;
#endif
}

// The exact rounding error of p = mul_rn(a, b): a * b - p (an FMA).
TBG_HOST_DEVICE float product_error(float a, float b, float p) { return fmaf(a, b, -p); }
TBG_HOST_DEVICE double product_error(double a, double b, double p) { return fma(a, b, -p); }

template <typename A>
struct ExactSum {
  A sum;
  A err;
};

// s += x, the add's exact rounding error going into s.err (TwoSum).
template <typename A>
TBG_HOST_DEVICE void add_exact(ExactSum<A>& s, A x) {
  const A t = s.sum + x;
  const A z = t - s.sum;
  s.err += (s.sum - (t - z)) + (x - z);
  s.sum = t;
}

template <typename A>
TBG_HOST_DEVICE ExactSum<A> merge(const ExactSum<A>& a, const ExactSum<A>& b) {
  ExactSum<A> r{a.sum, a.err + b.err};
  add_exact(r, b.sum);
  return r;
}

template <typename A>
TBG_HOST_DEVICE double value_of(const ExactSum<A>& s) {
  return static_cast<double>(s.sum) + static_cast<double>(s.err);
}

// ------------------------------------------------------------------ statistics
template <typename A>
struct ShiftedSums {
  int64_t count;
  ExactSum<A> d;   // sum(x - centre)
  ExactSum<A> d2;  // sum((x - centre)^2)
};

// One value's terms: d = x - centre with the subtraction's exact rounding
// error (TwoSum of x and -centre; none when x is near the centre), and d^2
// with its product's rounding error.
template <typename A>
TBG_HOST_DEVICE void add_shifted(ExactSum<A>& d, ExactSum<A>& d2, A x, A centre) {
  const A dx = x - centre;
  const A z = dx - x;
  d.err += (x - (dx - z)) - (centre + z);
  add_exact(d, dx);
  const A p = mul_rn(dx, dx);
  add_exact(d2, p);
  d2.err += product_error(dx, dx, p);
}

template <typename A>
TBG_HOST_DEVICE void add(ShiftedSums<A>& s, A x, A centre) {
  ++s.count;
  add_shifted(s.d, s.d2, x, centre);
}

// Two sets' sums about the same centre.
template <typename A>
TBG_HOST_DEVICE ShiftedSums<A> merge(const ShiftedSums<A>& a, const ShiftedSums<A>& b) {
  return {a.count + b.count, merge(a.d, b.d), merge(a.d2, b.d2)};
}

// The moments of the values summed about `centre`, in float64
// (math::shifted_moments). No values: {0, 0, 0}.
template <typename A>
TBG_HOST_DEVICE Moments<double, int64_t> shifted_moments(const ShiftedSums<A>& s, A centre) {
  if (s.count == 0) return {0, 0.0, 0.0};
  const Moments<double> m =
      shifted_moments(static_cast<double>(s.count), static_cast<double>(centre), value_of(s.d), value_of(s.d2));
  return {s.count, m.mean, m.m2};
}

// ------------------------------------------------------------------ backward
// The backward's two sums, compensated: sum(dy) and sum(dy * (x - mean)).
template <typename A>
struct ExactGradSums {
  ExactSum<A> dy;
  ExactSum<A> dy_xc;
};

template <typename A>
TBG_HOST_DEVICE void add_grad(ExactSum<A>& dy_sum, ExactSum<A>& dy_xc_sum, A x, A dy, A mean) {
  add_exact(dy_sum, dy);
  add_exact(dy_xc_sum, mul_rn(dy, x - mean));
}

template <typename A>
TBG_HOST_DEVICE ExactGradSums<A> merge(const ExactGradSums<A>& a, const ExactGradSums<A>& b) {
  return {merge(a.dy, b.dy), merge(a.dy_xc, b.dy_xc)};
}

template <typename A>
TBG_HOST_DEVICE GradSums<double> grad_sums_of(const ExactGradSums<A>& s) {
  return {value_of(s.dy), value_of(s.dy_xc)};
}

}  // namespace torch_bn_grad::math
