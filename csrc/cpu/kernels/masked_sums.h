// The masked kernels' per-channel sums (masked_kernels.cpp): over spans of
// one channel's valid values (planes form), and over valid rows of channels
// (rows form) in blocks merged in block order. Included by the per-ISA
// kernel source only (see vec_io.h).
//
// * float32, float16 and bfloat16 data are summed in float64 lanes: the
//   statistics as d = x - centre (exact in float64) and d^2 about the
//   channel's first valid value (math::shifted_moments), the backward's sums
//   as dy and dy * (x - mean). A float64 sum of such terms is far more accurate
//   than the data type can hold; it costs a widening per element, which the
//   memory traffic hides.
// * float64 data take compensated.h's sums (ShiftedSums, ExactGradSums), one
//   element at a time, as the CUDA kernels' threads do.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
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

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace torch_bn_grad::cpu
