// The plane kernels: one block of a channel whose rows are `inner` (> 1)
// contiguous elements (partition.h), reduced or transformed with that
// channel's values as vector constants. Independent accumulator chains hide
// the latency of the compensated adds (exact_sum.h); short rows are
// prefetched explicitly.
#pragma once

#include <c10/macros/Macros.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "math/batch_norm_math.h"
#include "cpu/kernels/epilogue.h"
#include "cpu/kernels/exact_sum.h"
#include "cpu/kernels/partition.h"
#include "cpu/kernels/vec_io.h"

namespace torch_bn_grad::cpu {
namespace CPU_CAPABILITY {
namespace {  // internal linkage: see vec_io.h

template <typename T>
struct PlaneKernels {
  TBG_KERNEL_TYPES(T);

  // A row (one channel's inner positions in one outer row) shorter than
  // kPrefetchRowBytes is too short for the hardware prefetchers, which follow
  // streams within a page: rows of a channel are channels * inner elements
  // apart, so each row would start with cache misses paid at full latency.
  // The row kPrefetchAhead rows on is requested explicitly instead.
  static constexpr int64_t kPrefetchRowBytes = 4096;
  static constexpr int64_t kPrefetchAhead = 12;
  static bool prefetches_rows(int64_t n) { return n * static_cast<int64_t>(sizeof(T)) < kPrefetchRowBytes; }
  // Requests the row kPrefetchAhead rows after outer row o (which starts at
  // `row`) of a and b (b may be null) and, for writing, of out (may be null).
  C10_ALWAYS_INLINE static void prefetch_row_ahead(const Extent& e, const Block& blk, int64_t o, int64_t row,
                                                   int64_t n, const T* a, const T* b, T* out = nullptr) {
    if (o + kPrefetchAhead >= blk.o1) return;
    const int64_t ahead = row + kPrefetchAhead * e.channels * e.inner;
    prefetch_lines<false>(a + ahead, n);
    if (b) prefetch_lines<false>(b + ahead, n);
    if (out) prefetch_lines<true>(out + ahead, n);
  }

  // Independent accumulator chains hide the latency of the dependent
  // compensated adds; chunk i of a run feeds group i % kGroups (a fixed
  // assignment, so the result does not depend on anything but the shape).
  static constexpr int groups_for(int chains) { return P >= chains ? 1 : chains / P; }
  static constexpr int kGroups = groups_for(4);
  // The statistics' first pass keeps three vectors a chain (sum, err, max
  // |x|): on AVX2's 16 registers, four chains of them spilled, each
  // compensated add then waiting on a store and a reload, so it takes two
  // there (float16 14x14 statistics about 0.8x the time; the grad sums,
  // which hold one vector a chain and sum, keep four: two made bfloat16
  // 56x56 backward 1.15x).
#if defined(CPU_CAPABILITY_AVX2)
  static constexpr int kSumMaxGroups = groups_for(2);
#else
  static constexpr int kSumMaxGroups = kGroups;
#endif
  static constexpr int kChains = kGroups * P;
  // Rows of one chunk or less (4x4 planes of float32) only ever feed group 0:
  // their passes carry one group, whose flushes and totals cost a quarter as
  // much, and give the same bits (the other groups' chains would stay zero).
  static bool one_chunk_rows(const Block& blk) { return blk.s1 - blk.s0 <= K; }

  // Sums of N kinds of terms over a planes block: each chain adds its terms
  // plainly into `run` and, every kRowRun terms or so, moves the run into the
  // compensated `sum`/`err` pair (as the row kernels do per channel).
  //
  // Every access names its accumulator with constant indices (folds over
  // index sequences, not loops): GCC keeps an array in registers only if no
  // access indexes it with a variable before its loops are unrolled, and
  // otherwise loads and stores every accumulator on each chunk.
  template <int N, int kChains>
  struct Sums {
    static constexpr auto kAll = std::make_integer_sequence<int, N * kChains>{};
    Vec sum[N][kChains], err[N][kChains], run[N][kChains];
    C10_ALWAYS_INLINE Sums() { zero(kAll); }
    // Moves every run into its compensated sum; kNonNegative when all terms
    // are >= 0 (the cheaper add_exact_nonnegative is then exact).
    template <bool kNonNegative = false>
    C10_ALWAYS_INLINE void flush() { flush_each<kNonNegative>(kAll); }
    C10_ALWAYS_INLINE double total(int n) const { return total_of(n, std::make_integer_sequence<int, kChains>{}); }

