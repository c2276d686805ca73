// The per-channel float64 work between an operator's reduction and its
// elementwise pass: merging each channel's block partials, then the
// formulas of batch_norm_math.h, a vector of channels at a time (one channel
// a lane of Vectorized<double>), the coefficients' rounding to the
// accumulation type included.
//
// Every channel goes through the same vector code, whether it falls in a
// full group of lanes or not, so a channel's result never depends on where
// its group starts (the thread count or the strategy). On layers of many
// channels and few rows this work was most of the operator's time: one
// channel at a time, a 2x4096 float32 backward waited on the divider for
// some 25 cycles a channel.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/macros/Macros.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>

#include "math/batch_norm_math.h"
#include "cpu/aligned_array.h"
#include "cpu/kernels/partition.h"

namespace torch_bn_grad::math {
// sqrt of every lane: correctly rounded, as the scalar sqrt.
template <>
struct LaneMath<at::vec::Vectorized<double>> {
  using V = at::vec::Vectorized<double>;
  static V sqrt(const V& x) { return x.sqrt(); }
  static V nonnegative(const V& x) { return V::blendv(x, V(0.0), x < V(0.0)); }
  // Lane by lane, as the scalar round_to (defined below NarrowedLanes).
  template <typename A>
  static V round_to(const V& x);
};
}  // namespace torch_bn_grad::math

namespace torch_bn_grad::cpu {
namespace CPU_CAPABILITY {
namespace {  // internal linkage: see vec_io.h

using VecD = at::vec::Vectorized<double>;
constexpr int64_t kLanes = VecD::size();

// kLanes floats in the ISA's register of half a VecD's width, and its moves:
// narrowed from a VecD (each lane rounded once, to the nearest), widened back,
// loaded and stored. A generic loop was split by the compiler into halves
// stored to the stack and reloaded whole, which stalled the per-channel work
// on store forwarding.
#if defined(CPU_CAPABILITY_AVX512)
inline __m256 narrow_lanes(const VecD& d) { return _mm512_cvtpd_ps(d); }
inline VecD widen_lanes(__m256 v) { return _mm512_cvtps_pd(v); }
inline __m256 load_lanes(const float* p) { return _mm256_loadu_ps(p); }
inline void store_lanes(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
#elif defined(CPU_CAPABILITY_AVX2)
inline __m128 narrow_lanes(const VecD& d) { return _mm256_cvtpd_ps(d); }
inline VecD widen_lanes(__m128 v) { return _mm256_cvtps_pd(v); }
inline __m128 load_lanes(const float* p) { return _mm_loadu_ps(p); }
inline void store_lanes(float* p, __m128 v) { _mm_storeu_ps(p, v); }
#else
struct FloatLanes {
  float f[kLanes];
};
inline FloatLanes narrow_lanes(const VecD& d) {
  FloatLanes h;
  for (int64_t l = 0; l < kLanes; ++l) h.f[l] = static_cast<float>(d[l]);
  return h;
}
inline VecD widen_lanes(const FloatLanes& v) {
  alignas(64) double d[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) d[l] = v.f[l];
  return VecD::loadu(d);
}
inline FloatLanes load_lanes(const float* p) {
  FloatLanes h;
  std::copy_n(p, kLanes, h.f);
  return h;
}
inline void store_lanes(float* p, const FloatLanes& v) { std::copy_n(v.f, kLanes, p); }
#endif
using HalfFloats = decltype(narrow_lanes(VecD()));

// kLanes doubles narrowed to float, or kLanes floats loaded as they are.
struct NarrowedLanes {
  HalfFloats v;
  explicit NarrowedLanes(const VecD& d) : v(narrow_lanes(d)) {}
  explicit NarrowedLanes(const float* p) : v(load_lanes(p)) {}
  VecD widened() const { return widen_lanes(v); }
  void store(float* p) const { store_lanes(p, v); }
  // The first n lanes.
  void store(float* p, int64_t n) const {
    if (n == kLanes) return store(p);
    float lanes[kLanes];
    store(lanes);
    std::copy_n(lanes, n, p);
  }
};

// Channels [k, k + n) (n <= kLanes) of per-channel float64 arrays, as
// vectors; lanes past n read as 0 and are never stored.
struct ChannelGroup {
  int64_t k, n;
  VecD load(const double* p) const { return VecD::loadu(p + k, n); }
  void store(const VecD& v, double* p) const {
    if (p) v.store(p + k, static_cast<int>(n));
  }
};

// Runs f(ChannelGroup) on channels [k0, k1) in groups of kLanes, on the
// calling thread.
template <typename F>
void for_each_group_in(int64_t k0, int64_t k1, const F& f) {
  for (int64_t k = k0; k < k1; k += kLanes) f(ChannelGroup{k, std::min(kLanes, k1 - k)});
}

// Runs f(ChannelGroup) on every group of kLanes channels (the last one
// shorter), in parallel when the channels' partials are many (merging a
// 32x2048x7x7 forward's 8192 partials serially cost it a quarter of its
// time; 16384 took that case 1.2x-1.3x), on the calling thread below that:
// a parallel region costs more than the work it shares on 4096 (2x4096 and
// 8x4096 float32 backward 0.6x and 0.8x the time serially, same process, 2
// threads). Groups are independent, so the results do not depend on the
// schedule.
template <typename F>
void for_each_channel_group(const Blocks& b, const Extent& e, const F& f) {
  constexpr int64_t kSerialPartials = 8192;
  const int64_t groups = ceil_div(e.channels, kLanes);
  const int64_t partials = e.channels * b.per_channel();
  const int64_t grain = partials < kSerialPartials ? groups + 1 : std::max<int64_t>(1, groups / 64);
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for_each_group_in(g0 * kLanes, std::min(e.channels, g1 * kLanes), f);
  });
}

// The group's partials (math::Moments or math::GradSums) merged in block
// order (math::merge_nonempty: every block holds data), lane by lane.
template <template <typename...> class S, typename... Double>
C10_ALWAYS_INLINE S<VecD> merged(const Partials<S<Double...>>& parts, const ChannelGroup& g) {
  constexpr int kFields = Partials<S<Double...>>::kFields;
  S<VecD> m{};
  for (int64_t i = 0; i < parts.per; ++i) {
    const S<VecD> s = [&]<int... F>(std::integer_sequence<int, F...>) {
      return S<VecD>{g.load(parts.field(i, F))...};
    }(std::make_integer_sequence<int, kFields>{});
    m = i == 0 ? s : math::merge_nonempty(m, s);
  }
  return m;
}

// The elementwise pass's per-channel coefficients (math::ChannelAffine) as
// arrays, of the accumulation type, in one allocation left uninitialized
// (the operators set every channel; zeroing the 2x4096 backward's buffers
// cost it a fifth of its time).
// Each array starts on a cache line, one line further into a 4 KiB page than
// the one before: arrays a multiple of 4 KiB apart (1024 float32 channels)
// would meet in one L1 set at every channel.
template <typename A>
struct AffineTable {
  AlignedArray<A> storage;
  A *mean, *dy_scale, *x_scale, *bias;
  explicit AffineTable(int64_t channels) : storage(aligned_array_for_overwrite<A>(4 * array_stride(channels))) {
    const int64_t stride = array_stride(channels);
    mean = storage.get();
    dy_scale = mean + stride;
    x_scale = dy_scale + stride;
    bias = x_scale + stride;
  }
  void set(int64_t k, const math::ChannelAffine<A>& c) {
    mean[k] = c.mean;
    dy_scale[k] = c.dy_scale;
    x_scale[k] = c.x_scale;
    bias[k] = c.bias;
  }
  // math::channel_affine of the group's float64 coefficients about `mean`,
  // a vector of channels at a time (one channel at a time, the conversions
  // were most of a 2x4096 backward's per-channel work).
  C10_ALWAYS_INLINE void set(const ChannelGroup& g, const VecD& mean_d, const math::BackwardCoefficients<VecD>& c) {
    const math::ChannelAffine<VecD> r = math::rounded_channel_affine<A>(mean_d, c);
    store(g, r.mean, mean);
    store(g, r.dy_scale, dy_scale);
    store(g, r.x_scale, x_scale);
    store(g, r.bias, bias);
  }
  // Lanes that hold values of A, stored as A (exactly).
  C10_ALWAYS_INLINE static void store(const ChannelGroup& g, const VecD& v, A* p) {
    if constexpr (std::is_same_v<A, double>) g.store(v, p);
    else NarrowedLanes(v).store(p + g.k, g.n);
  }
  math::AffineArrays<A> arrays() const { return {mean, dy_scale, x_scale, bias}; }

