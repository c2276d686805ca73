// The activations of the fused batch_norm_act operators, each formula written
// once for the CPU vector kernels, the CPU gates' constants and the CUDA kernels.
//
// A formula is a template over `Ops` (how to select on a sign and take exp)
// and the value type `V`: `ScalarOps` here works on float/double on the host
// and the device; the CPU kernels supply vector Ops (cpu/kernels/act_gates.h).
//
// Each activation says what its backward needs:
// * kGradFromOutput: act'(z) is a function of y = act(z) (relu, leaky_relu
//   with slope >= 0, identity), so the backward reads the saved output, never
//   a copy of z; otherwise (silu) z is recomputed from x, the statistics and
//   the residual.
// * kInvertible: z = inverse(y) for every y (identity, leaky_relu with
//   slope > 0): what the memory-saving backward (from the output) needs.
//
// To add an activation: a struct below, an entry in `Kind` and `kind_names`,
// a case in `dispatch_activation`; in Python its name in
// torch_bn_grad/_rules/checks.py, its dz as at:: ops in batch_norm_act_autograd.cpp (double
// backward differentiates it) and in _compile/inductor_act.py (the lowering).
#pragma once

#include <cmath>

#include "math/batch_norm_math.h"  // TBG_HOST_DEVICE

namespace torch_bn_grad::act {

enum class Kind : int { identity = 0, relu = 1, leaky_relu = 2, silu = 3 };

// The names the operators take, indexed by Kind.
inline constexpr const char* kind_names[] = {"identity", "relu", "leaky_relu", "silu"};

// Plain values, host or device.
struct ScalarOps {
  template <typename V>
  static TBG_HOST_DEVICE V select_positive(V c, V a, V b) {
    return c > V(0) ? a : b;
  }
  static TBG_HOST_DEVICE float exp(float v) { return expf(v); }
  static TBG_HOST_DEVICE double exp(double v) { return ::exp(v); }
};

struct Identity {
  static constexpr Kind kKind = Kind::identity;
  static constexpr bool kGradFromOutput = true;
  static constexpr bool kNeedsGate = false;  // act' == 1: dz = dy without reading anything
  template <typename O, typename V>
  static TBG_HOST_DEVICE V forward(V z, V) { return z; }
  template <typename O, typename V>
  static TBG_HOST_DEVICE V grad_from_output(V, V) { return V(1); }
  template <typename O, typename V>
  static TBG_HOST_DEVICE V inverse(V y, V) { return y; }
};

// relu'(0) = 0, as torch's threshold_backward; y > 0 exactly when z > 0.
struct Relu {
  static constexpr Kind kKind = Kind::relu;
  static constexpr bool kGradFromOutput = true;
  static constexpr bool kNeedsGate = true;
  template <typename O, typename V>
  static TBG_HOST_DEVICE V forward(V z, V) { return O::select_positive(z, z, V(0)); }
  template <typename O, typename V>
  static TBG_HOST_DEVICE V grad_from_output(V y, V) { return O::select_positive(y, V(1), V(0)); }
  template <typename O, typename V>
  static TBG_HOST_DEVICE V inverse(V y, V) { return y; }  // not invertible; never called
};

// Slope >= 0 (checked by the operators), so y > 0 exactly when z > 0.
struct LeakyRelu {
  static constexpr Kind kKind = Kind::leaky_relu;
  static constexpr bool kGradFromOutput = true;
  static constexpr bool kNeedsGate = true;
  template <typename O, typename V>
  static TBG_HOST_DEVICE V forward(V z, V slope) { return O::select_positive(z, z, z * slope); }
  template <typename O, typename V>
  static TBG_HOST_DEVICE V grad_from_output(V y, V slope) { return O::select_positive(y, V(1), slope); }
  template <typename O, typename V>
  static TBG_HOST_DEVICE V inverse(V y, V slope) { return O::select_positive(y, y, y / slope); }
};

// silu(z) = z * s, s = sigmoid(z); silu'(z) = s * (1 + z * (1 - s)).
struct Silu {
  static constexpr Kind kKind = Kind::silu;
  static constexpr bool kGradFromOutput = false;
  static constexpr bool kNeedsGate = true;
  template <typename O, typename V>
  static TBG_HOST_DEVICE V sigmoid(V z) { return V(1) / (V(1) + O::exp(V(0) - z)); }
  template <typename O, typename V>
  static TBG_HOST_DEVICE V forward(V z, V) { return z * sigmoid<O>(z); }
  template <typename O, typename V>
  static TBG_HOST_DEVICE V grad(V z, V) {
    const V s = sigmoid<O>(z);
    return s * (V(1) + z * (V(1) - s));
  }
};

// Whether the memory-saving backward (from the output) can invert `kind`.
TBG_HOST_DEVICE bool invertible(Kind kind, double slope) {
  return kind == Kind::identity || (kind == Kind::leaky_relu && slope > 0);
}

// f(Activation{}) for the activation `kind`: the one place an activation
// becomes a type.
template <typename F>
decltype(auto) dispatch_activation(Kind kind, const F& f) {
  switch (kind) {
    case Kind::relu: return f(Relu{});
    case Kind::leaky_relu: return f(LeakyRelu{});
    case Kind::silu: return f(Silu{});
    case Kind::identity: break;
  }
  return f(Identity{});
}

}  // namespace torch_bn_grad::act