   private:
    template <int... I>
    C10_ALWAYS_INLINE void zero(std::integer_sequence<int, I...>) {
      ((sum[I / kChains][I % kChains] = err[I / kChains][I % kChains] = run[I / kChains][I % kChains] =
            Vec(acc_t(0))), ...);
    }
    template <bool kNonNegative, int... I>
    C10_ALWAYS_INLINE void flush_each(std::integer_sequence<int, I...>) {
      (flush_one<kNonNegative, I / kChains, I % kChains>(), ...);
    }
    template <bool kNonNegative, int n, int c>
    C10_ALWAYS_INLINE void flush_one() {
      if constexpr (kNonNegative) add_exact_nonnegative(sum[n][c], err[n][c], run[n][c]);
      else add_exact(sum[n][c], err[n][c], run[n][c]);
      run[n][c] = Vec(acc_t(0));
    }
    // lanes_total over copies: its loop indexes its arguments with a variable.
    template <int... I>
    C10_ALWAYS_INLINE double total_of(int n, std::integer_sequence<int, I...>) const {
      const Vec s[kChains] = {sum[n][I]...}, r[kChains] = {err[n][I]...};
      return lanes_total(s, r);
    }
  };

  // Chain indices and full-chunk lane counts are passed as compile-time
  // constants, so that the accumulators stay in registers.
  template <int C>
  static constexpr std::integral_constant<int, C> chain{};
  // A full chunk's lane count, as a segment's (long rows) and as the rest's.
  using FullChunk = std::integral_constant<int64_t, K>;
  struct SegmentChunk : FullChunk {};

  // Calls pass.chunk(offset, chain base, lanes) for every chunk of every row
  // of a planes block (lanes < K only for a row's last, partial chunk),
  // spreading a row's chunks over the pass's chain groups, and pass.flush()
  // whenever a chain may have taken kRowRun plain terms. The schedule depends
  // on the shape only. Short rows of `a` and `b` (b may be null) are
  // prefetched ahead.
  //
  // The passes are objects holding their accumulators, reached without
  // closures: GCC keeps any variable whose address a closure holds (a lambda
  // capturing it by reference) in memory, which put every accumulator on
  // the stack, loaded and stored on each chunk. Always inlined, so that the
  // pass's accumulators become registers.
  template <typename Pass>
  C10_ALWAYS_INLINE static void walk_plane_rows(const Extent& e, const Block& blk, const T* a, const T* b, Pass& pass) {
    constexpr int G = Pass::kGroups;  // the pass's group count
    constexpr int64_t kSegment = kRowRun * G * K;
    constexpr auto groups = std::make_integer_sequence<int, G>{};
    const int64_t n = blk.s1 - blk.s0;
    const bool prefetch = prefetches_rows(n);
    int64_t pending = 0;  // most plain terms any chain holds
    for (int64_t o = blk.o0; o < blk.o1; ++o) {
      const int64_t row = (o * e.channels + blk.channel) * e.inner + blk.s0;
      if (prefetch) prefetch_row_ahead(e, blk, o, row, n, a, b);
      int64_t j = 0;
      for (; j + kSegment <= n; j += kSegment) {
        if constexpr (Pass::kFromMemory)
          if (!prefetch) prefetch_walk_ahead(e, blk, o, row, j, kSegment, a, b);
        for (int64_t r = 0; r < kRowRun; ++r) full_chunks(pass, row + j + r * G * K, SegmentChunk{}, groups);
        pass.flush();
        pending = 0;
      }
      // Chunk i of the rest goes to group i % G: whole rounds of full chunks
      // first (constant lane counts, as in a segment), then the last round.
      int64_t i = 0;
      for (; j + G * K <= n; j += G * K, i += G) full_chunks(pass, row + j, FullChunk{}, groups);
      while (j < n) rest_chunks(pass, row, n, j, i, groups);
      pending += ceil_div(i, G);
      if (pending >= kRowRun) {
        pass.flush();
        pending = 0;
      }
    }
    if (pending > 0) pass.flush();
  }

