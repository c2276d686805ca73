// Vectorized, parallel batch-norm kernels over a contiguous
// [outer, channels, inner] array. This file is compiled once per instruction
// set; everything in it lives in namespace CPU_CAPABILITY, as at::vec does.
//
// Numerics and determinism:
// * The reduction of each channel is cut into blocks whose boundaries depend on
//   the shape alone (never on the thread count). Each block is reduced by one
//   thread, and the per-block partials are combined in block order in float64,
//   so results are bitwise identical whatever the number of threads.
// * Statistics use a shifted two-pass scheme per block: the block's sum is taken
//   of (x - pivot), pivot being the channel's first element, which removes a
//   large common offset before it can cancel; the block's centred second moment
//   is then summed about the block mean while the block is still in cache. The
//   blocks are merged with Chan's parallel formula in float64.
// * The backward's two sums, sum(dy) and sum(dy * (x - mean)), are taken in one
//   pass and are centred by construction.
// * Inside a block, sums accumulate in several vector registers (float32 for
//   float32/float16/bfloat16 data, float64 for float64), at most a few hundred
//   terms per lane.
#include "cpu/kernels/kernel_table.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
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

// Sums of g(x) over a run of n contiguous elements, in two vector registers
// plus a scalar for the tail. `g` maps a vector (or scalar) of acc_t.
template <typename T, typename G>
void accumulate_run(const T* p, int64_t n, typename Io<T>::Vec& v0, typename Io<T>::Vec& v1,
                    double& tail, const G& g) {
  using IO = Io<T>;
  constexpr int64_t W = IO::kWidth;
  int64_t j = 0;
  for (; j + 2 * W <= n; j += 2 * W) {
    v0 = v0 + g(IO::load(p + j));
    v1 = v1 + g(IO::load(p + j + W));
  }
  for (; j + W <= n; j += W) v0 = v0 + g(IO::load(p + j));
  for (; j < n; ++j) tail += static_cast<double>(g(static_cast<typename IO::acc_t>(p[j])));
}

