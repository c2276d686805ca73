// The CPU kernels of the fused batch_norm_act operators (interface), compiled
// once per instruction set like kernel_table.h's; `act_kernel_table()` picks
// the running CPU's copy. Data tensors are contiguous [outer, channels,
// inner] arrays, per-channel values float64 vectors in host memory; an
// undefined tensor or a null vector is an absent operand or an output not
// asked for.
#pragma once

#include <ATen/core/Tensor.h>

#include "math/activation_math.h"
#include "cpu/kernels/isa_copy.h"
#include "math/extent.h"

namespace torch_bn_grad::cpu {

struct ActParams {
  act::Kind kind;
  double slope;  // leaky_relu's negative_slope
};

struct ActForwardArgs {
  at::Tensor src, residual;  // residual may be undefined
  at::Tensor dst;            // output
  at::Tensor dst_positive;   // output, or undefined: dst's sign bits (where sign_bits_fit), uint8
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
  at::Tensor dst_positive;  // the forward's sign bits of dst: read instead of `output` when defined
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
  // Whether the forward can write dst's sign bits (dst_positive) for this
  // layout and dtype (cpu/kernels/sign_bits.h).
  bool (*sign_bits_fit)(const Extent& e, at::ScalarType dtype);
};

const ActKernelTable& act_kernel_table();

// One table per compiled instruction set, defined with the backward
// (batch_norm_act_backward_kernels.cpp); the forward is compiled apart
// (batch_norm_act_forward_kernels.cpp), so that the two build side by side.
const ActKernelTable& act_kernel_table_DEFAULT();
const ActKernelTable& act_kernel_table_AVX2();
const ActKernelTable& act_kernel_table_AVX512();
void act_forward_DEFAULT(ActForwardArgs& a);
void act_forward_AVX2(ActForwardArgs& a);
void act_forward_AVX512(ActForwardArgs& a);

}  // namespace torch_bn_grad::cpu
