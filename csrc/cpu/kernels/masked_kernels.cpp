// The masked operators' CPU kernels (masked_kernel_table.h) and this
// instruction set's MaskedKernelTable; compiled once per instruction set,
// everything in namespace CPU_CAPABILITY.
//
// Numerics: every channel's sums run over its valid positions in a fixed
// order that depends on the data's shape only (planes: a channel at a time;
// rows: blocks of kBlockRows rows merged in block order), so results are
// bitwise the same for any thread count and any padding content.
// * float32, float16 and bfloat16 data are summed in float64 lanes: the
//   statistics as d = x - centre (exact in float64) and d^2 about the
//   channel's first valid value (math::shifted_moments), the backward's sums
//   as dy and dy * (x - mean). A float64 sum of such terms is far more accurate
//   than the data type can hold; it costs a widening per element, which the
//   memory traffic hides.
// * float64 data take compensated.h's sums (ShiftedSums, ExactGradSums), one
//   element at a time, as the CUDA kernels' threads do.
// * The elementwise pass runs in the accumulation type on coefficients
//   rounded by math::channel_affine, as the plain operators' pass does.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "math/batch_norm_math.h"
#include "math/compensated.h"
#include "cpu/kernels/masked_kernel_table.h"
#include "cpu/kernels/vec_io.h"

#define TBG_MASKED_CONCAT_IMPL(a, b) a##b
#define TBG_MASKED_CONCAT(a, b) TBG_MASKED_CONCAT_IMPL(a, b)

namespace torch_bn_grad::cpu {
namespace CPU_CAPABILITY {
namespace {

using VD = Vectorized<double>;
using VF = Vectorized<float>;

// Elements per step of the float64 reductions: four float64 vectors.
constexpr int64_t kStep = 4 * VD::size();
// Rows a block of the rows form reduces (its partial sums live in L1/L2).
constexpr int64_t kBlockRows = 256;
// Elements a task of the elementwise pass takes at least.
constexpr int64_t kGrainElements = 32768;

// kStep elements of float, float16 or bfloat16 data as four float64 vectors, in memory order.
template <typename T>
inline void load_step(const T* p, VD (&w)[4]) {
  static_assert(2 * VF::size() == kStep);
  if constexpr (std::is_same_v<T, float>) {
    widen(VF::loadu(p), w[0], w[1]);
    widen(VF::loadu(p + VF::size()), w[2], w[3]);
  } else {
    static_assert(Io<T>::kParts == 2);
    VF f[2];
    Io<T>::load(p, f);
    widen(f[0], w[0], w[1]);
    widen(f[1], w[2], w[3]);
  }
}

// Four float64 vectors and a scalar tail summed in a fixed order.
inline double total(const VD (&v)[4], double tail) {
  const VD s = (v[0] + v[1]) + (v[2] + v[3]);
  double lanes[VD::size()];
  s.store(lanes);
  double t = 0.0;
  for (int64_t i = 0; i < VD::size(); ++i) t += lanes[i];
  return t + tail;
}

// ---------------------------------------------------------------- per-channel sums over spans
// A channel's statistics sums over spans of valid values (planes form): float64
// lanes for float data, compensated.h's ShiftedSums for float64 data.
template <typename T>
struct SpanMoments {
  double centre;
  VD d[4] = {VD(0.0), VD(0.0), VD(0.0), VD(0.0)};
  VD d2[4] = {VD(0.0), VD(0.0), VD(0.0), VD(0.0)};
  double tail_d = 0.0, tail_d2 = 0.0;

  void add(const T* p, int64_t n) {
    const VD c(centre);
    int64_t i = 0;
    for (; i + kStep <= n; i += kStep) {
      VD w[4];
      load_step(p + i, w);
      for (int k = 0; k < 4; ++k) {
        const VD x = w[k] - c;
        d[k] = d[k] + x;
        d2[k] = at::vec::fmadd(x, x, d2[k]);
      }
    }
    for (; i < n; ++i) {
      const double x = static_cast<double>(p[i]) - centre;
      tail_d += x;
      tail_d2 = std::fma(x, x, tail_d2);
    }
  }
  math::Moments<double> moments(int64_t count) const {
    return math::shifted_moments(static_cast<double>(count), centre, total(d, tail_d), total(d2, tail_d2));
  }
};

template <>
struct SpanMoments<double> {
  double centre;
  math::ShiftedSums<double> s{0, {0.0, 0.0}, {0.0, 0.0}};

