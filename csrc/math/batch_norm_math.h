// The per-channel formulas of batch norm, written once for the CPU kernels,
// the CPU split stages, the CUDA kernels and the CUDA host code. Everything
// here is a small inline function of plain values: compiled by nvcc it is
// __host__ __device__, by a host compiler plain inline.
//
// Vocabulary (csrc/README.md):
// * Statistics: Moments {count, mean, m2}, m2 being the centred second moment
//   sum((x - mean)^2); variance = m2 / count (biased).
// * Forward: dst = scale * (x - mean) + shift, scale = gamma * rstd, shift = beta,
//   rstd = 1 / sqrt(variance + epsilon).
// * Backward: GradSums {sum_dy, sum_dy_xc}, sum_dy_xc = sum(dy * (x - mean));
//   diff_src = dy_scale * dy + x_scale * (x - mean) + bias.
// * Elementwise pass (both directions): ChannelAffine {mean, dy_scale,
//   x_scale, bias} of the accumulation type; the forward fills it with
//   x_scale = scale, bias = shift and no dy.
//
// The float64 formulas take their values as `D`: double, or on the CPU a
// vector of doubles (at::vec::Vectorized<double>) that holds one channel per
// lane, so that the CPU derives its channels' coefficients a vector at a
// time with the same IEEE operations, lane for lane. They use + - * / and
// LaneMath<D> only, and take the per-call constants (epsilon, count)
// as double.
#pragma once

#include <cmath>
#include <cstdint>

// Always inlined, on the host as on the device: the CPU kernels call the
// activation formulas (activation_math.h) once a chunk, and GCC left some
// out of line, which spilled the kernels' vector accumulators on each call.
#if defined(__CUDACC__)
#define TBG_HOST_DEVICE __host__ __device__ __forceinline__
#elif defined(_MSC_VER)
#define TBG_HOST_DEVICE __forceinline
#else
#define TBG_HOST_DEVICE inline __attribute__((always_inline))
#endif

