// The fused batch_norm_act operators' kernels: the plain batch-norm
// algorithms of operators.h with an activation epilogue (act_gates.h), and
// this instruction set's ActKernelTable. Compiled once per instruction set,
// like batch_norm_kernels.cpp; dtype and activation are dispatched here, once.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>

#include <cstdint>

#include "activation_math.h"
#include "batch_norm_math.h"
#include "cpu/aligned_array.h"
#include "cpu/kernels/act_gates.h"
#include "cpu/kernels/act_kernel_table.h"
#include "cpu/kernels/operators.h"
#include "cpu/kernels/sign_bits.h"

#define TBG_ACT_CONCAT_IMPL(a, b) a##b
#define TBG_ACT_CONCAT(a, b) TBG_ACT_CONCAT_IMPL(a, b)

namespace torch_bn_grad::cpu {
namespace CPU_CAPABILITY {
namespace {

template <typename T>
const T* data_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<T>() : nullptr;
}
template <typename T>
T* out_or_null(at::Tensor& t) {
  return t.defined() ? t.mutable_data_ptr<T>() : nullptr;
}

template <typename T, typename Act>
void forward_impl(ActForwardArgs& a) {
  using acc_t = at::opmath_type<T>;
  ForwardAct<T, Act> ep;
  ep.slope = static_cast<acc_t>(a.act.slope);
  const T* x = a.src.const_data_ptr<T>();
  const T* r = data_or_null<T>(a.residual);
  T* y = a.dst.mutable_data_ptr<T>();
  if (a.dst_positive.defined()) ep.positive = a.dst_positive.mutable_data_ptr<uint8_t>();
  if (a.batch) {
    forward_batch_impl<T>(x, r, y, a.extent, a.gamma, a.beta, a.epsilon, a.mean, a.var, ep);
  } else {
    forward_frozen_impl<T>(x, r, y, a.extent, a.mean, a.var, a.gamma, a.beta, a.epsilon, ep);
  }
}

template <typename T, typename Act>
void backward_impl_act(ActBackwardArgs& a) {
  using acc_t = at::opmath_type<T>;
  const Extent& e = a.extent;
  const T* x = a.data.const_data_ptr<T>();
  const T* dy = a.diff_dst.const_data_ptr<T>();
  const T* r = data_or_null<T>(a.residual);
  T* dx = out_or_null<T>(a.diff_src);
  T* dz = out_or_null<T>(a.diff_residual);
  const double *mean = a.mean, *var = a.var, *gamma = a.gamma, *beta = a.beta;
  double *dgamma = a.diff_gamma, *dbeta = a.diff_beta;
  const acc_t slope = static_cast<acc_t>(a.act.slope);
  if constexpr (Act::kGradFromOutput) {
    constexpr bool kInvertible = Act::kKind == act::Kind::identity || Act::kKind == act::Kind::leaky_relu;
    if constexpr (kInvertible) {
      if (a.from_output) {
        // The kernel centres u = act^-1(y) - r = gamma * rstd * (x - mean) + beta.
        const auto unit = aligned_array_for_overwrite<double>(e.channels);
        for (int64_t k = 0; k < e.channels; ++k) unit[k] = gamma[k] * math::rstd_of(var[k], a.epsilon);
        OutputGate<T, Act, true> gate;
        gate.r = r;
        gate.slope = slope;
        gate.dz = dz;
        backward_impl<T>(x, dy, dx, e, beta, unit.get(), var, gamma, a.epsilon, a.training, dgamma, dbeta, gate);
        return;
      }
    }
    if constexpr (Act::kNeedsGate) {
      if (a.dst_positive.defined()) {
        SignBitsGate<T, Act> gate;
        gate.positive = a.dst_positive.const_data_ptr<uint8_t>();
        gate.bytes = a.dst_positive.numel();
        gate.positive_grad = Act::template grad_from_output<act::ScalarOps>(acc_t(1), slope);
        gate.other_grad = Act::template grad_from_output<act::ScalarOps>(acc_t(-1), slope);
        gate.dz = dz;
        backward_impl<T>(x, dy, dx, e, mean, nullptr, var, gamma, a.epsilon, a.training, dgamma, dbeta, gate);
        return;
      }
    }
    OutputGate<T, Act, false> gate;
    gate.y = data_or_null<T>(a.output);
    gate.slope = slope;
    gate.dz = dz;
    backward_impl<T>(x, dy, dx, e, mean, nullptr, var, gamma, a.epsilon, a.training, dgamma, dbeta, gate);
  } else {
    AffineTable<acc_t> forward(e.channels);
    forward_affine_table(forward, 0, e.channels, mean, var, gamma, beta, a.epsilon, false);
    InputGate<T, Act> gate;
    gate.forward = forward.arrays();
    gate.r = r;
    gate.slope = slope;
    gate.dz = dz;
    backward_impl<T>(x, dy, dx, e, mean, nullptr, var, gamma, a.epsilon, a.training, dgamma, dbeta, gate);
  }
}

#define TBG_ACT_DISPATCH(tensor, name, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, (tensor).scalar_type(), name, __VA_ARGS__)

void forward(ActForwardArgs& a) {
  TBG_ACT_DISPATCH(a.src, "batch_norm_act_forward", [&] {
    act::dispatch_activation(a.act.kind, [&](auto activation) { forward_impl<scalar_t, decltype(activation)>(a); });
  });
}

void backward(ActBackwardArgs& a) {
  TBG_ACT_DISPATCH(a.data, "batch_norm_act_backward", [&] {
    act::dispatch_activation(a.act.kind,
                             [&](auto activation) { backward_impl_act<scalar_t, decltype(activation)>(a); });
  });
}

bool sign_bits_fit(const Extent& e, at::ScalarType dtype) {
  return AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "batch_norm_act_sign_bits_fit",
                                         [&] { return CPU_CAPABILITY::sign_bits_fit<scalar_t>(e); });
}

}  // namespace
}  // namespace CPU_CAPABILITY

const ActKernelTable& TBG_ACT_CONCAT(act_kernel_table_, CPU_CAPABILITY)() {
  static const ActKernelTable table{&CPU_CAPABILITY::forward, &CPU_CAPABILITY::backward,
                                    &CPU_CAPABILITY::sign_bits_fit};
  return table;
}

}  // namespace torch_bn_grad::cpu