  void add(const double* p, int64_t n) {
    for (int64_t i = 0; i < n; ++i) math::add(s, p[i], centre);
  }
  math::Moments<double> moments(int64_t) const {
    const auto m = math::shifted_moments(s, centre);
    return {static_cast<double>(m.count), m.mean, m.m2};
  }
};

// A channel's gradient sums over spans: sum(dy), sum(dy * (x - mean)).
template <typename T>
struct SpanGradSums {
  double mean;
  VD dy[4] = {VD(0.0), VD(0.0), VD(0.0), VD(0.0)};
  VD dy_xc[4] = {VD(0.0), VD(0.0), VD(0.0), VD(0.0)};
  double tail_dy = 0.0, tail_dy_xc = 0.0;

  void add(const T* x, const T* g, int64_t n) {
    const VD m(mean);
    int64_t i = 0;
    for (; i + kStep <= n; i += kStep) {
      VD wx[4], wg[4];
      load_step(x + i, wx);
      load_step(g + i, wg);
      for (int k = 0; k < 4; ++k) {
        dy[k] = dy[k] + wg[k];
        dy_xc[k] = at::vec::fmadd(wg[k], wx[k] - m, dy_xc[k]);
      }
    }
    for (; i < n; ++i) {
      const double gi = static_cast<double>(g[i]);
      tail_dy += gi;
      tail_dy_xc = std::fma(gi, static_cast<double>(x[i]) - mean, tail_dy_xc);
    }
  }
  math::GradSums<double> sums() const { return {total(dy, tail_dy), total(dy_xc, tail_dy_xc)}; }
};

template <>
struct SpanGradSums<double> {
  double mean;
  math::ExactGradSums<double> s{{0.0, 0.0}, {0.0, 0.0}};

  void add(const double* x, const double* g, int64_t n) {
    for (int64_t i = 0; i < n; ++i) math::add_grad(s.dy, s.dy_xc, x[i], g[i], mean);
  }
  math::GradSums<double> sums() const { return math::grad_sums_of(s); }
};

// ---------------------------------------------------------------- per-channel sums over rows
// The rows form's sums: per-channel arrays for one block of rows, each valid
// row adding its channels a vector at a time (float data), or one channel at
// a time (float64 data's compensated sums).
template <typename T>
struct RowMoments {
  std::vector<double> d, d2;
  explicit RowMoments(int64_t channels) : d(channels, 0.0), d2(channels, 0.0) {}

  void add_row(const T* x, const double* centre, int64_t channels) {
    int64_t c = 0;
    for (; c + kStep <= channels; c += kStep) {
      VD w[4];
      load_step(x + c, w);
      for (int k = 0; k < 4; ++k) {
        const int64_t at = c + k * VD::size();
        const VD v = w[k] - VD::loadu(centre + at);
        (VD::loadu(d.data() + at) + v).store(d.data() + at);
        at::vec::fmadd(v, v, VD::loadu(d2.data() + at)).store(d2.data() + at);
      }
    }
    for (; c < channels; ++c) {
      const double v = static_cast<double>(x[c]) - centre[c];
      d[c] += v;
      d2[c] = std::fma(v, v, d2[c]);
    }
  }
  void merge(const RowMoments& b) {
    for (size_t c = 0; c < d.size(); ++c) {
      d[c] += b.d[c];
      d2[c] += b.d2[c];
    }
  }
  math::Moments<double> moments(int64_t c, int64_t count, const double* centre) const {
    return math::shifted_moments(static_cast<double>(count), centre[c], d[c], d2[c]);
  }
};

template <>
struct RowMoments<double> {
  std::vector<math::ShiftedSums<double>> s;
  explicit RowMoments(int64_t channels) : s(channels, math::ShiftedSums<double>{0, {0.0, 0.0}, {0.0, 0.0}}) {}

  void add_row(const double* x, const double* centre, int64_t channels) {
    for (int64_t c = 0; c < channels; ++c) math::add(s[c], x[c], centre[c]);
  }
  void merge(const RowMoments& b) {
    for (size_t c = 0; c < s.size(); ++c) s[c] = math::merge(s[c], b.s[c]);
  }
  math::Moments<double> moments(int64_t c, int64_t, const double* centre) const {
    const auto m = math::shifted_moments(s[c], centre[c]);
    return {static_cast<double>(m.count), m.mean, m.m2};
  }
};

template <typename T>
struct RowGradSums {
  std::vector<double> dy, dy_xc;
  explicit RowGradSums(int64_t channels) : dy(channels, 0.0), dy_xc(channels, 0.0) {}

