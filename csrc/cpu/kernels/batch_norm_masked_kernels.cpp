// The masked operators' CPU kernels (masked_kernel_table.h) and this
// instruction set's MaskedKernelTable; compiled once per instruction set,
// everything in namespace CPU_CAPABILITY.
//
// Numerics: every channel's sums run over its valid positions in a fixed
// order that depends on the data's shape only (planes: a channel at a time;
// rows: blocks of kBlockRows rows merged in block order), so results are
// bitwise the same for any thread count and any padding content.
// * The sums are masked_sums.h's: float terms summed a few at a time into
//   float64 lanes, float64 terms, or compensated float64 sums.
// * The elementwise pass runs in the accumulation type on coefficients
//   rounded by math::channel_affine, as the plain operators' pass does.
// Scheduling (planes form): a thread sums a channel, or a run of short
// planes' channels, takes its coefficients from the operator's finish and
// runs its elementwise pass while its values are in the thread's cache, as
// the plain operators do (partition.h's strategies decide where): reading x
// (and dy) from memory a second time made a (32, 256, 400) float32 training
// step 1.3x the unmasked one's time (2 threads, AMD EPYC, docs/performance.md).
// The rows form reduces every channel first.
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dtypes.h"
#include "math/batch_norm_math.h"
#include "cpu/kernels/act_gates.h"
#include "cpu/kernels/masked_kernel_table.h"
#include "cpu/kernels/masked_sums.h"
#include "cpu/kernels/partition.h"
#include "cpu/kernels/tensor_data.h"
#include "cpu/kernels/vec_io.h"

#define TBG_MASKED_CONCAT_IMPL(a, b) a##b
#define TBG_MASKED_CONCAT(a, b) TBG_MASKED_CONCAT_IMPL(a, b)

namespace torch_bn_grad::cpu {
namespace CPU_CAPABILITY {
namespace {

// Elements a task of the elementwise pass takes at least.
constexpr int64_t kGrainElements = 32768;

// Coefficient array `p`'s vector for part q of the chunk at i: channel c's
// value in every lane (planes form), or lane by lane from c + i on (rows form).
template <typename V, bool kPerLane, int64_t kWidth, typename A>
C10_ALWAYS_INLINE V coefficient(const A* p, int64_t c, int64_t i, int q) {
  return kPerLane ? V::loadu(p + c + i + q * kWidth) : V(p[c]);
}

// The batch norm's value, x_scale * (x - mean) + bias, of part q of the chunk at i.
template <typename V, bool kPerLane, int64_t kWidth, typename A>
C10_ALWAYS_INLINE V normalized(const V& x, const math::AffineArrays<A>& a, int64_t c, int64_t i, int q) {
  return at::vec::fmadd(x - coefficient<V, kPerLane, kWidth>(a.mean, c, i, q),
                        coefficient<V, kPerLane, kWidth>(a.x_scale, c, i, q),
                        coefficient<V, kPerLane, kWidth>(a.bias, c, i, q));
}

// The elementwise pass over n values of one channel (planes form) or over a
// row's channels (rows form: coefficient arrays of kChunk-padded length):
// with dy, the backward's; without, the forward's, then `+ residual` where
// given and Act (the fused operators' epilogue, MaskedAct).
template <typename T, bool kDy, bool kPerLane, typename Act = act::Identity>
struct AffinePass {
  using I = Io<T>;
  using A = typename I::acc_t;
  using V = typename I::Vec;

  C10_ALWAYS_INLINE static void apply(const T* x, const T* g, const T* res, T* out, int64_t i, int64_t n,
                                      const math::AffineArrays<A>& a, int64_t c, A slope) {
    V xv[I::kParts], r[I::kParts];
    V gv[I::kParts];
    I::load_lanes(x + i, n, xv);
    if constexpr (kDy) I::load_lanes(g + i, n, gv);
    for (int q = 0; q < I::kParts; ++q) {
      r[q] = normalized<V, kPerLane, I::kWidth>(xv[q], a, c, i, q);
      if constexpr (kDy) r[q] = at::vec::fmadd(gv[q], coefficient<V, kPerLane, I::kWidth>(a.dy_scale, c, i, q), r[q]);
    }
    if constexpr (!kDy) {
      if (res) {
        V rv[I::kParts];
        I::load_lanes(res + i, n, rv);
        for (int q = 0; q < I::kParts; ++q) r[q] = r[q] + rv[q];
      }
      for (int q = 0; q < I::kParts; ++q) r[q] = Act::template forward<VecOps>(r[q], V(slope));
    }
    if (n == I::kChunk) I::store(out + i, r);
    else I::store_partial(out + i, n, r);
  }

