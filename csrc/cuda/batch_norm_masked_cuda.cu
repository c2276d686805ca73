// CUDA masked operators (batch_norm_masked_forward / _backward): the data in
// masked_layout.h's form, element (o, c, i) at (o * C + c) * inner + i, its
// mask at o * inner + i.
//
// Simple and exact rather than tuned: one block per channel reduces that
// channel's valid positions in float64 with compensated sums (compensated.h),
// the statistics in two passes (the mean, then the squares about it); its
// first thread derives the channel's coefficients (batch_norm_math.h); an
// elementwise kernel then writes every position, 0 where padded. Padded
// positions are never read. The valid count stays on the device.
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <limits>
#include <type_traits>

#include "dtypes.h"
#include "args/batch_norm_args.h"
#include "args/masked_layout.h"
#include "cuda/channel_values.cuh"
#include "library/signatures.h"
#include "math/batch_norm_math.h"
#include "math/compensated.h"

namespace torch_bn_grad::cuda {
namespace {

constexpr int kThreads = 256;
// Blocks of the elementwise kernel's grid-stride loop: enough to fill any current GPU.
constexpr int64_t kMostBlocks = 8192;

// The data's extents in the index type I: int32_t wherever every index and
// every grid-stride step fits (64-bit division is many times slower).
template <typename I>
struct Shape {
  using Index = I;
  I outer, channels, inner;
};

// Calls f(Shape<I>) with the narrowest index type for `extent`.
template <typename F>
void with_shape(const Extent& e, F&& f) {
  const int64_t total = e.outer * e.channels * e.inner;
  if (total <= std::numeric_limits<int32_t>::max() - kMostBlocks * kThreads) {
    f(Shape<int32_t>{static_cast<int32_t>(e.outer), static_cast<int32_t>(e.channels), static_cast<int32_t>(e.inner)});
  } else {
    f(Shape<int64_t>{e.outer, e.channels, e.inner});
  }
}

// The block's sum of each thread's compensated sum (thread 0 gets the total);
// the order is fixed, so the result depends on the data alone.
__device__ double block_total(math::ExactSum<double> s, math::ExactSum<double>* shared) {
  shared[threadIdx.x] = s;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (static_cast<int>(threadIdx.x) < half) shared[threadIdx.x] = math::merge(shared[threadIdx.x], shared[threadIdx.x + half]);
    __syncthreads();
  }
  const double total = math::value_of(shared[0]);
  __syncthreads();
  return total;
}

__device__ int64_t block_count(int64_t n, int64_t* shared) {
  shared[threadIdx.x] = n;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (static_cast<int>(threadIdx.x) < half) shared[threadIdx.x] += shared[threadIdx.x + half];
    __syncthreads();
  }
  const int64_t total = shared[0];
  __syncthreads();
  return total;
}

// Where channel c's element at mask position p lies in the data.
template <typename I>
__device__ __forceinline__ I element_of(const Shape<I>& s, I c, I p) {
  return ((p / s.inner) * s.channels + c) * s.inner + p % s.inner;
}

// Channel c = blockIdx.x's coefficients for the forward: the batch statistics
// (mean absent: written to batch_mean, batch_var) or the given ones.
// Block 0 also writes the valid count.
template <typename T, typename I>
__global__ void forward_coefficients_kernel(const T* __restrict__ x, const bool* __restrict__ mask, Shape<I> s,
                                            ChannelIn gamma, ChannelIn beta, ChannelIn mean, ChannelIn var,
                                            double epsilon, ChannelOut batch_mean, ChannelOut batch_var,
                                            double* count_out, math::ChannelAffine<at::opmath_type<T>>* affine) {
  __shared__ math::ExactSum<double> sums[kThreads];
  __shared__ int64_t counts[kThreads];
  const I c = blockIdx.x, positions = s.outer * s.inner;
  const bool given = mean.data != nullptr;
  int64_t n = 0;
  math::ExactSum<double> sum{0.0, 0.0};
  for (I p = threadIdx.x; p < positions; p += kThreads) {
    if (!mask[p]) continue;
    ++n;
    if (!given) math::add_exact(sum, static_cast<double>(x[element_of(s, c, p)]));
  }
  const int64_t count = block_count(n, counts);
  double m = 0.0, v = 0.0;
  if (given) {
    m = mean.at(c, 0.0);
    v = var.at(c, 0.0);
  } else if (count > 0) {
    m = block_total(sum, sums) / static_cast<double>(count);
    math::ExactSum<double> squares{0.0, 0.0};
    for (I p = threadIdx.x; p < positions; p += kThreads) {
      if (!mask[p]) continue;
      const double d = static_cast<double>(x[element_of(s, c, p)]) - m;
      math::add_exact(squares, __dmul_rn(d, d));
    }
    v = block_total(squares, sums) / static_cast<double>(count);
  }
  if (threadIdx.x != 0) return;
  if (!given) {
    batch_mean.set(c, m);
    batch_var.set(c, v);
  }
  if (c == 0) *count_out = static_cast<double>(count);
  affine[c] = math::channel_affine<at::opmath_type<T>>(
      m, math::forward_coefficients(v, gamma.at(c, 1.0), beta.at(c, 0.0), epsilon));
}

