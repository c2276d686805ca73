// Vectorized, parallel batch-norm kernels over a contiguous
// [outer, channels, inner] array. This file is compiled once per instruction
// set; everything in it lives in namespace CPU_CAPABILITY, as at::vec does.
//
// Numerics and determinism:
// * The reduction of each channel is cut into blocks whose boundaries depend on
//   the shape alone (never on the thread count). Each block is reduced by one
//   thread, and the per-block partials are combined in block order in float64,
//   so results are bitwise identical whatever the number of threads or the
//   execution strategy below.
// * Statistics use a shifted two-pass scheme per block: the block's sum is taken
//   of (x - pivot), pivot being the channel's first element, which removes a
//   large common offset before it can cancel; the block's centred second moment
//   is then summed about the block mean while the block is still in cache. The
//   blocks are merged with Chan's parallel formula in float64.
// * The backward's two sums, sum(dy) and sum(dy * (x - mean)), are taken in one
//   pass and are centred by construction.
// * Inside a block, sums accumulate in several vector registers (float32 for
//   float32/float16/bfloat16 data, float64 for float64), at most a few hundred
//   terms per lane. Per-channel coefficients are computed in float64.
//
// Memory traffic: an operator reads its inputs twice (reduce, then apply). When
// channels are outermost and there are enough of them, each thread runs both
// passes on one channel at a time, so the second pass finds that channel's data
// in its L2 cache; otherwise the second pass walks each thread's blocks in
// reverse, starting with the ones it read last and that are still cached.
#include "cpu/kernels/kernel_table.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#define TBG_CONCAT_IMPL(a, b) a##b
#define TBG_CONCAT(a, b) TBG_CONCAT_IMPL(a, b)
#define TBG_STR_IMPL(x) #x
#define TBG_STR(x) TBG_STR_IMPL(x)

namespace torch_bn_grad::cpu {
namespace CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

// Elements per reduction block: small enough to stay in L1/L2 between the two
// statistics passes.
constexpr int64_t kBlockElements = 16384;
// Channels per block when channels are innermost (per-column accumulators).
constexpr int64_t kColumnBlock = 256;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Loads and stores `T` data in chunks of one full vector of T, as kParts
// vectors of the accumulation type.
template <typename T>
struct Io {
  using acc_t = at::opmath_type<T>;
  using Vec = Vectorized<acc_t>;
  static constexpr int64_t kWidth = Vec::size();
  static constexpr int64_t kChunk = Vectorized<T>::size();
  static constexpr int kParts = static_cast<int>(kChunk / kWidth);

  static void load(const T* p, Vec (&v)[kParts]) {
    if constexpr (kParts == 1) {
      v[0] = Vec::loadu(p);
    } else {
      std::tie(v[0], v[1]) = at::vec::convert_to_float<T>(Vectorized<T>::loadu(p));
    }
  }
  static void store(T* p, const Vec (&v)[kParts]) {
    if constexpr (kParts == 1) {
      v[0].store(p);
    } else {
      at::vec::convert_from_float<T>(v[0], v[1]).store(p);
    }
  }
  static double hsum(const Vec& v) {
    alignas(64) acc_t lanes[kWidth];
    v.store(lanes);
    double s = 0;
    for (int64_t i = 0; i < kWidth; ++i) s += lanes[i];
    return s;
  }
};

// The deterministic partition. With inner > 1 ("planes") a block is one
// channel over a range of outer rows and a range of inner positions; with
// inner == 1 ("rows") a block is a range of rows over a range of channels.
struct Blocks {
  bool planes;
  int64_t outer_step, n_outer;
  int64_t span_step, n_span;  // planes: inner positions; rows: channels
  int64_t total;

