// The running-statistics update of one channel on the device, as at::lerp and
// at::mul round it: the standalone update kernel's (running_stats_cuda.cu) and,
// under the fused_update variant (config/cuda_variants.h), the training
// forward's coefficient and persistent kernels' (coefficient_kernels.cuh).
#pragma once

#include <ATen/OpMathType.h>

#include <cstdint>
#include <optional>
#include <type_traits>

#include "dtypes.h"
#include "math/batch_norm_math.h"
#include "cuda/channel_values.cuh"
#include "cuda/running_stats_cuda.h"

namespace torch_bn_grad::cuda {

// a * b rounded on its own, as at::mul rounds it: nvcc would otherwise fuse
// the product into lerp's subtraction.
__device__ __forceinline__ float product(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double product(double a, double b) { return __dmul_rn(a, b); }

// Channel k of the buffers (R; either may be null) towards the batch's mean
// and variance (S = opmath(R)): a half-precision buffer is updated as the
// tensor arithmetic does it, the product in S rounded to R, then at::lerp
// computing in S.
template <typename R, typename S = at::opmath_type<R>>
__device__ __forceinline__ void update_running_channel(R* running_mean, R* running_var, int64_t k, S mean,
                                                       S variance, S factor, S weight) {
  const auto towards = [&](R running, S value) {
    return static_cast<R>(math::lerp(static_cast<S>(running), static_cast<S>(static_cast<R>(value)), weight));
  };
  if (running_mean != nullptr) running_mean[k] = towards(running_mean[k], mean);
  if (running_var != nullptr) running_var[k] = towards(running_var[k], factor == S(1) ? variance : product(variance, factor));
}

// The buffers a training forward updates in its own kernels (fused_update):
// contiguous, of one data dtype `type` whose accumulation type is the
// forward's; `factor` the variance's Bessel factor. Null buffers: no update.
struct RunningUpdate {
  void* mean = nullptr;
  void* variance = nullptr;
  ChannelType type = ChannelType::kDouble;
  double factor = 1.0;
  double momentum = 0.0;

  __device__ __forceinline__ bool wanted() const { return mean != nullptr || variance != nullptr; }

  // Channel k's update from its batch statistics as the forward returns them (A).
  template <typename A>
  __device__ __forceinline__ void apply(int64_t k, A batch_mean, A batch_variance) const {
    switch (type) {
#define TBG_RUNNING_UPDATE_CASE(Name, unused)                                                                 \
  case ChannelType::k##Name: {                                                                                \
    using R = c10::impl::ScalarTypeToCPPTypeT<at::ScalarType::Name>;                                          \
    if constexpr (std::is_same_v<at::opmath_type<R>, A>)                                                      \
      update_running_channel<R>(static_cast<R*>(mean), static_cast<R*>(variance), k, batch_mean, batch_variance, \
                                static_cast<A>(factor), static_cast<A>(momentum));                            \
    break;                                                                                                    \
  }
      TBG_DATA_DTYPES(TBG_RUNNING_UPDATE_CASE, 0)
#undef TBG_RUNNING_UPDATE_CASE
    }
  }
};

// The kernels' view of `buffers` for a forward of `plan` on `src`, or nullopt
// where they do not take the kernel (running_stats_cuda.h's forward_updating).
std::optional<RunningUpdate> running_update_for(const ChannelPlan& plan, const at::Tensor& src,
                                                const RunningBuffers& buffers);

}  // namespace torch_bn_grad::cuda
