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
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "math/batch_norm_math.h"
#include "cpu/kernels/masked_kernel_table.h"
#include "cpu/kernels/masked_sums.h"
#include "cpu/kernels/partition.h"
#include "cpu/kernels/vec_io.h"

#define TBG_MASKED_CONCAT_IMPL(a, b) a##b
#define TBG_MASKED_CONCAT(a, b) TBG_MASKED_CONCAT_IMPL(a, b)

namespace torch_bn_grad::cpu {
namespace CPU_CAPABILITY {
namespace {

// Elements a task of the elementwise pass takes at least.
constexpr int64_t kGrainElements = 32768;

// The elementwise pass over n values of one channel (planes form) or over a
// row's channels (rows form: coefficient arrays of kChunk-padded length).
template <typename T, bool kDy, bool kPerLane>
struct AffinePass {
  using I = Io<T>;
  using A = typename I::acc_t;
  using V = typename I::Vec;

  C10_ALWAYS_INLINE static void apply(const T* x, const T* g, T* out, int64_t i, int64_t n,
                                      const math::AffineArrays<A>& a, int64_t c) {
    V xv[I::kParts], r[I::kParts];
    V gv[I::kParts];
    if (n == I::kChunk) {
      I::load(x + i, xv);
      if constexpr (kDy) I::load(g + i, gv);
    } else {
      I::load_partial(x + i, n, xv);
      if constexpr (kDy) I::load_partial(g + i, n, gv);
    }
    for (int q = 0; q < I::kParts; ++q) {
      const int64_t at = kPerLane ? c + i + q * I::kWidth : c;
      const V mean = kPerLane ? V::loadu(a.mean + at) : V(a.mean[at]);
      const V xs = kPerLane ? V::loadu(a.x_scale + at) : V(a.x_scale[at]);
      const V bias = kPerLane ? V::loadu(a.bias + at) : V(a.bias[at]);
      r[q] = at::vec::fmadd(xv[q] - mean, xs, bias);
      if constexpr (kDy) {
        const V ds = kPerLane ? V::loadu(a.dy_scale + at) : V(a.dy_scale[at]);
        r[q] = at::vec::fmadd(gv[q], ds, r[q]);
      }
    }
    if (n == I::kChunk) I::store(out + i, r);
    else I::store_partial(out + i, n, r);
  }

