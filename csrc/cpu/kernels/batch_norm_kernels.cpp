// Vectorized, parallel batch-norm kernels over a contiguous
// [outer, channels, inner] array. This file is compiled once per instruction
// set; everything in it lives in namespace CPU_CAPABILITY, as at::vec does.
//
// Numerics and determinism:
// * The reduction of each channel is cut into blocks whose boundaries depend on
//   the shape alone (never on the thread count). Each block is reduced by one
//   thread, and the per-block partials are combined in block order in float64,
//   so results are bitwise identical whatever the number of threads.
// * Every sum is compensated (add_exact): vector lanes of the accumulation type
//   (float32 for float32/float16/bfloat16 data, float64 for float64) carry the
//   exact rounding error of each add alongside the sum, so a block's sum is as
//   accurate as a float64 sum of its terms (see LaneSum).
// * Statistics take two passes per block, the second while the block is in
//   cache: the exact sum of x gives the mean; then the centred second moment is
//   summed about a centre that makes x - centre exact (exact_centre), so a
//   large common offset (mean 1000, unit noise) cancels before anything is
//   rounded. The blocks are merged with Chan's parallel formula in float64.
// * The backward's two sums, sum(dy) and sum(dy * (x - mean)), are taken in one
//   pass and are centred by construction (mean is an input).
#include "cpu/kernels/kernel_table.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#define TBG_CONCAT_IMPL(a, b) a##b
#define TBG_CONCAT(a, b) TBG_CONCAT_IMPL(a, b)

namespace torch_bn_grad::cpu {
namespace CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

// Elements per reduction block: small enough to stay in L2 between passes.
constexpr int64_t kBlockElements = 16384;
// Channels per block when channels are innermost (per-column accumulators).
constexpr int64_t kColumnBlock = 256;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Loads and stores `T` data as vectors of its accumulation type.
template <typename T>
struct Io {
  using acc_t = at::opmath_type<T>;
  using Vec = Vectorized<acc_t>;
  static constexpr int64_t kWidth = Vec::size();

