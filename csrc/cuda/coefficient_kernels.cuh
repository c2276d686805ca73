// The second stage: per-channel values from the first stage's partials
// (reduce_kernels.cuh), or from given statistics, in float64 with the formulas
// of batch_norm_math.h (the CPU's), each rounded once. A warp or a block per
// channel merges its partials (merge_channel); its first thread derives the
// coefficients. The
// persistent kernels call the same store_*_coefficients functions.
#pragma once

#include <cstdint>

#include "math/batch_norm_math.h"
#include "cuda/block_reduce.cuh"
#include "cuda/channel_values.cuh"
#include "cuda/running_update.cuh"
#include "cuda/thread_states.cuh"

namespace torch_bn_grad::cuda {

// The per-channel arrays a coefficient kernel writes (math::ChannelAffine's
// fields, of the accumulation type); a null array is not written.
template <typename A>
struct AffineOutputs {
  A* mean;
  A* dy_scale;
  A* x_scale;
  A* bias;

  __device__ __forceinline__ void store(int64_t k, const math::ChannelAffine<A>& c) const {
    if (mean != nullptr) mean[k] = c.mean;
    if (dy_scale != nullptr) dy_scale[k] = c.dy_scale;
    x_scale[k] = c.x_scale;
    bias[k] = c.bias;
  }
};

template <typename A>
struct ForwardCoefficientArgs {
  // Batch statistics: `per_channel` partials per channel. Null when frozen.
  const Moments<double>* partials;
  int64_t per_channel;
  // Frozen statistics (unused with partials).
  ChannelIn mean;
  ChannelIn variance;
  ChannelIn gamma;  // absent: 1
  ChannelIn beta;   // absent: 0
  double epsilon;
  int64_t channels;
  A* variance_out;  // batch statistics only
  // Batch statistics only: the running buffers updated with them
  // (fused_update); none by default.
  RunningUpdate running;
  // mean (the batch statistic returned), x_scale = scale and bias = shift
  // (math::channel_affine of math::forward_coefficients); no dy_scale.
  AffineOutputs<A> affine;
};

// Channel k's statistics and coefficients from its mean and variance.
template <typename A>
__device__ __forceinline__ void store_forward_coefficients(const ForwardCoefficientArgs<A>& a, int64_t k,
                                                           double mean, double variance) {
  const double gamma = a.gamma.at(k, 1.0);
  const double beta = a.beta.at(k, 0.0);
  if (a.variance_out != nullptr) a.variance_out[k] = static_cast<A>(variance);
  const math::ChannelAffine<A> c = math::channel_affine<A>(mean, math::forward_coefficients(variance, gamma, beta, a.epsilon));
  a.affine.store(k, c);
  // The update takes the statistics as the forward returns them.
  if (a.running.wanted()) a.running.apply(k, c.mean, static_cast<A>(variance));
}

// The same from the channel's merged moments (the persistent kernels', the
// last block's: last_block.cuh).
template <typename A>
__device__ __forceinline__ void store_merged(const ForwardCoefficientArgs<A>& a, int64_t k, const Moments<double>& m) {
  store_forward_coefficients(a, k, m.mean, math::variance_of(m));
}

// kGroup threads a channel (block_reduce.cuh's merge_channel).
template <typename A, int kGroup>
__global__ void __launch_bounds__(kThreads) forward_coefficients_kernel(ForwardCoefficientArgs<A> a) {
  __shared__ Moments<double> shared[kThreads / kWarp];
  const int64_t k = group_channel<kGroup>();
  if (k >= a.channels) return;  // whole groups: kThreads is a multiple of kWarp
  double mean, variance;
  if (a.partials != nullptr) {
    const Moments<double> m = merge_channel<kGroup>(a.partials, a.per_channel, k, shared);
    mean = m.mean;
    variance = math::variance_of(m);
  } else {
    mean = a.mean.at(k, 0.0);
    variance = a.variance.at(k, 0.0);
  }
  if (group_rank<kGroup>() == 0) store_forward_coefficients(a, k, mean, variance);
}

template <typename A>
struct BackwardCoefficientArgs {
  // `per_channel` partials per channel; null when the sums are not needed or
  // the batch is empty (the sums are then 0).
  const GradSums<double>* partials;
  int64_t per_channel;
  // The given mean, which the sums are taken about and the elementwise pass
  // subtracts. Its dtype is at most as precise as A, so it is the exact mean:
  // the sums need no re-centring and the bias no correction.
  const A* mean;
  ChannelIn variance;
  ChannelIn gamma;  // absent: 1
  // null: 1. Else x_true - mean = (x - mean) / unit: the memory-saving
  // backward reads u = gamma * rstd * (x_true - mean) + beta, `mean` being beta.
  const double* unit;
  double epsilon;
  int64_t channels;
  int64_t reduced;  // elements per channel
  bool training;
  // dy_scale, x_scale and bias (mean unused); null arrays when diff_src is
  // not needed.
  AffineOutputs<A> affine;
  ChannelOut diff_gamma;  // null when masked
  ChannelOut diff_beta;   // null when masked
};

// Channel k's coefficients and parameter gradients from its two sums.
template <typename A>
__device__ __forceinline__ void store_backward_coefficients(const BackwardCoefficientArgs<A>& p, int64_t k,
                                                            const GradSums<double>& taken) {
  GradSums<double> sums = taken;
  if (p.unit != nullptr) sums.sum_dy_xc /= p.unit[k];
  const double rstd = math::rstd_of(p.variance.at(k, 0.0), p.epsilon);
  if (p.affine.x_scale != nullptr) {
    const double gamma = p.gamma.at(k, 1.0);
    math::BackwardCoefficients c =
        math::backward_coefficients(rstd, gamma, sums, static_cast<double>(p.reduced), p.training);
    if (p.unit != nullptr) c.x_scale /= p.unit[k];
    p.affine.store(k, math::channel_affine<A>(static_cast<double>(p.mean[k]), c));
  }
  const math::ParameterGrads grads = math::parameter_grads(rstd, sums);
  if (p.diff_gamma.wanted()) p.diff_gamma.set(k, grads.diff_gamma);
  if (p.diff_beta.wanted()) p.diff_beta.set(k, grads.diff_beta);
}

// The backward's store_merged: channel k's coefficients and parameter
// gradients from its merged sums (the last block's store).
template <typename A>
__device__ __forceinline__ void store_merged(const BackwardCoefficientArgs<A>& p, int64_t k,
                                             const GradSums<double>& sums) {
  store_backward_coefficients(p, k, sums);
}

template <typename A, int kGroup>
__global__ void __launch_bounds__(kThreads) backward_coefficients_kernel(BackwardCoefficientArgs<A> p) {
  __shared__ GradSums<double> shared[kThreads / kWarp];
  const int64_t k = group_channel<kGroup>();
  if (k >= p.channels) return;  // whole groups
  GradSums<double> sums{0, 0};
  if (p.partials != nullptr) sums = merge_channel<kGroup>(p.partials, p.per_channel, k, shared);
  if (group_rank<kGroup>() == 0) store_backward_coefficients(p, k, sums);
}

// ------------------------------------------------------------------ split stages
// Per-channel rows written as float64, and the coefficients derived on the
// device from tensors (no host reads). With 1-D statistics the kernel channel
// order is the logical one.

// rows (3, channels): count, mean and m2 of each channel, from its partials.
template <typename A, int kGroup>
__global__ void __launch_bounds__(kThreads)
    stats_rows_kernel(const Moments<double>* partials, int64_t per_channel, int64_t channels, double* rows) {
  __shared__ Moments<double> shared[kThreads / kWarp];
  const int64_t k = group_channel<kGroup>();
  if (k >= channels) return;  // whole groups
  const Moments<double> m = merge_channel<kGroup>(partials, per_channel, k, shared);
  if (group_rank<kGroup>() != 0) return;
  rows[k] = static_cast<double>(m.count);
  rows[channels + k] = m.mean;
  rows[2 * channels + k] = m.m2;
}

// rows (2, channels): sum(dy) and sum(dy * (x - mean)) of each channel, taken
// about `centre` (the given float64 `mean` rounded to A) and re-centred on
// `mean`.
template <typename A, int kGroup>
__global__ void __launch_bounds__(kThreads)
    grad_sums_rows_kernel(const GradSums<double>* partials, int64_t per_channel, const double* mean, const A* centre,
                          int64_t channels, double* rows) {
  __shared__ GradSums<double> shared[kThreads / kWarp];
  const int64_t k = group_channel<kGroup>();
  if (k >= channels) return;  // whole groups
  const GradSums<double> merged = merge_channel<kGroup>(partials, per_channel, k, shared);
  if (group_rank<kGroup>() != 0) return;
  const GradSums<double> s = math::recentre(merged, mean[k], static_cast<double>(centre[k]));
  rows[k] = s.sum_dy;
  rows[channels + k] = s.sum_dy_xc;
}

// The training diff_src's coefficients from whole-batch values (mean, biased
// variance, element count, and the rows of grad_sums_rows_kernel summed over
// the batch), one thread per channel.
template <typename A>
__global__ void __launch_bounds__(kThreads)
    grad_input_coefficients_kernel(const double* mean, const double* variance, const double* gamma,
                                   const double* count, const double* sums, double epsilon, int64_t channels,
                                   AffineOutputs<A> affine) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (k >= channels) return;
  const GradSums<double> s{sums[k], sums[channels + k]};
  const double g = gamma != nullptr ? gamma[k] : 1.0;
  const math::BackwardCoefficients c =
      math::backward_coefficients(math::rstd_of(variance[k], epsilon), g, s, count[k], /*training=*/true);
  affine.store(k, math::channel_affine<A>(mean[k], c));
}

}  // namespace torch_bn_grad::cuda
