// CUDA implementations of the operators, the split-stage ones included. Same
// contract and per-channel math as csrc/cpu/batch_norm_cpu.cpp (and
// batch_norm_stages_cpu.cpp): validate, view the data as [outer, channels,
// inner], reduce, derive the per-channel coefficients in float64 on the
// device, then run one elementwise pass; or, for the training forward and
// backward of shapes a block can hold, all of it in one persistent kernel
// that reads the data once. The kernels and their launch planning are in
// batch_norm_kernels.cuh.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <type_traits>

#include "batch_norm_args.h"
#include "cuda/batch_norm_kernels.cuh"

namespace torch_bn_grad::cuda {
namespace {

cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream(); }

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

// The persistent counterpart: calls plane(launch, n) or columns(launch, n)
// and returns true when the shape qualifies (plan_persistent_*), else false
// with nothing launched.
template <typename T, typename OnPlane, typename OnColumns>
bool launch_persistent(const Extent& e, std::initializer_list<const void*> pointers, const OnPlane& plane,
                       const OnColumns& columns) {
  if (use_planes<T>(e)) {
    const int width = vector_width<T>(e.inner, pointers);
    const auto l = plan_persistent_plane<T>(e, width);
    if (!l) return false;
    with_vector_width<T>(width, [&](auto n) { plane(*l, n); });
  } else {
    const int width = vector_width<T>(e.channels * e.inner, pointers);
    const auto l = plan_persistent_columns<T>(e, width);
    if (!l) return false;
    with_vector_width<T>(width, [&](auto n) { columns(*l, n); });
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

template <typename T>
using Acc = at::opmath_type<T>;

// First-stage results: `per_channel` objects per channel, each channel's
// contiguous, in uninitialized device storage.
template <typename S>
struct Partials {
  at::Tensor storage;
  S* data = nullptr;
  int64_t per_channel = 0;

  Partials() = default;
  Partials(int64_t channels, int64_t per_channel, const at::Tensor& like)
      : storage(at::empty({channels * per_channel * static_cast<int64_t>(sizeof(S))},
                          like.options().dtype(at::kByte))),
        data(reinterpret_cast<S*>(storage.mutable_data_ptr())),
        per_channel(per_channel) {}
};

template <typename T>
Partials<Moments<Acc<T>>> moment_partials(const at::Tensor& x, const Extent& e) {
  const T* xp = x.const_data_ptr<T>();
  Partials<Moments<Acc<T>>> p;
  launch_partitioned<T>(
      e, {xp},
      [&](const PlaneLaunch& l, auto n) {
        p = {e.channels, l.partials_per_channel(), x};
        plane_moments_kernel<T, decltype(n)::value><<<l.grid, l.block, 0, stream()>>>(xp, l.g, p.data);
      },
      [&](const ColumnLaunch& l, auto n) {
        p = {e.channels, l.partials_per_channel(), x};
        column_moments_kernel<T, decltype(n)::value><<<l.grid, l.block, 0, stream()>>>(xp, l.g, p.data);
      });
  return p;
}

template <typename T>
Partials<GradSums<Acc<T>>> grad_sum_partials(const at::Tensor& x, const at::Tensor& dy,
                                             const at::Tensor& mean, const Extent& e) {
  const T* xp = x.const_data_ptr<T>();
  const T* dp = dy.const_data_ptr<T>();
  const Acc<T>* mp = mean.const_data_ptr<Acc<T>>();
  Partials<GradSums<Acc<T>>> p;
  launch_partitioned<T>(
      e, {xp, dp},
      [&](const PlaneLaunch& l, auto n) {
        p = {e.channels, l.partials_per_channel(), x};
        plane_grad_sums_kernel<T, decltype(n)::value><<<l.grid, l.block, 0, stream()>>>(xp, dp, mp, l.g, p.data);
      },
      [&](const ColumnLaunch& l, auto n) {
        p = {e.channels, l.partials_per_channel(), x};
        column_grad_sums_kernel<T, decltype(n)::value><<<l.grid, l.block, 0, stream()>>>(xp, dp, mp, l.g, p.data);
      });
  return p;
}

// out = p * y + q * (x - mean) + r; y is null in the forward.
template <typename T, bool kHasY>
void apply_affine(const at::Tensor& x, const T* y, const at::Tensor& out, const Extent& e,
                  const Affine<Acc<T>>& c) {
  const T* xp = x.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  launch_partitioned<T>(
      e, {xp, y, op},
      [&](const PlaneLaunch& l, auto n) {
        plane_affine_kernel<T, decltype(n)::value, kHasY><<<l.grid, l.block, 0, stream()>>>(xp, y, op, l.g, c);
      },
      [&](const ColumnLaunch& l, auto n) {
        column_affine_kernel<T, decltype(n)::value, kHasY><<<l.grid, l.block, 0, stream()>>>(xp, y, op, l.g, c);
      });
}

// The training forward in one kernel (statistics, coefficients, output) when
// the shape qualifies; false, with nothing launched, otherwise.
template <typename T>
bool persistent_forward(const at::Tensor& x, const at::Tensor& out, const Extent& e,
                        const ForwardCoefficientArgs<Acc<T>>& args) {
  const T* xp = x.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  return launch_persistent<T>(
      e, {xp, op},
      [&](const PersistentLaunch<PersistentPlane>& l, auto n) {
        plane_persistent_forward_kernel<T, decltype(n)::value><<<l.grid, l.block, 0, stream()>>>(xp, op, l.g, args);
      },
      [&](const PersistentLaunch<PersistentColumns>& l, auto n) {
        column_persistent_forward_kernel<T, decltype(n)::value><<<l.grid, l.block, 0, stream()>>>(xp, op, l.g, args);
      });
}

// The training backward's sums, coefficients, parameter gradients and (unless
// `out` is null) diff_src in one kernel when the shape qualifies; false, with
// nothing launched, otherwise.
template <typename T>
bool persistent_backward(const at::Tensor& x, const at::Tensor& dy, const at::Tensor& mean, T* out,
                         const Extent& e, const BackwardCoefficientArgs<Acc<T>>& args) {
  const T* xp = x.const_data_ptr<T>();
  const T* dp = dy.const_data_ptr<T>();
  const Acc<T>* mp = mean.const_data_ptr<Acc<T>>();
  return launch_persistent<T>(
      e, {xp, dp, out},
      [&](const PersistentLaunch<PersistentPlane>& l, auto n) {
        plane_persistent_backward_kernel<T, decltype(n)::value>
            <<<l.grid, l.block, 0, stream()>>>(xp, dp, mp, out, l.g, args);
      },
      [&](const PersistentLaunch<PersistentColumns>& l, auto n) {
        column_persistent_backward_kernel<T, decltype(n)::value>
            <<<l.grid, l.block, 0, stream()>>>(xp, dp, mp, out, l.g, args);
      });
}

dim3 channel_warps_grid(int64_t channels) {
  const int64_t blocks = ceil_div(channels, kChannelsPerBlock);
  TORCH_CHECK(blocks <= kMaxGridX, "batch_norm (CUDA): too many channels (", channels, ")");
  return dim3(static_cast<unsigned>(blocks));
}

const double* optional_data(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<double>() : nullptr;
}

at::Tensor channel_vector(const ChannelPlan& plan, const at::Tensor& like, at::ScalarType dtype) {
  return at::empty({plan.channels}, like.options().dtype(dtype));
}

// A per-channel float64 vector in kernel order, or undefined when `t` is absent.
at::Tensor optional_channels(const std::optional<at::Tensor>& t, const ChannelPlan& plan,
                             const at::Tensor& like) {
  return t.has_value() ? to_kernel_channels(t, plan, at::kDouble, 0, like) : at::Tensor();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_forward_cuda(
    const at::Tensor& src, const std::optional<at::Tensor>& gamma,
    const std::optional<at::Tensor>& beta, const std::optional<at::Tensor>& mean,
    const std::optional<at::Tensor>& variance, double epsilon, c10::string_view data_format) {
  const ChannelPlan plan = check_forward_args(src, gamma, beta, mean, variance, epsilon, data_format);
  const c10::cuda::CUDAGuard guard(src.device());
  const auto acc = accumulate_type(src.scalar_type());
  const Extent e{plan.outer, plan.channels, plan.inner};
  const bool batch_statistics = !mean.has_value();

  // Per-channel vectors in kernel order, of the accumulation type; var_k is
  // only needed as an output (batch statistics).
  at::Tensor mean_k = channel_vector(plan, src, acc);
  at::Tensor var_k = batch_statistics ? channel_vector(plan, src, acc) : at::Tensor();
  KernelOutput out = make_kernel_output(src, plan);
  if (src.numel() > 0) {
    const at::Tensor x = to_kernel_layout(src, plan);
    const at::Tensor gamma_d = optional_channels(gamma, plan, src);
    const at::Tensor beta_d = optional_channels(beta, plan, src);
    at::Tensor scale = channel_vector(plan, src, acc);
    at::Tensor shift = channel_vector(plan, src, acc);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "batch_norm_forward_cuda", [&] {
      using A = Acc<scalar_t>;
      ForwardCoefficientArgs<A> args{};
      args.gamma = optional_data(gamma_d);
      args.beta = optional_data(beta_d);
      args.epsilon = epsilon;
      args.channels = e.channels;
      args.mean_out = mean_k.mutable_data_ptr<A>();
      args.scale = scale.mutable_data_ptr<A>();
      args.shift = shift.mutable_data_ptr<A>();
      if (batch_statistics) {
        args.variance_out = var_k.mutable_data_ptr<A>();
        if (persistent_forward<scalar_t>(x, out.buffer, e, args)) return;
      }
      Partials<Moments<A>> partials;  // these stay alive until the kernels are queued
      at::Tensor mean_d, var_d;
      if (batch_statistics) {
        partials = moment_partials<scalar_t>(x, e);
        args.partials = partials.data;
        args.per_channel = partials.per_channel;
      } else {
        mean_d = to_kernel_channels(mean, plan, at::kDouble, 0, src);
        var_d = to_kernel_channels(variance, plan, at::kDouble, 0, src);
        args.mean = mean_d.const_data_ptr<double>();
        args.variance = var_d.const_data_ptr<double>();
      }
      forward_coefficients_kernel<A><<<channel_warps_grid(e.channels), kThreads, 0, stream()>>>(args);
      C10_CUDA_KERNEL_LAUNCH_CHECK();

      const Affine<A> c{mean_k.const_data_ptr<A>(), nullptr, scale.const_data_ptr<A>(),
                        shift.const_data_ptr<A>()};
      apply_affine<scalar_t, false>(x, nullptr, out.buffer, e, c);
    });
    finish_kernel_output(out, plan);
  } else if (batch_statistics) {
    // Empty batch: NaN statistics, as a mean over nothing.
    mean_k.fill_(std::numeric_limits<double>::quiet_NaN());
    var_k.fill_(std::numeric_limits<double>::quiet_NaN());
  }

  if (!batch_statistics) {
    return {out.result, mean->clone(at::MemoryFormat::Contiguous),
            variance->clone(at::MemoryFormat::Contiguous)};
  }
  return {out.result, from_kernel_channels(mean_k, plan, acc, src),
          from_kernel_channels(var_k, plan, acc, src)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_backward_cuda(
    const at::Tensor& src, const at::Tensor& diff_dst, const at::Tensor& mean,
    const at::Tensor& variance, const std::optional<at::Tensor>& gamma, double epsilon,
    c10::string_view data_format, bool training, std::array<bool, 3> output_mask) {
  const ChannelPlan plan =
      check_backward_args(src, diff_dst, mean, variance, gamma, epsilon, data_format);
  const c10::cuda::CUDAGuard guard(src.device());
  const auto acc = accumulate_type(src.scalar_type());
  const Extent e{plan.outer, plan.channels, plan.inner};
  const int64_t M = plan.reduced_count();
  const bool need_sums = training || output_mask[1] || output_mask[2];
  const bool need_diff_src = output_mask[0] && src.numel() > 0;

  KernelOutput out;
  if (output_mask[0]) out = make_kernel_output(src, plan);
  at::Tensor dg = output_mask[1] ? channel_vector(plan, src, at::kDouble) : at::Tensor();
  at::Tensor db = output_mask[2] ? channel_vector(plan, src, at::kDouble) : at::Tensor();

  if (e.channels > 0 && (need_diff_src || output_mask[1] || output_mask[2])) {
    const at::Tensor x = to_kernel_layout(src, plan);
    const at::Tensor mean_k = to_kernel_channels(mean, plan, acc, 0, src);
    const at::Tensor var_d = to_kernel_channels(variance, plan, at::kDouble, 0, src);
    const at::Tensor gamma_d = optional_channels(gamma, plan, src);
    at::Tensor dy;
    if (need_diff_src || (need_sums && M > 0)) dy = to_kernel_layout(diff_dst, plan);
    at::Tensor a, b, c;
    if (need_diff_src) {
      a = channel_vector(plan, src, acc);
      b = channel_vector(plan, src, acc);
      c = channel_vector(plan, src, acc);
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "batch_norm_backward_cuda", [&] {
      using A = Acc<scalar_t>;
      BackwardCoefficientArgs<A> args{};
      args.variance = var_d.const_data_ptr<double>();
      args.gamma = optional_data(gamma_d);
      args.epsilon = epsilon;
      args.channels = e.channels;
      args.reduced = M;
      args.training = training;
      if (need_diff_src) {
        args.a = a.mutable_data_ptr<A>();
        args.b = b.mutable_data_ptr<A>();
        args.c = c.mutable_data_ptr<A>();
      }
      if (dg.defined()) args.diff_gamma = dg.mutable_data_ptr<double>();
      if (db.defined()) args.diff_beta = db.mutable_data_ptr<double>();
      Partials<GradSums<A>> partials;  // alive until the kernels are queued
      if (need_sums && M > 0) {
        scalar_t* dst = need_diff_src ? out.buffer.mutable_data_ptr<scalar_t>() : nullptr;
        if (persistent_backward<scalar_t>(x, dy, mean_k, dst, e, args)) return;
        partials = grad_sum_partials<scalar_t>(x, dy, mean_k, e);
        args.partials = partials.data;
        args.per_channel = partials.per_channel;
      }
      backward_coefficients_kernel<A><<<channel_warps_grid(e.channels), kThreads, 0, stream()>>>(args);
      C10_CUDA_KERNEL_LAUNCH_CHECK();

      if (need_diff_src) {
        const Affine<A> coef{mean_k.const_data_ptr<A>(), a.const_data_ptr<A>(), b.const_data_ptr<A>(),
                             c.const_data_ptr<A>()};
        apply_affine<scalar_t, true>(x, dy.const_data_ptr<scalar_t>(), out.buffer, e, coef);
      }
    });
    if (need_diff_src) finish_kernel_output(out, plan);
  }

  const auto stats_dtype = mean.scalar_type();
  return {output_mask[0] ? out.result : at::empty({0}, src.options()),
          output_mask[1] ? from_kernel_channels(dg, plan, stats_dtype, src) : at::empty({0}, mean.options()),
          output_mask[2] ? from_kernel_channels(db, plan, stats_dtype, src) : at::empty({0}, mean.options())};
}

// ------------------------------------------------------------------ split stages
// The split-stage operators (see ops.cpp): the same partial reductions and
// elementwise pass, with the per-channel rows written as float64 and the
// coefficients derived on the device from tensors (no host reads). With 1-D
// statistics the kernel channel order is the logical one.

// rows (3, channels): count, mean and m2 of each channel, from its partials.
template <typename A>
__global__ void __launch_bounds__(kThreads)
    stats_rows_kernel(const Moments<A>* partials, int64_t per_channel, int64_t channels, double* rows) {
  const int64_t k = warp_channel();
  if (k >= channels) return;  // whole warps
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  Moments<double> m{0, 0, 0};
  for (int64_t i = lane; i < per_channel; i += kWarp) {
    const Moments<A> p = partials[k * per_channel + i];
    m = merge(m, Moments<double>{p.mean, p.m2, p.count});
  }
  m = warp_reduce(m);
  if (lane != 0) return;
  rows[k] = static_cast<double>(m.count);
  rows[channels + k] = m.mean;
  rows[2 * channels + k] = m.m2;
}

// rows (2, channels): sum(dy) and sum(dy * (x - mean)) of each channel.
template <typename A>
__global__ void __launch_bounds__(kThreads)
    grad_sums_rows_kernel(const GradSums<A>* partials, int64_t per_channel, int64_t channels, double* rows) {
  const int64_t k = warp_channel();
  if (k >= channels) return;  // whole warps
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  GradSums<double> s{0, 0};
  for (int64_t i = lane; i < per_channel; i += kWarp) {
    const GradSums<A> q = partials[k * per_channel + i];
    s = merge(s, GradSums<double>{q.dy, q.dy_xc});
  }
  s = warp_reduce(s);
  if (lane != 0) return;
  rows[k] = s.dy;
  rows[channels + k] = s.dy_xc;
}

// diff_src = a * dy + b * (x - mean) + c from whole-batch values: a = g * rstd,
// b = -a * rstd^2 * sum_dy_xc / count, c = -a * sum_dy / count.
template <typename A>
__global__ void __launch_bounds__(kThreads)
    grad_input_coefficients_kernel(const double* variance, const double* gamma, const double* count,
                                   const double* sums, double epsilon, int64_t channels, A* a, A* b, A* c) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (k >= channels) return;
  const double rstd = 1.0 / sqrt(variance[k] + epsilon);
  // Inconsistent arguments (a count below 1 with data) must not divide by zero.
  const double inv_n = count[k] >= 1 ? 1.0 / count[k] : 0.0;
  const double ak = (gamma != nullptr ? gamma[k] : 1.0) * rstd;
  a[k] = static_cast<A>(ak);
  b[k] = static_cast<A>(-ak * rstd * rstd * sums[channels + k] * inv_n);
  c[k] = static_cast<A>(-ak * sums[k] * inv_n);
}

at::Tensor batch_norm_local_stats_cuda(const at::Tensor& src, c10::string_view data_format) {
  const ChannelPlan plan = check_local_stats_args(src, data_format);
  const c10::cuda::CUDAGuard guard(src.device());
  const Extent e{plan.outer, plan.channels, plan.inner};
  at::Tensor rows = at::zeros({3, e.channels}, src.options().dtype(at::kDouble));
  if (src.numel() == 0) return rows;
  const at::Tensor x = to_kernel_layout(src, plan);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "batch_norm_local_stats_cuda", [&] {
    using A = Acc<scalar_t>;
    const Partials<Moments<A>> partials = moment_partials<scalar_t>(x, e);
    stats_rows_kernel<A><<<channel_warps_grid(e.channels), kThreads, 0, stream()>>>(
        partials.data, partials.per_channel, e.channels, rows.mutable_data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return rows;
}

at::Tensor batch_norm_grad_sums_cuda(const at::Tensor& src, const at::Tensor& diff_dst, const at::Tensor& mean,
                                     c10::string_view data_format) {
  const ChannelPlan plan = check_grad_sums_args(src, diff_dst, mean, data_format);
  const c10::cuda::CUDAGuard guard(src.device());
  const Extent e{plan.outer, plan.channels, plan.inner};
  at::Tensor rows = at::zeros({2, e.channels}, src.options().dtype(at::kDouble));
  if (src.numel() == 0) return rows;
  const at::Tensor x = to_kernel_layout(src, plan);
  const at::Tensor dy = to_kernel_layout(diff_dst, plan);
  const at::Tensor mean_k = to_kernel_channels(mean, plan, accumulate_type(src.scalar_type()), 0, src);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "batch_norm_grad_sums_cuda", [&] {
    using A = Acc<scalar_t>;
    const Partials<GradSums<A>> partials = grad_sum_partials<scalar_t>(x, dy, mean_k, e);
    grad_sums_rows_kernel<A><<<channel_warps_grid(e.channels), kThreads, 0, stream()>>>(
        partials.data, partials.per_channel, e.channels, rows.mutable_data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return rows;
}

at::Tensor batch_norm_grad_input_cuda(const at::Tensor& src, const at::Tensor& diff_dst, const at::Tensor& mean,
                                      const at::Tensor& variance, const std::optional<at::Tensor>& gamma,
                                      const at::Tensor& count, const at::Tensor& grad_sums, double epsilon,
                                      c10::string_view data_format) {
  const ChannelPlan plan =
      check_grad_input_args(src, diff_dst, mean, variance, gamma, count, grad_sums, epsilon, data_format);
  const c10::cuda::CUDAGuard guard(src.device());
  KernelOutput out = make_kernel_output(src, plan);
  if (src.numel() == 0) return out.result;
  const auto acc = accumulate_type(src.scalar_type());
  const Extent e{plan.outer, plan.channels, plan.inner};
  const at::Tensor x = to_kernel_layout(src, plan);
  const at::Tensor dy = to_kernel_layout(diff_dst, plan);
  const at::Tensor mean_k = to_kernel_channels(mean, plan, acc, 0, src);
  const at::Tensor gamma_d = optional_channels(gamma, plan, src);
  const at::Tensor variance_d = variance.contiguous();
  const at::Tensor count_d = count.contiguous();
  const at::Tensor sums_d = grad_sums.contiguous();
  const at::Tensor a = channel_vector(plan, src, acc);
  const at::Tensor b = channel_vector(plan, src, acc);
  const at::Tensor c = channel_vector(plan, src, acc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "batch_norm_grad_input_cuda", [&] {
    using A = Acc<scalar_t>;
    const dim3 grid(static_cast<unsigned>(ceil_div(e.channels, kThreads)));
    grad_input_coefficients_kernel<A><<<grid, kThreads, 0, stream()>>>(
        variance_d.const_data_ptr<double>(), optional_data(gamma_d), count_d.const_data_ptr<double>(),
        sums_d.const_data_ptr<double>(), epsilon, e.channels, a.mutable_data_ptr<A>(), b.mutable_data_ptr<A>(),
        c.mutable_data_ptr<A>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const Affine<A> coef{mean_k.const_data_ptr<A>(), a.const_data_ptr<A>(), b.const_data_ptr<A>(),
                         c.const_data_ptr<A>()};
    apply_affine<scalar_t, true>(x, dy.const_data_ptr<scalar_t>(), out.buffer, e, coef);
  });
  finish_kernel_output(out, plan);
  return out.result;
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_bn_grad, CUDA, m) {
  m.impl("batch_norm_forward", &batch_norm_forward_cuda);
  m.impl("batch_norm_backward", &batch_norm_backward_cuda);
  m.impl("batch_norm_local_stats", &batch_norm_local_stats_cuda);
  m.impl("batch_norm_grad_sums", &batch_norm_grad_sums_cuda);
  m.impl("batch_norm_grad_input", &batch_norm_grad_input_cuda);
}

}  // namespace torch_bn_grad::cuda
