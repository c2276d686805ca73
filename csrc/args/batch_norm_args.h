// Argument validation and the memory plan shared by every backend.
//
// Every operator views its data as a contiguous [outer, channels, inner] array:
// `channels` enumerates the kept (per-channel) positions, and the reduction for
// a channel runs over `outer * inner` elements. Most real layouts (NCHW,
// channels_last, NXC, and the common DirectML broadcast patterns) are such a
// view of the original storage, so kernels read the tensors without copies;
// any other layout is first copied into one.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <array>
#include <optional>
#include <tuple>
#include <cstdint>
#include <vector>

#include "library/signatures.h"
#include "math/activation_math.h"
#include "math/extent.h"

namespace torch_bn_grad {

struct ChannelPlan {
  // Permutation of src's dims that makes the data an [outer, channels, inner]
  // array; contiguous() of src.permute(permutation) is free when the layout fits.
  std::vector<int64_t> permutation;
  int64_t outer = 1;
  int64_t channels = 1;
  int64_t inner = 1;
  // Shape of the per-channel tensors (mean, variance, gamma, beta, diff_gamma).
  std::vector<int64_t> stats_shape;
  // Kept dims of src in logical order and in kernel order; they differ only for
  // broadcast statistics over a permuted layout.
  std::vector<int64_t> kept_logical;
  std::vector<int64_t> kept_kernel;