  explicit Blocks(const Extent& e) : planes(e.inner > 1) {
    if (planes) {
      n_span = ceil_div(e.inner, kBlockElements);
      span_step = ceil_div(e.inner, n_span);
      outer_step = std::max<int64_t>(1, kBlockElements / span_step);
      n_outer = ceil_div(e.outer, outer_step);
      total = e.channels * n_outer * n_span;
    } else {
      span_step = std::max<int64_t>(1, std::min(e.channels, kColumnBlock));
      n_span = ceil_div(e.channels, span_step);
      outer_step = std::max<int64_t>(1, kBlockElements / span_step);
      n_outer = ceil_div(e.outer, outer_step);
      total = n_outer * n_span;
    }
  }
  // Partials per channel, combined in this order.
  int64_t per_channel() const { return planes ? n_outer * n_span : n_outer; }
};

// One block's coordinates.
struct Block {
  int64_t o0, o1;   // outer rows
  int64_t s0, s1;   // planes: inner range; rows: channel range
  int64_t channel;  // planes only
  int64_t slot;     // index among the partials of its channel(s)
};

Block block_at(const Blocks& b, const Extent& e, int64_t id) {
  Block blk{};
  int64_t oc, sc;
  if (b.planes) {
    blk.channel = id / (b.n_outer * b.n_span);
    blk.slot = id % (b.n_outer * b.n_span);
    oc = blk.slot / b.n_span;
    sc = blk.slot % b.n_span;
    blk.s0 = sc * b.span_step;
    blk.s1 = std::min(e.inner, blk.s0 + b.span_step);
  } else {
    oc = id / b.n_span;
    sc = id % b.n_span;
    blk.slot = oc;
    blk.s0 = sc * b.span_step;
    blk.s1 = std::min(e.channels, blk.s0 + b.span_step);
  }
  blk.o0 = oc * b.outer_step;
  blk.o1 = std::min(e.outer, blk.o0 + b.outer_step);
  return blk;
}

// Runs f on every block in parallel. Threads get the same contiguous ranges of
// blocks on every call; `reverse` walks each range backwards.
template <typename F>
void for_each_block(const Blocks& b, const Extent& e, bool reverse, const F& f) {
  at::parallel_for(0, b.total, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) f(block_at(b, e, reverse ? begin + end - 1 - i : i));
  });
}

// Both passes per channel (see the header comment) when channels are
// outermost and there are enough of them to keep every thread busy.
bool per_channel_strategy(const Blocks& b, const Extent& e) {
  const int64_t threads = at::get_num_threads();
  return b.planes && threads > 0 && (e.channels % threads == 0 || e.channels >= 8 * threads);
}

// Per-block partials of every channel: [channel][slot].
struct Partials {
  int64_t per;
  std::vector<double> a, b, c;
  Partials(int64_t channels, int64_t per_channel, int fields)
      : per(per_channel),
        a(channels * per_channel),
        b(fields > 1 ? channels * per_channel : 0),
        c(fields > 2 ? channels * per_channel : 0) {}
};

// ---------------------------------------------------------------- block kernels
template <typename T>
struct Kernels {
  using IO = Io<T>;
  using acc_t = typename IO::acc_t;
  using Vec = typename IO::Vec;
  static constexpr int64_t W = IO::kWidth;
  static constexpr int64_t K = IO::kChunk;
  static constexpr int P = IO::kParts;

  // Sum of g(value) over a contiguous run: vector lanes plus a scalar tail.
  template <typename G>
  static void accumulate(const T* p, int64_t n, Vec (&acc)[P], double& tail, const G& g) {
    Vec v[P];
    int64_t j = 0;
    for (; j + K <= n; j += K) {
      IO::load(p + j, v);
      for (int q = 0; q < P; ++q) acc[q] = acc[q] + g(v[q]);
    }
    for (; j < n; ++j) tail += static_cast<double>(g(static_cast<acc_t>(p[j])));
  }

  static double total(const Vec (&acc)[P], double tail) {
    Vec s = acc[0];
    for (int q = 1; q < P; ++q) s = s + acc[q];
    return IO::hsum(s) + tail;
  }