  // out[0, n) from x[0, n) (and g, res); channel c's coefficients, or per lane from c on.
  static void span(const T* x, const T* g, const T* res, T* out, int64_t n, const math::AffineArrays<A>& a,
                   int64_t c, A slope) {
    int64_t i = 0;
    for (; i + I::kChunk <= n; i += I::kChunk) apply(x, g, res, out, i, I::kChunk, a, c, slope);
    if (i < n) apply(x, g, res, out, i, n - i, a, c, slope);
  }
};

// The fused backward's gate over n values: dz = dy (identity), dy * act'(y)
// from the forward's output y, or act'(z) from z recomputed as AffinePass<.., Act>
// made it (the forward's coefficients, x and the residual).
template <typename T, bool kPerLane, typename Act>
struct GatePass {
  using I = Io<T>;
  using A = typename I::acc_t;
  using V = typename I::Vec;

  C10_ALWAYS_INLINE static void apply(const T* x, const T* y, const T* res, const T* g, T* dz, int64_t i, int64_t n,
                                      const math::AffineArrays<A>& a, int64_t c, A slope) {
    V gv[I::kParts], d[I::kParts];
    I::load_lanes(g + i, n, gv);
    if constexpr (!Act::kNeedsGate) {
      for (int q = 0; q < I::kParts; ++q) d[q] = gv[q];
    } else if constexpr (Act::kGradFromOutput) {
      V yv[I::kParts];
      I::load_lanes(y + i, n, yv);
      for (int q = 0; q < I::kParts; ++q) d[q] = gv[q] * Act::template grad_from_output<VecOps>(yv[q], V(slope));
    } else {
      V xv[I::kParts], rv[I::kParts];
      I::load_lanes(x + i, n, xv);
      if (res) I::load_lanes(res + i, n, rv);
      for (int q = 0; q < I::kParts; ++q) {
        V z = normalized<V, kPerLane, I::kWidth>(xv[q], a, c, i, q);
        if (res) z = z + rv[q];
        d[q] = gv[q] * Act::template grad<VecOps>(z, V(slope));
      }
    }
    if (n == I::kChunk) I::store(dz + i, d);
    else I::store_partial(dz + i, n, d);
  }