  int64_t reduced_count() const { return outer * inner; }
  Extent extent() const { return {outer, channels, inner}; }
};

// Validates the backward operator's arguments (ValueError / TypeError naming
// the argument) and returns the plan. Nothing is allocated before it returns.
ChannelPlan check_backward_args(const at::Tensor& src, const at::Tensor& diff_dst,
                                const at::Tensor& mean, const at::Tensor& variance,
                                const std::optional<at::Tensor>& gamma, double epsilon,
                                c10::string_view data_format);

// The dtype of a backward operator's diff_gamma and diff_beta: the
// parameters' (gamma's, else beta's), else the statistics' (mean's).
inline at::ScalarType param_grad_dtype(const at::Tensor& mean, const std::optional<at::Tensor>& gamma,
                                       const std::optional<at::Tensor>& beta = std::nullopt) {
  if (gamma.has_value()) return gamma->scalar_type();
  return beta.has_value() ? beta->scalar_type() : mean.scalar_type();
}

// Validates the forward operator's arguments and returns the plan.
ChannelPlan check_forward_args(const at::Tensor& src, const std::optional<at::Tensor>& gamma,
                               const std::optional<at::Tensor>& beta,
                               const std::optional<at::Tensor>& mean,
                               const std::optional<at::Tensor>& variance, double epsilon,
                               c10::string_view data_format);

// batch_norm_forward.update's running statistics, before the forward runs:
// on src's device (their count per channel is the update's own check).
void check_running_stats_device(const at::Tensor& src, const std::optional<at::Tensor>& running_mean,
                                const std::optional<at::Tensor>& running_var);

// The masked operators' arguments: those of batch_norm_forward / _backward
// (channel axis 1, src of rank 2 or more, 1-D per-channel tensors), and
// `mask`, bool of src's shape without dim 1, on src's device (TypeError for
// another dtype, ValueError naming the expected shape otherwise).
ChannelPlan check_masked_forward_args(const at::Tensor& src, const at::Tensor& mask,
                                      const std::optional<at::Tensor>& gamma, const std::optional<at::Tensor>& beta,
                                      const std::optional<at::Tensor>& mean,
                                      const std::optional<at::Tensor>& variance, double epsilon);
ChannelPlan check_masked_backward_args(const at::Tensor& src, const at::Tensor& mask, const at::Tensor& diff_dst,
                                       const at::Tensor& mean, const at::Tensor& variance,
                                       const std::optional<at::Tensor>& gamma, double epsilon);

// The fused batch_norm_act operators' arguments: the plan and the activation.
// The backward's data tensor (the plan's src) is src, or dst when from_output.
struct ActPlan {
  ChannelPlan plan;
  act::Kind kind;
  bool reads_sign_bits = false;  // backward: dst_positive given and not empty (empty: read dst)
};
ActPlan check_act_forward_args(const at::Tensor& src, const std::optional<at::Tensor>& gamma,
                               const std::optional<at::Tensor>& beta, const std::optional<at::Tensor>& mean,
                               const std::optional<at::Tensor>& variance,
                               const std::optional<at::Tensor>& residual, double epsilon,
                               c10::string_view activation, double negative_slope, c10::string_view data_format);
// The fused backward's: all of batch_norm_act_backward's arguments.
ActPlan check_act_backward_args(TBG_PARAMS(batch_norm_act_backward));

// The fused masked operators' arguments: the masked operators', a residual
// like src, the activation; the backward's dst (read for act' of relu and
// leaky_relu) like src.
ActPlan check_masked_act_forward_args(const at::Tensor& src, const at::Tensor& mask,
                                      const std::optional<at::Tensor>& gamma, const std::optional<at::Tensor>& beta,
                                      const std::optional<at::Tensor>& mean,
                                      const std::optional<at::Tensor>& variance,
                                      const std::optional<at::Tensor>& residual, double epsilon,
                                      c10::string_view activation, double negative_slope);
ActPlan check_masked_act_backward_args(const at::Tensor& src, const at::Tensor& mask,
                                       const std::optional<at::Tensor>& dst,
                                       const std::optional<at::Tensor>& residual, const at::Tensor& diff_dst,
                                       const at::Tensor& mean, const at::Tensor& variance,
                                       const std::optional<at::Tensor>& gamma, const std::optional<at::Tensor>& beta,
                                       double epsilon, c10::string_view activation, double negative_slope);

// The split-stage operators' arguments (1-D statistics only; per-channel
// statistics float64 of shape (C,), packed rows (rows, C)), and their plan.
ChannelPlan check_local_stats_args(const at::Tensor& src, c10::string_view data_format);
ChannelPlan check_grad_sums_args(const at::Tensor& src, const at::Tensor& diff_dst, const at::Tensor& mean,
                                 c10::string_view data_format);
ChannelPlan check_grad_input_args(const at::Tensor& src, const at::Tensor& diff_dst, const at::Tensor& mean,
                                  const at::Tensor& variance, const std::optional<at::Tensor>& gamma,
                                  const at::Tensor& count, const at::Tensor& grad_sums, double epsilon,
                                  c10::string_view data_format);

// The tensor whose data the kernels read as a contiguous [outer, channels,
// inner] array: `t` itself when its strides already lay it out so (no view
// is made: kernels use the data pointer only), else a permuted contiguous copy.
at::Tensor to_kernel_layout(const at::Tensor& t, const ChannelPlan& plan);
// The same for an optional operand (residual, dst); absent: an undefined tensor.
at::Tensor to_kernel_layout(const std::optional<at::Tensor>& t, const ChannelPlan& plan);

// An output tensor laid out like `src` (its memory format), plus the
// contiguous [outer, channels, inner] buffer the kernel writes (its data
// pointer: it may keep the result's shape). The buffer is the output itself
// when the layouts agree; otherwise call
// `finish_kernel_output` after the kernel has run. `allocator`, when given,
// a CPU allocator, provides the result's memory (strides as empty_like(src)
// would choose).
struct KernelOutput {
  at::Tensor result;
  at::Tensor buffer;
};
KernelOutput make_kernel_output(const at::Tensor& src, const ChannelPlan& plan,
                                c10::Allocator* allocator = nullptr);
// An uninitialized tensor of `like`'s dtype and device with these sizes and
// strides, its memory from `allocator` (a CPU allocator) when given.
at::Tensor empty_output(c10::IntArrayRef sizes, c10::IntArrayRef strides, const at::Tensor& like,
                        c10::Allocator* allocator);
void finish_kernel_output(KernelOutput& out, const ChannelPlan& plan);

// A per-channel tensor (stats_shape) as a contiguous 1-D tensor of `dtype` in
// kernel channel order; `fill` is used when `t` is absent.
at::Tensor to_kernel_channels(const std::optional<at::Tensor>& t, const ChannelPlan& plan,
                              at::ScalarType dtype, double fill, const at::Tensor& like);

// The same as float64 values written to `out` (plan.channels of them, host
// memory): the CPU operators keep their per-channel vectors in one host
// buffer, as a tensor each costs a fair share of a small layer's call.
void load_kernel_channels(const std::optional<at::Tensor>& t, const ChannelPlan& plan, double fill,
                          const at::Tensor& like, double* out);

// A 1-D kernel-order channel vector back to stats_shape in `dtype`.
at::Tensor from_kernel_channels(const at::Tensor& v, const ChannelPlan& plan,
                                at::ScalarType dtype, const at::Tensor& like);
// The same from float64 values in host memory, as a CPU tensor.
at::Tensor kernel_channels_result(const double* v, const ChannelPlan& plan, at::ScalarType dtype,
                                  const at::Tensor& like);

// The fused backward's results (diff_src, diff_gamma, diff_beta, diff_residual):
// those asked for as given (diff_gamma and diff_beta already in the
// statistics' dtype and shape), an empty tensor for each output not asked
// for. Shared by the CPU and CUDA operators.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> act_backward_outputs(
    std::array<bool, 4> output_mask, const at::Tensor& diff_src, const at::Tensor& diff_gamma,
    const at::Tensor& diff_beta, const at::Tensor& diff_residual, const at::Tensor& data,
    at::ScalarType grad_dtype);

}  // namespace torch_bn_grad
