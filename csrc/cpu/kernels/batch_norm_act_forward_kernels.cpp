// The fused batch_norm_act forward: the plain forward of operators.h with an
// activation epilogue (act_gates.h, ForwardAct). Compiled once per
// instruction set, like batch_norm_kernels.cpp; dtype and activation are
// dispatched here, once.
//
// The identity activation has no epilogue of its own: without sign bits it
// is the plain forward with a residual (batch_norm_kernels.cpp's); with sign
// bits it is leaky_relu with slope 1 (z * 1 == z exactly, so the output and
// its bits are the same). relu is leaky_relu with slope 0 then relu
// (ForwardAct::then_relu). Neither adds an instantiation of the operators.
#include <ATen/OpMathType.h>

#include <cstdint>

#include "dtypes.h"
#include "math/activation_math.h"
#include "cpu/kernels/act_gates.h"
#include "cpu/kernels/act_kernel_table.h"
#include "cpu/kernels/kernel_table.h"
#include "cpu/kernels/operators.h"

namespace torch_bn_grad::cpu {
namespace CPU_CAPABILITY {
namespace {

template <typename T, typename Act>
void forward_as(ActForwardArgs& a, double slope, bool then_relu = false) {
  const T* x = a.src.const_data_ptr<T>();
  const T* r = data_or_null<T>(a.residual);
  T* y = a.dst.mutable_data_ptr<T>();
  ForwardAct<T, Act> ep;
  ep.slope = static_cast<at::opmath_type<T>>(slope);
  ep.then_relu = then_relu;
  if (a.dst_positive.defined()) ep.positive = a.dst_positive.mutable_data_ptr<uint8_t>();
  if (a.batch) {
    forward_batch_impl<T>(x, r, y, a.extent, a.gamma, a.beta, a.epsilon, a.mean, a.var, ep);
  } else {
    forward_frozen_impl<T>(x, r, y, a.extent, a.mean, a.var, a.gamma, a.beta, a.epsilon, ep);
  }
}

}  // namespace
}  // namespace CPU_CAPABILITY

void TBG_ISA_COPY(act_forward)(ActForwardArgs& a) {
  if (a.act.kind == act::Kind::identity && !a.dst_positive.defined()) {
    const KernelTable& plain = TBG_ISA_COPY(kernel_table)();
    if (a.batch) {
      plain.forward_batch(a.src, a.residual, a.dst, a.extent, a.gamma, a.beta, a.epsilon, a.mean, a.var);
    } else {
      plain.forward_frozen(a.src, a.residual, a.dst, a.extent, a.mean, a.var, a.gamma, a.beta, a.epsilon);
    }
    return;
  }
  TBG_DISPATCH_DATA_DTYPE(a.src.scalar_type(), "batch_norm_act_forward", [&] {
    act::dispatch_activation(a.act.kind, [&](auto activation) {
      using Act = decltype(activation);
      if constexpr (Act::kKind == act::Kind::identity) {
        CPU_CAPABILITY::forward_as<scalar_t, act::LeakyRelu>(a, 1.0);
      } else if constexpr (Act::kKind == act::Kind::relu) {
        CPU_CAPABILITY::forward_as<scalar_t, act::LeakyRelu>(a, 0.0, /*then_relu=*/true);
      } else {
        CPU_CAPABILITY::forward_as<scalar_t, Act>(a, a.act.slope);
      }
    });
  });
}

}  // namespace torch_bn_grad::cpu
