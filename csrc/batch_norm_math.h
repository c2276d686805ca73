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
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define TBG_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TBG_HOST_DEVICE inline
#endif

namespace torch_bn_grad::math {

// ------------------------------------------------------------------ statistics
// Count, mean and centred second moment of a set of values. `Count` is the
// type the counts travel in (float64 on the CPU, int64 on CUDA).
template <typename A, typename Count = A>
struct Moments {
  Count count;
  A mean;
  A m2;
};

// Chan et al.'s merge of the moments of two disjoint sets: no cancellation,
// exact up to rounding. An empty `b` leaves `a` unchanged.
template <typename A, typename Count>
TBG_HOST_DEVICE Moments<A, Count> merge(const Moments<A, Count>& a, const Moments<A, Count>& b) {
  if (b.count == 0) return a;
  const Count count = a.count + b.count;
  const A b_share = static_cast<A>(b.count) / static_cast<A>(count);  // the merge's one division
  const A delta = b.mean - a.mean;
  return {count, a.mean + delta * b_share, a.m2 + (b.m2 + delta * delta * (static_cast<A>(a.count) * b_share))};
}

// The biased variance of merged moments.
template <typename A, typename Count>
TBG_HOST_DEVICE double variance_of(const Moments<A, Count>& m) {
  return static_cast<double>(m.m2) / static_cast<double>(m.count);
}

// The moments of `count` values from the exact sums of x and of (x - centre)^2
// about a centre near their mean: m2 = sum_d2 - count * (mean - centre)^2,
// clamped at 0 (the subtraction may round below it).
TBG_HOST_DEVICE Moments<double> centred_moments(double count, double sum_x, double centre, double sum_d2) {
  const double mean = sum_x / count;
  const double offset = mean - centre;
  const double m2 = sum_d2 - count * offset * offset;
  return {count, mean, m2 < 0.0 ? 0.0 : m2};
}

// The moments of `count` values from the exact sums of d = x - centre and of
// d^2 about any centre (the CUDA kernels' first value of a channel): mean =
// centre + sum_d / count, m2 = sum_d2 - sum_d * (sum_d / count), clamped at 0.
// The same identity as centred_moments, taken from sum(d) rather than sum(x),
// so that a centre a few deviations from the mean costs float64 data nothing.
TBG_HOST_DEVICE Moments<double> shifted_moments(double count, double centre, double sum_d, double sum_d2) {
  const double offset = sum_d / count;
  const double m2 = sum_d2 - sum_d * offset;
  return {count, centre + offset, m2 < 0.0 ? 0.0 : m2};
}

// ------------------------------------------------------------------ forward
// dst = scale * (x - mean) + shift.
struct ForwardCoefficients {
  double scale;
  double shift;
};

TBG_HOST_DEVICE double rstd_of(double variance, double epsilon) { return 1.0 / sqrt(variance + epsilon); }

TBG_HOST_DEVICE ForwardCoefficients forward_coefficients(double variance, double gamma, double beta,
                                                         double epsilon) {
  return {gamma / sqrt(variance + epsilon), beta};
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

// Sums taken about `centre` (the mean rounded to the accumulation type, which
// the kernels subtract) re-centred on the exact `mean`:
// sum(dy (x - mean)) = sum(dy (x - centre)) - (mean - centre) sum(dy).
TBG_HOST_DEVICE GradSums<double> recentre(const GradSums<double>& s, double mean, double centre) {
  return {s.sum_dy, s.sum_dy_xc - (mean - centre) * s.sum_dy};
}

// diff_src = dy_scale * dy + x_scale * (x - mean) + bias, from rstd = rstd_of(variance,
// epsilon) (taken once a channel by the callers, which also pass it to
// parameter_grads). In training (batch statistics over `count` elements) dy_scale = gamma * rstd,
// x_scale = -dy_scale * rstd^2 * sum_dy_xc / count, bias = -dy_scale * sum_dy / count;
// with frozen statistics only dy_scale. A count below 1 (no data, or
// inconsistent split-stage arguments) leaves x_scale and bias 0.
struct BackwardCoefficients {
  double dy_scale;
  double x_scale;
  double bias;
};

TBG_HOST_DEVICE BackwardCoefficients backward_coefficients(double rstd, double gamma, const GradSums<double>& sums,
                                                           double count, bool training) {
  const double dy_scale = gamma * rstd;
  if (!training || !(count >= 1)) return {dy_scale, 0.0, 0.0};
  return {dy_scale, -dy_scale * rstd * rstd * sums.sum_dy_xc / count, -dy_scale * sums.sum_dy / count};
}

// The parameters' gradients: diff_gamma = rstd * sum_dy_xc, diff_beta = sum_dy.
struct ParameterGrads {
  double diff_gamma;
  double diff_beta;
};

TBG_HOST_DEVICE ParameterGrads parameter_grads(double rstd, const GradSums<double>& sums) {
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

template <typename A>
TBG_HOST_DEVICE ChannelAffine<A> channel_affine(double mean, const BackwardCoefficients& c) {
  const A rounded = static_cast<A>(mean);
  return {rounded, static_cast<A>(c.dy_scale), static_cast<A>(c.x_scale),
          static_cast<A>(c.bias - c.x_scale * (mean - static_cast<double>(rounded)))};
}

// The forward's normalization as an elementwise pass without dy.
template <typename A>
TBG_HOST_DEVICE ChannelAffine<A> channel_affine(double mean, const ForwardCoefficients& c) {
  return channel_affine<A>(mean, BackwardCoefficients{0.0, c.scale, c.shift});
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

}  // namespace torch_bn_grad::math
