// batch_norm_update_running_stats: torch BatchNorm's running-statistics update
// as one operator call, for eager training steps (Python tensor arithmetic is
// a dozen small operators, a large share of a small layer's step).
//
//   running_mean <- lerp(running_mean, mean, momentum)
//   running_var  <- lerp(running_var, variance * count / (count - 1), momentum)
//
// (.counted: the count as a 0-dim tensor, read on its device;
// batch_norm_forward.update, batch_norm_act_forward(_sign_bits).update: the
// training forward, then this update.)
// as at::lerp and at::mul compute it (the same roundings), so it equals the
// Python update that torch.compile traces instead (_rules/running_stats.py).
#include <ATen/ATen.h>

#include <cmath>
#include <optional>

#include "dtypes.h"
#include "args/batch_norm_args.h"
#include "config/cuda_variants.h"
#include "library/operators.h"
#include "cpu/kernels/kernel_table.h"
#ifdef TORCH_BN_GRAD_WITH_CUDA
#include "cuda/running_stats_cuda.h"
#endif

namespace torch_bn_grad {
namespace {

// count / (count - 1), 1 for a single sample: the unbiased variance's factor.
double bessel_factor(int64_t count) {
  return count > 1 ? static_cast<double>(count) / static_cast<double>(count - 1) : 1.0;
}

// The one-loop CPU update (kernel_table().update_running): contiguous buffers
// of a data dtype and batch statistics of its accumulation dtype (float32 for
// float16/bfloat16 buffers, as half-precision data's statistics are).
bool plain_loop_applies(const at::Tensor& running, const at::Tensor& batch) {
  const auto dtype = running.scalar_type();
  return running.is_cpu() && batch.is_cpu() && running.is_contiguous() && batch.is_contiguous() &&
         is_data_dtype(dtype) && batch.scalar_type() == accumulation_dtype(dtype) &&
         running.numel() == batch.numel();
}

void update_one(const at::Tensor& running, const at::Tensor& batch, double factor, double momentum) {
  if (plain_loop_applies(running, batch)) {  // one loop, in the CPU kernels (lerp with at::lerp's roundings)
    cpu::kernel_table().update_running(running, batch, factor, momentum);
    return;
  }
  const at::Tensor value = factor == 1.0 ? batch : batch * factor;
  const_cast<at::Tensor&>(running).lerp_(value.to(running.scalar_type()).view(running.sizes()), momentum);
}

#ifdef TORCH_BN_GRAD_WITH_CUDA
// Both updates in one CUDA kernel: every tensor on the batch statistics' GPU
// and contiguous; buffers of one data dtype whose accumulation dtype is the
// statistics' (float32 statistics for float16/bfloat16 buffers, as for the
// CPU loop). The numel checks come first.
bool one_cuda_kernel_applies(const std::optional<at::Tensor>& running_mean,
                             const std::optional<at::Tensor>& running_var, const at::Tensor& mean,
                             const at::Tensor& variance) {
  const auto dtype = mean.scalar_type();
  if (!mean.is_cuda() || !is_data_dtype(dtype) || accumulation_dtype(dtype) != dtype || !mean.is_contiguous())
    return false;
  return variance.device() == mean.device() && variance.scalar_type() == dtype && variance.is_contiguous() &&
         variance.numel() == mean.numel() &&
         cuda::buffers_take_kernel(running_mean, running_var, mean.device(), dtype, mean.numel());
}
#endif

void check_one_value_per_channel(const std::optional<at::Tensor>& running_mean,
                                 const std::optional<at::Tensor>& running_var, const at::Tensor& mean,
                                 const at::Tensor& variance) {
  for (const auto& [name, running, batch] : {std::tuple{"running_mean", &running_mean, &mean},
                                             std::tuple{"running_var", &running_var, &variance}}) {
    if (!running->has_value()) continue;
    TORCH_CHECK_VALUE((*running)->numel() == batch->numel(), "batch_norm_update_running_stats: ", name,
                      " must have one value per channel (", batch->numel(), "), got ", (*running)->numel());
  }
}

}  // namespace

void batch_norm_update_running_stats(TBG_PARAMS(batch_norm_update_running_stats)) {
  TORCH_CHECK_VALUE(count >= 0, "batch_norm_update_running_stats: count must be >= 0, got ", count);
  check_one_value_per_channel(running_mean, running_var, mean, variance);
  if (count == 0) return;  // torch's BatchNorm leaves the running statistics of an empty batch alone
#ifdef TORCH_BN_GRAD_WITH_CUDA
  if (one_cuda_kernel_applies(running_mean, running_var, mean, variance)) {
    cuda::update_running_stats(running_mean.has_value() ? &*running_mean : nullptr,
                               running_var.has_value() ? &*running_var : nullptr, mean, variance,
                               bessel_factor(count), momentum);
    return;
  }
#endif
  if (running_mean.has_value()) update_one(*running_mean, mean, 1.0, momentum);
  if (running_var.has_value()) update_one(*running_var, variance, bessel_factor(count), momentum);
}

// The update with the count held by a 0-dim tensor (a masked batch's valid
// count, float64 on the statistics' device): read where it is, so that no
// step waits for the device. A CPU count is read on the host; on a GPU one
// kernel reads it there; other tensors take the tensor arithmetic of
// _rules/running_stats.py (no update where the count is 0).
void batch_norm_update_running_stats_counted(TBG_PARAMS(batch_norm_update_running_stats_counted)) {
  TORCH_CHECK_VALUE(count.dim() == 0, "batch_norm_update_running_stats: count must be a 0-dim tensor, got shape ",
                    count.sizes());
  check_one_value_per_channel(running_mean, running_var, mean, variance);
  if (count.is_cpu()) {
    batch_norm_update_running_stats(running_mean, running_var, mean, variance,
                                    static_cast<int64_t>(count.item<double>()), momentum);
    return;
  }
#ifdef TORCH_BN_GRAD_WITH_CUDA
  if (count.device() == mean.device() && count.scalar_type() == at::kDouble &&
      one_cuda_kernel_applies(running_mean, running_var, mean, variance)) {
    cuda::update_running_stats(running_mean.has_value() ? &*running_mean : nullptr,
                               running_var.has_value() ? &*running_var : nullptr, mean, variance, count, momentum);
    return;
  }
#endif
  const at::Tensor n = count.to(mean.device(), at::kDouble);
  const at::Tensor seen = n.gt(0);
  const at::Tensor factor = n / (n - 1).clamp_min(1);
  for (const auto& [running, batch] : {std::pair{&running_mean, mean}, std::pair{&running_var, variance * factor}}) {
    if (!running->has_value()) continue;
    const at::Tensor& r = **running;
    const at::Tensor moved = r.lerp(batch.to(r.scalar_type()).view(r.sizes()), momentum);
    const_cast<at::Tensor&>(r).copy_(at::where(seen, moved, r));
  }
}

namespace {

// The update of a training forward's outputs (mean and variance at 1 and 2),
// with the elements per channel as count: the .update overloads' second step.
template <class Outputs>
Outputs then_update(Outputs outputs, const at::Tensor& src, const std::optional<at::Tensor>& running_mean,
                    const std::optional<at::Tensor>& running_var, double momentum) {
  const at::Tensor& mean = std::get<1>(outputs);
  const at::Tensor& variance = std::get<2>(outputs);
  const int64_t channels = mean.numel();
  batch_norm_update_running_stats(running_mean, running_var, mean, variance,
                                  channels > 0 ? src.numel() / channels : 0, momentum);
  return outputs;
}

// The buffers a GPU's training forward of `plan` updates in its own kernels
// (the fused_update variant), with the update's factor of its count; nullopt
// for an empty batch, which updates nothing.
#ifdef TORCH_BN_GRAD_WITH_CUDA
std::optional<cuda::RunningBuffers> fused_update_buffers(const ChannelPlan& plan, const OptionalTensor& running_mean,
                                                         const OptionalTensor& running_var, double momentum) {
  const int64_t count = plan.reduced_count();
  if (count == 0 || plan.channels == 0) return std::nullopt;
  return cuda::RunningBuffers{running_mean, running_var, bessel_factor(count), momentum};
}
#endif

}  // namespace

// The training forward (batch statistics), then the update: one call from
// Python for an eager step (the update's own call from Python was a fifth of
// a small layer's training forward on the CPU). Under the fused_update
// variant a GPU's forward kernels make the update themselves.
Outputs3 batch_norm_forward_update(TBG_PARAMS(batch_norm_forward_update)) {
  check_running_stats_device(src, running_mean, running_var);
#ifdef TORCH_BN_GRAD_WITH_CUDA
  if (src.is_cuda() && cuda_variant_on(CudaVariant::kFusedUpdate)) {
    const ChannelPlan plan = check_forward_args(src, gamma, beta, std::nullopt, std::nullopt, epsilon, data_format);
    if (const auto buffers = fused_update_buffers(plan, running_mean, running_var, momentum))
      if (auto done = cuda::forward_updating(plan, src, gamma, beta, epsilon, *buffers)) return *std::move(done);
  }
#endif
  return then_update(
      op::batch_norm_forward().call(src, gamma, beta, std::nullopt, std::nullopt, epsilon, data_format), src,
      running_mean, running_var, momentum);
}

// The fused forward's two entries, likewise.
Outputs3 batch_norm_act_forward_update(TBG_PARAMS(batch_norm_act_forward_update)) {
  check_running_stats_device(src, running_mean, running_var);
#ifdef TORCH_BN_GRAD_WITH_CUDA
  if (src.is_cuda() && cuda_variant_on(CudaVariant::kFusedUpdate)) {
    const ActPlan checked = check_act_forward_args(src, gamma, beta, std::nullopt, std::nullopt, residual, epsilon,
                                                   activation, negative_slope, data_format);
    if (const auto buffers = fused_update_buffers(checked.plan, running_mean, running_var, momentum))
      if (auto done = cuda::act_forward_updating(checked, src, gamma, beta, residual, epsilon, negative_slope,
                                                 *buffers))
        return *std::move(done);
  }
#endif
  return then_update(op::batch_norm_act_forward().call(src, gamma, beta, std::nullopt, std::nullopt, residual,
                                                       epsilon, activation, negative_slope, data_format,
                                                       memory_saving),
                     src, running_mean, running_var, momentum);
}

Outputs4 batch_norm_act_forward_sign_bits_update(TBG_PARAMS(batch_norm_act_forward_sign_bits_update)) {
  check_running_stats_device(src, running_mean, running_var);
  return then_update(op::batch_norm_act_forward_sign_bits().call(src, gamma, beta, std::nullopt, std::nullopt,
                                                                 residual, epsilon, activation, negative_slope,
                                                                 data_format),
                     src, running_mean, running_var, momentum);
}

}  // namespace torch_bn_grad
