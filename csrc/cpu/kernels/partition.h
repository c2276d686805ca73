// The deterministic partition of the CPU kernels' work into blocks, how the
// blocks are scheduled on threads, and the per-block partials they leave.
//
// The reduction of each channel is cut into blocks whose boundaries depend on
// the shape alone (never on the thread count). Each block is reduced by one
// thread, and the per-block partials are combined in block order in float64,
// so results are bitwise identical whatever the number of threads or the
// schedule.
//
// With inner > 1 ("planes", plane_kernels.h) a block is one channel over a
// range of outer rows and a range of inner positions; with inner == 1
// ("rows": row_statistics.h, row_grad_sums.h and row_affine.h) a block is a
// range of rows over a range of channels.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <type_traits>

#include "math/batch_norm_math.h"
#include "cpu/aligned_array.h"
#include "cpu/cache_geometry.h"
#include "math/extent.h"

namespace torch_bn_grad::cpu {
namespace CPU_CAPABILITY {
namespace {  // internal linkage: see vec_io.h

// Elements per planes block: small enough to stay in L1/L2 between the two
// statistics passes.
constexpr int64_t kBlockElements = 16384;
// Channels per rows block (per-column accumulators), and that block's target
// size and least height. A block row runs over up to kColumnBlock channels
// (4 KiB of float32): shorter segments of eight interleaved rows defeat the
// hardware prefetchers (256-channel segments took 1.5x as long per element on
// a 2048-channel layer). A block has at least kRowBlockRows rows, so that each
// channel's per-block work (its centre, its partial, the merge: a few dozen
// float64 operations, a vector of columns at a time) is spread over them, and
// otherwise about kRowBlockElements elements. 256 rows: a 1024-column float32
// block is then 1 MB, and the second statistics pass reads it back from L2
// (1 MB a Zen 4 core, 2 MB a Xeon EMR core); at 512 rows (2 MB) it came from
// L3. Against 512 rows (2 threads, Zen 4, variants interleaved in one process,
// four processes): 4096x1024 float32 forward 0.94x-0.97x the time,
// 32x1024x14x14 and 32x2048x7x7 channels_last forward 0.89x and 0.91x,
// backward level to 0.97x, nothing slower beyond noise from 256x1024 to
// 512x4096. 128 rows was level with 256 on the float32 forward and 1.07x on
// float16 2048-channel layers (the per-block column work); 1024 rows missed L2
// on 32x512x28x28 channels_last (1.25x).
constexpr int64_t kColumnBlock = 1024;
constexpr int64_t kRowBlockElements = 65536;
constexpr int64_t kRowBlockRows = 256;
// Threads take contiguous ranges of blocks, so a layer of a few blocks is
// shared unevenly: 4 blocks of 128 rows and one of 8 (a 1024-channel 7x7
// layer at batch 8) gave one of two threads two thirds of the work. Rows
// blocks therefore come in multiples of kBlockMultiple (when each keeps
// kMinRowBlockRows rows), of equal height; the count still depends on the
// shape alone.
constexpr int64_t kBlockMultiple = 4;
constexpr int64_t kMinRowBlockRows = 16;

struct Blocks {
  bool planes;
  int64_t outer_step, n_outer;
  int64_t span_step, n_span;  // planes: inner positions; rows: channels (columns)
  int64_t total;
  int64_t span;  // rows: columns per channel, 1 but in segments()

  explicit Blocks(const Extent& e) : Blocks(e, 1) {}

  // Short planes reduced as rows: the array seen as segment_rows(e), each
  // channel a segment of `inner` columns, every column block holding whole
  // segments (so each channel has one partial per row block, as rows do).
  static Blocks segments(const Extent& e) { return Blocks(segment_rows(e), e.inner); }
  static Extent segment_rows(const Extent& e) { return {e.outer, e.channels * e.inner, 1}; }

  // Partials per channel, combined in this order.
  int64_t per_channel() const { return planes ? n_outer * n_span : n_outer; }

 private:
  Blocks(const Extent& e, int64_t columns_per_channel) : planes(e.inner > 1), span(columns_per_channel) {
    if (planes) {
      n_span = ceil_div(e.inner, kBlockElements);
      span_step = ceil_div(e.inner, n_span);
      outer_step = std::max<int64_t>(1, kBlockElements / span_step);
      n_outer = ceil_div(e.outer, outer_step);
      total = e.channels * n_outer * n_span;
    } else {
      span_step = std::max<int64_t>(1, std::min(e.channels, span * std::max<int64_t>(1, kColumnBlock / span)));
      n_span = ceil_div(e.channels, span_step);
      n_outer = balanced_row_blocks(e.outer, n_span,
                                    ceil_div(e.outer, std::max(kRowBlockRows, kRowBlockElements / span_step)));
      outer_step = std::max<int64_t>(1, ceil_div(e.outer, n_outer));
      n_outer = ceil_div(e.outer, outer_step);
      total = n_outer * n_span;
    }
  }