  // (count, mean, centred second moment) of one block: partial slot(s) in `out`.
  static void stats_block(const T* x, const Extent& e, const Block& blk, const acc_t* pivot, Partials& out) {
    const int64_t C = e.channels, I = e.inner;
    if (I > 1) {
      const int64_t k = blk.channel, n = blk.s1 - blk.s0;
      const acc_t pv = pivot[k];
      Vec acc[P];
      for (auto& a : acc) a = Vec(0);
      double tail = 0;
      for (int64_t o = blk.o0; o < blk.o1; ++o) {
        accumulate(x + (o * C + k) * I + blk.s0, n, acc, tail, [&](auto v) { return v - decltype(v)(pv); });
      }
      const double count = static_cast<double>((blk.o1 - blk.o0) * n);
      const acc_t bmean = static_cast<acc_t>(pv + total(acc, tail) / count);
      for (auto& a : acc) a = Vec(0);
      tail = 0;
      for (int64_t o = blk.o0; o < blk.o1; ++o) {
        accumulate(x + (o * C + k) * I + blk.s0, n, acc, tail, [&](auto v) {
          const auto d = v - decltype(v)(bmean);
          return d * d;
        });
      }
      const int64_t s = k * out.per + blk.slot;
      out.a[s] = count;
      out.b[s] = bmean;
      out.c[s] = total(acc, tail);
      return;
    }
    // Rows: vector lanes run across channels, one accumulator per channel.
    const int64_t c0 = blk.s0, nc = blk.s1 - blk.s0, vec_end = nc - nc % K;
    alignas(64) acc_t sum[kColumnBlock];
    alignas(64) acc_t bmean[kColumnBlock];
    std::fill(sum, sum + nc, acc_t(0));
    Vec v[P];
    for (int64_t o = blk.o0; o < blk.o1; ++o) {
      const T* row = x + o * C + c0;
      for (int64_t j = 0; j < vec_end; j += K) {
        IO::load(row + j, v);
        for (int q = 0; q < P; ++q) {
          const int64_t jq = j + q * W;
          (Vec::loadu(sum + jq) + (v[q] - Vec::loadu(pivot + c0 + jq))).store(sum + jq);
        }
      }
      for (int64_t j = vec_end; j < nc; ++j) sum[j] += static_cast<acc_t>(row[j]) - pivot[c0 + j];
    }
    const double count = static_cast<double>(blk.o1 - blk.o0);
    for (int64_t j = 0; j < nc; ++j) {
      bmean[j] = static_cast<acc_t>(pivot[c0 + j] + static_cast<double>(sum[j]) / count);
      sum[j] = 0;
    }
    for (int64_t o = blk.o0; o < blk.o1; ++o) {
      const T* row = x + o * C + c0;
      for (int64_t j = 0; j < vec_end; j += K) {
        IO::load(row + j, v);
        for (int q = 0; q < P; ++q) {
          const int64_t jq = j + q * W;
          const Vec d = v[q] - Vec::loadu(bmean + jq);
          at::vec::fmadd(d, d, Vec::loadu(sum + jq)).store(sum + jq);
        }
      }
      for (int64_t j = vec_end; j < nc; ++j) {
        const acc_t d = static_cast<acc_t>(row[j]) - bmean[j];
        sum[j] += d * d;
      }
    }
    for (int64_t j = 0; j < nc; ++j) {
      const int64_t s = (c0 + j) * out.per + blk.slot;
      out.a[s] = count;
      out.b[s] = bmean[j];
      out.c[s] = sum[j];
    }
  }

  // sum(dy) and sum(dy * (x - mean)) of one block: partial slot(s) in `out`.
  static void sums_block(const T* x, const T* dy, const Extent& e, const Block& blk, const acc_t* mean,
                         Partials& out) {
    const int64_t C = e.channels, I = e.inner;
    Vec xv[P], dv[P];
    if (I > 1) {
      const int64_t k = blk.channel;
      const Vec m(mean[k]);
      Vec s[P], t[P];
      for (int q = 0; q < P; ++q) s[q] = t[q] = Vec(0);
      double s_tail = 0, t_tail = 0;
      for (int64_t o = blk.o0; o < blk.o1; ++o) {
        const int64_t off = (o * C + k) * I;
        const T* xp = x + off;
        const T* dp = dy + off;
        int64_t j = blk.s0;
        for (; j + K <= blk.s1; j += K) {
          IO::load(dp + j, dv);
          IO::load(xp + j, xv);
          for (int q = 0; q < P; ++q) {
            s[q] = s[q] + dv[q];
            t[q] = at::vec::fmadd(dv[q], xv[q] - m, t[q]);
          }
        }
        for (; j < blk.s1; ++j) {
          const acc_t d = static_cast<acc_t>(dp[j]);
          s_tail += d;
          t_tail += d * (static_cast<acc_t>(xp[j]) - mean[k]);
        }
      }
      const int64_t slot = k * out.per + blk.slot;
      out.a[slot] = total(s, s_tail);
      out.b[slot] = total(t, t_tail);
      return;
    }
    const int64_t c0 = blk.s0, nc = blk.s1 - blk.s0, vec_end = nc - nc % K;
    alignas(64) acc_t sd[kColumnBlock];
    alignas(64) acc_t sx[kColumnBlock];
    std::fill(sd, sd + nc, acc_t(0));
    std::fill(sx, sx + nc, acc_t(0));
    for (int64_t o = blk.o0; o < blk.o1; ++o) {
      const T* xr = x + o * C + c0;
      const T* dr = dy + o * C + c0;
      for (int64_t j = 0; j < vec_end; j += K) {
        IO::load(dr + j, dv);
        IO::load(xr + j, xv);
        for (int q = 0; q < P; ++q) {
          const int64_t jq = j + q * W;
          (Vec::loadu(sd + jq) + dv[q]).store(sd + jq);
          at::vec::fmadd(dv[q], xv[q] - Vec::loadu(mean + c0 + jq), Vec::loadu(sx + jq)).store(sx + jq);
        }
      }
      for (int64_t j = vec_end; j < nc; ++j) {
        const acc_t d = static_cast<acc_t>(dr[j]);
        sd[j] += d;
        sx[j] += d * (static_cast<acc_t>(xr[j]) - mean[c0 + j]);
      }
    }
    for (int64_t j = 0; j < nc; ++j) {
      const int64_t slot = (c0 + j) * out.per + blk.slot;
      out.a[slot] = sd[j];
      out.b[slot] = sx[j];
    }
  }

