// The running-statistics update's kernel (running_stats_cuda.h).
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <optional>
#include <utility>

#include "dtypes.h"
#include "cuda/running_stats_cuda.h"
#include "cuda/running_update.cuh"
#include "math/extent.h"

namespace torch_bn_grad::cuda {
namespace {

constexpr int kRunningThreads = 256;

// R: the running buffers' dtype; S = opmath(R): the batch statistics'
// (running_update.cuh's formula). `count` (float64, on the device), where
// given, decides the variance's factor and whether to update at all, as
// _rules/running_stats.py's tensor arithmetic does.
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
  update_running_channel<R>(running_mean, running_var, k, mean[k], variance[k], factor, weight);
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

bool buffers_take_kernel(const OptionalTensor& running_mean, const OptionalTensor& running_var,
                         const at::Device& device, at::ScalarType stats, int64_t channels) {
  std::optional<at::ScalarType> buffers;
  for (const auto* t : {&running_mean, &running_var}) {
    if (!t->has_value()) continue;
    const auto buffer = (*t)->scalar_type();
    if ((*t)->device() != device || !is_data_dtype(buffer) || accumulation_dtype(buffer) != stats ||
        (buffers.has_value() && *buffers != buffer) || !(*t)->is_contiguous() || (*t)->numel() != channels)
      return false;
    buffers = buffer;
  }
  return true;
}

std::optional<RunningUpdate> running_update_for(const ChannelPlan& plan, const at::Tensor& src,
                                                const RunningBuffers& buffers) {
  // The kernels write channel k of kernel order: the buffers' own order only where the orders agree.
  if (plan.kept_kernel != plan.kept_logical ||
      !buffers_take_kernel(buffers.running_mean, buffers.running_var, src.device(),
                           accumulation_dtype(src.scalar_type()), plan.channels))
    return std::nullopt;
  RunningUpdate u;
  for (const auto& [to, from] : {std::pair{&u.mean, &buffers.running_mean}, std::pair{&u.variance, &buffers.running_var}}) {
    if (!from->has_value()) continue;
    *to = (*from)->mutable_data_ptr();
    u.type = *channel_type((*from)->scalar_type());
  }
  u.factor = buffers.factor;
  u.momentum = buffers.momentum;
  return u;
}

void update_running_stats(const at::Tensor* running_mean, const at::Tensor* running_var, const at::Tensor& mean,
                          const at::Tensor& variance, double factor, double momentum) {
  launch_update(running_mean, running_var, mean, variance, factor, nullptr, momentum);
}

void update_running_stats(const at::Tensor* running_mean, const at::Tensor* running_var, const at::Tensor& mean,
                          const at::Tensor& variance, const at::Tensor& count, double momentum) {
  launch_update(running_mean, running_var, mean, variance, 1.0, count.const_data_ptr<double>(), momentum);
}

}  // namespace torch_bn_grad::cuda
