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
// * Every block sum is compensated: vector lanes of the accumulation type
//   (float32 for float32/float16/bfloat16 data, float64 for float64) carry the
//   exact rounding error of each add (TwoSum) alongside the sum. Terms first
//   go into short plain runs of kRowRun (a few roundings of a small partial
//   sum), and each run is added exactly, so a block's sum is within a few
//   units of the run sums' rounding of a float64 sum. A plain float32 lane
//   would be off by about sqrt(k) roundings after k terms: several units in
//   the last place of diff_beta, or of the mean of zero-mean data. The runs
//   keep the compensation's cost at a fraction of an add per term.
// * Statistics take two passes per block, the second while the block is in
//   cache: the exact sum of x gives the block mean; then the centred second
//   moment is summed about a centre that makes x - centre exact (exact_centre),
//   so a large common offset (mean 1000, unit noise) cancels before anything
//   is rounded. The blocks are merged with Chan's parallel formula in float64.
// * The backward's two sums, sum(dy) and sum(dy * (x - mean)), are taken in one
//   pass and are centred by construction (mean is an input).
// * Per-channel coefficients are computed in float64. The elementwise passes
//   subtract the mean rounded to the accumulation type; its rounding error is
//   folded into the additive coefficient, so that dst keeps full accuracy
//   when the mean is large.
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
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
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
// Channels per block when channels are innermost (per-column accumulators),
// and that block's target size: larger, so that the per-channel work of a
// block (its centre, its partials) is spread over at least 256 rows, while x
// and dy of a block still fit in L2 together.
constexpr int64_t kColumnBlock = 256;
constexpr int64_t kRowBlockElements = 65536;
// Terms summed plainly in registers before one compensated add (a channel's
// rows in the rows path, a chain's chunks in the planes path): an 8-term plain
// sum loses far less than the sqrt(n) drift the compensation prevents, at an
// eighth of its cost.
constexpr int64_t kRowRun = 8;

// A planes row (one channel's inner positions in one outer row) shorter than
// this is too short for the hardware prefetchers, which follow streams within
// a page: rows of a channel are channels * inner elements apart, so each row
// would start with cache misses paid at full latency. The row kPrefetchAhead
// rows on is requested explicitly instead.
constexpr int64_t kPrefetchRowBytes = 4096;
constexpr int64_t kPrefetchAhead = 12;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// f(std::integral_constant<int, 0>{}), ..., f(std::integral_constant<int, N - 1>{}).
template <int N, typename F>
inline void static_for(const F& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) {
    (f(std::integral_constant<int, I>{}), ...);
  }(std::make_integer_sequence<int, N>{});
}