  // out = alpha * y + beta * (x - mean) + gamma per channel over one block;
  // y may be null (then alpha is unused): the forward's normalization
  // (beta = scale, gamma = shift) and the backward's diff_src.
  static void affine_block(const T* x, const T* y, T* out, const Extent& e, const Block& blk, const acc_t* mean,
                           const acc_t* alpha, const acc_t* beta, const acc_t* gamma) {
    const int64_t C = e.channels, I = e.inner;
    Vec xv[P], yv[P];
    if (I > 1) {
      const int64_t k = blk.channel;
      const Vec m(mean[k]), bb(beta[k]), g(gamma[k]), a(y ? alpha[k] : acc_t(0));
      for (int64_t o = blk.o0; o < blk.o1; ++o) {
        const int64_t off = (o * C + k) * I;
        int64_t j = blk.s0;
        for (; j + K <= blk.s1; j += K) {
          IO::load(x + off + j, xv);
          if (y) IO::load(y + off + j, yv);
          for (int q = 0; q < P; ++q) {
            xv[q] = at::vec::fmadd(xv[q] - m, bb, g);
            if (y) xv[q] = at::vec::fmadd(a, yv[q], xv[q]);
          }
          IO::store(out + off + j, xv);
        }
        for (; j < blk.s1; ++j) out[off + j] = scalar(x, y, off + j, k, mean, alpha, beta, gamma);
      }
      return;
    }
    const int64_t c0 = blk.s0, c1 = blk.s1;
    for (int64_t o = blk.o0; o < blk.o1; ++o) {
      const int64_t off = o * C;
      int64_t j = c0;
      for (; j + K <= c1; j += K) {
        IO::load(x + off + j, xv);
        if (y) IO::load(y + off + j, yv);
        for (int q = 0; q < P; ++q) {
          const int64_t jq = j + q * W;
          xv[q] = at::vec::fmadd(xv[q] - Vec::loadu(mean + jq), Vec::loadu(beta + jq), Vec::loadu(gamma + jq));
          if (y) xv[q] = at::vec::fmadd(Vec::loadu(alpha + jq), yv[q], xv[q]);
        }
        IO::store(out + off + j, xv);
      }
      for (; j < c1; ++j) out[off + j] = scalar(x, y, off + j, j, mean, alpha, beta, gamma);
    }
  }

  static T scalar(const T* x, const T* y, int64_t i, int64_t k, const acc_t* mean, const acc_t* alpha,
                  const acc_t* beta, const acc_t* gamma) {
    acc_t r = (static_cast<acc_t>(x[i]) - mean[k]) * beta[k] + gamma[k];
    if (y) r += alpha[k] * static_cast<acc_t>(y[i]);
    return static_cast<T>(r);
  }
};

// Chan et al.'s merge of a channel's (count, mean, M2) partials, in order.
void merge_stats(const Partials& p, int64_t k, double& mean, double& var) {
  double n = 0, m = 0, m2 = 0;
  for (int64_t i = k * p.per; i < (k + 1) * p.per; ++i) {
    const double nb = p.a[i];
    if (nb == 0) continue;
    const double delta = p.b[i] - m;
    const double total = n + nb;
    m += delta * (nb / total);
    m2 += p.c[i] + delta * delta * (n * nb / total);
    n = total;
  }
  mean = m;
  var = m2 / n;
}

