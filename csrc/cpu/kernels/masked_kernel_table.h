// The masked CPU kernels' interface (batch_norm_masked_*, see
// cpu/masked_batch_norm_cpu.cpp). Compiled once per instruction set like the
// plain kernels (masked_kernels.cpp); `masked_kernel_table()` returns the copy
// that runs.
//
// The data is a contiguous [outer, channels, inner] array (Extent) in one of
// two forms (MaskedView): planes (NCX data, inner > 1), where the valid
// positions of each outer index come as runs along inner, or rows (channels
// last, and 2-D data: inner == 1), where an outer index (a row of channels) is
// valid or not. Padded positions are never read.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

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

struct MaskedKernelTable {
  // Mean and biased variance of each channel's valid values (count > 0).
  void (*moments)(const at::Tensor& src, const MaskedView& v, double* mean, double* var);
  // sum(dy) and sum(dy * (x - mean)) over each channel's valid positions.
  void (*grad_sums)(const at::Tensor& src, const at::Tensor& diff_dst, const MaskedView& v, const double* mean,
                    double* sum_dy, double* sum_dy_xc);
  // out = dy_scale * dy + x_scale * (x - mean) + bias at valid positions
  // (without dy, when diff_dst is undefined: x_scale * (x - mean) + bias), 0 at
  // padded ones; the per-channel coefficients as math::BackwardCoefficients,
  // rounded by math::channel_affine.
  void (*affine)(const at::Tensor& src, const at::Tensor& diff_dst, at::Tensor& out, const MaskedView& v,
                 const double* mean, const double* dy_scale, const double* x_scale, const double* bias);
};

const MaskedKernelTable& masked_kernel_table();

const MaskedKernelTable& masked_kernel_table_DEFAULT();
const MaskedKernelTable& masked_kernel_table_AVX2();
const MaskedKernelTable& masked_kernel_table_AVX512();

}  // namespace torch_bn_grad::cpu