  void add_row(const T* x, const T* g, const double* mean, int64_t channels) {
    int64_t c = 0;
    for (; c + kStep <= channels; c += kStep) {
      VD wx[4], wg[4];
      load_step(x + c, wx);
      load_step(g + c, wg);
      for (int k = 0; k < 4; ++k) {
        const int64_t at = c + k * VD::size();
        (VD::loadu(dy.data() + at) + wg[k]).store(dy.data() + at);
        at::vec::fmadd(wg[k], wx[k] - VD::loadu(mean + at), VD::loadu(dy_xc.data() + at)).store(dy_xc.data() + at);
      }
    }
    for (; c < channels; ++c) {
      const double gc = static_cast<double>(g[c]);
      dy[c] += gc;
      dy_xc[c] = std::fma(gc, static_cast<double>(x[c]) - mean[c], dy_xc[c]);
    }
  }
  void merge(const RowGradSums& b) {
    for (size_t c = 0; c < dy.size(); ++c) {
      dy[c] += b.dy[c];
      dy_xc[c] += b.dy_xc[c];
    }
  }
  math::GradSums<double> sums(int64_t c) const { return {dy[c], dy_xc[c]}; }
};

template <>
struct RowGradSums<double> {
  std::vector<math::ExactGradSums<double>> s;
  explicit RowGradSums(int64_t channels) : s(channels, math::ExactGradSums<double>{{0.0, 0.0}, {0.0, 0.0}}) {}

  void add_row(const double* x, const double* g, const double* mean, int64_t channels) {
    for (int64_t c = 0; c < channels; ++c) math::add_grad(s[c].dy, s[c].dy_xc, x[c], g[c], mean[c]);
  }
  void merge(const RowGradSums& b) {
    for (size_t c = 0; c < s.size(); ++c) s[c] = math::merge(s[c], b.s[c]);
  }
  math::GradSums<double> sums(int64_t c) const { return math::grad_sums_of(s[c]); }
};

// The rows form's reduction: blocks of kBlockRows rows in parallel, each
// block's sums (made by `make`, filled by add(block_sums, row)) merged in
// block order.
template <typename Sums, typename Make, typename Add>
Sums reduce_rows(const MaskedView& v, const Make& make, const Add& add) {
  const int64_t rows = v.e.outer;
  const int64_t blocks = ceil_div(rows, kBlockRows);
  std::vector<Sums> partial;
  partial.reserve(blocks);
  for (int64_t b = 0; b < blocks; ++b) partial.push_back(make());
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t end = std::min(rows, (b + 1) * kBlockRows);
      for (int64_t r = b * kBlockRows; r < end; ++r) {
        if (v.mask[r]) add(partial[b], r);
      }
    }
  });
  Sums result = make();
  for (const Sums& p : partial) result.merge(p);
  return result;
}

// ---------------------------------------------------------------- kernels
template <typename T>
void moments_typed(const T* x, const MaskedView& v, double* mean, double* var) {
  const int64_t C = v.e.channels, S = v.e.inner;
  if (v.rows) {
    std::vector<double> centre(C);
    for (int64_t c = 0; c < C; ++c) centre[c] = static_cast<double>(x[v.first_outer * C + c]);
    const auto sums = reduce_rows<RowMoments<T>>(
        v, [&] { return RowMoments<T>(C); },
        [&](RowMoments<T>& s, int64_t r) { s.add_row(x + r * C, centre.data(), C); });
    for (int64_t c = 0; c < C; ++c) {
      const auto m = sums.moments(c, v.count, centre.data());
      mean[c] = m.mean;
      var[c] = math::variance_of(m);
    }
    return;
  }
  at::parallel_for(0, C, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      SpanMoments<T> s{static_cast<double>(x[(v.first_outer * C + c) * S + v.first_inner])};
      for (int64_t o = 0; o < v.e.outer; ++o) {
        const T* plane = x + (o * C + c) * S;
        for (int64_t k = v.run_offsets[o]; k < v.run_offsets[o + 1]; ++k) {
          s.add(plane + v.runs[2 * k], v.runs[2 * k + 1] - v.runs[2 * k]);
        }
      }
      const auto m = s.moments(v.count);
      mean[c] = m.mean;
      var[c] = math::variance_of(m);
    }
  });
}