  static void span(const T* x, const T* y, const T* res, const T* g, T* dz, int64_t n,
                   const math::AffineArrays<A>& a, int64_t c, A slope) {
    int64_t i = 0;
    for (; i + I::kChunk <= n; i += I::kChunk) apply(x, y, res, g, dz, i, I::kChunk, a, c, slope);
    if (i < n) apply(x, y, res, g, dz, i, n - i, a, c, slope);
  }
};

// The pass's coefficients of every channel, math::channel_affine of the
// operator's, in arrays padded to whole chunks (the rows form loads them a
// vector at a time).
template <typename T>
struct Coefficients {
  using A = at::opmath_type<T>;
  int64_t padded;
  std::vector<A> storage;
  explicit Coefficients(int64_t channels)
      : padded(ceil_div(channels, Io<T>::kChunk) * Io<T>::kChunk), storage(4 * padded, A(0)) {}
  Coefficients(int64_t channels, MaskedCoefficients coefficients) : Coefficients(channels) {
    for (int64_t c = 0; c < channels; ++c) set(c, coefficients(c));
  }
  void set(int64_t c, const MaskedChannelAffine& k) {
    const math::ChannelAffine<A> r = math::channel_affine<A>(k.mean, k.k);
    A* m = storage.data();
    m[c] = r.mean;
    m[padded + c] = r.dy_scale;
    m[2 * padded + c] = r.x_scale;
    m[3 * padded + c] = r.bias;
  }
  math::AffineArrays<A> arrays() const {
    const A* m = storage.data();
    return {m, m + padded, m + 2 * padded, m + 3 * padded};
  }
};

// ---------------------------------------------------------------- walks over the valid positions
// span(at, n, c, per_lane) on the valid runs of plane (o, c) (planes form),
// per_lane std::false_type, and zeros in `out` between them.
template <typename T, typename Span>
C10_ALWAYS_INLINE void plane_spans(T* out, const MaskedView& v, int64_t o, int64_t c, const Span& span) {
  const int64_t S = v.e.inner, base = (o * v.e.channels + c) * S;
  int64_t done = 0;
  for (int64_t k = v.run_offsets[o]; k < v.run_offsets[o + 1]; ++k) {
    const int64_t b = v.runs[2 * k], e = v.runs[2 * k + 1];
    std::memset(out + base + done, 0, (b - done) * sizeof(T));
    span(base + b, e - b, c, std::false_type{});
    done = e;
  }
  std::memset(out + base + done, 0, (S - done) * sizeof(T));
}

// span(at, n, c, per_lane) on every valid run of the array, and zeros in
// `out` at padded positions, in memory order and in parallel: the rows
// form's valid rows (a row's channels: per_lane std::true_type), or every
// plane's runs (plane_spans).
template <typename T, typename Span>
void valid_spans(T* out, const MaskedView& v, const Span& span) {
  const int64_t C = v.e.channels;
  if (v.rows) {
    const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(C, 1));
    at::parallel_for(0, v.e.outer, grain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        if (v.mask[r]) span(r * C, C, 0, std::true_type{});
        else std::memset(out + r * C, 0, C * sizeof(T));
      }
    });
    return;
  }
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(v.e.inner, 1));
  at::parallel_for(0, v.e.outer * C, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) plane_spans(out, v, p / C, p % C, span);
  });
}

// The elementwise pass of the operator (AffinePass) as a valid-span callback.
template <typename T, bool kDy, typename Act = act::Identity>
struct AffineSpans {
  using A = at::opmath_type<T>;
  const T* x;
  const T* g;
  const T* res;
  T* out;
  math::AffineArrays<A> a;
  A slope;
  template <typename PerLane>
  C10_ALWAYS_INLINE void operator()(int64_t at, int64_t n, int64_t c, PerLane) const {
    AffinePass<T, kDy, PerLane::value, Act>::span(x + at, kDy ? g + at : nullptr, res ? res + at : nullptr, out + at,
                                                  n, a, c, slope);
  }
};

// Channels a thread reduces, finishes and passes over together in the planes
// form, chosen as the plain operators choose theirs (partition.h): one when
// per_channel_strategy holds, a run of short planes' channels sized to the
// L2 (channel_run_channels), or 0: every channel reduced first, then the
// pass in memory order.
template <typename T>
int64_t fused_run_channels(const Extent& e, RunPass pass) {
  const Blocks b(e);
  if (per_channel_strategy(b, e, sizeof(T))) return 1;
  return channel_run_channels(b, e, sizeof(T), pass);
}

// The planes form's training pass: reduce(c) on every channel (it sums the
// channel, in a fixed order, and sets the coefficients `spans` reads), then,
// where `out` is given, the elementwise pass (`spans`, a valid-span
// callback); per run of fused_run_channels channels where there are runs, so
// that the pass reads the run's values from the thread's cache instead of
// memory (one outer index at a time: the run's planes of an outer index are
// adjacent).
template <typename T, typename Reduce, typename Spans>
void reduce_apply_planes(T* out, const MaskedView& v, RunPass pass, const Reduce& reduce, const Spans& spans) {
  const Extent& e = v.e;
  const int64_t run = out ? fused_run_channels<T>(e, pass) : 0;
  at::parallel_for(0, e.channels, grain_for(e, e.channels), [&](int64_t c0, int64_t c1) {
    if (run == 0) {
      for (int64_t c = c0; c < c1; ++c) reduce(c);
      return;
    }
    for (int64_t k0 = c0; k0 < c1; k0 += run) {
      const int64_t k1 = std::min(c1, k0 + run);
      for (int64_t c = k0; c < k1; ++c) reduce(c);
      for (int64_t o = 0; o < e.outer; ++o) {
        for (int64_t c = k0; c < k1; ++c) plane_spans(out, v, o, c, spans);
      }
    }
  });
  if (run == 0 && out) valid_spans(out, v, spans);
}