  // The row-block count, at least `wanted`, raised so that the blocks
  // (times the column blocks) are a multiple of kBlockMultiple while each
  // keeps kMinRowBlockRows rows.
  static int64_t balanced_row_blocks(int64_t outer, int64_t n_span, int64_t wanted) {
    const int64_t step = kBlockMultiple / std::gcd(kBlockMultiple, n_span);
    const int64_t balanced = ceil_div(std::max<int64_t>(wanted, 1), step) * step;
    return balanced * kMinRowBlockRows <= outer ? balanced : std::max<int64_t>(wanted, 1);
  }
};

// One block's coordinates.
struct Block {
  int64_t o0, o1;   // outer rows
  int64_t s0, s1;   // planes: inner range; rows: channel range
  int64_t channel;  // planes only
  int64_t slot;     // index among the partials of its channel(s)
};

inline Block block_at(const Blocks& b, const Extent& e, int64_t id) {
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

// Below this many elements an operator runs on the calling thread: waking the
// pool costs more than the work (ATen's batch norm uses the same grain). The
// blocks, and so the results, do not depend on it.
constexpr int64_t kSerialElements = 32768;

// parallel_for's grain for `items` work items of an operator on `e`: all of them
// on the calling thread when the operator is small, else one item per task.
// `extra_elements` counts work beyond the elements (for_each_column_block).
inline int64_t grain_for(const Extent& e, int64_t items, int64_t extra_elements = 0) {
  return e.outer * e.channels * e.inner + extra_elements < kSerialElements ? items + 1 : 1;
}

// Runs f on every block in parallel. Threads get the same contiguous ranges of
// blocks on every call; `reverse` walks each range backwards, starting with
// the blocks the thread read last, which are still in its cache.
template <typename F>
void for_each_block(const Blocks& b, const Extent& e, bool reverse, const F& f) {
  at::parallel_for(0, b.total, grain_for(e, b.total), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) f(block_at(b, e, reverse ? begin + end - 1 - i : i));
  });
}

// Planes of `inner` elements a thread takes at least (and in multiples of)
// when it walks whole planes of the elementwise pass, so that its elements
// start on a byte of the fused forward's sign bits (sign_bits.h): the fewest
// planes whose elements are a multiple of 8, 8 / gcd(inner, 8).
inline int64_t planes_per_bits_unit(int64_t inner) { return 8 / std::gcd<int64_t>(inner, 8); }

// A tensor of this size or more is taken not to stay in the caches between
// an operator's passes (measured here: 1 MB of L2 a core, 32 MB of L3).
constexpr int64_t kLargeTensorBytes = int64_t{4} << 20;

// Planes so short that the elementwise pass is better done over the whole
// array in memory order (affine_all) than channel by channel: a channel's
// rows are channels * inner elements apart, so writing one channel at a time
// requests a new line of a new page every row or few, while the memory-order
// pass writes one stream. Planes under 1 KiB always (a bfloat16 2048-channel
// 7x7 forward at batch 32 took 0.72x-0.85x the time); under 4 KiB when the
// tensor is too large for the per-channel pass's second read to come from L2
// anyway (256-channel 28x28 at batch 8: forward 0.77x, backward 0.63x; at 64
// channels, 1.6 MB, the per-channel pass was 5% faster).
inline bool short_planes(const Blocks& b, const Extent& e, size_t element_bytes) {
  constexpr int64_t kShortPlaneBytes = 1024, kShortPlaneBytesLarge = 4096;
  if (!b.planes) return false;
  const auto bytes = static_cast<int64_t>(element_bytes);
  const int64_t plane_bytes = e.inner * bytes;
  return plane_bytes < kShortPlaneBytes ||
         (plane_bytes < kShortPlaneBytesLarge && e.outer * e.channels * plane_bytes >= kLargeTensorBytes);
}

// Planes under 256 bytes (7x7 float32, float16, bfloat16) of 16 or more outer rows are
// reduced as rows of whole channels (Blocks::segments, by the row kernels)
// instead of a channel at a time: a plane row is a few cache lines,
// channels * inner elements from the next, so the plane kernels wait on a
// miss per row and split each row into a full and a partial chunk, while the
// row kernels read eight rows of ~1000 columns side by side in full chunks.
// Measured (2 threads, separate processes alternating, A/B
// builds), time taken, segments over planes: 32x2048x7x7 forward 0.69x-0.78x,
// backward 0.72x-0.92x (float32, bfloat16, float16); 64x2048x7x7 float32
// 0.88x / 0.71x; 32x1024x7x7 bfloat16 0.73x / 0.80x; 16 rows 0.82x-1.0x.
// With 8 rows a column's fixed work (its sums' set-up and fold) is spread
// over too few elements (8x2048x7x7 1.07x-1.19x), and 14x14 planes of 784
// bytes lost (32x256x14x14 float32 backward 1.4x), 392 bytes were level.
inline bool reduces_as_segments(const Blocks& b, const Extent& e, size_t element_bytes) {
  constexpr int64_t kSegmentPlaneBytes = 256, kSegmentMinRows = 16;
  return b.planes && e.inner * static_cast<int64_t>(element_bytes) < kSegmentPlaneBytes &&
         e.outer >= kSegmentMinRows && e.inner <= kColumnBlock;
}

// An elementwise pass that moves this many bytes or more (its inputs and its
// output) writes the output with streaming stores (Io::store_stream): the
// output does not stay in the caches for the next operator anyway, and a
// streaming store writes a line without reading it first. 48 MB is 1.5x this
// machine's L3. Measured (2 threads, A/B in one process, results
// bitwise equal): backward passes (x, dy, dx) of 16 MB outputs 0.77x-0.92x
// the time; forward and eval passes (x, out) of 24 MB to 100 MB outputs
// 0.63x-0.95x, but of 16-18 MB outputs up to 1.3x (when the previous call's
// output is still in the L3, a plain store finds its lines there).
constexpr int64_t kStreamPassBytes = int64_t{48} << 20;

// Whether an elementwise pass over `operands` tensors of e's size (the output
// included) moves kStreamPassBytes or more, with `out` on a cache line: the
// walk that streams must keep its full chunks on lines too.
inline bool streams_pass(const void* out, const Extent& e, size_t element_bytes, int operands) {
  const auto bytes = static_cast<int64_t>(element_bytes);
  return operands * e.outer * e.channels * e.inner * bytes >= kStreamPassBytes &&
         reinterpret_cast<uintptr_t>(out) % kCacheLineBytes == 0;
}

// Whether a walk line by line (a plane row, or a row of channels) writes
// `out` with streaming stores: a large pass (streams_pass) whose every line
// starts on a cache line, so that full chunks are aligned stores that fill
// whole lines.
inline bool streams_output(const void* out, const Extent& e, size_t element_bytes, int operands) {
  const int64_t line_bytes = (e.inner > 1 ? e.inner : e.channels) * static_cast<int64_t>(element_bytes);
  return streams_pass(out, e, element_bytes, operands) && line_bytes % static_cast<int64_t>(kCacheLineBytes) == 0;
}

// Both passes of an operator per channel (reduce, then apply while the
// channel is still in the thread's L2) when channels are outermost, planes
// are not short, and there are enough channels to keep every thread busy.
inline bool per_channel_strategy(const Blocks& b, const Extent& e, size_t element_bytes) {
  const int64_t threads = at::get_num_threads();
  return b.planes && !short_planes(b, e, element_bytes) && threads > 0 &&
         (e.channels % threads == 0 || e.channels >= 8 * threads);
}

// Runs reduce(block) on each block of a channel, then finish(channel), then
// apply(block) on its blocks in reverse, one channel at a time per thread.
template <typename Reduce, typename Finish, typename Apply>
void for_each_channel(const Blocks& b, const Extent& e, const Reduce& reduce, const Finish& finish,
                      const Apply& apply) {
  const int64_t per = b.per_channel();
  at::parallel_for(0, e.channels, grain_for(e, e.channels), [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      for (int64_t i = 0; i < per; ++i) reduce(block_at(b, e, k * per + i));
      finish(k);
      for (int64_t i = per - 1; i >= 0; --i) apply(block_at(b, e, k * per + i));
    }
  });
}

// Rows of few enough rows that every channel is one block's (Blocks has one
// row block): a channel's partial is final where its block leaves it, so a
// thread can reduce a column block, finish its channels and run its
// elementwise pass while the block is in its L1, all in one parallel region,
// instead of a region for the reduction, a serial finish of every channel
// and a region for the pass.
inline bool column_block_strategy(const Blocks& b) { return !b.planes && b.n_outer == 1; }

// Runs reduce(block), finish(k0, k1) over its channels [k0, k1) and
// apply(block) on each column block, threads taking contiguous ranges of them.
// Operators on batch statistics weigh each channel's finish (merge, square
// root, division, coefficients: `weigh_finish`) as kFinishElements elements
// toward the serial threshold, which puts 2x4096 and 8x2048 on both threads:
// training steps 0.80x -> 0.89x and 0.94x -> 1.01x of torch's module's time
// (same process, calls shuffled; in a training step the neighbouring ops'
// parallel regions keep the pool's workers awake). The frozen forward does
// not: there, where the workers were often asleep, the same weight made the
// 2x4096 eval 1.6x slower (benchmarks/small_layers.py, torch's module
// between calls).
constexpr int64_t kFinishElements = 16;

template <typename Reduce, typename Finish, typename Apply>
void for_each_column_block(const Blocks& b, const Extent& e, const Reduce& reduce, const Finish& finish,
                           const Apply& apply, bool weigh_finish) {
  const int64_t finish_elements = weigh_finish ? kFinishElements * e.channels : 0;
  at::parallel_for(0, b.total, grain_for(e, b.total, finish_elements), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Block blk = block_at(b, e, i);
      reduce(blk);
      finish(blk.s0, blk.s1);
      apply(blk);
    }
  });
}