  // Long rows, read by a pass from memory (Pass::kFromMemory), request the
  // segment kPrefetchAheadBytes (vec_io.h) on in the block's walk (this
  // row's elements, then the next row's), at most a row on, as the row
  // kernels do (row_walk.h). Measured (2 threads, A/B
  // builds in alternating processes): forward 0.67x-0.86x the time on NCHW
  // 56x56 and 112x112 planes (float32, float16, bfloat16; float32 112x112
  // level), half-precision backward 0.72x-0.97x. Requesting past the row's
  // end (another channel's plane, which this thread does not read next) had
  // made the float32 56x56 backward 1.15x-1.25x.
  C10_ALWAYS_INLINE static void prefetch_walk_ahead(const Extent& e, const Block& blk, int64_t o, int64_t row,
                                                    int64_t j, int64_t len, const T* a, const T* b) {
    const int64_t n = blk.s1 - blk.s0;
    int64_t at = j + std::min<int64_t>(kPrefetchAheadBytes / static_cast<int64_t>(sizeof(T)), n);
    int64_t base = row;
    if (at >= n) {
      if (o + 1 >= blk.o1) return;
      at -= n;
      base += e.channels * e.inner;
    }
    const int64_t m = std::min(len, n - at);
    prefetch_lines<false>(a + base + at, m);
    if (b) prefetch_lines<false>(b + base + at, m);
  }

  // One full chunk per chain group, at base + g * K; `lanes` says whether
  // they are a segment's (SegmentChunk) or the rest's (FullChunk).
  template <typename Pass, typename L, int... G>
  C10_ALWAYS_INLINE static void full_chunks(Pass& pass, int64_t base, L lanes, std::integer_sequence<int, G...>) {
    (pass.chunk(base + G * K, chain<G * P>, lanes), ...);
  }

  // The next chunks of a row's rest (from j, n elements in all), one per
  // chain group while any are left; j advances by K and i counts them.
  template <typename Pass, int... G>
  C10_ALWAYS_INLINE static void rest_chunks(Pass& pass, int64_t row, int64_t n, int64_t& j, int64_t& i,
                                            std::integer_sequence<int, G...>) {
    ((j < n ? (pass.chunk(row + j, chain<G * P>, std::min(K, n - j)), j += K, ++i) : 0), ...);
  }

  static acc_t max_lane(const Vec& v) {
    alignas(64) acc_t lanes[W];
    v.store(lanes);
    return *std::max_element(lanes, lanes + W);
  }

