// The CPU kernels' interface. The kernels are compiled once per instruction
// set (csrc/cpu/kernels/*.cpp, see setup.py); `kernel_table()` returns the
// copy that matches the running CPU (at::get_cpu_capability()).
//
// Every data tensor is a contiguous [outer, channels, inner] array (Extent).
// Per-channel values are float64 vectors in host memory (null: absent).
#pragma once

#include <ATen/core/Tensor.h>

#include "cpu/kernels/isa_copy.h"
#include "math/extent.h"

namespace torch_bn_grad::cpu {

struct KernelTable {
  // Training forward: batch mean and biased variance (written to mean, var),
  // then dst = scale * (src - mean) + shift (+ residual, when defined: the
  // fused operators' identity activation).
  void (*forward_batch)(const at::Tensor& src, const at::Tensor& residual, at::Tensor& dst, const Extent& e,
                        const double* gamma, const double* beta, double epsilon, double* mean, double* var);
  // Forward with given statistics.
  void (*forward_frozen)(const at::Tensor& src, const at::Tensor& residual, at::Tensor& dst, const Extent& e,
                         const double* mean, const double* var, const double* gamma, const double* beta,
                         double epsilon);
  // Backward: diff_src when `diff_src` is defined, diff_gamma and diff_beta when
  // they are not null; `training` selects the batch-statistics gradient.
  void (*backward)(const at::Tensor& src, const at::Tensor& diff_dst, at::Tensor& diff_src, const Extent& e,
                   const double* mean, const double* var, const double* gamma, double epsilon, bool training,
                   double* diff_gamma, double* diff_beta);

  // Primitives for split-stage algorithms (statistics across processes).
  // Batch mean and centred second moment m2 of each channel.
  void (*batch_moments)(const at::Tensor& src, const Extent& e, double* mean, double* m2);
  // sum_dy = sum(diff_dst), sum_dy_xc = sum(diff_dst * (src - mean)) in one pass.
  void (*grad_sums)(const at::Tensor& src, const at::Tensor& diff_dst, const Extent& e, const double* mean,
                    double* sum_dy, double* sum_dy_xc);
  // The training diff_src from whole-batch statistics: `count` elements per
  // channel and grad_sums' rows (sum_dy, sum_dy_xc) summed over the batch.
  void (*grad_input)(const at::Tensor& src, const at::Tensor& diff_dst, at::Tensor& diff_src, const Extent& e,
                     const double* mean, const double* var, const double* gamma, const double* count,
                     const double* grad_sums, double epsilon);
  // The running-statistics update of batch_norm_update_running_stats on
  // contiguous vectors: running (float64, float32, float16 or bfloat16) <-
  // lerp(running, batch * factor, weight) (factor 1: batch as it is), batch
  // in running's opmath type (float32 for half-precision buffers), with
  // at::mul's, the cast's and at::lerp's roundings. Here so that its fused
  // multiply-add is an instruction, not a libm call per value, and a
  // half-precision model's update is one loop, not five tensor operations.
  void (*update_running)(const at::Tensor& running, const at::Tensor& batch, double factor, double weight);
  // The operators' per-channel vectors (channel_convert.h): a contiguous
  // floating vector to float64 values, and float64 values to one, rounded
  // once to the nearest.
  void (*widen_channels)(const at::Tensor& t, double* out);
  void (*narrow_channels)(const double* v, const at::Tensor& out);
  const char* isa;
};

const KernelTable& kernel_table();

// One table per compiled instruction set (defined in the per-ISA objects).
const KernelTable& kernel_table_DEFAULT();
const KernelTable& kernel_table_AVX2();
const KernelTable& kernel_table_AVX512();

}  // namespace torch_bn_grad::cpu
