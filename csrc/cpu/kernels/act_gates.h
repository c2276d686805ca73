// The epilogues (epilogue.h) of the fused batch_norm_act operators: the
// activation of the forward, and the backward's dz = dy * act'(z), with the
// formulas of activation_math.h evaluated on vectors (VecOps).
//
// Where the backward gets act'(z) from (activation_math.h):
// * SignBitsGate: from the forward's sign bits of y (relu, leaky_relu;
//   sign_bits.h), which ForwardAct writes when asked.
// * OutputGate: from the forward's output y (relu, leaky_relu, identity);
//   kFromOutput (memory saving) also reads y in place of x, the kernel then
//   centring u = act^-1(y) - r (operators.h, backward_impl's `unit`).
// * InputGate: from z recomputed as scale * (x - mean) + shift + r (silu).
#pragma once

#include <c10/macros/Macros.h>

#include <cstdint>

#include "math/activation_math.h"
#include "math/batch_norm_math.h"
#include "cpu/kernels/epilogue.h"
#include "cpu/kernels/sign_bits.h"
#include "cpu/kernels/vec_io.h"

namespace torch_bn_grad::cpu {
namespace CPU_CAPABILITY {
namespace {  // internal linkage: see vec_io.h

// The per-chunk hooks are always inlined (as are activation_math.h's
// formulas): called out of line, each call made the block kernels spill and
// reload their vector accumulators (every vector register is caller-saved),
// and GCC left OutputGate::apply and Relu::grad_from_output out of line.

// activation_math.h's Ops on at::vec vectors.
struct VecOps {
  template <typename V>
  C10_ALWAYS_INLINE static V select_positive(const V& c, const V& a, const V& b) {
    return V::blendv(b, a, c > V(0));
  }
  template <typename V>
  C10_ALWAYS_INLINE static V exp(const V& v) {
    return v.exp();
  }
};

// Hooks every activation epilogue shares: none of its own per-channel data.
template <typename T>
struct GateBase {
  using IO = Io<T>;
  using acc_t = typename IO::acc_t;
  using Vec = typename IO::Vec;
  static constexpr int P = IO::kParts;
  static constexpr int64_t K = IO::kChunk;
  // InputGate binds channels' coefficients: no chunk across planes
  // (epilogue.h); the other gates say so themselves.
  static constexpr bool kSegmentChunks = false;

  C10_ALWAYS_INLINE static void load(const T* p, int64_t off, int64_t lanes, Vec (&v)[P]) {
    IO::load_lanes(p + off, lanes, v);
  }
  C10_ALWAYS_INLINE static void store(T* p, int64_t off, int64_t lanes, const Vec (&v)[P]) {
    if (lanes == K) IO::store(p + off, v);
    else IO::store_partial(p + off, lanes, v);
  }
};

// The forward: out = act(out) before the store; with `positive`, the sign
// bits of what was stored (the rounded values: act' is read from them as from
// the output).
template <typename T, typename Act>
struct ForwardAct : PlainEpilogue<T> {
  using typename PlainEpilogue<T>::acc_t;
  using typename PlainEpilogue<T>::Vec;
  using IO = Io<T>;
  static constexpr int P = IO::kParts;
  acc_t slope;
  // relu as leaky_relu with slope 0 then relu: the negative side's z * 0
  // (-0, or NaN for -inf) made 0, bit for bit relu's; one instantiation for both.
  bool then_relu = false;
  uint8_t* positive = nullptr;  // sign bits, in layouts where sign_bits_fit<T>
  C10_ALWAYS_INLINE void post(Vec& v) const {
    v = Act::template forward<VecOps>(v, Vec(slope));
    if (then_relu) v = act::Relu::forward<VecOps>(v, Vec(0));
  }
  C10_ALWAYS_INLINE void stored(const T*, int64_t off, int64_t lanes, const Vec (&v)[P]) const {
    constexpr int64_t K = IO::kChunk;
    if constexpr (K % 8 == 0 && K <= 32) {  // else never set (sign_bits_fit)
      if (!positive) return;
      if constexpr (P == 1) {
        write_bits<K>(positive, off, chunk_positive_bits<T>(v), static_cast<int>(lanes));
      } else {
        // The stored values, rounded in registers as the store rounded them:
        // reading them back would stall on a streaming store (partition.h).
        Vec rounded[P];
        std::tie(rounded[0], rounded[1]) = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(v[0], v[1]));
        write_bits<K>(positive, off, chunk_positive_bits<T>(rounded), static_cast<int>(lanes));
      }
    }
  }
};

// What both backward gates do with dz once they have it.
template <typename T>
struct DzOut : GateBase<T> {
  using typename GateBase<T>::acc_t;
  using typename GateBase<T>::Vec;
  static constexpr int P = GateBase<T>::P;
  T* dz = nullptr;  // diff_residual, or null
  void post(Vec&) const {}
  void stored(const T*, int64_t, int64_t, const Vec (&)[P]) const {}
  C10_ALWAYS_INLINE void store_dz(int64_t off, int64_t lanes, const Vec (&v)[P]) const {
    if (dz) this->store(dz, off, lanes, v);
  }
};

// act'(z) from the forward's sign bits of y (relu, leaky_relu): act' is
// `positive_grad` where y > 0, else `other_grad`.
template <typename T, typename Act>
struct SignBitsGate : DzOut<T> {
  using typename DzOut<T>::acc_t;
  using typename DzOut<T>::Vec;
  static constexpr int P = DzOut<T>::P;
  static constexpr int64_t W = Vec::size(), K = DzOut<T>::K;
  const uint8_t* positive = nullptr;
  int64_t bytes = 0;
  acc_t positive_grad = 1, other_grad = 0;