// ---------------------------------------------------------------- statistics
template <typename T>
void batch_stats_impl(const T* x, const Extent& e, double* mean, double* var) {
  using IO = Io<T>;
  using acc_t = typename IO::acc_t;
  using Vec = typename IO::Vec;
  constexpr int64_t W = IO::kWidth;
  const Blocks b(e);
  const int64_t per = b.per_channel();
  const int64_t C = e.channels, I = e.inner;
  // Per-channel pivot: the channel's first element.
  std::vector<acc_t> pivot(C);
  for (int64_t k = 0; k < C; ++k) pivot[k] = static_cast<acc_t>(x[k * I]);
  // Partials: count, mean, centred second moment, per channel in block order.
  std::vector<double> p_n(C * per), p_mean(C * per), p_m2(C * per);

  for_each_block(b, e, [&](const Block& blk) {
    if (b.planes) {
      const int64_t k = blk.channel;
      const int64_t n = blk.s1 - blk.s0;
      const acc_t pv = pivot[k];
      Vec v0(0), v1(0);
      double tail = 0;
      for (int64_t o = blk.o0; o < blk.o1; ++o) {
        accumulate_run<T>(x + (o * C + k) * I + blk.s0, n, v0, v1, tail,
                          [&](auto v) { return v - decltype(v)(pv); });
      }
      const double count = static_cast<double>((blk.o1 - blk.o0) * n);
      const acc_t bmean = static_cast<acc_t>(pv + (IO::hsum(v0 + v1) + tail) / count);
      Vec w0(0), w1(0);
      double tail2 = 0;
      for (int64_t o = blk.o0; o < blk.o1; ++o) {
        accumulate_run<T>(x + (o * C + k) * I + blk.s0, n, w0, w1, tail2, [&](auto v) {
          const auto d = v - decltype(v)(bmean);
          return d * d;
        });
      }
      const int64_t s = k * per + blk.slot;
      p_n[s] = count;
      p_mean[s] = bmean;
      p_m2[s] = IO::hsum(w0 + w1) + tail2;
    } else {
      const int64_t c0 = blk.s0, nc = blk.s1 - blk.s0;
      const int64_t vec_end = nc - nc % W;
      alignas(64) acc_t sum[kColumnBlock];
      alignas(64) acc_t bmean[kColumnBlock];
      std::fill(sum, sum + nc, acc_t(0));
      for (int64_t o = blk.o0; o < blk.o1; ++o) {
        const T* row = x + o * C + c0;
        for (int64_t j = 0; j < vec_end; j += W) {
          (Vec::loadu(sum + j) + (IO::load(row + j) - Vec::loadu(pivot.data() + c0 + j))).store(sum + j);
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
        for (int64_t j = 0; j < vec_end; j += W) {
          const Vec d = IO::load(row + j) - Vec::loadu(bmean + j);
          at::vec::fmadd(d, d, Vec::loadu(sum + j)).store(sum + j);
        }
        for (int64_t j = vec_end; j < nc; ++j) {
          const acc_t d = static_cast<acc_t>(row[j]) - bmean[j];
          sum[j] += d * d;
        }
      }
      for (int64_t j = 0; j < nc; ++j) {
        const int64_t s = (c0 + j) * per + blk.slot;
        p_n[s] = count;
        p_mean[s] = bmean[j];
        p_m2[s] = sum[j];
      }
    }
  });

  // Chan et al.'s merge, in block order.
  for (int64_t k = 0; k < C; ++k) {
    double n = 0, m = 0, m2 = 0;
    for (int64_t i = 0; i < per; ++i) {
      const int64_t s = k * per + i;
      const double nb = p_n[s];
      if (nb == 0) continue;
      const double delta = p_mean[s] - m;
      const double total = n + nb;
      m += delta * (nb / total);
      m2 += p_m2[s] + delta * delta * (n * nb / total);
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
      Vec s0(0), s1(0), t0(0), t1(0);
      double s_tail = 0, t_tail = 0;
      for (int64_t o = blk.o0; o < blk.o1; ++o) {
        const int64_t off = (o * C + k) * I;
        const T* xp = x + off;
        const T* dp = dy + off;
        int64_t j = blk.s0;
        for (; j + 2 * W <= blk.s1; j += 2 * W) {
          const Vec d0 = IO::load(dp + j), d1 = IO::load(dp + j + W);
          s0 = s0 + d0;
          s1 = s1 + d1;
          t0 = at::vec::fmadd(d0, IO::load(xp + j) - m, t0);
          t1 = at::vec::fmadd(d1, IO::load(xp + j + W) - m, t1);
        }
        for (; j + W <= blk.s1; j += W) {
          const Vec d0 = IO::load(dp + j);
          s0 = s0 + d0;
          t0 = at::vec::fmadd(d0, IO::load(xp + j) - m, t0);
        }
        for (; j < blk.s1; ++j) {
          const acc_t d = static_cast<acc_t>(dp[j]);
          s_tail += d;
          t_tail += d * (static_cast<acc_t>(xp[j]) - mean[k]);
        }
      }
      const int64_t s = k * per + blk.slot;
      p_dy[s] = IO::hsum(s0 + s1) + s_tail;
      p_dyxc[s] = IO::hsum(t0 + t1) + t_tail;
    } else {
      const int64_t c0 = blk.s0, nc = blk.s1 - blk.s0;
      const int64_t vec_end = nc - nc % W;
      alignas(64) acc_t sd[kColumnBlock];
      alignas(64) acc_t sx[kColumnBlock];
      std::fill(sd, sd + nc, acc_t(0));
      std::fill(sx, sx + nc, acc_t(0));
      for (int64_t o = blk.o0; o < blk.o1; ++o) {
        const T* xr = x + o * C + c0;
        const T* dr = dy + o * C + c0;
        for (int64_t j = 0; j < vec_end; j += W) {
          const Vec d = IO::load(dr + j);
          (Vec::loadu(sd + j) + d).store(sd + j);
          at::vec::fmadd(d, IO::load(xr + j) - Vec::loadu(mean + c0 + j), Vec::loadu(sx + j)).store(sx + j);
        }
        for (int64_t j = vec_end; j < nc; ++j) {
          const acc_t d = static_cast<acc_t>(dr[j]);
          sd[j] += d;
          sx[j] += d * (static_cast<acc_t>(xr[j]) - mean[c0 + j]);
        }
      }
      for (int64_t j = 0; j < nc; ++j) {
        const int64_t s = (c0 + j) * per + blk.slot;
        p_dy[s] = sd[j];
        p_dyxc[s] = sx[j];
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
