// Exact (compensated) summation and the exact centre of the CPU statistics.
//
// Every block sum is compensated: vector lanes of the accumulation type
// (float32 for float32/float16/bfloat16 data, float64 for float64) carry the
// exact rounding error of each add (TwoSum) alongside the sum. Terms first go
// into short plain runs of kRowRun (a few roundings of a small partial sum),
// and each run is added exactly, so a block's sum is within a few units of the
// run sums' rounding of a float64 sum. A plain float32 lane would be off by
// about sqrt(k) roundings after k terms: several units in the last place of
// diff_beta, or of the mean of zero-mean data. The runs keep the
// compensation's cost at a fraction of an add per term.
#pragma once

#include <ATen/cpu/vec/vec.h>
#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "cpu/kernels/vec_io.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace torch_bn_grad::cpu {
namespace CPU_CAPABILITY {
namespace {  // internal linkage: see vec_io.h

// Terms summed plainly in registers before one compensated add (a channel's
// rows in the row kernels, a chain's chunks in the plane kernels): an 8-term
// plain sum loses far less than the sqrt(n) drift the compensation prevents,
// at an eighth of its cost.
constexpr int64_t kRowRun = 8;

// a + b and a - b, rounded once as the operators round them; kOnFma issues
// them on vectors as fused multiply-adds by 1, for the FMA ports to share
// with the adders (see add_exact).
template <bool kOnFma, typename V>
C10_ALWAYS_INLINE V add_on(const V& a, const V& b) {
  if constexpr (kOnFma && !std::is_arithmetic_v<V>) return at::vec::fmadd(a, V(1), b);
  else return a + b;
}
template <bool kOnFma, typename V>
C10_ALWAYS_INLINE V sub_on(const V& a, const V& b) {
  if constexpr (kOnFma && !std::is_arithmetic_v<V>) return at::vec::fmsub(a, V(1), b);
  else return a - b;
}

// sum += x, with the exact rounding error of the add collected in err (Knuth's
// TwoSum), for vectors and scalars alike. Its seven operations are all adds;
// kOnFma moves four to the FMA ports, with the same bits: a float16 plane
// pass of long rows, which TwoSum bounds, took 0.84x-0.86x the time (its
// 56x56 forward), but shorter rows and the row kernels, whose chains are
// fewer or shorter, waited on the FMA's longer latency (1.05x-1.10x on
// 14x14 planes), so they keep the adders.
template <bool kOnFma = false, typename V>
inline void add_exact(V& sum, V& err, const V& x) {
  const V t = sum + x;
  const V z = sub_on<kOnFma>(t, sum);
  err = add_on<kOnFma>(err, (sum - sub_on<kOnFma>(t, z)) + sub_on<kOnFma>(x, z));
  sum = t;
}

// The same for non-negative terms with half the adds (Dekker's Fast2Sum, exact
// when sum >= x, which can fail only while the first terms come in).
template <typename V>
inline void add_exact_nonnegative(V& sum, V& err, const V& x) {
  const V t = sum + x;
  err = err + (x - (t - sum));
  sum = t;
}

// The float64 total of n compensated (sum, err) vector pairs: lane by lane
// across the pairs, then a fixed pairwise tree over the lanes. It runs once
// per block and sum, so it must be cheap next to a small block (a 4 x 16-lane
// serial chain of float64 adds cost the smallest planes a third of their
// time); the order is fixed, so the result depends on the data alone.
//
// The generic form keeps per-lane float64 accumulators in an array, which
// GCC leaves on the stack; the float32 forms below add the same terms in the
// same order (lanes widened to float64 vectors, the tree as halves of
// vectors), so they give the same bits.
template <typename acc_t, int N>
C10_ALWAYS_INLINE double lanes_total_generic(const at::vec::Vectorized<acc_t> (&sum)[N],
                                             const at::vec::Vectorized<acc_t> (&err)[N]) {
  constexpr int64_t W = at::vec::Vectorized<acc_t>::size();
  alignas(64) double acc[W] = {};
  for (int c = 0; c < N; ++c) {
    alignas(64) acc_t s[W];
    alignas(64) acc_t r[W];
    sum[c].store(s);
    err[c].store(r);
    for (int64_t i = 0; i < W; ++i) acc[i] += static_cast<double>(s[i]) + static_cast<double>(r[i]);
  }
  for (int64_t half = W / 2; half >= 1; half /= 2)
    for (int64_t i = 0; i < half; ++i) acc[i] += acc[i + half];
  return acc[0];
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// The last two levels of lanes_total's tree, over four float64 lanes:
// (a[0] + a[2]) + (a[1] + a[3]).
C10_ALWAYS_INLINE double tree_total(__m256d a4) {
  const __m128d a2 = _mm_add_pd(_mm256_castpd256_pd128(a4), _mm256_extractf128_pd(a4, 1));
  return _mm_cvtsd_f64(_mm_add_sd(a2, _mm_unpackhi_pd(a2, a2)));
}
#endif

template <typename acc_t, int N>
C10_ALWAYS_INLINE double lanes_total(const at::vec::Vectorized<acc_t> (&sum)[N], const at::vec::Vectorized<acc_t> (&err)[N]) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<acc_t, float>) {
    using VD = at::vec::Vectorized<double>;
    VD lo(0.0), hi(0.0);  // the float lanes' lower and upper halves
    for (int c = 0; c < N; ++c) {
      VD s_lo, s_hi, r_lo, r_hi;
      widen(sum[c], s_lo, s_hi);
      widen(err[c], r_lo, r_hi);
      lo = lo + (s_lo + r_lo);
      hi = hi + (s_hi + r_hi);
    }
    const VD a = lo + hi;
#if defined(CPU_CAPABILITY_AVX512)
    return tree_total(_mm256_add_pd(_mm512_castpd512_pd256(a), _mm512_extractf64x4_pd(a, 1)));
#else
    return tree_total(a);
#endif
  }
#endif
  return lanes_total_generic(sum, err);
}

// The centre of the statistics' sums about a centre: a mean rounded to a
// multiple of the spacing of acc_t (the type given: the row kernels give the
// data's, row_statistics.h) at the largest magnitude of the values it was
// taken from. Each of them is a multiple of that spacing or finer, so d = x -
// centre is exact in the accumulation type (bar rare ties that round to even):
// sum(d^2) carries no rounding bias from the centre's low bits, and a centre
// this close to the mean costs nothing in cancellation. math::centred_moments
// (from sum(x)) or shifted_moments (from sum(d)) turns the sums into moments.
//
// max_abs comes from a plain (not NaN-propagating) max: a NaN element makes
// the sum, and so `mean`, NaN, which is returned as it is.
//
// A vector of channels at a time (means and max |x| as float64 lanes), each
// lane the float64 value the caller rounds to acc_t: with max_abs in
// [2^(e-1), 2^e), max_abs with its mantissa cleared is 2^(e-1), the spacing
// 2^(e - digits) that times 2^(1 - digits), its inverse 1 / spacing; powers
// of two, so every product is exact. Lanes whose spacing would be subnormal
// (zero or tiny max_abs), and non-finite ones, get `mean`.
template <typename acc_t>
inline at::vec::Vectorized<double> exact_centre_lanes(const at::vec::Vectorized<double>& mean,
                                                      const at::vec::Vectorized<double>& max_abs) {
  using VecD = at::vec::Vectorized<double>;
  constexpr int kDigits = std::numeric_limits<acc_t>::digits;
  const VecD inf(std::numeric_limits<double>::infinity());  // the exponent bits' mask
  const VecD valid = (max_abs >= VecD(std::ldexp(1.0, kDigits - 1023))) & (max_abs < inf) & (mean.abs() < inf);
  const VecD spacing = (max_abs & inf) * VecD(std::ldexp(1.0, 1 - kDigits));
  const VecD centre = (mean * (VecD(1.0) / spacing)).round() * spacing;
  return VecD::blendv(mean, centre, valid);
}

// One channel's centre (the plane kernels' blocks, segment rows): lane 0 of
// exact_centre_lanes, rounded to acc_t.
template <typename acc_t>
inline acc_t exact_centre(double mean, double max_abs) {
  using VecD = at::vec::Vectorized<double>;
  alignas(64) double lanes[VecD::size()];
  exact_centre_lanes<acc_t>(VecD(mean), VecD(max_abs)).store(lanes);
  return static_cast<acc_t>(lanes[0]);
}

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace torch_bn_grad::cpu