  // Statistics pass 1: the exact sum of x and max |x| (a plain max: see
  // exact_centre). Zero-filled lanes of a partial chunk add nothing to either.
  //
  // float32 data: every term is added exactly (no plain runs), so that the
  // mean is right to well within half a unit of its float32 rounding.
  // Half-precision data: plain runs of kRowRun chunks a chain, each run
  // added exactly, as the row kernels do; TwoSum on every term had cost
  // these planes more than the rest of the forward (32x256x14x14 float16).
  // Its terms have 11 (float16) or 8 (bfloat16) significant bits and a run's
  // sum stays under 8 times its largest term, so a run rounds only terms
  // over 2^10 (bfloat16: 2^13) times smaller than its largest, and only
  // their low bits. Where such data cancel, the mean is then a few float32
  // units from the exact one (up to 14 on tests/support/accuracy.py's "mixed
  // magnitudes"; 0 or 1 on ordinary data), as on channels_last, instead of
  // correctly rounded: about 30x closer than native's there.
  template <int G>
  struct SumMaxPass {
    static constexpr int kGroups = G, kChains = G * P;
    static constexpr bool kFromMemory = true;
    static constexpr bool kPlainRuns = sizeof(T) == 2;
    const T* x;
    Sums<1, kChains> sums;
    Vec max_abs[kChains];
    C10_ALWAYS_INLINE explicit SumMaxPass(const T* data) : x(data) {
      // Not a range for: its pointer walk would keep the pass in memory (see Sums).
      for (int c = 0; c < kChains; ++c) max_abs[c] = Vec(acc_t(0));
    }
    template <typename C, typename L>
    C10_ALWAYS_INLINE void chunk(int64_t off, C c, L lanes) {
      Vec v[P];
      IO::load_lanes(x + off, lanes, v);
      for (int q = 0; q < P; ++q) {
        if constexpr (kPlainRuns) {
          sums.run[0][c + q] = sums.run[0][c + q] + v[q];
        } else {
          // In segments of long rows the FMA ports share TwoSum's adds
          // (exact_sum.h); shorter rows wait on the FMA's latency.
          add_exact<std::is_same_v<L, SegmentChunk>>(sums.sum[0][c + q], sums.err[0][c + q], v[q]);
        }
        max_abs[c + q] = at::vec::clamp_min(v[q].abs(), max_abs[c + q]);
      }
    }
    C10_ALWAYS_INLINE void flush() {
      if constexpr (kPlainRuns) sums.flush();
    }
    C10_ALWAYS_INLINE acc_t max_all() const { return max_of(std::make_integer_sequence<int, kChains>{}); }
    template <int... I>
    C10_ALWAYS_INLINE acc_t max_of(std::integer_sequence<int, I...>) const {  // constant indices, as in Sums
      Vec m = max_abs[0];
      ((m = at::vec::clamp_min(max_abs[I], m)), ...);
      return max_lane(m);
    }
  };

  // Statistics pass 2: the exact sum of (x - centre)^2.
  template <int G>
  struct SquaresPass {
    static constexpr int kGroups = G, kChains = G * P;
    static constexpr bool kFromMemory = false;  // the block, just read by SumMaxPass
    const T* x;
    Vec centre;
    Sums<1, kChains> sums;
    C10_ALWAYS_INLINE SquaresPass(const T* data, acc_t c) : x(data), centre(c) {}
    template <typename C, typename L>
    C10_ALWAYS_INLINE void chunk(int64_t off, C c, L lanes) {
      Vec v[P];
      IO::load_lanes(x + off, lanes, v);
      for (int q = 0; q < P; ++q) {
        Vec d = v[q] - centre;
        // Lanes past the row must not add (0 - centre)^2.
        if (lanes < K) d = Vec::set(Vec(acc_t(0)), d, IO::part_lanes(lanes, q));
        sums.run[0][c + q] = at::vec::fmadd(d, d, sums.run[0][c + q]);
      }
    }
    C10_ALWAYS_INLINE void flush() { sums.template flush<true>(); }
  };

  // The backward's sums of dy and dy * (x - mean), dy and x as the
  // epilogue's bound (epilogue.h) turns them. Zero-filled dy lanes of a
  // partial chunk add nothing to either sum.
  template <typename Bound, int G>
  struct GradSumsPass {
    static constexpr int kGroups = G, kChains = G * P;
    // Half precision only: float32 grad sums of 51-103 MB tensors took
    // 1.07x-1.09x the time with the requests (half precision 0.72x-0.93x).
    static constexpr bool kFromMemory = sizeof(T) == 2;
    const T *x, *dy;
    Vec mean;
    Bound bound;
    Sums<2, kChains> sums;
    C10_ALWAYS_INLINE GradSumsPass(const T* data, const T* grad, acc_t m, Bound b)
        : x(data), dy(grad), mean(m), bound(b) {}
    template <typename C, typename L>
    C10_ALWAYS_INLINE void chunk(int64_t off, C c, L lanes) {
      Vec xv[P], dv[P];
      if (lanes == K) {
        IO::load(dy + off, dv);
        IO::load(x + off, xv);
      } else {
        IO::load_partial(dy + off, lanes, dv);
        IO::load_partial(x + off, lanes, xv);
      }
      bound.apply(off, lanes, xv, dv);
      for (int q = 0; q < P; ++q) {
        sums.run[0][c + q] = sums.run[0][c + q] + dv[q];
        sums.run[1][c + q] = at::vec::fmadd(dv[q], xv[q] - mean, sums.run[1][c + q]);
      }
    }
    C10_ALWAYS_INLINE void flush() { sums.flush(); }
  };