  static Vec load(const T* p) {
    if constexpr (std::is_same_v<T, acc_t>) {
      return Vec::loadu(p);
    } else {
      Vec v;
      at::vec::load_to_float(p, v);
      return v;
    }
  }
  static void store(T* p, const Vec& v) {
    if constexpr (std::is_same_v<T, acc_t>) {
      v.store(p);
    } else {
      at::vec::convert_from_float<T>(v, v).store(p, kWidth);
    }
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
      span_step = std::min(e.channels, kColumnBlock);
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
  int64_t o0, o1;  // outer rows
  int64_t s0, s1;  // planes: inner range; rows: channel range
  int64_t channel;  // planes only
  int64_t slot;     // planes: index among the channel's partials; rows: outer chunk
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

template <typename F>
void for_each_block(const Blocks& b, const Extent& e, const F& f) {
  at::parallel_for(0, b.total, 1, [&](int64_t begin, int64_t end) {
    for (int64_t id = begin; id < end; ++id) f(block_at(b, e, id));
  });
}

// ---------------------------------------------------------------- exact sums
// Every sum is compensated: each add also computes its own rounding error
// exactly (Knuth's TwoSum), and the errors are collected in a second
// accumulator. sum + error, taken in float64 at the end, is then as accurate as
// a float64 sum of the terms, while the loop runs on float32 vectors for
// float32/float16/bfloat16 data. (A plain float32 lane that takes k terms is
// off by about sqrt(k) rounding errors of its running sum: several units in the
// last place of diff_beta, of the mean of zero-mean data, or of the variance,
// where torch's native CPU kernel, accumulating in float64, is exact.)
// Cost: about six vector operations per term instead of one, which shows when
// the data is in cache (the stats pass measured up to ~1.7x slower than plain
// float32 sums on L3-resident tensors); from DRAM the loads dominate.
template <typename V>
inline void add_exact(V& sum, V& err, const V& x) {
  const V t = sum + x;
  const V z = t - sum;
  err = err + ((sum - (t - z)) + (x - z));
  sum = t;
}

// The same for non-negative terms with half the adds (Dekker's Fast2Sum, exact
// when sum >= x, which can fail only while the first terms come in).
template <typename V>
inline void add_exact_nonnegative(V& sum, V& err, const V& x) {
  const V t = sum + x;
  err = err + (x - (t - sum));
  sum = t;
}

// Compensated vector sums in two independent chains (they hide the latency of
// the dependent adds), plus a float64 tail for scalar terms.
template <typename acc_t>
struct LaneSum {
  using Vec = Vectorized<acc_t>;
  static constexpr int64_t kWidth = Vec::size();
  Vec sum[2] = {Vec(acc_t(0)), Vec(acc_t(0))};
  Vec err[2] = {Vec(acc_t(0)), Vec(acc_t(0))};
  double tail = 0;

  void add(int chain, const Vec& x) { add_exact(sum[chain], err[chain], x); }
  void add_nonnegative(int chain, const Vec& x) { add_exact_nonnegative(sum[chain], err[chain], x); }
  void add(acc_t x) { tail += static_cast<double>(x); }
  // Each lane of one chain (rows: one channel per lane), in float64.
  void lanes(int chain, double* out) const {
    alignas(64) acc_t s[kWidth];
    alignas(64) acc_t r[kWidth];
    sum[chain].store(s);
    err[chain].store(r);
    for (int64_t i = 0; i < kWidth; ++i) out[i] = static_cast<double>(s[i]) + static_cast<double>(r[i]);
  }
  // Everything (planes: one channel), in a fixed order.
  double total() const {
    double a[kWidth], b[kWidth];
    lanes(0, a);
    lanes(1, b);
    double s = tail;
    for (int64_t i = 0; i < kWidth; ++i) s += a[i] + b[i];
    return s;
  }
};

// Planes: walks a run of n contiguous elements of one channel: vec(j, chain)
// for each full vector at offset j, alternating the two chains, then
// scalar(j) for the tail.
template <int64_t W, typename VecStep, typename ScalarStep>
void walk_run(int64_t n, const VecStep& vec, const ScalarStep& scalar) {
  int64_t j = 0;
  for (; j + 2 * W <= n; j += 2 * W) {
    vec(j, 0);
    vec(j + W, 1);
  }
  if (j + W <= n) {
    vec(j, 0);
    j += W;
  }
  for (; j < n; ++j) scalar(j);
}

// Rows: walks a block's nc channels in tiles of two vectors (one chain each),
// then one vector, then single channels. tile(j, chains) covers channels
// [j, j + chains * W) (chains a std::integral_constant), column(j) channel j;
// each runs down all the block's rows with its accumulators in registers.
template <int64_t W, typename Tile, typename Column>
void walk_channels(int64_t nc, const Tile& tile, const Column& column) {
  int64_t j = 0;
  for (; j + 2 * W <= nc; j += 2 * W) tile(j, std::integral_constant<int, 2>{});
  if (j + W <= nc) {
    tile(j, std::integral_constant<int, 1>{});
    j += W;
  }
  for (; j < nc; ++j) column(j);
}

// ---------------------------------------------------------------- statistics
// Mean and centred second moment of one block, for Chan's merge.
struct Moments {
  double count, mean, m2;
};

// Pass 2's centre: the block mean rounded to a multiple of the acc_t spacing
// at the block's largest magnitude. Every element is then a multiple of that
// spacing or finer, so d = x - centre is exact in acc_t (bar rare ties that
// round to even): sum(d^2) carries no rounding bias from the centre's low bits,
// and a centre this close to the mean costs nothing in cancellation.
template <typename acc_t>
acc_t exact_centre(double mean, double max_abs) {
  if (!std::isfinite(mean) || !std::isfinite(max_abs) || max_abs == 0) return static_cast<acc_t>(mean);
  int exponent = 0;
  std::frexp(max_abs, &exponent);  // max_abs = f * 2^exponent, f in [0.5, 1)
  const double spacing = std::ldexp(1.0, exponent - std::numeric_limits<acc_t>::digits);
  return static_cast<acc_t>(std::round(mean / spacing) * spacing);
}

// A block's moments from the exact sums of x and of d^2 about the centre:
// m2 = sum(d^2) - n (mean - centre)^2.
Moments block_moments(double count, double sum_x, double centre, double sum_d2) {
  const double mean = sum_x / count;
  const double shift = mean - centre;
  return {count, mean, std::max(sum_d2 - count * shift * shift, 0.0)};
}

// Two passes per block, the second while the block is in cache: pass 1 takes
// the exact sum of x (hence the mean) and max |x|; pass 2 the exact sum of d^2
// about the exact centre, so no common offset survives into pass 2's terms.
template <typename T>
void batch_stats_impl(const T* x, const Extent& e, double* mean, double* var) {
  using IO = Io<T>;
  using acc_t = typename IO::acc_t;
  using Vec = typename IO::Vec;
  constexpr int64_t W = IO::kWidth;
  const Blocks b(e);
  const int64_t per = b.per_channel();
  const int64_t C = e.channels, I = e.inner;
  std::vector<Moments> partial(C * per);  // per channel, in block order

  for_each_block(b, e, [&](const Block& blk) {
    if (b.planes) {
      const int64_t k = blk.channel;
      const int64_t n = blk.s1 - blk.s0;
      const double count = static_cast<double>((blk.o1 - blk.o0) * n);
      LaneSum<acc_t> sum_x;
      Vec max_v[2] = {Vec(acc_t(0)), Vec(acc_t(0))};
      acc_t max_abs = 0;
      for (int64_t o = blk.o0; o < blk.o1; ++o) {
        const T* p = x + (o * C + k) * I + blk.s0;
        walk_run<W>(
            n,
            [&](int64_t j, int chain) {
              const Vec v = IO::load(p + j);
              sum_x.add(chain, v);
              max_v[chain] = at::vec::clamp_min(v.abs(), max_v[chain]);
            },
            [&](int64_t j) {
              const acc_t v = static_cast<acc_t>(p[j]);
              sum_x.add(v);
              max_abs = std::max(max_abs, std::abs(v));
            });
      }
      alignas(64) acc_t lanes[W];
      at::vec::clamp_min(max_v[0], max_v[1]).store(lanes);
      for (int64_t i = 0; i < W; ++i) max_abs = std::max(max_abs, lanes[i]);
      const double sx = sum_x.total();
      const acc_t centre = exact_centre<acc_t>(sx / count, max_abs);
      const Vec cv(centre);
      LaneSum<acc_t> sum_d2;
      for (int64_t o = blk.o0; o < blk.o1; ++o) {
        const T* p = x + (o * C + k) * I + blk.s0;
        walk_run<W>(
            n,
            [&](int64_t j, int chain) {
              const Vec d = IO::load(p + j) - cv;
              sum_d2.add_nonnegative(chain, d * d);
            },
            [&](int64_t j) {
              const acc_t d = static_cast<acc_t>(p[j]) - centre;
              sum_d2.add(d * d);
            });
      }
      partial[k * per + blk.slot] = block_moments(count, sx, centre, sum_d2.total());
    } else {
      const int64_t c0 = blk.s0, nc = blk.s1 - blk.s0;
      const double count = static_cast<double>(blk.o1 - blk.o0);
      const T* base = x + c0;
      double sum_x[kColumnBlock], sum_d2[kColumnBlock];
      alignas(64) acc_t max_abs[kColumnBlock];
      alignas(64) acc_t centre[kColumnBlock];
      walk_channels<W>(
          nc,
          [&](int64_t j, auto chains) {
            constexpr int kChains = decltype(chains)::value;
            LaneSum<acc_t> s;
            Vec max_v[kChains];
            for (int v = 0; v < kChains; ++v) max_v[v] = Vec(acc_t(0));
            for (int64_t o = blk.o0; o < blk.o1; ++o) {
              for (int v = 0; v < kChains; ++v) {
                const Vec a = IO::load(base + o * C + j + v * W);
                s.add(v, a);
                max_v[v] = at::vec::clamp_min(a.abs(), max_v[v]);
              }
            }
            for (int v = 0; v < kChains; ++v) {
              s.lanes(v, sum_x + j + v * W);
              max_v[v].store(max_abs + j + v * W);
            }
          },
          [&](int64_t j) {
            acc_t s = 0, r = 0, m = 0;
            for (int64_t o = blk.o0; o < blk.o1; ++o) {
              const acc_t a = static_cast<acc_t>(base[o * C + j]);
              add_exact(s, r, a);
              m = std::max(m, std::abs(a));
            }
            sum_x[j] = static_cast<double>(s) + static_cast<double>(r);
            max_abs[j] = m;
          });
      for (int64_t j = 0; j < nc; ++j) centre[j] = exact_centre<acc_t>(sum_x[j] / count, max_abs[j]);
      walk_channels<W>(
          nc,
          [&](int64_t j, auto chains) {
            constexpr int kChains = decltype(chains)::value;
            LaneSum<acc_t> s;
            Vec cv[kChains];
            for (int v = 0; v < kChains; ++v) cv[v] = Vec::loadu(centre + j + v * W);
            for (int64_t o = blk.o0; o < blk.o1; ++o) {
              for (int v = 0; v < kChains; ++v) {
                const Vec d = IO::load(base + o * C + j + v * W) - cv[v];
                s.add_nonnegative(v, d * d);
              }
            }
            for (int v = 0; v < kChains; ++v) s.lanes(v, sum_d2 + j + v * W);
          },
          [&](int64_t j) {
            acc_t s = 0, r = 0;
            for (int64_t o = blk.o0; o < blk.o1; ++o) {
              const acc_t d = static_cast<acc_t>(base[o * C + j]) - centre[j];
              add_exact_nonnegative(s, r, d * d);
            }
            sum_d2[j] = static_cast<double>(s) + static_cast<double>(r);
          });
      for (int64_t j = 0; j < nc; ++j) {
        partial[(c0 + j) * per + blk.slot] = block_moments(count, sum_x[j], centre[j], sum_d2[j]);
      }
    }
  });

  // Chan et al.'s merge, in block order.
  for (int64_t k = 0; k < C; ++k) {
    double n = 0, m = 0, m2 = 0;
    for (int64_t i = 0; i < per; ++i) {
      const Moments& p = partial[k * per + i];
      if (p.count == 0) continue;
      const double delta = p.mean - m;
      const double total = n + p.count;
      m += delta * (p.count / total);
      m2 += p.m2 + delta * delta * (n * p.count / total);
      n = total;
    }
    mean[k] = m;
    var[k] = m2 / n;
  }
}

// ---------------------------------------------------------------- elementwise
// out = alpha * y + beta * (x - mean) + gamma per channel; y may be null
// (then alpha is unused). Used by the forward's normalization (y null,
// beta = scale, gamma = shift) and by the backward's diff_src.
template <typename T>
void affine_impl(const T* x, const T* y, T* out, const Extent& e, const typename Io<T>::acc_t* mean,
                 const typename Io<T>::acc_t* alpha, const typename Io<T>::acc_t* beta,
                 const typename Io<T>::acc_t* gamma) {
  using IO = Io<T>;
  using acc_t = typename IO::acc_t;
  using Vec = typename IO::Vec;
  constexpr int64_t W = IO::kWidth;
  const Blocks b(e);
  const int64_t C = e.channels, I = e.inner;
  auto apply = [&](acc_t xv, acc_t yv, acc_t m, acc_t a, acc_t bb, acc_t g) {
    const acc_t r = (xv - m) * bb + g;
    return y ? a * yv + r : r;
  };
  for_each_block(b, e, [&](const Block& blk) {
    if (b.planes) {
      const int64_t k = blk.channel;
      const Vec m(mean[k]), bb(beta[k]), g(gamma[k]), a(y ? alpha[k] : acc_t(0));
      for (int64_t o = blk.o0; o < blk.o1; ++o) {
        const int64_t off = (o * C + k) * I;
        const T* xp = x + off;
        const T* yp = y ? y + off : nullptr;
        T* op = out + off;
        int64_t j = blk.s0;
        for (; j + W <= blk.s1; j += W) {
          Vec r = at::vec::fmadd(IO::load(xp + j) - m, bb, g);
          if (yp) r = at::vec::fmadd(a, IO::load(yp + j), r);
          IO::store(op + j, r);
        }
        for (; j < blk.s1; ++j) {
          op[j] = static_cast<T>(apply(static_cast<acc_t>(xp[j]), yp ? static_cast<acc_t>(yp[j]) : 0,
                                       mean[k], y ? alpha[k] : 0, beta[k], gamma[k]));
        }
      }
    } else {
      const int64_t c0 = blk.s0, c1 = blk.s1;
      for (int64_t o = blk.o0; o < blk.o1; ++o) {
        const int64_t off = o * C;
        int64_t j = c0;
        for (; j + W <= c1; j += W) {
          Vec r = at::vec::fmadd(IO::load(x + off + j) - Vec::loadu(mean + j), Vec::loadu(beta + j),
                                 Vec::loadu(gamma + j));
          if (y) r = at::vec::fmadd(Vec::loadu(alpha + j), IO::load(y + off + j), r);
          IO::store(out + off + j, r);
        }
        for (; j < c1; ++j) {
          out[off + j] = static_cast<T>(apply(static_cast<acc_t>(x[off + j]),
                                              y ? static_cast<acc_t>(y[off + j]) : 0, mean[j],
                                              y ? alpha[j] : 0, beta[j], gamma[j]));
        }
      }
    }
  });
}

// ---------------------------------------------------------------- gradient sums
template <typename T>
void grad_sums_impl(const T* x, const T* dy, const Extent& e, const typename Io<T>::acc_t* mean,
                    double* sum_dy, double* sum_dy_xc) {
  using IO = Io<T>;
  using acc_t = typename IO::acc_t;
  using Vec = typename IO::Vec;
  constexpr int64_t W = IO::kWidth;
  const Blocks b(e);
  const int64_t per = b.per_channel();
  const int64_t C = e.channels, I = e.inner;
  std::vector<double> p_dy(C * per), p_dyxc(C * per);

  for_each_block(b, e, [&](const Block& blk) {
    if (b.planes) {
      const int64_t k = blk.channel;
      const Vec m(mean[k]);
      LaneSum<acc_t> s, t;
      for (int64_t o = blk.o0; o < blk.o1; ++o) {
        const int64_t off = (o * C + k) * I + blk.s0;
        const T* xp = x + off;
        const T* dp = dy + off;
        walk_run<W>(
            blk.s1 - blk.s0,
            [&](int64_t j, int chain) {
              const Vec d = IO::load(dp + j);
              s.add(chain, d);
              t.add(chain, d * (IO::load(xp + j) - m));
            },
            [&](int64_t j) {
              const acc_t d = static_cast<acc_t>(dp[j]);
              s.add(d);
              t.add(d * (static_cast<acc_t>(xp[j]) - mean[k]));
            });
      }
      const int64_t slot = k * per + blk.slot;
      p_dy[slot] = s.total();
      p_dyxc[slot] = t.total();
    } else {
      const int64_t c0 = blk.s0, nc = blk.s1 - blk.s0;
      double sd[kColumnBlock], sx[kColumnBlock];
      walk_channels<W>(
          nc,
          [&](int64_t j, auto chains) {
            constexpr int kChains = decltype(chains)::value;
            LaneSum<acc_t> s, t;
            Vec m[kChains];
            for (int v = 0; v < kChains; ++v) m[v] = Vec::loadu(mean + c0 + j + v * W);
            for (int64_t o = blk.o0; o < blk.o1; ++o) {
              const int64_t off = o * C + c0 + j;
              for (int v = 0; v < kChains; ++v) {
                const Vec d = IO::load(dy + off + v * W);
                s.add(v, d);
                t.add(v, d * (IO::load(x + off + v * W) - m[v]));
              }
            }
            for (int v = 0; v < kChains; ++v) {
              s.lanes(v, sd + j + v * W);
              t.lanes(v, sx + j + v * W);
            }
          },
          [&](int64_t j) {
            acc_t s = 0, sr = 0, t = 0, tr = 0;
            const acc_t m = mean[c0 + j];
            for (int64_t o = blk.o0; o < blk.o1; ++o) {
              const int64_t off = o * C + c0 + j;
              const acc_t d = static_cast<acc_t>(dy[off]);
              add_exact(s, sr, d);
              add_exact(t, tr, d * (static_cast<acc_t>(x[off]) - m));
            }
            sd[j] = static_cast<double>(s) + static_cast<double>(sr);
            sx[j] = static_cast<double>(t) + static_cast<double>(tr);
          });
      for (int64_t j = 0; j < nc; ++j) {
        const int64_t slot = (c0 + j) * per + blk.slot;
        p_dy[slot] = sd[j];
        p_dyxc[slot] = sx[j];
      }
    }
  });

  for (int64_t k = 0; k < C; ++k) {
    double a = 0, c = 0;
    for (int64_t i = 0; i < per; ++i) {
      a += p_dy[k * per + i];
      c += p_dyxc[k * per + i];
    }
    sum_dy[k] = a;
    sum_dy_xc[k] = c;
  }
}

// ---------------------------------------------------------------- entry points
#define TBG_DISPATCH(tensor, name, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, (tensor).scalar_type(), name, __VA_ARGS__)

void batch_stats(const at::Tensor& src, const Extent& e, at::Tensor& mean, at::Tensor& var) {
  TBG_DISPATCH(src, "batch_stats", [&] {
    batch_stats_impl<scalar_t>(src.const_data_ptr<scalar_t>(), e, mean.mutable_data_ptr<double>(),
                               var.mutable_data_ptr<double>());
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

void grad_sums(const at::Tensor& src, const at::Tensor& diff_dst, const Extent& e,
               const at::Tensor& mean, at::Tensor& sum_dy, at::Tensor& sum_dy_xc) {
  TBG_DISPATCH(src, "grad_sums", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    grad_sums_impl<scalar_t>(src.const_data_ptr<scalar_t>(), diff_dst.const_data_ptr<scalar_t>(), e,
                             mean.const_data_ptr<acc_t>(), sum_dy.mutable_data_ptr<double>(),
                             sum_dy_xc.mutable_data_ptr<double>());
  });
}

void grad_input(const at::Tensor& src, const at::Tensor& diff_dst, at::Tensor& diff_src,
                const Extent& e, const at::Tensor& mean, const at::Tensor& a, const at::Tensor& b,
                const at::Tensor& c) {
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
  static const KernelTable table{&CPU_CAPABILITY::batch_stats, &CPU_CAPABILITY::normalize,
                                 &CPU_CAPABILITY::grad_sums, &CPU_CAPABILITY::grad_input,
#define TBG_STR_IMPL(x) #x
#define TBG_STR(x) TBG_STR_IMPL(x)
                                 TBG_STR(CPU_CAPABILITY)};
  return table;
}

}  // namespace torch_bn_grad::cpu
