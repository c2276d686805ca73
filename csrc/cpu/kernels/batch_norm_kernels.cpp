// The CPU operators' kernels over a contiguous [outer, channels, inner] array,
// and this instruction set's KernelTable. This file is compiled once per
// instruction set; everything in it lives in namespace CPU_CAPABILITY, as
// at::vec does.
//
// Each operator reduces (statistics, or the backward's two sums), derives the
// per-channel coefficients in float64 (batch_norm_math.h) and runs one
// elementwise pass. The work is cut into blocks (partition.h) run by the plane
// kernels (inner > 1, plane_kernels.h) or the row kernels (inner == 1,
// row_statistics.h, row_grad_sums.h and row_affine.h).
//
// Numerics:
// * Sums are exact (compensated, exact_sum.h), per-block partials are merged
//   in block order in float64, so results do not depend on the thread count.
// * Statistics take two passes per block, the second while the block is in
//   cache: the exact sum of x gives the block mean; then the centred second
//   moment is summed about a centre that makes x - centre exact (exact_centre),
//   so a large common offset (mean 1000, unit noise) cancels before anything
//   is rounded. The blocks are merged with Chan's formula (math::merge).
// * The backward's two sums are taken in one pass, about the mean rounded to
//   the accumulation type, and re-centred on the exact mean (math::recentre).
// * The elementwise passes subtract the mean rounded to the accumulation type;
//   its rounding error is folded into the bias (math::channel_affine), so that
//   the output keeps full accuracy when the mean is large.
//
// Memory traffic: an operator reads its inputs twice (reduce, then apply).
// When channels are outermost and there are enough of them, each thread runs
// both passes on one channel at a time (for_each_channel), so the second pass
// finds that channel's data in its L2 cache. Short planes walk their second
// pass in memory order, but a pass that the caches would not give back fast
// (cpu/cache_geometry.cpp: past a CCD's L3, or under a server's mesh L3) runs
// both passes on a run of adjacent channels at a time (for_each_channel_run).
// Otherwise the second pass walks each thread's blocks in reverse, starting
// with the ones it read last. An elementwise pass with no reduction before it
// (frozen statistics, the split-stage grad_input) walks the planes in memory
// order (affine_all).
#include <ATen/OpMathType.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "dtypes.h"
#include "math/batch_norm_math.h"
#include "cpu/kernels/channel_convert.h"
#include "cpu/kernels/kernel_table.h"
#include "cpu/kernels/operators.h"
#include "cpu/kernels/partition.h"

