// The running-statistics update's kernel (running_stats_cuda.h).
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "batch_norm_math.h"
#include "cuda/running_stats_cuda.h"
#include "extent.h"

namespace torch_bn_grad::cuda {
namespace {

constexpr int kRunningThreads = 256;

// a * b rounded on its own, as at::mul rounds it: nvcc would otherwise fuse
// the product into lerp's subtraction.
__device__ __forceinline__ float product(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double product(double a, double b) { return __dmul_rn(a, b); }

template <typename T>
__global__ void __launch_bounds__(kRunningThreads)
    update_running_kernel(T* running_mean, T* running_var, const T* mean, const T* variance, int64_t channels,
                          T factor, T weight) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * kRunningThreads + threadIdx.x;
  if (k >= channels) return;
  if (running_mean != nullptr) running_mean[k] = math::lerp(running_mean[k], mean[k], weight);
  if (running_var != nullptr) {
    const T unbiased = factor == T(1) ? variance[k] : product(variance[k], factor);
    running_var[k] = math::lerp(running_var[k], unbiased, weight);
  }
}

}  // namespace

void update_running_stats(const at::Tensor* running_mean, const at::Tensor* running_var, const at::Tensor& mean,
                          const at::Tensor& variance, double factor, double momentum) {
  const int64_t channels = mean.numel();
  if (channels == 0 || (running_mean == nullptr && running_var == nullptr)) return;
  const c10::cuda::CUDAGuard guard(mean.device());
  AT_DISPATCH_FLOATING_TYPES(mean.scalar_type(), "update_running_stats_cuda", [&] {
    const auto blocks = static_cast<unsigned>(ceil_div(channels, int64_t{kRunningThreads}));
    update_running_kernel<scalar_t><<<blocks, kRunningThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        running_mean != nullptr ? running_mean->mutable_data_ptr<scalar_t>() : nullptr,
        running_var != nullptr ? running_var->mutable_data_ptr<scalar_t>() : nullptr, mean.const_data_ptr<scalar_t>(),
        variance.const_data_ptr<scalar_t>(), channels, static_cast<scalar_t>(factor),
        static_cast<scalar_t>(momentum));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace torch_bn_grad::cuda
