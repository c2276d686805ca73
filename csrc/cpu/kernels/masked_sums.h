// The masked kernels' per-channel sums (batch_norm_masked_kernels.cpp): over spans of
// one channel's valid values (planes form), and over valid rows of channels
// (rows form) in blocks merged in block order. Included by the per-ISA
// kernel source only (see vec_io.h).
//
// * float32, float16 and bfloat16 data: the statistics as d = x - centre
//   and d^2 about the channel's first valid value (math::shifted_moments),
//   the backward's sums as dy and dy * (x - mean). Over a channel's spans
//   (planes form) the terms are float, summed plainly a few at a time and
//   those partial sums added in float64 lanes; over rows (rows form) each
//   term is float64 (channels side by side leave no run of terms to sum
//   plainly first).
// * float64 data take compensated.h's sums (ShiftedSums, ExactGradSums), one
//   element at a time, as the CUDA kernels' threads do.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "math/batch_norm_math.h"
#include "math/compensated.h"
#include "cpu/kernels/masked_kernel_table.h"
#include "cpu/kernels/vec_io.h"

namespace torch_bn_grad::cpu {
namespace CPU_CAPABILITY {
namespace {  // internal linkage: see vec_io.h

using VD = Vectorized<double>;
using VF = Vectorized<float>;

// Elements per step of the float64 reductions: four float64 vectors.
constexpr int64_t kStep = 4 * VD::size();
// Rows a block of the rows form reduces (its partial sums live in L1/L2).
constexpr int64_t kBlockRows = 256;

// Four float64 vectors and a scalar tail summed in a fixed order.
inline double total(const VD (&v)[4], double tail) {
  const VD s = (v[0] + v[1]) + (v[2] + v[3]);
  double lanes[VD::size()];
  s.store(lanes);
  double t = 0.0;
  for (int64_t i = 0; i < VD::size(); ++i) t += lanes[i];
  return t + tail;
}

// ---------------------------------------------------------------- sums of u and u * v
// Float data's reductions are float64 sums of u and of u * v: the
// statistics' with u = v = x - centre, the gradient's with u = dy and
// v = x - mean.
using Terms = VD[4];

// Float terms, a step of them in float vectors.
using FloatTerms = VF[2];
// Steps of float terms summed plainly before their sums go into float64
// lanes, as the plain kernels add a few terms plainly before each exact add
// (exact_sum.h): float arithmetic per element instead of float64, which had
// the masked sums take twice the plain sums' time per element.
constexpr int64_t kFloatBlockSteps = 8;

// kStep elements of float, float16 or bfloat16 data as two float vectors.
template <typename T>
inline void load_floats(const T* p, FloatTerms& f) {
  static_assert(2 * VF::size() == kStep);
  if constexpr (std::is_same_v<T, float>) {
    f[0] = VF::loadu(p);
    f[1] = VF::loadu(p + VF::size());
  } else {
    static_assert(Io<T>::kParts == 2);
    Io<T>::load(p, f);
  }
}

// A step's float vectors as four float64 vectors, in memory order.
inline void widen_step(const FloatTerms& f, Terms& w) {
  widen(f[0], w[0], w[1]);
  widen(f[1], w[2], w[3]);
}

// kStep elements of float, float16 or bfloat16 data as four float64 vectors.
template <typename T>
inline void load_step(const T* p, Terms& w) {
  FloatTerms f;
  load_floats(p, f);
  widen_step(f, w);
}

// One span's sums (all terms into one total): float64 vectors, totalled at the end.
struct SpanLaneSums {
  VD u[4] = {VD(0.0), VD(0.0), VD(0.0), VD(0.0)};
  VD uv[4] = {VD(0.0), VD(0.0), VD(0.0), VD(0.0)};
  double tail_u = 0.0, tail_uv = 0.0;

  // Adds n elements' terms: terms(i, u, v) makes the float terms of the
  // step at i, whose sums and sums of u * v go into the float64 lanes every
  // kFloatBlockSteps steps; scalar_terms(i) makes the last n % kStep
  // elements' as a pair of doubles.
  template <typename StepTerms, typename ScalarTerms>
  void add(int64_t n, const StepTerms& terms, const ScalarTerms& scalar_terms) {
    const int64_t full = n - n % kStep;
    for (int64_t i = 0; i < full;) {
      const int64_t end = std::min(full, i + kFloatBlockSteps * kStep);
      FloatTerms su = {VF(0.f), VF(0.f)}, suv = {VF(0.f), VF(0.f)};
      for (; i < end; i += kStep) {
        FloatTerms a, b;
        terms(i, a, b);
        for (int k = 0; k < 2; ++k) {
          su[k] = su[k] + a[k];
          suv[k] = at::vec::fmadd(a[k], b[k], suv[k]);
        }
      }
      add_widened(u, su);
      add_widened(uv, suv);
    }
    for (int64_t i = full; i < n; ++i) {
      const auto [a, b] = scalar_terms(i);
      tail_u += a;
      tail_uv = std::fma(a, b, tail_uv);
    }
  }
  static void add_widened(VD (&to)[4], const FloatTerms& f) {
    Terms w;
    widen_step(f, w);
    for (int k = 0; k < 4; ++k) to[k] = to[k] + w[k];
  }
  double sum_u() const { return total(u, tail_u); }
  double sum_uv() const { return total(uv, tail_uv); }
};

// Rows' sums (the term at i into channel i): a float64 sum per channel.
struct ChannelSums {
  std::vector<double> u, uv;
  explicit ChannelSums(int64_t channels) : u(channels, 0.0), uv(channels, 0.0) {}

