// The CPU kernels of the fused batch_norm_act operators (interface), compiled
// once per instruction set like kernel_table.h's; `act_kernel_table()` picks
// the running CPU's copy. Data tensors are contiguous [outer, channels,
// inner] arrays, per-channel values float64 vectors in host memory; an
// undefined tensor or a null vector is an absent operand or an output not
// asked for.
#pragma once

#include <ATen/core/Tensor.h>

#include "activation_math.h"
#include "extent.h"

namespace torch_bn_grad::cpu {

struct ActParams {
  act::Kind kind;
  double slope;  // leaky_relu's negative_slope
};

struct ActForwardArgs {
  at::Tensor src, residual;  // residual may be undefined
  at::Tensor dst;            // output
  Extent extent;
  const double *gamma, *beta;
  double *mean, *var;  // batch: written (batch statistics); frozen: read
  double epsilon;
  bool batch;
  ActParams act;
};

struct ActBackwardArgs {
  at::Tensor data;      // src, or the forward's dst when from_output
  at::Tensor output;    // the forward's dst (act' of relu/leaky_relu), when not from_output
  at::Tensor residual;  // the forward's residual: silu's z, from_output's act^-1(y) - r
  at::Tensor diff_dst;
  at::Tensor diff_src, diff_residual;  // outputs (diff_src defined whenever diff_residual is)
  Extent extent;
  const double *mean, *var, *gamma, *beta;
  double *diff_gamma = nullptr, *diff_beta = nullptr;  // outputs
  double epsilon;
  bool training, from_output;
  ActParams act;
};

struct ActKernelTable {
  void (*forward)(ActForwardArgs& a);
  void (*backward)(ActBackwardArgs& a);
};

const ActKernelTable& act_kernel_table();

const ActKernelTable& act_kernel_table_DEFAULT();
const ActKernelTable& act_kernel_table_AVX2();
const ActKernelTable& act_kernel_table_AVX512();

}  // namespace torch_bn_grad::cpu