  // The block's (count, mean, m2) partial: pass 1 takes the exact sum of x and
  // max |x|, pass 2 (block in cache) the exact sum of (x - centre)^2.
  static void stats(const T* x, const Extent& e, const Block& blk, Partials<math::Moments<double>>& out) {
    if (one_chunk_rows(blk)) stats_with<1, 1>(x, e, blk, out);
    else stats_with<kSumMaxGroups, kGroups>(x, e, blk, out);
  }
  template <int G1, int G2>
  static void stats_with(const T* x, const Extent& e, const Block& blk, Partials<math::Moments<double>>& out) {
    const int64_t n = blk.s1 - blk.s0;
    SumMaxPass<G1> first(x);
    walk_plane_rows(e, blk, x, nullptr, first);
    const double count = static_cast<double>((blk.o1 - blk.o0) * n);
    const double sum_x = first.sums.total(0);
    const acc_t centre = exact_centre<acc_t>(sum_x / count, first.max_all());
    SquaresPass<G2> second(x, centre);
    walk_plane_rows(e, blk, x, nullptr, second);
    out.set(blk.channel, blk.slot, math::centred_moments<double>(count, sum_x, centre, second.sums.total(0)));
  }

  // The block's exact sum(dy) and sum(dy * (x - mean)); with an epilogue,
  // of dz and of the value it centres (epilogue.h).
  template <typename E = PlainEpilogue<T>>
  static void grad_sums(const T* x, const T* dy, const Extent& e, const Block& blk, const acc_t* mean,
                        Partials<math::GradSums<double>>& out, const E& ep = E{}) {
    if (one_chunk_rows(blk)) grad_sums_with<1>(x, dy, e, blk, mean, out, ep);
    else grad_sums_with<kGroups>(x, dy, e, blk, mean, out, ep);
  }
  template <int G, typename E>
  static void grad_sums_with(const T* x, const T* dy, const Extent& e, const Block& blk, const acc_t* mean,
                             Partials<math::GradSums<double>>& out, const E& ep) {
    const int64_t k = blk.channel;
    GradSumsPass<decltype(ep.plane(k)), G> pass(x, dy, mean[k], ep.plane(k));
    walk_plane_rows(e, blk, x, dy, pass);
    out.set(k, blk.slot, {pass.sums.total(0), pass.sums.total(1)});
  }

  // out = dy_scale * y + x_scale * (x - mean) + bias over the block; y may be
  // null (the forward's normalization, dy_scale unused). The epilogue turns
  // y into dz in the backward, or activates out in the forward.
  template <typename E = PlainEpilogue<T>>
  static void affine(const T* x, const T* y, T* out, const Extent& e, const Block& blk,
                     const math::AffineArrays<acc_t>& c, const E& ep = E{}) {
    const int64_t C = e.channels, I = e.inner;
    const int64_t k = blk.channel;
    const ChannelAffine<E> ca(c, k, y != nullptr, ep);
    const int64_t n = blk.s1 - blk.s0;
    const bool prefetch = prefetches_rows(n);
    // Each row starts a whole number of planes after out + blk.s0.
    const bool stream = streams_output(out + blk.s0, e, sizeof(T), y ? 3 : 2);
    for (int64_t o = blk.o0; o < blk.o1; ++o) {
      const int64_t off = (o * C + k) * I + blk.s0;
      if (prefetch) prefetch_row_ahead(e, blk, o, off, n, x, y, out);
      ca.row(x, y, out, off, n, ep, stream);
    }
    if (stream) stream_fence();
  }