void merge_sums(const Partials& p, int64_t k, double& sum_a, double& sum_b) {
  double a = 0, b = 0;
  for (int64_t i = k * p.per; i < (k + 1) * p.per; ++i) {
    a += p.a[i];
    b += p.b[i];
  }
  sum_a = a;
  sum_b = b;
}

// Per-channel coefficient vectors of the accumulation type.
template <typename acc_t>
struct Coefficients {
  std::vector<acc_t> mean, alpha, beta, gamma;
  explicit Coefficients(int64_t channels) : mean(channels), alpha(channels), beta(channels), gamma(channels) {}
};

template <typename T>
std::vector<typename Io<T>::acc_t> channel_pivots(const T* x, const Extent& e) {
  std::vector<typename Io<T>::acc_t> pivot(e.channels);
  for (int64_t k = 0; k < e.channels; ++k) pivot[k] = static_cast<typename Io<T>::acc_t>(x[k * e.inner]);
  return pivot;
}

// ---------------------------------------------------------------- operators
template <typename T>
void forward_batch_impl(const T* x, T* y, const Extent& e, const double* gamma, const double* beta,
                        double eps, double* mean, double* var) {
  using KN = Kernels<T>;
  using acc_t = typename Io<T>::acc_t;
  const Blocks b(e);
  const auto pivot = channel_pivots(x, e);
  Partials parts(e.channels, b.per_channel(), 3);
  Coefficients<acc_t> co(e.channels);
  auto finish_channel = [&](int64_t k) {
    merge_stats(parts, k, mean[k], var[k]);
    const double scale = gamma[k] / std::sqrt(var[k] + eps);
    co.mean[k] = static_cast<acc_t>(mean[k]);
    co.beta[k] = static_cast<acc_t>(scale);
    co.gamma[k] = static_cast<acc_t>(beta[k]);
  };
  auto normalize = [&](const Block& blk) {
    KN::affine_block(x, nullptr, y, e, blk, co.mean.data(), nullptr, co.beta.data(), co.gamma.data());
  };
  if (per_channel_strategy(b, e)) {
    const int64_t per = b.per_channel();
    at::parallel_for(0, e.channels, 1, [&](int64_t k0, int64_t k1) {
      for (int64_t k = k0; k < k1; ++k) {
        for (int64_t i = 0; i < per; ++i) KN::stats_block(x, e, block_at(b, e, k * per + i), pivot.data(), parts);
        finish_channel(k);
        for (int64_t i = per - 1; i >= 0; --i) normalize(block_at(b, e, k * per + i));
      }
    });
    return;
  }
  for_each_block(b, e, false, [&](const Block& blk) { KN::stats_block(x, e, blk, pivot.data(), parts); });
  for (int64_t k = 0; k < e.channels; ++k) finish_channel(k);
  for_each_block(b, e, true, normalize);
}

template <typename T>
void forward_frozen_impl(const T* x, T* y, const Extent& e, const double* mean, const double* var,
                         const double* gamma, const double* beta, double eps) {
  using acc_t = typename Io<T>::acc_t;
  Coefficients<acc_t> co(e.channels);
  for (int64_t k = 0; k < e.channels; ++k) {
    co.mean[k] = static_cast<acc_t>(mean[k]);
    co.beta[k] = static_cast<acc_t>(gamma[k] / std::sqrt(var[k] + eps));
    co.gamma[k] = static_cast<acc_t>(beta[k]);
  }
  const Blocks b(e);
  for_each_block(b, e, false, [&](const Block& blk) {
    Kernels<T>::affine_block(x, nullptr, y, e, blk, co.mean.data(), nullptr, co.beta.data(), co.gamma.data());
  });
}

