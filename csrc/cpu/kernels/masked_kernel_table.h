// The masked CPU kernels' interface (batch_norm_masked_*, see
// cpu/batch_norm_masked_cpu.cpp). Compiled once per instruction set like the
// plain kernels (batch_norm_masked_kernels.cpp); `masked_kernel_table()` returns the copy
// that runs.
//
// The data is a contiguous [outer, channels, inner] array (Extent) in one of
// two forms (MaskedView): planes (NCX data, inner > 1), where the valid
// positions of each outer index come as runs along inner, or rows (channels
// last, and 2-D data: inner == 1), where an outer index (a row of channels) is
// valid or not. Padded positions are never read.
//
// A training pass reduces each channel, asks the operator's finish for the
// channel's coefficients, and runs the elementwise pass with them; the
// kernels pick the order (planes: a channel, or a run of channels, at a time,
// the pass following while the channel is in cache). The formulas stay with
// the operator.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/FunctionRef.h>

#include <cstdint>

#include "math/activation_math.h"
#include "math/batch_norm_math.h"
#include "math/extent.h"

namespace torch_bn_grad::cpu {

struct MaskedView {
  Extent e;
  // rows form: mask[o] for row o. planes form: the runs [begin, end) along
  // inner of outer index o are runs[2 * k], runs[2 * k + 1] for k in
  // [run_offsets[o], run_offsets[o + 1]).
  const bool* mask;
  const int64_t* run_offsets;
  const int64_t* runs;
  bool rows;
  // Valid positions per channel, and the first one (outer, inner), whose
  // value of each channel is that channel's centre for the statistics.
  int64_t count;
  int64_t first_outer;
  int64_t first_inner;
};

// A channel's elementwise pass in float64: out = k.dy_scale * dy +
// k.x_scale * (x - mean) + k.bias at valid positions (without dy:
// k.x_scale * (x - mean) + k.bias), 0 at padded ones. The kernels round it
// by math::channel_affine.
struct MaskedChannelAffine {
  double mean;
  math::BackwardCoefficients<double> k;
};

// The forward pass's epilogue: dst = act(z + residual) where z is the
// batch norm's value, at valid positions (padded ones stay 0, which every
// activation keeps); `residual` in the layout's form, undefined when absent.
// The plain operators' epilogue is the default: identity, no residual.
struct MaskedAct {
  at::Tensor residual;
  act::Kind kind = act::Kind::identity;
  double slope = 0.0;
};

// The operator's per-channel step between a reduction and the elementwise
// pass: a channel's coefficients from its sums (it may keep results of its
// own, such as the statistics). Called once per channel, from any thread.
using MaskedMomentsFinish = c10::function_ref<MaskedChannelAffine(int64_t channel, const math::Moments<double>&)>;
using MaskedGradFinish = c10::function_ref<MaskedChannelAffine(int64_t channel, const math::GradSums<double>&)>;
// A channel's coefficients where no reduction precedes the pass.
using MaskedCoefficients = c10::function_ref<MaskedChannelAffine(int64_t channel)>;

struct MaskedKernelTable {
  // The training forward (count > 0): each channel's moments over its valid
  // values, finish, and the pass without dy into `out`, through `act`.
  void (*forward)(const at::Tensor& src, at::Tensor& out, const MaskedView& v, MaskedMomentsFinish finish,
                  const MaskedAct& act);
  // The forward's pass alone (frozen statistics, or no valid position).
  void (*forward_affine)(const at::Tensor& src, at::Tensor& out, const MaskedView& v,
                         MaskedCoefficients coefficients, const MaskedAct& act);
  // The backward's sums (count > 0): sum(dy) and sum(dy * (x - mean[c])) over
  // each channel's valid positions, finish, and the pass with dy into `out`
  // where `out` is defined.
  void (*backward)(const at::Tensor& src, const at::Tensor& diff_dst, at::Tensor& out, const MaskedView& v,
                   const double* mean, MaskedGradFinish finish);
  // The backward's pass alone.
  void (*backward_affine)(const at::Tensor& src, const at::Tensor& diff_dst, at::Tensor& out, const MaskedView& v,
                          MaskedCoefficients coefficients);
  // The fused backward's gate: dz = diff_dst * act'(...) at valid positions,
  // 0 at padded ones; act' read from `dst` where the activation allows
  // (act::*::kGradFromOutput), else from z recomputed as the forward made it
  // (`forward`'s coefficients, src and act.residual).
  void (*gate)(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& diff_dst, at::Tensor& dz,
               const MaskedView& v, MaskedCoefficients forward, const MaskedAct& act);
};

const MaskedKernelTable& masked_kernel_table();

const MaskedKernelTable& masked_kernel_table_DEFAULT();
const MaskedKernelTable& masked_kernel_table_AVX2();
const MaskedKernelTable& masked_kernel_table_AVX512();

}  // namespace torch_bn_grad::cpu
