// The CPU kernels' interface. The kernels are compiled once per instruction
// set (csrc/cpu/kernels/*.cpp, see setup.py); `kernel_table()` returns the
// copy that matches the running CPU (at::get_cpu_capability()).
//
// Every data tensor is a contiguous [outer, channels, inner] array. Per-channel
// tensors are contiguous float64 vectors, except the inputs of the
// primitives marked "acc", which are of the accumulation type (float64 for
// float64 data, float32 otherwise).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace torch_bn_grad::cpu {

struct Extent {
  int64_t outer;
  int64_t channels;
  int64_t inner;
};

struct KernelTable {
  // Training forward: batch mean and biased variance (written to mean, var),
  // then dst = (src - mean) * gamma * rstd + beta.
  void (*forward_batch)(const at::Tensor& src, at::Tensor& dst, const Extent& e, const at::Tensor& gamma,
                        const at::Tensor& beta, double epsilon, at::Tensor& mean, at::Tensor& var);
  // Forward with given statistics.
  void (*forward_frozen)(const at::Tensor& src, at::Tensor& dst, const Extent& e, const at::Tensor& mean,
                         const at::Tensor& var, const at::Tensor& gamma, const at::Tensor& beta,
                         double epsilon);
  // Backward: diff_src when `diff_src` is defined, diff_gamma and diff_beta when
  // they are defined; `training` selects the batch-statistics gradient.
  void (*backward)(const at::Tensor& src, const at::Tensor& diff_dst, at::Tensor& diff_src,
                   const Extent& e, const at::Tensor& mean, const at::Tensor& var,
                   const at::Tensor& gamma, double epsilon, bool training, at::Tensor& diff_gamma,
                   at::Tensor& diff_beta);

  // Primitives for split-stage algorithms (statistics across processes).
  // Batch mean and biased variance of each channel.
  void (*batch_stats)(const at::Tensor& src, const Extent& e, at::Tensor& mean, at::Tensor& var);
  // sum_dy = sum(diff_dst), sum_dy_xc = sum(diff_dst * (src - mean)) in one pass; mean "acc".
  void (*grad_sums)(const at::Tensor& src, const at::Tensor& diff_dst, const Extent& e,
                    const at::Tensor& mean, at::Tensor& sum_dy, at::Tensor& sum_dy_xc);
  // diff_src = a * diff_dst + b * (src - mean) + c; mean, a, b, c "acc".
  void (*grad_input)(const at::Tensor& src, const at::Tensor& diff_dst, at::Tensor& diff_src,
                     const Extent& e, const at::Tensor& mean, const at::Tensor& a,
                     const at::Tensor& b, const at::Tensor& c);
  const char* isa;
};

const KernelTable& kernel_table();

// One table per compiled instruction set (defined in the per-ISA objects).
const KernelTable& kernel_table_DEFAULT();
const KernelTable& kernel_table_AVX2();
const KernelTable& kernel_table_AVX512();

}  // namespace torch_bn_grad::cpu