// f(at, n) on each valid run of channel c (planes form), in memory order.
template <typename F>
void for_channel_runs(const MaskedView& v, int64_t c, const F& f) {
  const int64_t C = v.e.channels, S = v.e.inner;
  for (int64_t o = 0; o < v.e.outer; ++o) {
    const int64_t base = (o * C + c) * S;
    for (int64_t k = v.run_offsets[o]; k < v.run_offsets[o + 1]; ++k)
      f(base + v.runs[2 * k], v.runs[2 * k + 1] - v.runs[2 * k]);
  }
}

// ---------------------------------------------------------------- kernels
template <typename T, typename Act>
void forward_typed(const T* x, const T* res, T* out, const MaskedView& v, MaskedMomentsFinish finish,
                   at::opmath_type<T> slope) {
  const int64_t C = v.e.channels, S = v.e.inner;
  Coefficients<T> co(C);
  const AffineSpans<T, false, Act> spans{x, nullptr, res, out, co.arrays(), slope};
  if (v.rows) {
    std::vector<double> centre(C);
    for (int64_t c = 0; c < C; ++c) centre[c] = static_cast<double>(x[v.first_outer * C + c]);
    const auto sums = reduce_rows<RowMoments<T>>(
        v, [&] { return RowMoments<T>(C); },
        [&](RowMoments<T>& s, int64_t r) { s.add_row(x + r * C, centre.data(), C); });
    for (int64_t c = 0; c < C; ++c) co.set(c, finish(c, sums.moments(c, v.count, centre.data())));
    valid_spans(out, v, spans);
    return;
  }
  reduce_apply_planes(out, v, RunPass::kForward, [&](int64_t c) {
    SpanMoments<T> s{static_cast<double>(x[(v.first_outer * C + c) * S + v.first_inner])};
    for_channel_runs(v, c, [&](int64_t at, int64_t n) { s.add(x + at, n); });
    co.set(c, finish(c, s.moments(v.count)));
  }, spans);
}

// `out` null: the sums and finish only.
template <typename T>
void backward_typed(const T* x, const T* g, T* out, const MaskedView& v, const double* mean,
                    MaskedGradFinish finish) {
  const int64_t C = v.e.channels;
  Coefficients<T> co(C);
  const AffineSpans<T, true> spans{x, g, nullptr, out, co.arrays(), 0};
  if (v.rows) {
    const auto sums = reduce_rows<RowGradSums<T>>(
        v, [&] { return RowGradSums<T>(C); },
        [&](RowGradSums<T>& s, int64_t r) { s.add_row(x + r * C, g + r * C, mean, C); });
    for (int64_t c = 0; c < C; ++c) co.set(c, finish(c, sums.sums(c)));
    if (out) valid_spans(out, v, spans);
    return;
  }
  reduce_apply_planes(out, v, RunPass::kBackward, [&](int64_t c) {
    SpanGradSums<T> s{mean[c]};
    for_channel_runs(v, c, [&](int64_t at, int64_t n) { s.add(x + at, g + at, n); });
    co.set(c, finish(c, s.sums()));
  }, spans);
}

template <typename T, bool kDy, typename Act = act::Identity>
void affine_typed(const T* x, const T* g, const T* res, T* out, const MaskedView& v, MaskedCoefficients coefficients,
                  at::opmath_type<T> slope = 0) {
  const Coefficients<T> co(v.e.channels, coefficients);
  valid_spans(out, v, AffineSpans<T, kDy, Act>{x, g, res, out, co.arrays(), slope});
}

