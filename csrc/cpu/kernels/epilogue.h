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

#include <c10/macros/Macros.h>

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

// A chunk coefficient that is the same vector for each of the chunk's parts
// (one channel's, in the plane kernels).
template <typename V>
struct EveryPart {
  V v;
  C10_ALWAYS_INLINE const V& operator[](int) const { return v; }
};

// The elementwise pass on the chunk at `off` (lanes < K: a partial chunk),
// the plane and the row kernels' alike: out = x_scale * (x - mean) + bias,
// plus dy_scale * y where y is given (y as the bound turns it), through the
// epilogue's hooks. `k` holds mean, x_scale, bias and dy_scale, each indexed
// by the chunk's part; `stream`: a full chunk goes out with a streaming store.
template <typename T, typename Coefficients, typename Bound, typename E>
C10_ALWAYS_INLINE void affine_chunk(const T* x, const T* y, T* out, int64_t off, const Coefficients& k,
                                    const Bound& bound, const E& ep, bool stream, int64_t lanes = Io<T>::kChunk) {
  using IO = Io<T>;
  typename IO::Vec xv[IO::kParts], yv[IO::kParts];
  IO::load_lanes(x + off, lanes, xv);
  if (y) {
    IO::load_lanes(y + off, lanes, yv);
    bound.apply(off, lanes, xv, yv);
    ep.store_dz(off, lanes, yv);
  }
  for (int q = 0; q < IO::kParts; ++q) {
    xv[q] = at::vec::fmadd(xv[q] - k.mean[q], k.x_scale[q], k.bias[q]);
    if (y) xv[q] = at::vec::fmadd(k.dy_scale[q], yv[q], xv[q]);
    ep.post(xv[q]);
  }
  if (lanes < IO::kChunk) IO::store_partial(out + off, lanes, xv);
  else if (stream) IO::store_stream(out + off, xv);
  else IO::store(out + off, xv);
  ep.stored(out, off, lanes, xv);
}

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace torch_bn_grad::cpu