// Channels a thread takes together when planes are short (short_planes) and
// reduced as planes: it reduces their blocks, finishes them, and runs their
// elementwise pass over each outer row's run of channels while their `inputs`
// operands (x; x and dy in the backward) are still in its L2 (the whole-array
// pass in memory order reads them a second time from the L3 or memory).
// About kRunBytes of input a run, in units of planes_per_bits_unit channels,
// so that each row of a run starts on a byte of the sign bits; 0 when the
// runs do not apply: planes reduced as segments, a channel count that is no
// multiple of the unit, or a pass (inputs and output) smaller than
// channel_runs_min_pass_bytes (cpu/cache_geometry.cpp: which caches read
// back fast enough, with the measurements).
inline int64_t channel_run_channels(const Blocks& b, const Extent& e, size_t element_bytes, RunPass pass) {
  constexpr int64_t kRunBytes = 384 << 10;
  if (!short_planes(b, e, element_bytes) || reduces_as_segments(b, e, element_bytes)) return 0;
  const int inputs = pass == RunPass::kForward ? 1 : 2;
  const int64_t channel_bytes = e.outer * e.inner * static_cast<int64_t>(element_bytes);
  if ((inputs + 1) * e.channels * channel_bytes < channel_runs_min_pass_bytes(pass)) return 0;
  const int64_t unit = planes_per_bits_unit(e.inner);
  if (e.channels % unit != 0) return 0;
  const int64_t fit = std::max<int64_t>(1, kRunBytes / (channel_bytes * inputs)) / unit * unit;
  return std::min(std::max(fit, unit), e.channels);
}