// y: the forward's output (Act::kGradFromOutput), else null and z recomputed from x.
template <typename T, typename Act>
void gate_typed(const T* x, const T* y, const T* res, const T* g, T* dz, const MaskedView& v,
                MaskedCoefficients forward, at::opmath_type<T> slope) {
  const Coefficients<T> co = Act::kGradFromOutput ? Coefficients<T>(0) : Coefficients<T>(v.e.channels, forward);
  const auto a = co.arrays();
  valid_spans(dz, v, [&](int64_t at, int64_t n, int64_t c, auto per_lane) {
    GatePass<T, decltype(per_lane)::value, Act>::span(x ? x + at : nullptr, y ? y + at : nullptr,
                                                      res ? res + at : nullptr, g + at, dz + at, n, a, c, slope);
  });
}

void masked_forward(const at::Tensor& src, at::Tensor& out, const MaskedView& v, MaskedMomentsFinish finish,
                    const MaskedAct& act) {
  TBG_DISPATCH_DATA_DTYPE(src.scalar_type(), "batch_norm_masked_forward", [&] {
    act::dispatch_activation(act.kind, [&](auto a) {
      forward_typed<scalar_t, decltype(a)>(src.const_data_ptr<scalar_t>(), data_or_null<scalar_t>(act.residual),
                                           out.mutable_data_ptr<scalar_t>(), v, finish, act.slope);
    });
  });
}

void masked_forward_affine(const at::Tensor& src, at::Tensor& out, const MaskedView& v,
                           MaskedCoefficients coefficients, const MaskedAct& act) {
  TBG_DISPATCH_DATA_DTYPE(src.scalar_type(), "batch_norm_masked_forward", [&] {
    act::dispatch_activation(act.kind, [&](auto a) {
      affine_typed<scalar_t, false, decltype(a)>(src.const_data_ptr<scalar_t>(), nullptr,
                                                 data_or_null<scalar_t>(act.residual),
                                                 out.mutable_data_ptr<scalar_t>(), v, coefficients, act.slope);
    });
  });
}

void masked_backward(const at::Tensor& src, const at::Tensor& diff_dst, at::Tensor& out, const MaskedView& v,
                     const double* mean, MaskedGradFinish finish) {
  TBG_DISPATCH_DATA_DTYPE(src.scalar_type(), "batch_norm_masked_backward", [&] {
    backward_typed(src.const_data_ptr<scalar_t>(), diff_dst.const_data_ptr<scalar_t>(),
                   out_or_null<scalar_t>(out), v, mean, finish);
  });
}

void masked_backward_affine(const at::Tensor& src, const at::Tensor& diff_dst, at::Tensor& out, const MaskedView& v,
                            MaskedCoefficients coefficients) {
  TBG_DISPATCH_DATA_DTYPE(src.scalar_type(), "batch_norm_masked_backward", [&] {
    affine_typed<scalar_t, true>(src.const_data_ptr<scalar_t>(), diff_dst.const_data_ptr<scalar_t>(), nullptr,
                                 out.mutable_data_ptr<scalar_t>(), v, coefficients);
  });
}

void masked_gate(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& diff_dst, at::Tensor& dz,
                 const MaskedView& v, MaskedCoefficients forward, const MaskedAct& act) {
  TBG_DISPATCH_DATA_DTYPE(src.scalar_type(), "batch_norm_masked_act_backward", [&] {
    act::dispatch_activation(act.kind, [&](auto a) {
      using Act = decltype(a);
      gate_typed<scalar_t, Act>(Act::kGradFromOutput ? nullptr : src.const_data_ptr<scalar_t>(),
                                Act::kGradFromOutput ? data_or_null<scalar_t>(dst) : nullptr,
                                Act::kGradFromOutput ? nullptr : data_or_null<scalar_t>(act.residual),
                                diff_dst.const_data_ptr<scalar_t>(), dz.mutable_data_ptr<scalar_t>(), v, forward,
                                act.slope);
    });
  });
}

}  // namespace
}  // namespace CPU_CAPABILITY

const MaskedKernelTable& TBG_MASKED_CONCAT(masked_kernel_table_, CPU_CAPABILITY)() {
  static const MaskedKernelTable table{&CPU_CAPABILITY::masked_forward, &CPU_CAPABILITY::masked_forward_affine,
                                       &CPU_CAPABILITY::masked_backward, &CPU_CAPABILITY::masked_backward_affine,
                                       &CPU_CAPABILITY::masked_gate};
  return table;
}

}  // namespace torch_bn_grad::cpu