template <typename T>
void backward_impl(const T* x, const T* dy, T* dx, const Extent& e, const double* mean, const double* var,
                   const double* gamma, double eps, bool training, double* diff_gamma, double* diff_beta) {
  using KN = Kernels<T>;
  using acc_t = typename Io<T>::acc_t;
  const Blocks b(e);
  const bool need_sums = training || diff_gamma != nullptr || diff_beta != nullptr;
  const double count = static_cast<double>(e.outer * e.inner);
  Partials parts(e.channels, b.per_channel(), 2);
  Coefficients<acc_t> co(e.channels);
  for (int64_t k = 0; k < e.channels; ++k) co.mean[k] = static_cast<acc_t>(mean[k]);
  // diff_src = a * dy + b * (x - mean) + c, with a = g * rstd and, in training,
  // b = -a * rstd^2 * sum(dy * xc) / M, c = -a * sum(dy) / M.
  auto finish_channel = [&](int64_t k) {
    double sum_dy = 0, sum_dy_xc = 0;
    if (need_sums) merge_sums(parts, k, sum_dy, sum_dy_xc);
    const double rstd = 1.0 / std::sqrt(var[k] + eps);
    const double a = gamma[k] * rstd;
    co.alpha[k] = static_cast<acc_t>(a);
    co.beta[k] = static_cast<acc_t>(training ? -a * rstd * rstd * sum_dy_xc / count : 0.0);
    co.gamma[k] = static_cast<acc_t>(training ? -a * sum_dy / count : 0.0);
    if (diff_gamma) diff_gamma[k] = rstd * sum_dy_xc;
    if (diff_beta) diff_beta[k] = sum_dy;
  };
  auto sums = [&](const Block& blk) { KN::sums_block(x, dy, e, blk, co.mean.data(), parts); };
  auto apply = [&](const Block& blk) {
    KN::affine_block(x, dy, dx, e, blk, co.mean.data(), co.alpha.data(), co.beta.data(), co.gamma.data());
  };
  if (need_sums && dx && per_channel_strategy(b, e)) {
    const int64_t per = b.per_channel();
    at::parallel_for(0, e.channels, 1, [&](int64_t k0, int64_t k1) {
      for (int64_t k = k0; k < k1; ++k) {
        for (int64_t i = 0; i < per; ++i) sums(block_at(b, e, k * per + i));
        finish_channel(k);
        for (int64_t i = per - 1; i >= 0; --i) apply(block_at(b, e, k * per + i));
      }
    });
    return;
  }
  if (need_sums) for_each_block(b, e, false, sums);
  for (int64_t k = 0; k < e.channels; ++k) finish_channel(k);
  if (dx) for_each_block(b, e, need_sums, apply);
}

// ---------------------------------------------------------------- primitives
template <typename T>
void batch_stats_impl(const T* x, const Extent& e, double* mean, double* var) {
  const Blocks b(e);
  const auto pivot = channel_pivots(x, e);
  Partials parts(e.channels, b.per_channel(), 3);
  for_each_block(b, e, false, [&](const Block& blk) { Kernels<T>::stats_block(x, e, blk, pivot.data(), parts); });
  for (int64_t k = 0; k < e.channels; ++k) merge_stats(parts, k, mean[k], var[k]);
}

template <typename T>
void grad_sums_impl(const T* x, const T* dy, const Extent& e, const typename Io<T>::acc_t* mean,
                    double* sum_dy, double* sum_dy_xc) {
  const Blocks b(e);
  Partials parts(e.channels, b.per_channel(), 2);
  for_each_block(b, e, false, [&](const Block& blk) { Kernels<T>::sums_block(x, dy, e, blk, mean, parts); });
  for (int64_t k = 0; k < e.channels; ++k) merge_sums(parts, k, sum_dy[k], sum_dy_xc[k]);
}

template <typename T>
void affine_impl(const T* x, const T* y, T* out, const Extent& e, const typename Io<T>::acc_t* mean,
                 const typename Io<T>::acc_t* alpha, const typename Io<T>::acc_t* beta,
                 const typename Io<T>::acc_t* gamma) {
  const Blocks b(e);
  for_each_block(b, e, false, [&](const Block& blk) {
    Kernels<T>::affine_block(x, y, out, e, blk, mean, alpha, beta, gamma);
  });
}

// ---------------------------------------------------------------- entry points
#define TBG_DISPATCH(tensor, name, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, (tensor).scalar_type(), name, __VA_ARGS__)

const double* f64(const at::Tensor& t) { return t.defined() ? t.const_data_ptr<double>() : nullptr; }
double* f64_out(at::Tensor& t) { return t.defined() ? t.mutable_data_ptr<double>() : nullptr; }