// Runs, for each run of `run` adjacent channels, reduce(block) on each block
// of its channels, then finish(k0, k1) and apply(k0, k1) over the run's
// channels [k0, k1). Threads take equal shares of the channels, in units of
// planes_per_bits_unit, and walk their share in runs (the last one shorter):
// taking whole runs instead left one thread a run more than the other,
// 5 runs against 4 for 32x256x14x14 bfloat16. Bits do not depend on the
// runs (each channel's partials merge in block order).
template <typename Reduce, typename Finish, typename Apply>
void for_each_channel_run(const Blocks& b, const Extent& e, int64_t run, const Reduce& reduce, const Finish& finish,
                          const Apply& apply) {
  const int64_t per = b.per_channel(), unit = planes_per_bits_unit(e.inner), units = ceil_div(e.channels, unit);
  at::parallel_for(0, units, grain_for(e, units), [&](int64_t u0, int64_t u1) {
    const int64_t end = std::min(e.channels, u1 * unit);
    for (int64_t k0 = u0 * unit; k0 < end; k0 += run) {
      const int64_t k1 = std::min(end, k0 + run);
      for (int64_t i = k0 * per; i < k1 * per; ++i) reduce(block_at(b, e, i));
      finish(k0, k1);
      apply(k0, k1);
    }
  });
}

// Per-block partials of every channel, `per` a channel, in merge order. S is
// a struct of float64 fields (math::Moments, math::GradSums), stored field
// by field with the channels of a slot adjacent, so that the finish loads a
// vector of channels' field at once (channel_finish.h).
template <typename S>
struct Partials {
  static constexpr int kFields = static_cast<int>(sizeof(S) / sizeof(double));
  static_assert(std::is_trivially_copyable_v<S> && sizeof(S) == kFields * sizeof(double));
  int64_t channels, per;
  AlignedArray<double> data;  // left uninitialized: every block sets its slots
  Partials(int64_t channel_count, int64_t per_channel)
      : channels(channel_count),
        per(per_channel),
        data(aligned_array_for_overwrite<double>(kFields * channel_count * per_channel)) {}
  void set(int64_t channel, int64_t slot, const S& s) {
    double fields[kFields];
    std::memcpy(fields, &s, sizeof s);
    for (int f = 0; f < kFields; ++f) data[(slot * kFields + f) * channels + channel] = fields[f];
  }
  // Field f of slot `slot`, every channel.
  const double* field(int64_t slot, int f) const { return data.get() + (slot * kFields + f) * channels; }
  double* field(int64_t slot, int f) { return data.get() + (slot * kFields + f) * channels; }
};

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace torch_bn_grad::cpu