namespace torch_bn_grad::math {

// The operations on D that are not operators; the CPU kernels specialize it
// for their vectors (cpu/kernels/channel_finish.h).
template <typename D>
struct LaneMath {
  TBG_HOST_DEVICE static D sqrt(D x) { return ::sqrt(x); }
  // a * b + c rounded once.
  TBG_HOST_DEVICE static D fma(D a, D b, D c) {
#if defined(__CUDA_ARCH__)
    return ::fma(a, b, c);
#else
    return std::fma(a, b, c);
#endif
  }
  // x clamped at 0 from below (NaN and -0.0 pass as they are).
  TBG_HOST_DEVICE static D nonnegative(D x) { return x < D(0.0) ? D(0.0) : x; }
  // x rounded to A (once, to the nearest), held as D.
  template <typename A>
  TBG_HOST_DEVICE static D round_to(D x) {
    return static_cast<D>(static_cast<A>(x));
  }
};

// ------------------------------------------------------------------ statistics
// Count, mean and centred second moment of a set of values. `Count` is the
// type the counts travel in (float64 on the CPU, int64 on CUDA).
template <typename A, typename Count = A>
struct Moments {
  Count count;
  A mean;
  A m2;
};

// Chan et al.'s merge of the moments of two disjoint sets, neither empty:
// no cancellation, exact up to rounding.
template <typename A, typename Count>
TBG_HOST_DEVICE Moments<A, Count> merge_nonempty(const Moments<A, Count>& a, const Moments<A, Count>& b) {
  const Count count = a.count + b.count;
  const A b_share = static_cast<A>(b.count) / static_cast<A>(count);  // the merge's one division
  const A delta = b.mean - a.mean;
  return {count, a.mean + delta * b_share, a.m2 + (b.m2 + delta * delta * (static_cast<A>(a.count) * b_share))};
}

// merge_nonempty, where either may be empty (an empty `b` leaves `a` unchanged).
template <typename A, typename Count>
TBG_HOST_DEVICE Moments<A, Count> merge(const Moments<A, Count>& a, const Moments<A, Count>& b) {
  if (b.count == 0) return a;
  if (a.count == 0) return b;
  return merge_nonempty(a, b);
}

// The biased variance of merged moments.
template <typename D, typename Count>
TBG_HOST_DEVICE D variance_of(const Moments<D, Count>& m) {
  return m.m2 / static_cast<D>(m.count);
}

// The moments of `count` values from the exact sums of x and of (x - centre)^2
// about a centre near their mean: m2 = sum_d2 - count * (mean - centre)^2,
// clamped at 0 (the subtraction may round below it).
template <typename D>
TBG_HOST_DEVICE Moments<D> centred_moments(D count, D sum_x, D centre, D sum_d2) {
  const D mean = sum_x / count;
  const D offset = mean - centre;
  return {count, mean, LaneMath<D>::nonnegative(sum_d2 - count * offset * offset)};
}

// The moments of `count` values from the exact sums of d = x - centre and of
// d^2 about any centre (the CUDA kernels' first value of a channel, the CPU
// row kernels' mean of a block's first rows): mean = centre + sum_d / count,
// m2 = sum_d2 - sum_d * (sum_d / count), clamped at 0. The same identity as
// centred_moments, taken from sum(d) rather than sum(x), so that the values'
// rounding does not reach m2 through a centre off the mean: sum(d)'s is at
// the deviations' scale.
template <typename D>
TBG_HOST_DEVICE Moments<D> shifted_moments(D count, D centre, D sum_d, D sum_d2) {
  const D offset = sum_d / count;
  return {count, centre + offset, LaneMath<D>::nonnegative(sum_d2 - sum_d * offset)};
}
TBG_HOST_DEVICE Moments<double> shifted_moments(double count, double centre, double sum_d, double sum_d2) {
  return shifted_moments<double>(count, centre, sum_d, sum_d2);
}

// ------------------------------------------------------------------ forward
// dst = scale * (x - mean) + shift.
template <typename D = double>
struct ForwardCoefficients {
  D scale;
  D shift;
};

template <typename D>
TBG_HOST_DEVICE D rstd_of(D variance, double epsilon) {
  return D(1.0) / LaneMath<D>::sqrt(variance + D(epsilon));
}

template <typename D>
TBG_HOST_DEVICE ForwardCoefficients<D> forward_coefficients(D variance, D gamma, D beta, double epsilon) {
  return {gamma / LaneMath<D>::sqrt(variance + D(epsilon)), beta};
}

// ------------------------------------------------------------------ backward
// The backward's two sums over a channel: sum(dy) and sum(dy * (x - mean)).
template <typename A>
struct GradSums {
  A sum_dy;
  A sum_dy_xc;
};

template <typename A>
TBG_HOST_DEVICE GradSums<A> merge(const GradSums<A>& a, const GradSums<A>& b) {
  return {a.sum_dy + b.sum_dy, a.sum_dy_xc + b.sum_dy_xc};
}

// The same, for the vectors that merge_nonempty names for moments.
template <typename A>
TBG_HOST_DEVICE GradSums<A> merge_nonempty(const GradSums<A>& a, const GradSums<A>& b) {
  return merge(a, b);
}

// Sums taken about `centre` (the mean rounded to the accumulation type, which
// the kernels subtract) re-centred on the exact `mean`:
// sum(dy (x - mean)) = sum(dy (x - centre)) - (mean - centre) sum(dy).
template <typename D>
TBG_HOST_DEVICE GradSums<D> recentre(const GradSums<D>& s, D mean, D centre) {
  return {s.sum_dy, s.sum_dy_xc - (mean - centre) * s.sum_dy};
}

// diff_src = dy_scale * dy + x_scale * (x - mean) + bias, from rstd = rstd_of(variance,
// epsilon) (taken once a channel by the callers, which also pass it to
// parameter_grads). In training (batch statistics over `count` elements) dy_scale = gamma * rstd,
// x_scale = -dy_scale * rstd^2 * sum_dy_xc / count, bias = -dy_scale * sum_dy / count;
// with frozen statistics only dy_scale. A count below 1 (no data, or
// inconsistent split-stage arguments) leaves x_scale and bias 0.
template <typename D = double>
struct BackwardCoefficients {
  D dy_scale;
  D x_scale;
  D bias;
};

template <typename D>
TBG_HOST_DEVICE BackwardCoefficients<D> backward_coefficients(D rstd, D gamma, const GradSums<D>& sums,
                                                              double count, bool training) {
  const D dy_scale = gamma * rstd;
  if (!training || !(count >= 1)) return {dy_scale, D(0.0), D(0.0)};
  // Times 1 / count rather than divided by it: the CPU takes a vector of
  // channels at a time, and two divisions a channel were a third of a 2x4096
  // backward's float64 work (the extra rounding is one float64 unit).
  const D inv_count(1.0 / count);
  return {dy_scale, -dy_scale * rstd * rstd * sums.sum_dy_xc * inv_count, -dy_scale * sums.sum_dy * inv_count};
}

// The parameters' gradients: diff_gamma = rstd * sum_dy_xc, diff_beta = sum_dy.
template <typename D = double>
struct ParameterGrads {
  D diff_gamma;
  D diff_beta;
};

template <typename D>
TBG_HOST_DEVICE ParameterGrads<D> parameter_grads(D rstd, const GradSums<D>& sums) {
  return {rstd * sums.sum_dy_xc, sums.sum_dy};
}

// ------------------------------------------------------------------ elementwise pass
// out = dy_scale * dy + x_scale * (x - mean) + bias, per channel, of the
// accumulation type A. `mean` is rounded to A; its rounding error times
// x_scale goes into bias, in float64, so that x - mean loses nothing to it.
template <typename A>
struct ChannelAffine {
  A mean;
  A dy_scale;
  A x_scale;
  A bias;
};

// Its fields rounded to A but held as D (float64, or a CPU vector of
// channels): the one formula, which channel_affine converts exactly to A.
template <typename A, typename D>
TBG_HOST_DEVICE ChannelAffine<D> rounded_channel_affine(D mean, const BackwardCoefficients<D>& c) {
  using M = LaneMath<D>;
  const D rounded = M::template round_to<A>(mean);
  return {rounded, M::template round_to<A>(c.dy_scale), M::template round_to<A>(c.x_scale),
          M::template round_to<A>(c.bias - c.x_scale * (mean - rounded))};
}

template <typename A>
TBG_HOST_DEVICE ChannelAffine<A> channel_affine(double mean, const BackwardCoefficients<double>& c) {
  const ChannelAffine<double> r = rounded_channel_affine<A>(mean, c);
  return {static_cast<A>(r.mean), static_cast<A>(r.dy_scale), static_cast<A>(r.x_scale), static_cast<A>(r.bias)};
}

// The forward's normalization as an elementwise pass without dy.
template <typename A>
TBG_HOST_DEVICE ChannelAffine<A> channel_affine(double mean, const ForwardCoefficients<double>& c) {
  return channel_affine<A>(mean, BackwardCoefficients<double>{0.0, c.scale, c.shift});
}

// ChannelAffine's fields as per-channel arrays, as the elementwise kernels
// read them; dy_scale is null (unused) without dy.
template <typename A>
struct AffineArrays {
  const A* mean;
  const A* dy_scale;
  const A* x_scale;
  const A* bias;
};

// ------------------------------------------------------------------ running statistics
// at::lerp(start, end, weight) with its roundings (ATen/native/Lerp.h), fused
// as its vectorized CPU kernel and nvcc's contraction of its CUDA kernel fuse
// it, so that every channel count and device rounds alike.
template <typename T>
TBG_HOST_DEVICE T lerp(T start, T end, T weight) {
  const bool near_start = (weight < T(0) ? -weight : weight) < T(0.5);
  return LaneMath<T>::fma(near_start ? weight : weight - T(1), end - start, near_start ? start : end);
}

}  // namespace torch_bn_grad::math
