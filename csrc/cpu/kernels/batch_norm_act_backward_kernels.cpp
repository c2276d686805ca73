// The fused batch_norm_act backward: the plain backward of operators.h with a
// gate (act_gates.h) that turns dy into dz = dy * act'(z), and this
// instruction set's ActKernelTable (its forward is
// batch_norm_act_forward_kernels.cpp's). Compiled once per instruction set,
// like batch_norm_kernels.cpp; dtype and activation are dispatched here, once.
//
// relu's and identity's backwards are leaky_relu's, so they add no
// instantiation: relu's with slope 0 (act'(z) is then select(y > 0, 1, 0) in
// both, bit for bit, and relu is never inverted: from_output is refused for
// it), identity's with slope 1 (act' is 1 and the inverse y / 1 is y, exactly)
// and no output to read in its normal mode (OutputGate without `y`: dz = dy).
#include <ATen/OpMathType.h>

#include <cstdint>

#include "dtypes.h"
#include "math/activation_math.h"
#include "math/batch_norm_math.h"
#include "cpu/aligned_array.h"
#include "cpu/kernels/act_gates.h"
#include "cpu/kernels/act_kernel_table.h"
#include "cpu/kernels/operators.h"
#include "cpu/kernels/sign_bits.h"

namespace torch_bn_grad::cpu {
namespace CPU_CAPABILITY {
namespace {

template <typename T, typename Act>
void backward_as(ActBackwardArgs& a, double act_slope, bool identity = false) {
  using acc_t = at::opmath_type<T>;
  const Extent& e = a.extent;
  const T* x = a.data.const_data_ptr<T>();
  const T* dy = a.diff_dst.const_data_ptr<T>();
  const T* r = data_or_null<T>(a.residual);
  T* dx = out_or_null<T>(a.diff_src);
  T* dz = out_or_null<T>(a.diff_residual);
  const double *mean = a.mean, *var = a.var, *gamma = a.gamma, *beta = a.beta;
  double *dgamma = a.diff_gamma, *dbeta = a.diff_beta;
  const acc_t slope = static_cast<acc_t>(act_slope);
  if constexpr (Act::kGradFromOutput) {
    if constexpr (Act::kKind == act::Kind::leaky_relu) {
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
    gate.y = identity ? nullptr : data_or_null<T>(a.output);
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

void backward(ActBackwardArgs& a) {
  TBG_DISPATCH_DATA_DTYPE(a.data.scalar_type(), "batch_norm_act_backward", [&] {
    act::dispatch_activation(a.act.kind, [&](auto activation) {
      using Act = decltype(activation);
      if constexpr (Act::kKind == act::Kind::relu) {
        backward_as<scalar_t, act::LeakyRelu>(a, 0.0);
      } else if constexpr (Act::kKind == act::Kind::identity) {
        backward_as<scalar_t, act::LeakyRelu>(a, 1.0, true);
      } else {
        backward_as<scalar_t, Act>(a, a.act.slope);
      }
    });
  });
}

bool sign_bits_fit(const Extent& e, at::ScalarType dtype) {
  return TBG_DISPATCH_DATA_DTYPE(dtype, "batch_norm_act_sign_bits_fit",
                                 [&] { return CPU_CAPABILITY::sign_bits_fit<scalar_t>(e); });
}

}  // namespace
}  // namespace CPU_CAPABILITY

const ActKernelTable& TBG_ISA_COPY(act_kernel_table)() {
  static const ActKernelTable table{&TBG_ISA_COPY(act_forward), &CPU_CAPABILITY::backward,
                                    &CPU_CAPABILITY::sign_bits_fit};
  return table;
}

}  // namespace torch_bn_grad::cpu