// Channel c's gradient sums, parameter gradients (where wanted) and backward coefficients.
template <typename T, typename I>
__global__ void backward_coefficients_kernel(const T* __restrict__ x, const T* __restrict__ dy,
                                             const bool* __restrict__ mask, Shape<I> s, ChannelIn mean,
                                             ChannelIn var, ChannelIn gamma, double epsilon, bool training,
                                             ChannelOut diff_gamma, ChannelOut diff_beta,
                                             math::ChannelAffine<at::opmath_type<T>>* affine) {
  __shared__ math::ExactSum<double> sums[kThreads];
  __shared__ int64_t counts[kThreads];
  const I c = blockIdx.x, positions = s.outer * s.inner;
  const double m = mean.at(c, 0.0);
  int64_t n = 0;
  math::ExactSum<double> sum_dy{0.0, 0.0}, sum_dy_xc{0.0, 0.0};
  for (I p = threadIdx.x; p < positions; p += kThreads) {
    if (!mask[p]) continue;
    ++n;
    const I at = element_of(s, c, p);
    math::add_grad(sum_dy, sum_dy_xc, static_cast<double>(x[at]), static_cast<double>(dy[at]), m);
  }
  const int64_t count = block_count(n, counts);
  const math::GradSums<double> g{block_total(sum_dy, sums), block_total(sum_dy_xc, sums)};
  if (threadIdx.x != 0) return;
  const double rstd = math::rstd_of(var.at(c, 0.0), epsilon);
  const auto p = math::parameter_grads(rstd, g);
  if (diff_gamma.wanted()) diff_gamma.set(c, p.diff_gamma);
  if (diff_beta.wanted()) diff_beta.set(c, p.diff_beta);
  affine[c] = math::channel_affine<at::opmath_type<T>>(
      m, math::backward_coefficients(rstd, gamma.at(c, 1.0), g, static_cast<double>(count), training));
}

// out = dy_scale * dy + x_scale * (x - mean) + bias at valid positions (no dy:
// without its term), 0 at padded ones.
template <typename T, typename I>
__global__ void affine_kernel(const T* __restrict__ x, const T* __restrict__ dy, const bool* __restrict__ mask,
                              Shape<I> s, const math::ChannelAffine<at::opmath_type<T>>* affine, T* __restrict__ out) {
  using A = at::opmath_type<T>;
  const I total = s.outer * s.channels * s.inner, plane = s.channels * s.inner;
  for (I e = blockIdx.x * static_cast<I>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<I>(gridDim.x) * blockDim.x) {
    const I o = e / plane, i = e % s.inner, c = (e / s.inner) % s.channels;
    if (!mask[o * s.inner + i]) {
      out[e] = T(0);
      continue;
    }
    const math::ChannelAffine<A> a = affine[c];
    A r = ::fma(static_cast<A>(x[e]) - a.mean, a.x_scale, a.bias);
    if (dy != nullptr) r = ::fma(static_cast<A>(dy[e]), a.dy_scale, r);
    out[e] = static_cast<T>(r);
  }
}

int affine_blocks(int64_t total) {
  const int64_t wanted = (total + kThreads - 1) / kThreads;
  return static_cast<int>(wanted < 1 ? 1 : (wanted > kMostBlocks ? kMostBlocks : wanted));
}

// The per-channel coefficients of the elementwise pass: `A` values, four a channel.
at::Tensor affine_buffer(const at::Tensor& src, int64_t channels) {
  return at::empty({channels * 4}, src.options().dtype(accumulation_dtype(src.scalar_type())));
}