  // Bit i is element i: chunks may run across lines (segment reductions).
  static constexpr bool kSegmentChunks = true;

  C10_ALWAYS_INLINE void apply(int64_t off, int64_t lanes, Vec (&)[P], Vec (&d)[P]) const {
    // A partial chunk's other lanes read as 0 and meet zero-filled dy lanes.
    const uint32_t bits = read_bits(positive, bytes, off, static_cast<int>(lanes));
    for (int q = 0; q < P; ++q)
      d[q] = d[q] * select_bits(bits >> (q * W), Vec(positive_grad), Vec(other_grad));
  }
  const SignBitsGate& plane(int64_t) const { return *this; }
  const SignBitsGate& columns(int64_t, int64_t = 0) const { return *this; }
};

// act'(z) from the output y. Normal mode: the kernel's x is the input and
// `y` the output, or null where act' is 1 (identity: dz = dy). kFromOutput:
// the kernel's x is the output, turned into u = act^-1(y) - r.
template <typename T, typename Act, bool kFromOutput>
struct OutputGate : DzOut<T> {
  using typename DzOut<T>::acc_t;
  using typename DzOut<T>::Vec;
  static constexpr int P = DzOut<T>::P;
  const T* y = nullptr;  // normal mode
  const T* r = nullptr;  // kFromOutput: the residual, or null
  acc_t slope = 0;
  static constexpr bool kSegmentChunks = true;

  C10_ALWAYS_INLINE void apply(int64_t off, int64_t lanes, Vec (&x)[P], Vec (&d)[P]) const {
    if constexpr (!Act::kNeedsGate && !kFromOutput) return;
    Vec g[P], rv[P];
    if constexpr (kFromOutput) {
      if (r) this->load(r, off, lanes, rv);
      for (int q = 0; q < P; ++q) {
        g[q] = x[q];
        x[q] = Act::template inverse<VecOps>(x[q], Vec(slope));
        if (r) x[q] = x[q] - rv[q];
      }
    } else {
      if (!y) return;
      this->load(y, off, lanes, g);
    }
    if constexpr (Act::kNeedsGate)
      for (int q = 0; q < P; ++q) d[q] = d[q] * Act::template grad_from_output<VecOps>(g[q], Vec(slope));
  }
  // No per-channel data: the gate binds to itself.
  const OutputGate& plane(int64_t) const { return *this; }
  const OutputGate& columns(int64_t, int64_t = 0) const { return *this; }
};

// act'(z) from z = scale * (x - mean) + shift + r, recomputed with the
// forward's per-channel coefficients (`forward`, of the accumulation type).
template <typename T, typename Act>
struct InputGate : DzOut<T> {
  using typename DzOut<T>::acc_t;
  using typename DzOut<T>::Vec;
  static constexpr int P = DzOut<T>::P;
  static constexpr int64_t W = Vec::size();
  math::AffineArrays<acc_t> forward{};
  const T* r = nullptr;
  acc_t slope = 0;

  struct Bound {
    const InputGate& gate;
    Vec mean[P], scale[P], shift[P];
    C10_ALWAYS_INLINE void apply(int64_t off, int64_t lanes, Vec (&x)[P], Vec (&d)[P]) const {
      Vec rv[P];
      if (gate.r) gate.load(gate.r, off, lanes, rv);
      for (int q = 0; q < P; ++q) {
        Vec z = at::vec::fmadd(x[q] - mean[q], scale[q], shift[q]);
        if (gate.r) z = z + rv[q];
        d[q] = d[q] * Act::template grad<VecOps>(z, Vec(gate.slope));
      }
    }
  };
  Bound plane(int64_t k) const {
    Bound b{*this, {}, {}, {}};
    for (int q = 0; q < P; ++q) {
      b.mean[q] = Vec(forward.mean[k]);
      b.scale[q] = Vec(forward.x_scale[k]);
      b.shift[q] = Vec(forward.bias[k]);
    }
    return b;
  }
  // Channels [c, c + lanes): a partial chunk's lanes past them read zero
  // coefficients (and meet zero-filled dy lanes).
  Bound columns(int64_t c, int64_t lanes = GateBase<T>::K) const {
    Bound b{*this, {}, {}, {}};
    for (int q = 0; q < P; ++q) {
      const int64_t n = GateBase<T>::IO::part_lanes(lanes, q);
      b.mean[q] = Vec::loadu(forward.mean + c + q * W, n);
      b.scale[q] = Vec::loadu(forward.x_scale + c + q * W, n);
      b.shift[q] = Vec::loadu(forward.bias + c + q * W, n);
    }
    return b;
  }
};

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace torch_bn_grad::cpu