  // out[0, n) from x[0, n) (and g); channel c's coefficients, or per lane from c on.
  static void span(const T* x, const T* g, T* out, int64_t n, const math::AffineArrays<A>& a, int64_t c) {
    int64_t i = 0;
    for (; i + I::kChunk <= n; i += I::kChunk) apply(x, g, out, i, I::kChunk, a, c);
    if (i < n) apply(x, g, out, i, n - i, a, c);
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

// ---------------------------------------------------------------- passes
// The rows form's pass: valid rows through AffinePass, padded rows zeroed.
template <typename T, bool kDy>
void affine_rows(const T* x, const T* g, T* out, const MaskedView& v, const math::AffineArrays<at::opmath_type<T>>& a) {
  const int64_t C = v.e.channels;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(C, 1));
  at::parallel_for(0, v.e.outer, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (v.mask[r]) {
        AffinePass<T, kDy, true>::span(x + r * C, kDy ? g + r * C : nullptr, out + r * C, C, a, 0);
      } else {
        std::memset(out + r * C, 0, C * sizeof(T));
      }
    }
  });
}

// The pass over plane (o, c) of the planes form: its runs, and zeros between them.
template <typename T, bool kDy>
void affine_plane(const T* x, const T* g, T* out, const MaskedView& v, int64_t o, int64_t c,
                  const math::AffineArrays<at::opmath_type<T>>& a) {
  const int64_t S = v.e.inner, base = (o * v.e.channels + c) * S;
  int64_t done = 0;
  for (int64_t k = v.run_offsets[o]; k < v.run_offsets[o + 1]; ++k) {
    const int64_t b = v.runs[2 * k], e = v.runs[2 * k + 1];
    std::memset(out + base + done, 0, (b - done) * sizeof(T));
    AffinePass<T, kDy, false>::span(x + base + b, kDy ? g + base + b : nullptr, out + base + b, e - b, a, c);
    done = e;
  }
  std::memset(out + base + done, 0, (S - done) * sizeof(T));
}

// The planes form's pass over the whole array in memory order.
template <typename T, bool kDy>
void affine_planes(const T* x, const T* g, T* out, const MaskedView& v,
                   const math::AffineArrays<at::opmath_type<T>>& a) {
  const int64_t C = v.e.channels;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(v.e.inner, 1));
  at::parallel_for(0, v.e.outer * C, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) affine_plane<T, kDy>(x, g, out, v, p / C, p % C, a);
  });
}

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
// channel, in a fixed order, and sets its coefficients in `co`), then, where
// `out` is given, the elementwise pass; per run of fused_run_channels
// channels where there are runs, so that the pass reads the run's values
// from the thread's cache instead of memory (one outer index at a time: the
// run's planes of an outer index are adjacent).
template <typename T, bool kDy, typename Reduce>
void reduce_apply_planes(const T* x, const T* g, T* out, const MaskedView& v, RunPass pass,
                         const Coefficients<T>& co, const Reduce& reduce) {
  const Extent& e = v.e;
  const int64_t run = out ? fused_run_channels<T>(e, pass) : 0;
  const auto a = co.arrays();
  at::parallel_for(0, e.channels, grain_for(e, e.channels), [&](int64_t c0, int64_t c1) {
    if (run == 0) {
      for (int64_t c = c0; c < c1; ++c) reduce(c);
      return;
    }
    for (int64_t k0 = c0; k0 < c1; k0 += run) {
      const int64_t k1 = std::min(c1, k0 + run);
      for (int64_t c = k0; c < k1; ++c) reduce(c);
      for (int64_t o = 0; o < e.outer; ++o) {
        for (int64_t c = k0; c < k1; ++c) affine_plane<T, kDy>(x, g, out, v, o, c, a);
      }
    }
  });
  if (run == 0 && out) affine_planes<T, kDy>(x, g, out, v, a);
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
template <typename T>
void forward_typed(const T* x, T* out, const MaskedView& v, MaskedMomentsFinish finish) {
  const int64_t C = v.e.channels, S = v.e.inner;
  Coefficients<T> co(C);
  if (v.rows) {
    std::vector<double> centre(C);
    for (int64_t c = 0; c < C; ++c) centre[c] = static_cast<double>(x[v.first_outer * C + c]);
    const auto sums = reduce_rows<RowMoments<T>>(
        v, [&] { return RowMoments<T>(C); },
        [&](RowMoments<T>& s, int64_t r) { s.add_row(x + r * C, centre.data(), C); });
    for (int64_t c = 0; c < C; ++c) co.set(c, finish(c, sums.moments(c, v.count, centre.data())));
    affine_rows<T, false>(x, nullptr, out, v, co.arrays());
    return;
  }
  reduce_apply_planes<T, false>(x, nullptr, out, v, RunPass::kForward, co, [&](int64_t c) {
    SpanMoments<T> s{static_cast<double>(x[(v.first_outer * C + c) * S + v.first_inner])};
    for_channel_runs(v, c, [&](int64_t at, int64_t n) { s.add(x + at, n); });
    co.set(c, finish(c, s.moments(v.count)));
  });
}

// `out` null: the sums and finish only.
template <typename T>
void backward_typed(const T* x, const T* g, T* out, const MaskedView& v, const double* mean,
                    MaskedGradFinish finish) {
  const int64_t C = v.e.channels;
  Coefficients<T> co(C);
  if (v.rows) {
    const auto sums = reduce_rows<RowGradSums<T>>(
        v, [&] { return RowGradSums<T>(C); },
        [&](RowGradSums<T>& s, int64_t r) { s.add_row(x + r * C, g + r * C, mean, C); });
    for (int64_t c = 0; c < C; ++c) co.set(c, finish(c, sums.sums(c)));
    if (out) affine_rows<T, true>(x, g, out, v, co.arrays());
    return;
  }
  reduce_apply_planes<T, true>(x, g, out, v, RunPass::kBackward, co, [&](int64_t c) {
    SpanGradSums<T> s{mean[c]};
    for_channel_runs(v, c, [&](int64_t at, int64_t n) { s.add(x + at, g + at, n); });
    co.set(c, finish(c, s.sums()));
  });
}

template <typename T, bool kDy>
void affine_typed(const T* x, const T* g, T* out, const MaskedView& v, MaskedCoefficients coefficients) {
  Coefficients<T> co(v.e.channels);
  for (int64_t c = 0; c < v.e.channels; ++c) co.set(c, coefficients(c));
  if (v.rows) affine_rows<T, kDy>(x, g, out, v, co.arrays());
  else affine_planes<T, kDy>(x, g, out, v, co.arrays());
}

#define TBG_MASKED_DISPATCH(tensor, name, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, (tensor).scalar_type(), name, __VA_ARGS__)

void masked_forward(const at::Tensor& src, at::Tensor& out, const MaskedView& v, MaskedMomentsFinish finish) {
  TBG_MASKED_DISPATCH(src, "batch_norm_masked_forward", [&] {
    forward_typed(src.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(), v, finish);
  });
}

void masked_backward(const at::Tensor& src, const at::Tensor& diff_dst, at::Tensor& out, const MaskedView& v,
                     const double* mean, MaskedGradFinish finish) {
  TBG_MASKED_DISPATCH(src, "batch_norm_masked_backward", [&] {
    backward_typed(src.const_data_ptr<scalar_t>(), diff_dst.const_data_ptr<scalar_t>(),
                   out.defined() ? out.mutable_data_ptr<scalar_t>() : nullptr, v, mean, finish);
  });
}

void masked_affine(const at::Tensor& src, const at::Tensor& diff_dst, at::Tensor& out, const MaskedView& v,
                   MaskedCoefficients coefficients) {
  TBG_MASKED_DISPATCH(src, "batch_norm_masked_affine", [&] {
    const scalar_t* x = src.const_data_ptr<scalar_t>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    if (diff_dst.defined()) affine_typed<scalar_t, true>(x, diff_dst.const_data_ptr<scalar_t>(), o, v, coefficients);
    else affine_typed<scalar_t, false>(x, nullptr, o, v, coefficients);
  });
}

}  // namespace
}  // namespace CPU_CAPABILITY

const MaskedKernelTable& TBG_MASKED_CONCAT(masked_kernel_table_, CPU_CAPABILITY)() {
  static const MaskedKernelTable table{&CPU_CAPABILITY::masked_forward, &CPU_CAPABILITY::masked_backward,
                                       &CPU_CAPABILITY::masked_affine};
  return table;
}

}  // namespace torch_bn_grad::cpu
