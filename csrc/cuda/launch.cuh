// Host side of the CUDA operators: the launches of the kernels on the
// current stream (c10::cuda::getCurrentCUDAStream()), with the partition and
// vector width of launch_plan.cuh, and the per-channel tensors they take.
// Shared by batch_norm_cuda.cu (the fused operators) and
// batch_norm_stages_cuda.cu (the split stages).
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <initializer_list>
#include <optional>

#include "args/batch_norm_args.h"
#include "config/cuda_variants.h"
#include "math/batch_norm_math.h"
#include "cuda/affine_kernels.cuh"
#include "cuda/block_reduce.cuh"
#include "cuda/coefficient_kernels.cuh"
#include "cuda/last_block.cuh"
#include "cuda/launch_plan.cuh"
#include "cuda/persistent_kernels.cuh"
#include "cuda/reduce_kernels.cuh"
#include "cuda/stream_counters.h"
#include "math/extent.h"

namespace torch_bn_grad::cuda {

inline cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream(); }

// Picks the partition of `e` for T and the vector width that `pointers`
// allow, then calls planes(launch, n) or columns(launch, n), where n is a
// std::integral_constant<int, N> and each call launches one kernel.
template <typename T, typename OnPlanes, typename OnColumns>
void launch_partitioned(const Extent& e, std::initializer_list<const void*> pointers,
                        const OnPlanes& planes, const OnColumns& columns) {
  if (use_planes<T>(e)) {
    const int width = vector_width<T>(e.inner, pointers);
    const PlaneLaunch l = plan_planes(e, width, sizeof(T));
    with_vector_width<T>(width, [&](auto n) { planes(l, n); });
  } else {
    const int width = vector_width<T>(e.channels * e.inner, pointers);
    const ColumnLaunch l = plan_columns(e, width, sizeof(T));
    with_vector_width<T>(width, [&](auto n) { columns(l, n); });
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Calls on(launch, n, r) with the vector width n and the slots per thread r
// (persistent_slots) as std::integral_constants.
template <typename T, typename G, typename F>
void with_persistent_kernel(const PersistentLaunch<G>& l, int width, const F& on) {
  with_vector_width<T>(width, [&](auto n) {
    constexpr int kMax = kPersistentItems<T> / decltype(n)::value;
    with_persistent_slots<kMax>(persistent_slots<kMax>(l.slots_needed), [&](auto r) { on(l, n, r); });
  });
}

// The persistent counterpart: calls plane(launch, n, r) or columns(launch, n,
// r) and returns true when the shape qualifies (plan_persistent_*), else
// false with nothing launched.
template <typename T, typename OnPlane, typename OnColumns>
bool launch_persistent(const Extent& e, std::initializer_list<const void*> pointers, const OnPlane& plane,
                       const OnColumns& columns) {
  if (use_persistent_planes<T>(e)) {
    const int width = vector_width<T>(e.inner, pointers);
    const auto l = plan_persistent_plane<T>(e, width);
    if (!l) return false;
    with_persistent_kernel<T>(*l, width, plane);
  } else {
    const int width = vector_width<T>(e.channels * e.inner, pointers);
    const auto l = plan_persistent_columns<T>(e, width);
    if (!l) return false;
    with_persistent_kernel<T>(*l, width, columns);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

template <typename T>
using Acc = at::opmath_type<T>;

// First-stage results: `per_channel` objects per channel, each channel's
// contiguous, in uninitialized device storage. `finished`: the first stage's
// kernel also stored the coefficients (last_block.cuh), so no coefficient
// kernel is to run.
template <typename S>
struct Partials {
  at::Tensor storage;
  S* data = nullptr;
  int64_t per_channel = 0;
  bool finished = false;

  Partials() = default;
  Partials(int64_t channels, int64_t per_channel, const at::Tensor& like)
      : storage(at::empty({channels * per_channel * static_cast<int64_t>(sizeof(S))},
                          like.options().dtype(at::kByte))),
        data(reinterpret_cast<S*>(storage.mutable_data_ptr())),
        per_channel(per_channel) {}
};

// Whether the last blocks of a first-stage kernel can store the
// coefficients (last_block.cuh): always for planes; for columns, where a
// tile holds whole channels (inner == 1) and each has few enough partials
// for a thread to merge.
inline bool last_block_finishes(const PlaneLaunch&, const Extent&) { return true; }
inline bool last_block_finishes(const ColumnLaunch& l, const Extent& e) {
  return e.inner == 1 && l.grid.y <= kLastBlockColumnPartials;
}

// Launches a first-stage kernel, launch(finish): with a LastBlockFinish, so
// that its last blocks store `coefficients` (the last_block_coefficients
// variant), where the variant is on and applies to launch `l`, and counters
// are to be had (stream_counters); else with NoFinish, as without
// `coefficients`. Only whole vectors (N > 1) take the variant: its kernels are
// compiled for them alone. Points `coefficients` at the partials either way.
template <int N, typename Args, typename S, typename L, typename Launch>
void launch_first_stage(Args* coefficients, Partials<S>& p, const L& l, const Extent& e, const Launch& launch) {
  if (coefficients != nullptr) {
    coefficients->partials = p.data;
    coefficients->per_channel = p.per_channel;
  }
  if constexpr (N > 1) {
    if (coefficients != nullptr && cuda_variant_on(CudaVariant::kLastBlockCoefficients) && last_block_finishes(l, e)) {
      if (unsigned* counters = stream_counters(l.grid.x)) {
        p.finished = true;
        launch(LastBlockFinish<Args>{*coefficients, counters});
        return;
      }
    }
  }
  launch(NoFinish{});
}

// The first stage's moments. Given `coefficients` (the forward's, batch
// statistics), it points them at the partials and, where the
// last_block_coefficients variant applies, stores them too (`finished`).
template <typename T>
Partials<Moments<double>> moment_partials(const at::Tensor& x, const Extent& e,
                                          ForwardCoefficientArgs<Acc<T>>* coefficients = nullptr) {
  const T* xp = x.const_data_ptr<T>();
  Partials<Moments<double>> p;
  launch_partitioned<T>(
      e, {xp},
      [&](const PlaneLaunch& l, auto n) {
        constexpr int N = decltype(n)::value;
        p = {e.channels, l.partials_per_channel(), x};
        launch_first_stage<N>(coefficients, p, l, e, [&](const auto& finish) {
          plane_moments_kernel<T, N><<<l.grid, l.block, 0, stream()>>>(xp, l.g, p.data, finish);
        });
      },
      [&](const ColumnLaunch& l, auto n) {
        constexpr int N = decltype(n)::value;
        p = {e.channels, l.partials_per_channel(), x};
        launch_first_stage<N>(coefficients, p, l, e, [&](const auto& finish) {
          column_moments_kernel<T, N><<<l.grid, l.block, 0, stream()>>>(xp, l.g, p.data, finish);
        });
      });
  return p;
}

// The first stage's gradient sums; `coefficients` (the backward's) as in
// moment_partials.
template <typename T, typename E = PlainEpilogue>
Partials<GradSums<double>> grad_sum_partials(const at::Tensor& x, const at::Tensor& dy, const at::Tensor& mean,
                                             const Extent& e, BackwardCoefficientArgs<Acc<T>>* coefficients = nullptr,
                                             const E& ep = E{}) {
  const T* xp = x.const_data_ptr<T>();
  const T* dp = dy.const_data_ptr<T>();
  const Acc<T>* mp = mean.const_data_ptr<Acc<T>>();
  Partials<GradSums<double>> p;
  launch_partitioned<T>(
      e, {xp, dp},
      [&](const PlaneLaunch& l, auto n) {
        constexpr int N = decltype(n)::value;
        p = {e.channels, l.partials_per_channel(), x};
        launch_first_stage<N>(coefficients, p, l, e, [&](const auto& finish) {
          plane_grad_sums_kernel<T, N, E><<<l.grid, l.block, 0, stream()>>>(xp, dp, mp, l.g, p.data, ep, finish);
        });
      },
      [&](const ColumnLaunch& l, auto n) {
        constexpr int N = decltype(n)::value;
        p = {e.channels, l.partials_per_channel(), x};
        launch_first_stage<N>(coefficients, p, l, e, [&](const auto& finish) {
          column_grad_sums_kernel<T, N, E><<<l.grid, l.block, 0, stream()>>>(xp, dp, mp, l.g, p.data, ep, finish);
        });
      });
  return p;
}

// out = dy_scale * y + x_scale * (x - mean) + bias; y is null in the forward.
// The epilogue (epilogue.cuh) is plain batch norm's unless given.
template <typename T, bool kHasY, typename E = PlainEpilogue>
void apply_affine(const at::Tensor& x, const T* y, const at::Tensor& out, const Extent& e,
                  const math::AffineArrays<Acc<T>>& c, const E& ep = E{}) {
  const T* xp = x.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  launch_partitioned<T>(
      e, {xp, y, op},
      [&](const PlaneLaunch& l, auto n) {
        plane_affine_kernel<T, decltype(n)::value, kHasY, E><<<l.grid, l.block, 0, stream()>>>(xp, y, op, l.g, c, ep);
      },
      [&](const ColumnLaunch& l, auto n) {
        column_affine_kernel<T, decltype(n)::value, kHasY, E>
            <<<l.grid, l.block, 0, stream()>>>(xp, y, op, l.g, c, ep);
      });
}

// The training forward in one kernel (statistics, coefficients, output) when
// the shape qualifies; false, with nothing launched, otherwise. The epilogue
// (epilogue.cuh) is plain batch norm's unless given.
template <typename T, typename E = PlainEpilogue>
bool persistent_forward(const at::Tensor& x, const at::Tensor& out, const Extent& e,
                        const ForwardCoefficientArgs<Acc<T>>& args, const E& ep = E{}) {
  const T* xp = x.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  return launch_persistent<T>(
      e, {xp, op},
      [&](const PersistentLaunch<PersistentPlane>& l, auto n, auto r) {
        plane_persistent_forward_kernel<T, decltype(n)::value, decltype(r)::value, E>
            <<<l.grid, l.block, 0, stream()>>>(xp, op, l.g, args, ep);
      },
      [&](const PersistentLaunch<PersistentColumns>& l, auto n, auto r) {
        column_persistent_forward_kernel<T, decltype(n)::value, decltype(r)::value, E>
            <<<l.grid, l.block, 0, stream()>>>(xp, op, l.g, args, ep);
      });
}

// The training backward's sums, coefficients, parameter gradients and (unless
// `out` is null) diff_src in one kernel when the shape qualifies; false, with
// nothing launched, otherwise. The epilogue gates dy (and writes dz) as the
// two-kernel path's does.
template <typename T, typename E = PlainEpilogue>
bool persistent_backward(const at::Tensor& x, const at::Tensor& dy, const at::Tensor& mean, T* out,
                         const Extent& e, const BackwardCoefficientArgs<Acc<T>>& args, const E& ep = E{}) {
  const T* xp = x.const_data_ptr<T>();
  const T* dp = dy.const_data_ptr<T>();
  const Acc<T>* mp = mean.const_data_ptr<Acc<T>>();
  return launch_persistent<T>(
      e, {xp, dp, out},
      [&](const PersistentLaunch<PersistentPlane>& l, auto n, auto r) {
        plane_persistent_backward_kernel<T, decltype(n)::value, decltype(r)::value, E>
            <<<l.grid, l.block, 0, stream()>>>(xp, dp, mp, out, l.g, args, ep);
      },
      [&](const PersistentLaunch<PersistentColumns>& l, auto n, auto r) {
        column_persistent_backward_kernel<T, decltype(n)::value, decltype(r)::value, E>
            <<<l.grid, l.block, 0, stream()>>>(xp, dp, mp, out, l.g, args, ep);
      });
}

inline dim3 channel_warps_grid(int64_t channels) {
  const int64_t blocks = ceil_div(channels, kChannelsPerBlock);
  TORCH_CHECK(blocks <= kMaxGridX, "batch_norm (CUDA): too many channels (", channels, ")");
  return dim3(static_cast<unsigned>(blocks));
}

// Calls launch(group, grid) for a kernel that merges each channel's
// `per_channel` partials with a group of threads (block_reduce.cuh's
// merge_channel): group is std::integral_constant<int, kWarp> (a warp a
// channel), or <int, kThreads> (a block a channel) from kBlockMergeMinPartials.
template <typename F>
void launch_channel_groups(int64_t channels, int64_t per_channel, const F& launch) {
  if (per_channel >= kBlockMergeMinPartials) {
    TORCH_CHECK(channels <= kMaxGridX, "batch_norm (CUDA): too many channels (", channels, ")");
    launch(std::integral_constant<int, kThreads>{}, dim3(static_cast<unsigned>(channels)));
  } else {
    launch(std::integral_constant<int, kWarp>{}, channel_warps_grid(channels));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The coefficient kernels (coefficient_kernels.cuh) on the current stream.
template <typename A>
void forward_coefficients(const ForwardCoefficientArgs<A>& args) {
  launch_channel_groups(args.channels, args.partials != nullptr ? args.per_channel : 0, [&](auto group, dim3 grid) {
    forward_coefficients_kernel<A, decltype(group)::value><<<grid, kThreads, 0, stream()>>>(args);
  });
}

// The coefficient arguments of a backward: its statistics, gamma and sizes;
// dy_scale (null: no diff_src) heads its three coefficient arrays of
// `channels` each. The caller adds the partials and, from the output, unit.
template <typename A>
BackwardCoefficientArgs<A> backward_coefficient_args(const A* mean, const ChannelIn& variance, const ChannelIn& gamma,
                                                     double epsilon, int64_t channels, int64_t reduced, bool training,
                                                     A* dy_scale, ChannelOut diff_gamma, ChannelOut diff_beta) {
  AffineOutputs<A> affine{};
  if (dy_scale) affine = {nullptr, dy_scale, dy_scale + channels, dy_scale + 2 * channels};
  return {.mean = mean, .variance = variance, .gamma = gamma, .epsilon = epsilon, .channels = channels,
          .reduced = reduced, .training = training, .affine = affine, .diff_gamma = diff_gamma,
          .diff_beta = diff_beta};
}

template <typename A>
void backward_coefficients(const BackwardCoefficientArgs<A>& args) {
  launch_channel_groups(args.channels, args.partials != nullptr ? args.per_channel : 0, [&](auto group, dim3 grid) {
    backward_coefficients_kernel<A, decltype(group)::value><<<grid, kThreads, 0, stream()>>>(args);
  });
}

inline const double* optional_data(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<double>() : nullptr;
}

inline at::Tensor channel_vector(const ChannelPlan& plan, const at::Tensor& like, at::ScalarType dtype) {
  return at::empty({plan.channels}, like.options().dtype(dtype));
}

// `count` per-channel vectors of `dtype` in one allocation, vector i from
// element i * channels on: a small layer's call is mostly host time, and each
// allocation is a share of it.
inline at::Tensor channel_vectors(const ChannelPlan& plan, const at::Tensor& like, at::ScalarType dtype,
                                  int64_t count) {
  return at::empty({count * plan.channels}, like.options().dtype(dtype));
}

// A per-channel float64 vector in kernel order, or undefined when `t` is absent.
inline at::Tensor optional_channels(const std::optional<at::Tensor>& t, const ChannelPlan& plan,
                             const at::Tensor& like) {
  return t.has_value() ? to_kernel_channels(t, plan, at::kDouble, 0, like) : at::Tensor();
}

}  // namespace torch_bn_grad::cuda
