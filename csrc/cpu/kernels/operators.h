// The operators' algorithms over the blocks of partition.h, shared by plain
// batch norm (batch_norm_kernels.cpp) and the fused batch_norm_act operators
// (batch_norm_act_forward_kernels.cpp, batch_norm_act_backward_kernels.cpp),
// which pass an epilogue (epilogue.h, act_gates.h) down to the block kernels.
// Numerics and scheduling are described in batch_norm_kernels.cpp.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "math/batch_norm_math.h"
#include "cpu/kernels/channel_finish.h"
#include "cpu/kernels/epilogue.h"
#include "cpu/kernels/partition.h"
#include "cpu/kernels/plane_kernels.h"
#include "cpu/kernels/row_affine.h"
#include "cpu/kernels/row_grad_sums.h"
#include "cpu/kernels/row_statistics.h"
#include "cpu/kernels/tensor_data.h"

namespace torch_bn_grad::cpu {
namespace CPU_CAPABILITY {
namespace {  // internal linkage: see vec_io.h

using Moments = math::Moments<double>;
using GradSums = math::GradSums<double>;

// ---------------------------------------------------------------- one block
// The partition a reduction runs over: `blocks` of `extent`, the operator's
// own, or for short planes its segment rows (partition.h,
// reduces_as_segments) when the epilogue takes such chunks.
struct Reduction {
  Blocks blocks;
  Extent extent;
};

template <typename T, typename E = PlainEpilogue<T>>
Reduction reduction_for(const Blocks& b, const Extent& e) {
  if (E::kSegmentChunks && reduces_as_segments(b, e, sizeof(T))) return {Blocks::segments(e), Blocks::segment_rows(e)};
  return {b, e};
}

// The plane or the row kernel for a block of reduction `r`.
template <typename T>
void stats_block(const Reduction& r, const T* x, const Block& blk, Partials<Moments>& out) {
  if (r.blocks.planes) PlaneKernels<T>::stats(x, r.extent, blk, out);
  else RowStatistics<T>::stats(x, r.extent, blk, out, r.blocks.span);
}

template <typename T, typename E = PlainEpilogue<T>>
void grad_sums_block(const Reduction& r, const T* x, const T* dy, const Block& blk, const at::opmath_type<T>* mean,
                     Partials<GradSums>& out, const E& ep = E{}) {
  if (r.blocks.planes) PlaneKernels<T>::grad_sums(x, dy, r.extent, blk, mean, out, ep);
  else RowGradSums<T>::grad_sums(x, dy, r.extent, blk, mean, out, ep, r.blocks.span);
}

// Runs f on every block of reduction `r` in parallel (for_each_block).
template <typename F>
void for_each_reduction_block(const Reduction& r, const F& f) {
  for_each_block(r.blocks, r.extent, false, f);
}

template <typename T, typename E = PlainEpilogue<T>>
void affine_block(const Blocks& b, const T* x, const T* y, T* out, const Extent& e, const Block& blk,
                  const math::AffineArrays<at::opmath_type<T>>& c, const E& ep = E{}) {
  if (b.planes) PlaneKernels<T>::affine(x, y, out, e, blk, c, ep);
  else RowAffine<T>::affine(x, y, out, e, blk, c, ep);
}

// affine_block over the whole array, for an elementwise pass that follows no
// reduction (frozen statistics, the split-stage grad_input): planes, and
// rows, are walked in memory order.
template <typename T, typename E = PlainEpilogue<T>>
void affine_all(const Blocks& b, const T* x, const T* y, T* out, const Extent& e,
                const math::AffineArrays<at::opmath_type<T>>& c, const E& ep = E{}) {
  if (!b.planes) {
    // Whole rows per thread: column blocks would cut each row into segments
    // of a page or less, where the hardware prefetchers stop.
    at::parallel_for(0, e.outer, grain_for(e, e.outer), [&](int64_t o0, int64_t o1) {
      RowAffine<T>::affine(x, y, out, e, Block{o0, o1, 0, e.channels, 0, 0}, c, ep);
    });
    return;
  }
  // Threads take runs of whole units of planes, each starting on a byte of
  // the forward's sign bits.
  const int64_t planes = e.outer * e.channels;
  const int64_t unit = planes_per_bits_unit(e.inner);
  const int64_t units = ceil_div(planes, unit);
  at::parallel_for(0, units, grain_for(e, units), [&](int64_t u0, int64_t u1) {
    PlaneKernels<T>::affine_planes(x, y, out, e, u0 * unit, std::min(planes, u1 * unit), c, ep);
  });
}

// The elementwise pass that follows a reduction over the same blocks: block
// by block, each thread's range in reverse (starting with the blocks it read
// last, still in its cache), or over the whole array in memory order when
// planes are short (partition.h).
template <typename T, typename E>
void affine_after_reduction(const Blocks& b, const T* x, const T* y, T* out, const Extent& e,
                            const math::AffineArrays<at::opmath_type<T>>& c, const E& ep) {
  if (short_planes(b, e, sizeof(T))) {
    affine_all<T>(b, x, y, out, e, c, ep);
    return;
  }
  for_each_block(b, e, true, [&](const Block& blk) { affine_block<T>(b, x, y, out, e, blk, c, ep); });
}

// A training operator's three steps: reduce(block) on every block, finish
// on every channel group, then the elementwise pass of `x`, `y` (the second
// input, or null) into `out` with coefficients `c`. Where partition.h's
// strategies say so, a thread runs all three on a channel run, a channel or
// a column block at a time (`pass` picks the run length); otherwise each
// step is one parallel region.
template <typename T, typename E, typename Reduce, typename Finish>
void reduce_finish_apply(const Blocks& b, const Reduction& red, const Extent& e, RunPass pass, const Reduce& reduce,
                         const Finish& finish, const T* x, const T* y, T* out,
                         const math::AffineArrays<at::opmath_type<T>>& c, const E& ep) {
  auto apply = [&](const Block& blk) { affine_block<T>(b, x, y, out, e, blk, c, ep); };
  auto finish_range = [&](int64_t k0, int64_t k1) { for_each_group_in(k0, k1, finish); };
  if (const int64_t run = channel_run_channels(b, e, sizeof(T), pass)) {
    for_each_channel_run(b, e, run, reduce, finish_range, [&](int64_t k0, int64_t k1) {
      PlaneKernels<T>::affine_channel_run(x, y, out, e, k0, k1, c, ep);
    });
    return;
  }
  if (per_channel_strategy(b, e, sizeof(T))) {
    for_each_channel(b, e, reduce, [&](int64_t k) { finish(ChannelGroup{k, 1}); }, apply);
    return;
  }
  if (column_block_strategy(b)) {
    for_each_column_block(b, e, reduce, finish_range, apply, /*weigh_finish=*/true);
    return;
  }
  for_each_reduction_block(red, reduce);
  for_each_channel_group(red.blocks, e, finish);
  affine_after_reduction<T>(b, x, y, out, e, c, ep);
}

// ---------------------------------------------------------------- operators
// `r` (may be null) is a residual added before the epilogue's activation.
template <typename T, typename E = PlainEpilogue<T>>
void forward_batch_impl(const T* x, const T* r, T* y, const Extent& e, const double* gamma, const double* beta,
                        double eps, double* mean, double* var, const E& ep = E{}) {
  using acc_t = at::opmath_type<T>;
  const Blocks b(e);
  const Reduction red = reduction_for<T>(b, e);
  Partials<Moments> parts(e.channels, red.blocks.per_channel());
  AffineTable<acc_t> co(e.channels);
  const math::AffineArrays<acc_t> coefficients = co.arrays();
  auto reduce = [&](const Block& blk) { stats_block(red, x, blk, parts); };
  auto finish = [&](const ChannelGroup& g) C10_ALWAYS_INLINE_ATTRIBUTE {
    const math::Moments<VecD> m = merged(parts, g);
    const VecD v = math::variance_of(m);
    g.store(m.mean, mean);
    g.store(v, var);
    set_forward_affine(co, g, m.mean, v, gamma, beta, eps, r != nullptr);
  };
  reduce_finish_apply<T>(b, red, e, RunPass::kForward, reduce, finish, x, r, y, coefficients, ep);
}

template <typename T, typename E = PlainEpilogue<T>>
void forward_frozen_impl(const T* x, const T* r, T* y, const Extent& e, const double* mean, const double* var,
                         const double* gamma, const double* beta, double eps, const E& ep = E{}) {
  using acc_t = at::opmath_type<T>;
  AffineTable<acc_t> co(e.channels);
  const Blocks b(e);
  auto table = [&](int64_t k0, int64_t k1) {
    forward_affine_table(co, k0, k1, mean, var, gamma, beta, eps, r != nullptr);
  };
  if (column_block_strategy(b)) {  // few rows: each thread sets, then applies, its blocks' channels
    for_each_column_block(
        b, e, [](const Block&) {}, table,
        [&](const Block& blk) { affine_block<T>(b, x, r, y, e, blk, co.arrays(), ep); },
        /*weigh_finish=*/false);
    return;
  }
  table(0, e.channels);
  affine_all<T>(b, x, r, y, e, co.arrays(), ep);
}

// The kernel reads `x` about `centre`; `unit` (null: 1) relates it to the
// statistics' frame: x_true - mean = (x - centre) / unit. Plain batch norm
// passes centre = mean. The memory-saving backward reads u = act^-1(y) - r
// = gamma * rstd * (x_true - mean) + beta, so centre = beta,
// unit = gamma * rstd: its sums and x coefficient are rescaled in float64.
template <typename T, typename E = PlainEpilogue<T>>
void backward_impl(const T* x, const T* dy, T* dx, const Extent& e, const double* centre, const double* unit,
                   const double* var, const double* gamma, double eps, bool training, double* diff_gamma,
                   double* diff_beta, const E& ep = E{}) {
  using acc_t = at::opmath_type<T>;
  const Blocks b(e);
  const bool need_sums = training || diff_gamma != nullptr || diff_beta != nullptr;
  const double count = static_cast<double>(e.reduced());
  const Reduction red = reduction_for<T, E>(b, e);
  Partials<GradSums> parts(e.channels, red.blocks.per_channel());
  AffineTable<acc_t> co(e.channels);
  // The sums are centred on the rounded centre the elementwise pass subtracts.
  for (int64_t k = 0; k < e.channels; ++k) co.mean[k] = static_cast<acc_t>(centre[k]);
  const math::AffineArrays<acc_t> coefficients = co.arrays();
  auto reduce = [&](const Block& blk) { grad_sums_block(red, x, dy, blk, coefficients.mean, parts, ep); };
  auto finish = [&](const ChannelGroup& g) C10_ALWAYS_INLINE_ATTRIBUTE {
    math::GradSums<VecD> sums{VecD(0.0), VecD(0.0)};
    if (need_sums) sums = merged(parts, g);
    const VecD c_exact = g.load(centre);
    sums = math::recentre(sums, c_exact, math::LaneMath<VecD>::round_to<acc_t>(c_exact));
    if (unit) sums.sum_dy_xc = sums.sum_dy_xc / g.load(unit);
    const VecD rstd = math::rstd_of(g.load(var), eps);
    math::BackwardCoefficients<VecD> c = math::backward_coefficients(rstd, g.load(gamma), sums, count, training);
    if (unit) c.x_scale = c.x_scale / g.load(unit);
    co.set(g, c_exact, c);
    const math::ParameterGrads<VecD> grads = math::parameter_grads(rstd, sums);
    g.store(grads.diff_gamma, diff_gamma);
    g.store(grads.diff_beta, diff_beta);
  };
  if (need_sums && dx) {
    reduce_finish_apply<T>(b, red, e, RunPass::kBackward, reduce, finish, x, dy, dx, coefficients, ep);
    return;
  }
  // No sums (frozen statistics, no parameter gradients), or no dx.
  if (need_sums) for_each_reduction_block(red, reduce);
  for_each_channel_group(red.blocks, e, finish);
  if (dx) affine_all<T>(b, x, dy, dx, e, coefficients, ep);
}

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace torch_bn_grad::cpu