namespace torch_bn_grad::cpu {
namespace CPU_CAPABILITY {
namespace {

// ---------------------------------------------------------------- split-stage primitives
template <typename T>
void batch_moments_impl(const T* x, const Extent& e, double* mean, double* m2) {
  const Reduction red = reduction_for<T>(Blocks(e), e);
  Partials<Moments> parts(e.channels, red.blocks.per_channel());
  for_each_reduction_block(red, [&](const Block& blk) { stats_block(red, x, blk, parts); });
  for_each_channel_group(red.blocks, e, [&](const ChannelGroup& g) {
    const math::Moments<VecD> m = merged(parts, g);
    g.store(m.mean, mean);
    g.store(m.m2, m2);
  });
}

template <typename T>
void grad_sums_impl(const T* x, const T* dy, const Extent& e, const double* mean, double* sum_dy,
                    double* sum_dy_xc) {
  using acc_t = at::opmath_type<T>;
  const Reduction red = reduction_for<T>(Blocks(e), e);
  const auto centre = aligned_array_for_overwrite<acc_t>(e.channels);
  for (int64_t k = 0; k < e.channels; ++k) centre[k] = static_cast<acc_t>(mean[k]);
  Partials<GradSums> parts(e.channels, red.blocks.per_channel());
  for_each_reduction_block(red, [&](const Block& blk) { grad_sums_block(red, x, dy, blk, centre.get(), parts); });
  for_each_channel_group(red.blocks, e, [&](const ChannelGroup& g) {
    const VecD m = g.load(mean);
    const math::GradSums<VecD> s = math::recentre(merged(parts, g), m, math::LaneMath<VecD>::round_to<acc_t>(m));
    g.store(s.sum_dy, sum_dy);
    g.store(s.sum_dy_xc, sum_dy_xc);
  });
}

// `sums` holds the rows (sum_dy, sum_dy_xc) of grad_sums.
template <typename T>
void grad_input_impl(const T* x, const T* dy, T* dx, const Extent& e, const double* mean, const double* var,
                     const double* gamma, const double* count, const double* sums, double eps) {
  using acc_t = at::opmath_type<T>;
  AffineTable<acc_t> co(e.channels);
  for (int64_t k = 0; k < e.channels; ++k) {
    const GradSums s{sums[k], sums[e.channels + k]};
    const math::BackwardCoefficients<double> c =
        math::backward_coefficients(math::rstd_of(var[k], eps), gamma[k], s, count[k], /*training=*/true);
    co.set(k, math::channel_affine<acc_t>(mean[k], c));
  }
  const Blocks b(e);
  const math::AffineArrays<acc_t> coefficients = co.arrays();
  affine_all<T>(b, x, dy, dx, e, coefficients);
}

// ---------------------------------------------------------------- entry points
void forward_batch(const at::Tensor& src, const at::Tensor& residual, at::Tensor& dst, const Extent& e,
                   const double* gamma, const double* beta, double epsilon, double* mean, double* var) {
  TBG_DISPATCH_DATA_DTYPE(src.scalar_type(), "forward_batch", [&] {
    forward_batch_impl<scalar_t>(src.const_data_ptr<scalar_t>(), data_or_null<scalar_t>(residual),
                                 dst.mutable_data_ptr<scalar_t>(), e, gamma, beta, epsilon, mean, var);
  });
}

void forward_frozen(const at::Tensor& src, const at::Tensor& residual, at::Tensor& dst, const Extent& e,
                    const double* mean, const double* var, const double* gamma, const double* beta, double epsilon) {
  TBG_DISPATCH_DATA_DTYPE(src.scalar_type(), "forward_frozen", [&] {
    forward_frozen_impl<scalar_t>(src.const_data_ptr<scalar_t>(), data_or_null<scalar_t>(residual),
                                  dst.mutable_data_ptr<scalar_t>(), e, mean, var, gamma, beta, epsilon);
  });
}

void backward(const at::Tensor& src, const at::Tensor& diff_dst, at::Tensor& diff_src, const Extent& e,
              const double* mean, const double* var, const double* gamma, double epsilon, bool training,
              double* diff_gamma, double* diff_beta) {
  TBG_DISPATCH_DATA_DTYPE(src.scalar_type(), "backward", [&] {
    backward_impl<scalar_t>(src.const_data_ptr<scalar_t>(), diff_dst.const_data_ptr<scalar_t>(),
                            diff_src.defined() ? diff_src.mutable_data_ptr<scalar_t>() : nullptr, e, mean, nullptr,
                            var, gamma, epsilon, training, diff_gamma, diff_beta);
  });
}

// running <- lerp(running, batch * factor, weight) as the tensor arithmetic
// rounds it (_rules/running_stats.py), batch in R's opmath type (float32 for
// half-precision buffers): the product rounded on its own as at::mul rounds
// it, then to R, then at::lerp in the opmath type, rounded to R. The
// product is a fused multiply-add with -0.0, not a plain product: GCC (with
// -mfma) fused that into lerp's subtraction.
template <typename R>
void update_running_as(const at::Tensor& running, const at::Tensor& batch, double factor, double weight) {
  using opmath_t = at::opmath_type<R>;
  R* r = running.mutable_data_ptr<R>();
  const opmath_t* b = batch.const_data_ptr<opmath_t>();
  const auto w = static_cast<opmath_t>(weight);
  const auto f = static_cast<opmath_t>(factor);
  for (int64_t k = 0; k < running.numel(); ++k) {
    const opmath_t value = factor == 1.0 ? b[k] : std::fma(b[k], f, opmath_t(-0.0));
    r[k] = static_cast<R>(math::lerp(static_cast<opmath_t>(r[k]), static_cast<opmath_t>(static_cast<R>(value)), w));
  }
}

void update_running(const at::Tensor& running, const at::Tensor& batch, double factor, double weight) {
  TBG_DISPATCH_DATA_DTYPE(running.scalar_type(), "update_running", [&] {
    update_running_as<scalar_t>(running, batch, factor, weight);
  });
}

void batch_moments(const at::Tensor& src, const Extent& e, double* mean, double* m2) {
  TBG_DISPATCH_DATA_DTYPE(src.scalar_type(), "batch_moments",
                          [&] { batch_moments_impl<scalar_t>(src.const_data_ptr<scalar_t>(), e, mean, m2); });
}

void grad_sums(const at::Tensor& src, const at::Tensor& diff_dst, const Extent& e, const double* mean,
               double* sum_dy, double* sum_dy_xc) {
  TBG_DISPATCH_DATA_DTYPE(src.scalar_type(), "grad_sums", [&] {
    grad_sums_impl<scalar_t>(src.const_data_ptr<scalar_t>(), diff_dst.const_data_ptr<scalar_t>(), e, mean, sum_dy,
                             sum_dy_xc);
  });
}

void grad_input(const at::Tensor& src, const at::Tensor& diff_dst, at::Tensor& diff_src, const Extent& e,
                const double* mean, const double* var, const double* gamma, const double* count,
                const double* grad_sums, double epsilon) {
  TBG_DISPATCH_DATA_DTYPE(src.scalar_type(), "grad_input", [&] {
    grad_input_impl<scalar_t>(src.const_data_ptr<scalar_t>(), diff_dst.const_data_ptr<scalar_t>(),
                              diff_src.mutable_data_ptr<scalar_t>(), e, mean, var, gamma, count, grad_sums, epsilon);
  });
}

}  // namespace
}  // namespace CPU_CAPABILITY

const KernelTable& TBG_ISA_COPY(kernel_table)() {
  static const KernelTable table{
      &CPU_CAPABILITY::forward_batch, &CPU_CAPABILITY::forward_frozen, &CPU_CAPABILITY::backward,
      &CPU_CAPABILITY::batch_moments, &CPU_CAPABILITY::grad_sums,
      &CPU_CAPABILITY::grad_input,    &CPU_CAPABILITY::update_running, &CPU_CAPABILITY::widen_channels,
      &CPU_CAPABILITY::narrow_channels, TBG_ISA_NAME};
  return table;
}

}  // namespace torch_bn_grad::cpu