// Requests the cache lines of p[0, n) (for writing when kWrite).
template <bool kWrite, typename T>
inline void prefetch_lines(const T* p, int64_t n) {
  constexpr uintptr_t kLine = 64;
  const uintptr_t end = reinterpret_cast<uintptr_t>(p + n);
  for (uintptr_t a = reinterpret_cast<uintptr_t>(p) & ~(kLine - 1); a < end; a += kLine)
    __builtin_prefetch(reinterpret_cast<const void*>(a), kWrite ? 1 : 0, 3);
}

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
  // The first n (< kChunk) elements; the other lanes read as zero.
  static void load_partial(const T* p, int64_t n, Vec (&v)[kParts]) {
    if constexpr (kParts == 1) {
      v[0] = Vec::loadu(p, n);
    } else {
      std::tie(v[0], v[1]) = at::vec::convert_to_float<T>(Vectorized<T>::loadu(p, n));
    }
  }
  static void store_partial(T* p, int64_t n, const Vec (&v)[kParts]) {
    if constexpr (kParts == 1) {
      v[0].store(p, n);
    } else {
      at::vec::convert_from_float<T>(v[0], v[1]).store(p, n);
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
      span_step = std::max<int64_t>(1, std::min(e.channels, kColumnBlock));
      n_span = ceil_div(e.channels, span_step);
      outer_step = std::max<int64_t>(1, kRowBlockElements / span_step);
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

// ---------------------------------------------------------------- exact sums
// sum += x, with the exact rounding error of the add collected in err (Knuth's
// TwoSum), for vectors and scalars alike.
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

// sum + err of each lane, in float64.
template <typename acc_t>
void lanes_to_double(const Vectorized<acc_t>& sum, const Vectorized<acc_t>& err, double* out) {
  constexpr int64_t W = Vectorized<acc_t>::size();
  alignas(64) acc_t s[W];
  alignas(64) acc_t r[W];
  sum.store(s);
  err.store(r);
  for (int64_t i = 0; i < W; ++i) out[i] = static_cast<double>(s[i]) + static_cast<double>(r[i]);
}

// Pass 2's centre: the block mean rounded to a multiple of the acc_t spacing
// at the block's largest magnitude. Every element is a multiple of that
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

// Writes a block's (count, mean, M2) partial from the exact sums of x and of
// d^2 about the centre: M2 = sum(d^2) - n (mean - centre)^2.
void store_moments(Partials& out, int64_t slot, double count, double sum_x, double centre, double sum_d2) {
  const double mean = sum_x / count;
  const double shift = mean - centre;
  out.a[slot] = count;
  out.b[slot] = mean;
  out.c[slot] = std::max(sum_d2 - count * shift * shift, 0.0);
}

// ---------------------------------------------------------------- block kernels
template <typename T>
struct Kernels {
  using IO = Io<T>;
  using acc_t = typename IO::acc_t;
  using Vec = typename IO::Vec;
  static constexpr int64_t W = IO::kWidth;
  static constexpr int64_t K = IO::kChunk;
  static constexpr int P = IO::kParts;

  // Planes: independent accumulator chains hide the latency of the dependent
  // compensated adds; chunk i of a run feeds group i % kGroups (a fixed
  // assignment, so the result does not depend on anything but the shape).
  static constexpr int kGroups = P >= 4 ? 1 : 4 / P;
  static constexpr int kChains = kGroups * P;

  // Sums of N kinds of terms over a planes block: each chain adds its terms
  // plainly into `run` and, every kRowRun terms or so, moves the run into the
  // compensated `sum`/`err` pair (as the rows path does per channel).
  template <int N>
  struct Sums {
    Vec sum[N][kChains], err[N][kChains], run[N][kChains];
    Sums() {
      for (int n = 0; n < N; ++n)
        for (int c = 0; c < kChains; ++c) sum[n][c] = err[n][c] = run[n][c] = Vec(acc_t(0));
    }
    // Moves every run into its compensated sum; kNonNegative when all terms
    // are >= 0 (the cheaper add_exact_nonnegative is then exact).
    template <bool kNonNegative = false>
    void flush() {
      for (int n = 0; n < N; ++n)
        for (int c = 0; c < kChains; ++c) {
          if constexpr (kNonNegative) add_exact_nonnegative(sum[n][c], err[n][c], run[n][c]);
          else add_exact(sum[n][c], err[n][c], run[n][c]);
          run[n][c] = Vec(acc_t(0));
        }
    }
    double total(int n) const {
      double lanes[W];
      double t = 0;
      for (int c = 0; c < kChains; ++c) {
        lanes_to_double(sum[n][c], err[n][c], lanes);
        for (int64_t i = 0; i < W; ++i) t += lanes[i];
      }
      return t;
    }
  };

  // Chain indices and full-chunk lane counts are passed as compile-time
  // constants, so that the accumulators stay in registers.
  template <int C>
  static constexpr std::integral_constant<int, C> chain{};
  static constexpr std::integral_constant<int64_t, K> full{};

  // Calls chunk(offset, chain base, lanes) for every chunk of every row of a
  // planes block (lanes < K only for a row's last, partial chunk), spreading a
  // row's chunks over the kGroups chain groups, and flush() whenever a chain
  // may have taken kRowRun plain terms. The schedule depends on the shape only.
  // Short rows of `a` and `b` (b may be null) are prefetched ahead.
  template <typename Chunk, typename Flush>
  static void walk_plane_rows(const Extent& e, const Block& blk, const T* a, const T* b, const Chunk& chunk,
                              const Flush& flush) {
    constexpr int64_t kSegment = kRowRun * kGroups * K;
    const int64_t n = blk.s1 - blk.s0;
    const bool prefetch = n * static_cast<int64_t>(sizeof(T)) < kPrefetchRowBytes;
    int64_t pending = 0;  // most plain terms any chain holds
    for (int64_t o = blk.o0; o < blk.o1; ++o) {
      const int64_t row = (o * e.channels + blk.channel) * e.inner + blk.s0;
      if (prefetch && o + kPrefetchAhead < blk.o1) {
        const int64_t ahead = row + kPrefetchAhead * e.channels * e.inner;
        prefetch_lines<false>(a + ahead, n);
        if (b) prefetch_lines<false>(b + ahead, n);
      }
      int64_t j = 0;
      for (; j + kSegment <= n; j += kSegment) {
        for (int64_t r = 0; r < kRowRun; ++r)
          static_for<kGroups>([&](auto g) { chunk(row + j + (r * kGroups + g) * K, chain<g * P>, full); });
        flush();
        pending = 0;
      }
      int64_t i = 0;  // chunk i of the rest goes to group i % kGroups
      while (j < n) {
        static_for<kGroups>([&](auto g) {
          if (j < n) {
            chunk(row + j, chain<g * P>, std::min(K, n - j));
            j += K;
            ++i;
          }
        });
      }
      pending += ceil_div(i, kGroups);
      if (pending >= kRowRun) {
        flush();
        pending = 0;
      }
    }
    flush();
  }

  // Compensated per-channel accumulators of a rows block, in L1: the block is
  // walked row by row (contiguous memory), lanes running across channels.
  struct ColumnSums {
    alignas(64) acc_t sum[kColumnBlock];
    alignas(64) acc_t err[kColumnBlock];
    explicit ColumnSums(int64_t n) {
      std::fill(sum, sum + n, acc_t(0));
      std::fill(err, err + n, acc_t(0));
    }
    void add(int64_t j, const Vec& v) {
      Vec s = Vec::loadu(sum + j), r = Vec::loadu(err + j);
      add_exact(s, r, v);
      s.store(sum + j);
      r.store(err + j);
    }
    void add_nonnegative(int64_t j, const Vec& v) {
      Vec s = Vec::loadu(sum + j), r = Vec::loadu(err + j);
      add_exact_nonnegative(s, r, v);
      s.store(sum + j);
      r.store(err + j);
    }
    void add(int64_t j, acc_t v) { add_exact(sum[j], err[j], v); }
    double value(int64_t j) const { return static_cast<double>(sum[j]) + static_cast<double>(err[j]); }
  };

  static acc_t max_lane(const Vec& v) {
    alignas(64) acc_t lanes[W];
    v.store(lanes);
    return *std::max_element(lanes, lanes + W);
  }

  // A block's (count, mean, M2) partial(s): pass 1 takes the exact sum of x
  // and max |x|, pass 2 (block in cache) the exact sum of (x - centre)^2.
  static void stats_block(const T* x, const Extent& e, const Block& blk, Partials& out) {
    const int64_t C = e.channels, I = e.inner;
    if (I > 1) {
      const int64_t k = blk.channel, n = blk.s1 - blk.s0;
      Sums<1> sx;
      Vec max_v[kChains];
      for (auto& m : max_v) m = Vec(acc_t(0));
      // Zero-filled lanes of a partial chunk add nothing to the sum or the max.
      // Every term is added exactly (no plain runs): the mean must be right to
      // well within half a unit of its float32 rounding.
      walk_plane_rows(e, blk, x, nullptr, [&](int64_t off, auto c, auto lanes) {
        Vec v[P];
        if (lanes == K) IO::load(x + off, v); else IO::load_partial(x + off, lanes, v);
        for (int q = 0; q < P; ++q) {
          add_exact(sx.sum[0][c + q], sx.err[0][c + q], v[q]);
          max_v[c + q] = at::vec::maximum(max_v[c + q], v[q].abs());
        }
      }, [] {});
      acc_t max_abs = 0;
      for (const auto& m : max_v) max_abs = std::max(max_abs, max_lane(m));
      const double count = static_cast<double>((blk.o1 - blk.o0) * n);
      const double sum_x = sx.total(0);
      const acc_t centre = exact_centre<acc_t>(sum_x / count, max_abs);
      const Vec cv(centre), zero(acc_t(0));
      Sums<1> sd;
      walk_plane_rows(e, blk, x, nullptr, [&](int64_t off, auto c, auto lanes) {
        Vec v[P];
        if (lanes == K) IO::load(x + off, v); else IO::load_partial(x + off, lanes, v);
        for (int q = 0; q < P; ++q) {
          Vec d = v[q] - cv;
          // Lanes past the row must not add (0 - centre)^2.
          if (lanes < K) d = Vec::set(zero, d, std::clamp<int64_t>(lanes - q * W, 0, W));
          sd.run[0][c + q] = at::vec::fmadd(d, d, sd.run[0][c + q]);
        }
      }, [&] { sd.template flush<true>(); });
      store_moments(out, k * out.per + blk.slot, count, sum_x, centre, sd.total(0));
      return;
    }
    const int64_t c0 = blk.s0, nc = blk.s1 - blk.s0, vec_end = nc - nc % K;
    const double count = static_cast<double>(blk.o1 - blk.o0);
    ColumnSums sx(nc);
    alignas(64) acc_t max_abs[kColumnBlock];
    alignas(64) acc_t centre[kColumnBlock];
    std::fill(max_abs, max_abs + nc, acc_t(0));
    Vec v[P];
    for (int64_t r0 = blk.o0; r0 < blk.o1; r0 += kRowRun) {
      const int64_t r1 = std::min(blk.o1, r0 + kRowRun);
      for (int64_t j = 0; j < vec_end; j += K) {
        Vec a[P], mx[P];
        for (int q = 0; q < P; ++q) {
          a[q] = Vec(acc_t(0));
          mx[q] = Vec::loadu(max_abs + j + q * W);
        }
        for (int64_t o = r0; o < r1; ++o) {
          IO::load(x + o * C + c0 + j, v);
          for (int q = 0; q < P; ++q) {
            a[q] = a[q] + v[q];
            mx[q] = at::vec::maximum(mx[q], v[q].abs());
          }
        }
        for (int q = 0; q < P; ++q) {
          sx.add(j + q * W, a[q]);
          mx[q].store(max_abs + j + q * W);
        }
      }
      for (int64_t o = r0; o < r1; ++o) {
        const T* row = x + o * C + c0;
        for (int64_t j = vec_end; j < nc; ++j) {
          const acc_t a = static_cast<acc_t>(row[j]);
          sx.add(j, a);
          max_abs[j] = std::max(max_abs[j], std::abs(a));
        }
      }
    }
    for (int64_t j = 0; j < nc; ++j) centre[j] = exact_centre<acc_t>(sx.value(j) / count, max_abs[j]);
    ColumnSums sd(nc);
    for (int64_t r0 = blk.o0; r0 < blk.o1; r0 += kRowRun) {
      const int64_t r1 = std::min(blk.o1, r0 + kRowRun);
      for (int64_t j = 0; j < vec_end; j += K) {
        Vec a[P], cv[P];
        for (int q = 0; q < P; ++q) {
          a[q] = Vec(acc_t(0));
          cv[q] = Vec::loadu(centre + j + q * W);
        }
        for (int64_t o = r0; o < r1; ++o) {
          IO::load(x + o * C + c0 + j, v);
          for (int q = 0; q < P; ++q) {
            const Vec d = v[q] - cv[q];
            a[q] = at::vec::fmadd(d, d, a[q]);
          }
        }
        for (int q = 0; q < P; ++q) sd.add_nonnegative(j + q * W, a[q]);
      }
      for (int64_t o = r0; o < r1; ++o) {
        const T* row = x + o * C + c0;
        for (int64_t j = vec_end; j < nc; ++j) {
          const acc_t d = static_cast<acc_t>(row[j]) - centre[j];
          add_exact_nonnegative(sd.sum[j], sd.err[j], d * d);
        }
      }
    }
    for (int64_t j = 0; j < nc; ++j)
      store_moments(out, (c0 + j) * out.per + blk.slot, count, sx.value(j), centre[j], sd.value(j));
  }

  // Exact sum(dy) and sum(dy * (x - mean)) of one block: partial slot(s) in `out`.
  static void sums_block(const T* x, const T* dy, const Extent& e, const Block& blk, const acc_t* mean,
                         Partials& out) {
    const int64_t C = e.channels, I = e.inner;
    if (I > 1) {
      const int64_t k = blk.channel;
      const Vec m(mean[k]);
      Sums<2> st;
      // Zero-filled dy lanes of a partial chunk add nothing to either sum.
      walk_plane_rows(e, blk, x, dy, [&](int64_t off, auto c, auto lanes) {
        Vec xv[P], dv[P];
        if (lanes == K) {
          IO::load(dy + off, dv);
          IO::load(x + off, xv);
        } else {
          IO::load_partial(dy + off, lanes, dv);
          IO::load_partial(x + off, lanes, xv);
        }
        for (int q = 0; q < P; ++q) {
          st.run[0][c + q] = st.run[0][c + q] + dv[q];
          st.run[1][c + q] = at::vec::fmadd(dv[q], xv[q] - m, st.run[1][c + q]);
        }
      }, [&] { st.flush(); });
      const int64_t slot = k * out.per + blk.slot;
      out.a[slot] = st.total(0);
      out.b[slot] = st.total(1);
      return;
    }
    const int64_t c0 = blk.s0, nc = blk.s1 - blk.s0, vec_end = nc - nc % K;
    ColumnSums sd(nc), sx(nc);
    Vec xv[P], dv[P];
    for (int64_t r0 = blk.o0; r0 < blk.o1; r0 += kRowRun) {
      const int64_t r1 = std::min(blk.o1, r0 + kRowRun);
      for (int64_t j = 0; j < vec_end; j += K) {
        Vec a[P], b[P], m[P];
        for (int q = 0; q < P; ++q) {
          a[q] = b[q] = Vec(acc_t(0));
          m[q] = Vec::loadu(mean + c0 + j + q * W);
        }
        for (int64_t o = r0; o < r1; ++o) {
          const int64_t off = o * C + c0 + j;
          IO::load(dy + off, dv);
          IO::load(x + off, xv);
          for (int q = 0; q < P; ++q) {
            a[q] = a[q] + dv[q];
            b[q] = at::vec::fmadd(dv[q], xv[q] - m[q], b[q]);
          }
        }
        for (int q = 0; q < P; ++q) {
          sd.add(j + q * W, a[q]);
          sx.add(j + q * W, b[q]);
        }
      }
      for (int64_t o = r0; o < r1; ++o) {
        const int64_t off = o * C + c0;
        for (int64_t j = vec_end; j < nc; ++j) {
          const acc_t d = static_cast<acc_t>(dy[off + j]);
          sd.add(j, d);
          sx.add(j, d * (static_cast<acc_t>(x[off + j]) - mean[c0 + j]));
        }
      }
    }
    for (int64_t j = 0; j < nc; ++j) {
      const int64_t slot = (c0 + j) * out.per + blk.slot;
      out.a[slot] = sd.value(j);
      out.b[slot] = sx.value(j);
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
      const int64_t n = blk.s1 - blk.s0;
      const bool prefetch = n * static_cast<int64_t>(sizeof(T)) < kPrefetchRowBytes;
      for (int64_t o = blk.o0; o < blk.o1; ++o) {
        const int64_t off = (o * C + k) * I;
        if (prefetch && o + kPrefetchAhead < blk.o1) {
          const int64_t ahead = off + kPrefetchAhead * C * I + blk.s0;
          prefetch_lines<false>(x + ahead, n);
          if (y) prefetch_lines<false>(y + ahead, n);
          prefetch_lines<true>(out + ahead, n);
        }
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
        if (j < blk.s1) {
          const int64_t n = blk.s1 - j;
          IO::load_partial(x + off + j, n, xv);
          if (y) IO::load_partial(y + off + j, n, yv);
          for (int q = 0; q < P; ++q) {
            xv[q] = at::vec::fmadd(xv[q] - m, bb, g);
            if (y) xv[q] = at::vec::fmadd(a, yv[q], xv[q]);
          }
          IO::store_partial(out + off + j, n, xv);
        }
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

// Per-channel coefficients of out = alpha * y + beta * (x - mean) + gamma, of
// the accumulation type. `mean` is rounded to it; the rounding error times
// beta goes into gamma, in float64, so x - mean loses nothing to it.
template <typename acc_t>
struct Coefficients {
  std::vector<acc_t> mean, alpha, beta, gamma;
  explicit Coefficients(int64_t channels) : mean(channels), alpha(channels), beta(channels), gamma(channels) {}

  void set(int64_t k, double m, double a, double b, double c) {
    mean[k] = static_cast<acc_t>(m);
    alpha[k] = static_cast<acc_t>(a);
    beta[k] = static_cast<acc_t>(b);
    gamma[k] = static_cast<acc_t>(c - b * (m - static_cast<double>(mean[k])));
  }
  // dst = (x - mean) * scale + shift.
  void set_normalize(int64_t k, double m, double scale, double shift) { set(k, m, 0.0, scale, shift); }
};

// ---------------------------------------------------------------- operators
template <typename T>
void forward_batch_impl(const T* x, T* y, const Extent& e, const double* gamma, const double* beta,
                        double eps, double* mean, double* var) {
  using KN = Kernels<T>;
  using acc_t = typename Io<T>::acc_t;
  const Blocks b(e);
  Partials parts(e.channels, b.per_channel(), 3);
  Coefficients<acc_t> co(e.channels);
  auto finish_channel = [&](int64_t k) {
    merge_stats(parts, k, mean[k], var[k]);
    co.set_normalize(k, mean[k], gamma[k] / std::sqrt(var[k] + eps), beta[k]);
  };
  auto normalize = [&](const Block& blk) {
    KN::affine_block(x, nullptr, y, e, blk, co.mean.data(), nullptr, co.beta.data(), co.gamma.data());
  };
  if (per_channel_strategy(b, e)) {
    const int64_t per = b.per_channel();
    at::parallel_for(0, e.channels, 1, [&](int64_t k0, int64_t k1) {
      for (int64_t k = k0; k < k1; ++k) {
        for (int64_t i = 0; i < per; ++i) KN::stats_block(x, e, block_at(b, e, k * per + i), parts);
        finish_channel(k);
        for (int64_t i = per - 1; i >= 0; --i) normalize(block_at(b, e, k * per + i));
      }
    });
    return;
  }
  for_each_block(b, e, false, [&](const Block& blk) { KN::stats_block(x, e, blk, parts); });
  for (int64_t k = 0; k < e.channels; ++k) finish_channel(k);
  for_each_block(b, e, true, normalize);
}

template <typename T>
void forward_frozen_impl(const T* x, T* y, const Extent& e, const double* mean, const double* var,
                         const double* gamma, const double* beta, double eps) {
  using acc_t = typename Io<T>::acc_t;
  Coefficients<acc_t> co(e.channels);
  for (int64_t k = 0; k < e.channels; ++k) co.set_normalize(k, mean[k], gamma[k] / std::sqrt(var[k] + eps), beta[k]);
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
  // The sums are centred on the rounded mean the kernels subtract.
  for (int64_t k = 0; k < e.channels; ++k) co.mean[k] = static_cast<acc_t>(mean[k]);
  // diff_src = a * dy + b * (x - mean) + c, with a = g * rstd and, in training,
  // b = -a * rstd^2 * sum(dy * xc) / M, c = -a * sum(dy) / M.
  auto finish_channel = [&](int64_t k) {
    double sum_dy = 0, sum_dy_xc = 0;
    if (need_sums) merge_sums(parts, k, sum_dy, sum_dy_xc);
    // Re-centre the sum on the exact mean: sum(dy (x - m)) = sum(dy (x - mk)) - (m - mk) sum(dy).
    sum_dy_xc -= (mean[k] - static_cast<double>(co.mean[k])) * sum_dy;
    const double rstd = 1.0 / std::sqrt(var[k] + eps);
    const double a = gamma[k] * rstd;
    co.set(k, mean[k], a, training ? -a * rstd * rstd * sum_dy_xc / count : 0.0,
           training ? -a * sum_dy / count : 0.0);
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
  Partials parts(e.channels, b.per_channel(), 3);
  for_each_block(b, e, false, [&](const Block& blk) { Kernels<T>::stats_block(x, e, blk, parts); });
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
      &CPU_CAPABILITY::batch_stats,   &CPU_CAPABILITY::grad_sums,
      &CPU_CAPABILITY::grad_input,    TBG_STR(CPU_CAPABILITY)};
  return table;
}

}  // namespace torch_bn_grad::cpu
