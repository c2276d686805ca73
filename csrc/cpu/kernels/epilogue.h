// What the block kernels do around their per-element arithmetic besides plain
// batch norm: the hooks of the fused batch_norm_act operators
// (act_gates.h). `PlainEpilogue`, every hook a no-op, is plain batch norm;
// the compiler removes its calls.
//
// The hooks, as the plane and row kernels call them:
// * `plane(k)` / `columns(c)`: the hooks bound to channel k (planes) or to
//   the chunk of channels starting at c (rows), holding per-channel vectors.
// * `bound.apply(off, lanes, x, dy)` (backward, after the loads at offset
//   off): turns the loaded x into the value the kernel centres (the memory-
//   saving backward reads the output there) and dy into dz = dy * act'(z).
// * `store_dz(off, lanes, dz)`: writes dz (diff_residual) when asked for.
// * `post(v)`: the forward's activation, applied before the store.
// * `stored(out, off, lanes, v)`: after out[off, off + lanes) was stored from v
//   (the forward's sign bits, sign_bits.h).
// * `kSegmentChunks`: whether the hooks take chunks that run across channels
//   and plane rows (a segment reduction of short planes, partition.h): true
//   when they hold no per-channel data and address elements by offset only.
#pragma once

#include <cstdint>

#include "cpu/kernels/vec_io.h"

namespace torch_bn_grad::cpu {
namespace CPU_CAPABILITY {
namespace {  // internal linkage: see vec_io.h

template <typename T>
struct PlainEpilogue {
  using acc_t = typename Io<T>::acc_t;
  using Vec = typename Io<T>::Vec;
  static constexpr int P = Io<T>::kParts;
  static constexpr bool kSegmentChunks = true;

  struct Bound {
    void apply(int64_t, int64_t, Vec (&)[P], Vec (&)[P]) const {}
  };
  Bound plane(int64_t) const { return {}; }
  Bound columns(int64_t, int64_t = 0) const { return {}; }
  void store_dz(int64_t, int64_t, const Vec (&)[P]) const {}
  void post(Vec&) const {}
  void stored(const T*, int64_t, int64_t, const Vec (&)[P]) const {}
};

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace torch_bn_grad::cpu