template <typename T>
void grad_sums_typed(const T* x, const T* g, const MaskedView& v, const double* mean, double* sum_dy,
                     double* sum_dy_xc) {
  const int64_t C = v.e.channels, S = v.e.inner;
  if (v.rows) {
    const auto sums = reduce_rows<RowGradSums<T>>(
        v, [&] { return RowGradSums<T>(C); },
        [&](RowGradSums<T>& s, int64_t r) { s.add_row(x + r * C, g + r * C, mean, C); });
    for (int64_t c = 0; c < C; ++c) {
      const auto s = sums.sums(c);
      sum_dy[c] = s.sum_dy;
      sum_dy_xc[c] = s.sum_dy_xc;
    }
    return;
  }
  at::parallel_for(0, C, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      SpanGradSums<T> s{mean[c]};
      for (int64_t o = 0; o < v.e.outer; ++o) {
        const int64_t base = (o * C + c) * S;
        for (int64_t k = v.run_offsets[o]; k < v.run_offsets[o + 1]; ++k) {
          const int64_t b = v.runs[2 * k];
          s.add(x + base + b, g + base + b, v.runs[2 * k + 1] - b);
        }
      }
      const auto r = s.sums();
      sum_dy[c] = r.sum_dy;
      sum_dy_xc[c] = r.sum_dy_xc;
    }
  });
}

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

template <typename T, bool kDy>
void affine_typed(const T* x, const T* g, T* out, const MaskedView& v, const math::AffineArrays<at::opmath_type<T>>& a) {
  const int64_t C = v.e.channels, S = v.e.inner;
  if (v.rows) {
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
    return;
  }
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(S, 1));
  at::parallel_for(0, v.e.outer * C, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t o = p / C, c = p % C, base = p * S;
      int64_t done = 0;
      for (int64_t k = v.run_offsets[o]; k < v.run_offsets[o + 1]; ++k) {
        const int64_t b = v.runs[2 * k], e = v.runs[2 * k + 1];
        std::memset(out + base + done, 0, (b - done) * sizeof(T));
        AffinePass<T, kDy, false>::span(x + base + b, kDy ? g + base + b : nullptr, out + base + b, e - b, a, c);
        done = e;
      }
      std::memset(out + base + done, 0, (S - done) * sizeof(T));
    }
  });
}

#define TBG_MASKED_DISPATCH(tensor, name, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, (tensor).scalar_type(), name, __VA_ARGS__)

void moments(const at::Tensor& src, const MaskedView& v, double* mean, double* var) {
  TBG_MASKED_DISPATCH(src, "batch_norm_masked_moments",
                      [&] { moments_typed(src.const_data_ptr<scalar_t>(), v, mean, var); });
}

void grad_sums(const at::Tensor& src, const at::Tensor& diff_dst, const MaskedView& v, const double* mean,
               double* sum_dy, double* sum_dy_xc) {
  TBG_MASKED_DISPATCH(src, "batch_norm_masked_grad_sums", [&] {
    grad_sums_typed(src.const_data_ptr<scalar_t>(), diff_dst.const_data_ptr<scalar_t>(), v, mean, sum_dy,
                    sum_dy_xc);
  });
}

void affine(const at::Tensor& src, const at::Tensor& diff_dst, at::Tensor& out, const MaskedView& v,
            const double* mean, const double* dy_scale, const double* x_scale, const double* bias) {
  TBG_MASKED_DISPATCH(src, "batch_norm_masked_affine", [&] {
    using A = at::opmath_type<scalar_t>;
    const bool has_dy = diff_dst.defined();
    // Coefficient arrays padded to whole chunks, so that the rows form loads them a vector at a time.
    const int64_t C = v.e.channels;
    const int64_t padded = ceil_div(C, Io<scalar_t>::kChunk) * Io<scalar_t>::kChunk;
    std::vector<A> coef(4 * padded, A(0));
    A *m = coef.data(), *ds = m + padded, *xs = ds + padded, *b = xs + padded;
    for (int64_t c = 0; c < C; ++c) {
      const auto r = math::channel_affine<A>(
          mean[c], math::BackwardCoefficients<double>{has_dy ? dy_scale[c] : 0.0, x_scale[c], bias[c]});
      m[c] = r.mean;
      ds[c] = r.dy_scale;
      xs[c] = r.x_scale;
      b[c] = r.bias;
    }
    const math::AffineArrays<A> arrays{m, ds, xs, b};
    const scalar_t* x = src.const_data_ptr<scalar_t>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    if (has_dy) affine_typed<scalar_t, true>(x, diff_dst.const_data_ptr<scalar_t>(), o, v, arrays);
    else affine_typed<scalar_t, false>(x, nullptr, o, v, arrays);
  });
}

}  // namespace
}  // namespace CPU_CAPABILITY

const MaskedKernelTable& TBG_MASKED_CONCAT(masked_kernel_table_, CPU_CAPABILITY)() {
  static const MaskedKernelTable table{&CPU_CAPABILITY::moments, &CPU_CAPABILITY::grad_sums,
                                       &CPU_CAPABILITY::affine};
  return table;
}

}  // namespace torch_bn_grad::cpu