void forward_batch(const at::Tensor& src, at::Tensor& dst, const Extent& e, const at::Tensor& gamma,
                   const at::Tensor& beta, double epsilon, at::Tensor& mean, at::Tensor& var) {
  TBG_DISPATCH(src, "forward_batch", [&] {
    forward_batch_impl<scalar_t>(src.const_data_ptr<scalar_t>(), dst.mutable_data_ptr<scalar_t>(), e, f64(gamma),
                                 f64(beta), epsilon, f64_out(mean), f64_out(var));
  });
}

void forward_frozen(const at::Tensor& src, at::Tensor& dst, const Extent& e, const at::Tensor& mean,
                    const at::Tensor& var, const at::Tensor& gamma, const at::Tensor& beta, double epsilon) {
  TBG_DISPATCH(src, "forward_frozen", [&] {
    forward_frozen_impl<scalar_t>(src.const_data_ptr<scalar_t>(), dst.mutable_data_ptr<scalar_t>(), e, f64(mean),
                                  f64(var), f64(gamma), f64(beta), epsilon);
  });
}

void backward(const at::Tensor& src, const at::Tensor& diff_dst, at::Tensor& diff_src, const Extent& e,
              const at::Tensor& mean, const at::Tensor& var, const at::Tensor& gamma, double epsilon,
              bool training, at::Tensor& diff_gamma, at::Tensor& diff_beta) {
  TBG_DISPATCH(src, "backward", [&] {
    backward_impl<scalar_t>(src.const_data_ptr<scalar_t>(), diff_dst.const_data_ptr<scalar_t>(),
                            diff_src.defined() ? diff_src.mutable_data_ptr<scalar_t>() : nullptr, e, f64(mean),
                            f64(var), f64(gamma), epsilon, training, f64_out(diff_gamma), f64_out(diff_beta));
  });
}

void batch_stats(const at::Tensor& src, const Extent& e, at::Tensor& mean, at::Tensor& var) {
  TBG_DISPATCH(src, "batch_stats", [&] {
    batch_stats_impl<scalar_t>(src.const_data_ptr<scalar_t>(), e, f64_out(mean), f64_out(var));
  });
}

void normalize(const at::Tensor& src, at::Tensor& dst, const Extent& e, const at::Tensor& mean,
               const at::Tensor& scale, const at::Tensor& shift) {
  TBG_DISPATCH(src, "normalize", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    affine_impl<scalar_t>(src.const_data_ptr<scalar_t>(), nullptr, dst.mutable_data_ptr<scalar_t>(), e,
                          mean.const_data_ptr<acc_t>(), nullptr, scale.const_data_ptr<acc_t>(),
                          shift.const_data_ptr<acc_t>());
  });
}

void grad_sums(const at::Tensor& src, const at::Tensor& diff_dst, const Extent& e, const at::Tensor& mean,
               at::Tensor& sum_dy, at::Tensor& sum_dy_xc) {
  TBG_DISPATCH(src, "grad_sums", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    grad_sums_impl<scalar_t>(src.const_data_ptr<scalar_t>(), diff_dst.const_data_ptr<scalar_t>(), e,
                             mean.const_data_ptr<acc_t>(), f64_out(sum_dy), f64_out(sum_dy_xc));
  });
}

void grad_input(const at::Tensor& src, const at::Tensor& diff_dst, at::Tensor& diff_src, const Extent& e,
                const at::Tensor& mean, const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
  TBG_DISPATCH(src, "grad_input", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    affine_impl<scalar_t>(src.const_data_ptr<scalar_t>(), diff_dst.const_data_ptr<scalar_t>(),
                          diff_src.mutable_data_ptr<scalar_t>(), e, mean.const_data_ptr<acc_t>(),
                          a.const_data_ptr<acc_t>(), b.const_data_ptr<acc_t>(), c.const_data_ptr<acc_t>());
  });
}

}  // namespace
}  // namespace CPU_CAPABILITY

const KernelTable& TBG_CONCAT(kernel_table_, CPU_CAPABILITY)() {
  static const KernelTable table{
      &CPU_CAPABILITY::forward_batch, &CPU_CAPABILITY::forward_frozen, &CPU_CAPABILITY::backward,
      &CPU_CAPABILITY::batch_stats,   &CPU_CAPABILITY::normalize,      &CPU_CAPABILITY::grad_sums,
      &CPU_CAPABILITY::grad_input,    TBG_STR(CPU_CAPABILITY)};
  return table;
}

}  // namespace torch_bn_grad::cpu
