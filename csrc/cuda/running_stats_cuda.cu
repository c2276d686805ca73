// The running-statistics update's kernel (running_stats_cuda.h).
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "dtypes.h"
#include "math/batch_norm_math.h"
#include "cuda/running_stats_cuda.h"
#include "math/extent.h"

namespace torch_bn_grad::cuda {
namespace {

constexpr int kRunningThreads = 256;

// a * b rounded on its own, as at::mul rounds it: nvcc would otherwise fuse
// the product into lerp's subtraction.
__device__ __forceinline__ float product(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double product(double a, double b) { return __dmul_rn(a, b); }

// R: the running buffers' dtype; S = opmath(R): the batch statistics'. A
// half-precision buffer is updated as the tensor arithmetic does it: the
// product in S, rounded to R, then at::lerp computing in S. `count` (float64,
// on the device), where given, decides the variance's factor and whether to
// update at all, as _rules/running_stats.py's tensor arithmetic does.
template <typename R, typename S = at::opmath_type<R>>
__global__ void __launch_bounds__(kRunningThreads)
    update_running_kernel(R* running_mean, R* running_var, const S* mean, const S* variance, int64_t channels,
                          S factor, const double* count, S weight) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * kRunningThreads + threadIdx.x;
  if (k >= channels) return;
  if (count != nullptr) {
    const double n = *count;
    if (!(n > 0.0)) return;
    factor = static_cast<S>(n > 1.0 ? n / (n - 1.0) : 1.0);
  }
  const auto towards = [&](R running, S value) {
    return static_cast<R>(math::lerp(static_cast<S>(running), static_cast<S>(static_cast<R>(value)), weight));
  };
  if (running_mean != nullptr) running_mean[k] = towards(running_mean[k], mean[k]);
  if (running_var != nullptr) {
    running_var[k] = towards(running_var[k], factor == S(1) ? variance[k] : product(variance[k], factor));
  }
}

void launch_update(const at::Tensor* running_mean, const at::Tensor* running_var, const at::Tensor& mean,
                   const at::Tensor& variance, double factor, const double* count, double momentum) {
  const int64_t channels = mean.numel();
  if (channels == 0 || (running_mean == nullptr && running_var == nullptr)) return;
  const c10::cuda::CUDAGuard guard(mean.device());
  const at::Tensor& running = running_mean != nullptr ? *running_mean : *running_var;
  TBG_DISPATCH_DATA_DTYPE(running.scalar_type(), "update_running_stats_cuda", [&] {
    using S = at::opmath_type<scalar_t>;
    const auto blocks = static_cast<unsigned>(ceil_div(channels, int64_t{kRunningThreads}));
    update_running_kernel<scalar_t><<<blocks, kRunningThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        running_mean != nullptr ? running_mean->mutable_data_ptr<scalar_t>() : nullptr,
        running_var != nullptr ? running_var->mutable_data_ptr<scalar_t>() : nullptr, mean.const_data_ptr<S>(),
        variance.const_data_ptr<S>(), channels, static_cast<S>(factor), count, static_cast<S>(momentum));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

void update_running_stats(const at::Tensor* running_mean, const at::Tensor* running_var, const at::Tensor& mean,
                          const at::Tensor& variance, double factor, double momentum) {
  launch_update(running_mean, running_var, mean, variance, factor, nullptr, momentum);
}

void update_running_stats(const at::Tensor* running_mean, const at::Tensor* running_var, const at::Tensor& mean,
                          const at::Tensor& variance, const at::Tensor& count, double momentum) {
  launch_update(running_mean, running_var, mean, variance, 1.0, count.const_data_ptr<double>(), momentum);
}

}  // namespace torch_bn_grad::cuda