 private:
  // Elements from one array's start to the next: whole lines, plus one.
  static int64_t array_stride(int64_t channels) {
    constexpr int64_t kLine = kCacheLineBytes / sizeof(A);
    return ceil_div(channels, kLine) * kLine + kLine;
  }
};

// The forward's elementwise coefficients of the group from its statistics;
// with a residual r (added with weight 1 through the pass's dy operand)
// dst = scale * (x - mean) + shift + r.
template <typename A>
C10_ALWAYS_INLINE void set_forward_affine(AffineTable<A>& co, const ChannelGroup& g, const VecD& mean,
                                          const VecD& var, const double* gamma, const double* beta, double eps,
                                          bool residual) {
  const math::ForwardCoefficients<VecD> f = math::forward_coefficients(var, g.load(gamma), g.load(beta), eps);
  co.set(g, mean, math::BackwardCoefficients<VecD>{VecD(residual ? 1.0 : 0.0), f.scale, f.shift});
}

// The forward coefficients of channels [k0, k1) from given statistics
// (frozen, or recomputed by a backward that needs the forward's values bit
// for bit).
template <typename A>
void forward_affine_table(AffineTable<A>& co, int64_t k0, int64_t k1, const double* mean, const double* var,
                          const double* gamma, const double* beta, double eps, bool residual) {
  for_each_group_in(k0, k1, [&](const ChannelGroup& g) {
    set_forward_affine(co, g, g.load(mean), g.load(var), gamma, beta, eps, residual);
  });
}

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace torch_bn_grad::cpu

namespace torch_bn_grad::math {
template <typename A>
at::vec::Vectorized<double> LaneMath<at::vec::Vectorized<double>>::round_to(const V& x) {
  static_assert(std::is_same_v<A, float> || std::is_same_v<A, double>, "an accumulation type");
  if constexpr (std::is_same_v<A, double>) return x;
  else return cpu::CPU_CAPABILITY::NarrowedLanes(x).widened();
}
}  // namespace torch_bn_grad::math