  // affine() over the planes [p0, p1) (plane p: outer row p / channels,
  // channel p % channels) in memory order, for an elementwise pass that
  // follows no reduction of its own (frozen statistics): planes of a few
  // dozen elements, walked a channel at a time, would each start with a
  // cache miss.
  template <typename E = PlainEpilogue<T>>
  static void affine_planes(const T* x, const T* y, T* out, const Extent& e, int64_t p0, int64_t p1,
                            const math::AffineArrays<acc_t>& c, const E& ep = E{}) {
    const bool stream = streams_output(out, e, sizeof(T), y ? 3 : 2);
    planes_in_order(x, y, out, e, p0, p1, c, ep, stream);
    if (stream) stream_fence();
  }

  // affine() over channels [k0, k1) of every outer row, row by row: a
  // channel run (partition.h, for_each_channel_run) whose inputs the
  // thread has just reduced, walked as one stream a row.
  template <typename E = PlainEpilogue<T>>
  static void affine_channel_run(const T* x, const T* y, T* out, const Extent& e, int64_t k0, int64_t k1,
                                 const math::AffineArrays<acc_t>& c, const E& ep = E{}) {
    const bool stream = streams_output(out, e, sizeof(T), y ? 3 : 2);
    for (int64_t o = 0; o < e.outer; ++o)
      planes_in_order(x, y, out, e, o * e.channels + k0, o * e.channels + k1, c, ep, stream);
    if (stream) stream_fence();
  }

  // The elementwise pass over planes [p0, p1), one after the other, unfenced.
  template <typename E>
  static void planes_in_order(const T* x, const T* y, T* out, const Extent& e, int64_t p0, int64_t p1,
                              const math::AffineArrays<acc_t>& c, const E& ep, bool stream) {
    // The channel is counted along (a division a plane cost 7x7 planes ~5%).
    for (int64_t p = p0, k = p0 % e.channels; p < p1; ++p, k = k + 1 == e.channels ? 0 : k + 1) {
      const ChannelAffine<E> ca(c, k, y != nullptr, ep);
      ca.row(x, y, out, p * e.inner, e.inner, ep, stream);
    }
  }

  // One channel's coefficients as vectors, and the elementwise pass over
  // n contiguous elements of it.
  template <typename E>
  struct ChannelAffine {
    decltype(std::declval<const E&>().plane(0)) bound;
    // The same vector for every part of a chunk (epilogue.h's affine_chunk).
    EveryPart<Vec> mean, x_scale, bias, dy_scale;
    ChannelAffine(const math::AffineArrays<acc_t>& c, int64_t k, bool with_y, const E& ep)
        : bound(ep.plane(k)), mean{Vec(c.mean[k])}, x_scale{Vec(c.x_scale[k])}, bias{Vec(c.bias[k])},
          dy_scale{Vec(with_y ? c.dy_scale[k] : acc_t(0))} {}

    C10_ALWAYS_INLINE void chunk(const T* x, const T* y, T* out, int64_t off, int64_t lanes, const E& ep,
                                 bool stream) const {
      affine_chunk(x, y, out, off, *this, bound, ep, stream, lanes);
    }
    // `stream`: full chunks are written with streaming stores (row starts aligned).
    // A row of K or more elements ending in a partial chunk ends instead
    // with the full chunk that ends where it does (plain batch norm): its
    // first lanes rewrite the same values, while a partial store of 16-bit
    // data on AVX2 goes through the stack (7x7 bfloat16 planes: a quarter
    // of the pass's time).
    C10_ALWAYS_INLINE void row(const T* x, const T* y, T* out, int64_t off, int64_t n, const E& ep,
                               bool stream) const {
      int64_t j = 0;
      for (; j + K <= n; j += K) chunk(x, y, out, off + j, K, ep, stream);
      if (j == n) return;
      if (std::is_same_v<E, PlainEpilogue<T>> && n >= K) chunk(x, y, out, off + n - K, K, ep, false);
      else chunk(x, y, out, off + j, n - j, ep, stream);
    }
  };
};

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace torch_bn_grad::cpu