// Queues a masked pass in layout.data's dtype: coefficients(a, x, shape,
// stream) queues the kernel that writes the per-channel coefficients `a`,
// then, where `out` has elements, the elementwise kernel writes out from x
// (and dy where defined).
template <typename Coefficients>
void run_masked_pass(const MaskedLayout& layout, const at::Tensor& valid, const at::Tensor& dy, const at::Tensor& out,
                     const Coefficients& coefficients) {
  const at::Tensor& data = layout.data;
  if (layout.extent.channels == 0) return;
  const at::Tensor affine = affine_buffer(data, layout.extent.channels);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  TBG_DISPATCH_DATA_DTYPE(data.scalar_type(), "batch_norm_masked_cuda", [&] {
    using Affine = math::ChannelAffine<at::opmath_type<scalar_t>>;
    auto* a = reinterpret_cast<Affine*>(affine.mutable_data_ptr());
    const scalar_t* x = data.const_data_ptr<scalar_t>();
    with_shape(layout.extent, [&](const auto& s) {
      using I = typename std::decay_t<decltype(s)>::Index;
      coefficients(a, x, s, stream);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (out.numel() > 0) {
        const scalar_t* g = dy.defined() ? dy.const_data_ptr<scalar_t>() : nullptr;
        affine_kernel<scalar_t, I><<<affine_blocks(out.numel()), kThreads, 0, stream>>>(
            x, g, valid.const_data_ptr<bool>(), s, a, out.mutable_data_ptr<scalar_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    });
  });
}

}  // namespace

Outputs4 batch_norm_masked_forward_cuda(TBG_PARAMS(batch_norm_masked_forward)) {
  const ChannelPlan plan = check_masked_forward_args(src, mask, gamma, beta, mean, variance, epsilon);
  const c10::cuda::CUDAGuard guard(src.device());
  const MaskedLayout layout = masked_layout(src);
  const at::Tensor valid = mask.contiguous();
  const bool frozen = mean.has_value();
  const ChannelValues gamma_in = channel_values(gamma, plan, src), beta_in = channel_values(beta, plan, src);
  const ChannelValues mean_in = channel_values(mean, plan, src), var_in = channel_values(variance, plan, src);
  const auto stats_dtype = accumulation_dtype(src.scalar_type());
  const ChannelResult batch_mean = frozen ? ChannelResult{} : channel_result(plan, stats_dtype, src);
  const ChannelResult batch_var = frozen ? ChannelResult{} : channel_result(plan, stats_dtype, src);
  const auto count_options = src.options().dtype(at::kDouble);
  // Written by the kernel, which runs where there are channels.
  const at::Tensor count = plan.channels > 0 ? at::empty({}, count_options) : at::zeros({}, count_options);
  at::Tensor dst = masked_output(src, layout);
  run_masked_pass(layout, valid, at::Tensor(), dst, [&](auto* a, const auto* x, const auto& s, cudaStream_t stream) {
    using scalar_t = std::remove_cv_t<std::remove_pointer_t<decltype(x)>>;
    using I = typename std::decay_t<decltype(s)>::Index;
    forward_coefficients_kernel<scalar_t, I><<<s.channels, kThreads, 0, stream>>>(
        x, valid.const_data_ptr<bool>(), s, gamma_in.in, beta_in.in, mean_in.in, var_in.in, epsilon,
        batch_mean.out, batch_var.out, count.mutable_data_ptr<double>(), a);
  });
  if (frozen) return {dst, mean->clone(), variance->clone(), count};
  return {dst, batch_mean.finish(plan, stats_dtype, src), batch_var.finish(plan, stats_dtype, src), count};
}

Outputs3 batch_norm_masked_backward_cuda(TBG_PARAMS(batch_norm_masked_backward)) {
  const ChannelPlan plan = check_masked_backward_args(src, mask, diff_dst, mean, variance, gamma, epsilon);
  const c10::cuda::CUDAGuard guard(src.device());
  const MaskedLayout layout = masked_layout(src);
  const at::Tensor valid = mask.contiguous();
  const at::Tensor dy = to_masked_layout(diff_dst, layout);
  const ChannelValues mean_in = channel_values(mean, plan, src), var_in = channel_values(variance, plan, src),
                      gamma_in = channel_values(gamma, plan, src);
  const auto grad_dtype = param_grad_dtype(mean, gamma);
  const ChannelResult diff_gamma = output_mask[1] ? channel_result(plan, grad_dtype, src) : ChannelResult{};
  const ChannelResult diff_beta = output_mask[2] ? channel_result(plan, grad_dtype, src) : ChannelResult{};
  at::Tensor diff_src = output_mask[0] ? masked_output(src, layout) : at::empty({0}, src.options());
  run_masked_pass(layout, valid, dy, diff_src, [&](auto* a, const auto* x, const auto& s, cudaStream_t stream) {
    using scalar_t = std::remove_cv_t<std::remove_pointer_t<decltype(x)>>;
    using I = typename std::decay_t<decltype(s)>::Index;
    backward_coefficients_kernel<scalar_t, I><<<s.channels, kThreads, 0, stream>>>(
        x, dy.const_data_ptr<scalar_t>(), valid.const_data_ptr<bool>(), s, mean_in.in, var_in.in, gamma_in.in,
        epsilon, training, diff_gamma.out, diff_beta.out, a);
  });
  const auto absent = [&] { return at::empty({0}, mean.options().dtype(grad_dtype)); };
  return {diff_src, output_mask[1] ? diff_gamma.finish(plan, grad_dtype, src) : absent(),
          output_mask[2] ? diff_beta.finish(plan, grad_dtype, src) : absent()};
}

}  // namespace torch_bn_grad::cuda