  // Adds the terms of channels [0, n): terms(i, u, v) makes the kStep terms
  // at i as float64 vectors, scalar_terms(i) one channel's as a pair of doubles.
  template <typename StepTerms, typename ScalarTerms>
  void add(int64_t n, const StepTerms& terms, const ScalarTerms& scalar_terms) {
    int64_t i = 0;
    for (; i + kStep <= n; i += kStep) {
      Terms a, b;
      terms(i, a, b);
      for (int k = 0; k < 4; ++k) {
        const int64_t at = i + k * VD::size();
        (VD::loadu(u.data() + at) + a[k]).store(u.data() + at);
        at::vec::fmadd(a[k], b[k], VD::loadu(uv.data() + at)).store(uv.data() + at);
      }
    }
    for (; i < n; ++i) {
      const auto [a, b] = scalar_terms(i);
      u[i] += a;
      uv[i] = std::fma(a, b, uv[i]);
    }
  }
  void merge(const ChannelSums& o) {
    for (size_t c = 0; c < u.size(); ++c) {
      u[c] += o.u[c];
      uv[c] += o.uv[c];
    }
  }
};

// The statistics' terms of a step of a row: u = v = x - centre (per channel).
template <typename T>
inline void centred_terms(const T* x, const double* centre, Terms& u, Terms& v) {
  Terms w;
  load_step(x, w);
  for (int k = 0; k < 4; ++k) u[k] = v[k] = w[k] - VD::loadu(centre + k * VD::size());
}
template <typename T>
inline std::pair<double, double> centred_term(T x, double centre) {
  const double d = static_cast<double>(x) - centre;
  return {d, d};
}

// The gradient's terms of a step of a row: u = dy, v = x - mean (per channel).
template <typename T>
inline void gradient_terms(const T* x, const T* g, const double* mean, Terms& u, Terms& v) {
  Terms w;
  load_step(x, w);
  load_step(g, u);
  for (int k = 0; k < 4; ++k) v[k] = w[k] - VD::loadu(mean + k * VD::size());
}
template <typename T>
inline std::pair<double, double> gradient_term(T x, T g, double mean) {
  return {static_cast<double>(g), static_cast<double>(x) - mean};
}

// ---------------------------------------------------------------- per-channel sums over spans
// A channel's statistics sums over spans of valid values (planes form): float64
// lanes for float data, compensated.h's ShiftedSums for float64 data.
template <typename T>
struct SpanMoments {
  double centre;
  SpanLaneSums s;

  // centre is one of the data's values, so a float exactly.
  void add(const T* x, int64_t n) {
    const VF c(static_cast<float>(centre));
    s.add(
        n,
        [&](int64_t i, FloatTerms& u, FloatTerms& v) {
          load_floats(x + i, u);
          for (int k = 0; k < 2; ++k) u[k] = v[k] = u[k] - c;
        },
        [&](int64_t i) { return centred_term(x[i], centre); });
  }
  math::Moments<double> moments(int64_t count) const {
    return math::shifted_moments(static_cast<double>(count), centre, s.sum_u(), s.sum_uv());
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
  SpanLaneSums s;

  // Centred on the float nearest the mean, mean_f; sums() moves the sum of
  // dy * (x - mean_f) to the mean: minus (mean - mean_f) * sum(dy).
  void add(const T* x, const T* g, int64_t n) {
    const float mf = static_cast<float>(mean);
    const VF m(mf);
    s.add(
        n,
        [&](int64_t i, FloatTerms& u, FloatTerms& v) {
          load_floats(g + i, u);
          load_floats(x + i, v);
          for (int k = 0; k < 2; ++k) v[k] = v[k] - m;
        },
        [&](int64_t i) { return gradient_term(x[i], g[i], static_cast<double>(mf)); });
  }
  math::GradSums<double> sums() const {
    const double sum_dy = s.sum_u();
    return {sum_dy, s.sum_uv() - (mean - static_cast<double>(static_cast<float>(mean))) * sum_dy};
  }
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
  ChannelSums s;
  explicit RowMoments(int64_t channels) : s(channels) {}

  void add_row(const T* x, const double* centre, int64_t channels) {
    s.add(channels, [&](int64_t c, Terms& u, Terms& v) { centred_terms(x + c, centre + c, u, v); },
              [&](int64_t c) { return centred_term(x[c], centre[c]); });
  }
  void merge(const RowMoments& b) { s.merge(b.s); }
  math::Moments<double> moments(int64_t c, int64_t count, const double* centre) const {
    return math::shifted_moments(static_cast<double>(count), centre[c], s.u[c], s.uv[c]);
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
  ChannelSums s;
  explicit RowGradSums(int64_t channels) : s(channels) {}

  void add_row(const T* x, const T* g, const double* mean, int64_t channels) {
    s.add(channels, [&](int64_t c, Terms& u, Terms& v) { gradient_terms(x + c, g + c, mean + c, u, v); },
              [&](int64_t c) { return gradient_term(x[c], g[c], mean[c]); });
  }
  void merge(const RowGradSums& b) { s.merge(b.s); }
  math::GradSums<double> sums(int64_t c) const { return {s.u[c], s.uv[c]}; }
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

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace torch_bn_grad::cpu
