// CUDA implementations of the fused batch_norm_act operators: the plain
// operators' paths (batch_norm_cuda.cu: the persistent single-read kernel, or
// reduce, per-channel coefficients and elementwise pass) with an activation
// epilogue (epilogue.cuh) in the gradient sums and the output. The forward's
// driver is the plain forward's (forward.cuh). Same contract, checks and
// per-channel math as the CPU operators (cpu/batch_norm_act_cpu.cpp).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/add.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/rsqrt.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <limits>

#include "dtypes.h"
#include "args/batch_norm_args.h"
#include "cuda/coefficient_kernels.cuh"
#include "cuda/epilogue.cuh"
#include "cuda/forward.cuh"
#include "cuda/launch.cuh"
#include "cuda/running_stats_cuda.h"
#include "cuda/running_update.cuh"
#include "library/signatures.h"
#include "math/activation_math.h"
#include "math/batch_norm_math.h"

namespace torch_bn_grad::cuda {
namespace {

template <typename T>
const T* data_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<T>() : nullptr;
}

// The forward's coefficients (mean, x_scale, bias) of given statistics.
template <typename A>
void frozen_forward_coefficients(ChannelIn mean, ChannelIn variance, ChannelIn gamma, ChannelIn beta,
                                 double epsilon, int64_t channels, const math::AffineArrays<A>& out) {
  ForwardCoefficientArgs<A> args{};
  args.mean = mean;
  args.variance = variance;
  args.gamma = gamma;
  args.beta = beta;
  args.epsilon = epsilon;
  args.channels = channels;
  args.affine = {const_cast<A*>(out.mean), nullptr, const_cast<A*>(out.x_scale), const_cast<A*>(out.bias)};
  forward_coefficients(args);
}

// The fused forward of a checked plan; `running`: the fused_update variant's buffers.
Outputs3 act_forward(const ActPlan& checked, const at::Tensor& src, const OptionalTensor& gamma,
                     const OptionalTensor& beta, const OptionalTensor& mean, const OptionalTensor& variance,
                     const OptionalTensor& residual, double epsilon, double negative_slope,
                     const RunningUpdate& running = RunningUpdate{}) {
  const at::Tensor r = to_kernel_layout(residual, checked.plan);
  return forward_cuda(
      checked.plan, src, gamma, beta, mean, variance, epsilon,
      [&](auto type, const auto& run) {
        using scalar_t = typename decltype(type)::type;
        act::dispatch_activation(checked.kind, [&](auto activation_type) {
          ForwardActEpilogue<scalar_t, decltype(activation_type)> ep{};
          ep.r = data_or_null<scalar_t>(r);
          ep.slope = static_cast<Acc<scalar_t>>(negative_slope);
          run(ep);
        });
      },
      running);
}

}  // namespace

// memory_saving changes what autograd saves, not what the operator computes.
Outputs3 batch_norm_act_forward_cuda(TBG_PARAMS(batch_norm_act_forward)) {
  const ActPlan checked = check_act_forward_args(src, gamma, beta, mean, variance, residual, epsilon, activation,
                                                 negative_slope, data_format);
  return act_forward(checked, src, gamma, beta, mean, variance, residual, epsilon, negative_slope);
}

std::optional<Outputs3> act_forward_updating(const ActPlan& checked, const at::Tensor& src,
                                             const OptionalTensor& gamma, const OptionalTensor& beta,
                                             const OptionalTensor& residual, double epsilon, double negative_slope,
                                             const RunningBuffers& buffers) {
  const std::optional<RunningUpdate> running = running_update_for(checked.plan, src, buffers);
  if (!running) return std::nullopt;
  return act_forward(checked, src, gamma, beta, std::nullopt, std::nullopt, residual, epsilon, negative_slope,
                     *running);
}

Outputs4 batch_norm_act_backward_cuda(TBG_PARAMS(batch_norm_act_backward)) {
  const ActPlan checked =
      check_act_backward_args(diff_dst, src, dst, residual, mean, variance, gamma, beta, epsilon, activation,
                              negative_slope, data_format, training, from_output, output_mask, dst_positive);
  TORCH_CHECK_NOT_IMPLEMENTED(!checked.reads_sign_bits,
                              "batch_norm_act_backward: dst_positive (sign bits) is CPU only; pass dst on CUDA");
  const ChannelPlan& plan = checked.plan;
  const at::Tensor& data = from_output ? *dst : *src;
  const c10::cuda::CUDAGuard guard(data.device());
  const auto acc = accumulation_dtype(data.scalar_type());
  const Extent e = plan.extent();
  const int64_t M = plan.reduced_count();
  const bool need_sums = training || output_mask[1] || output_mask[2];
  // dz is written by the elementwise pass, which diff_src drives.
  const bool need_pass = (output_mask[0] || output_mask[3]) && data.numel() > 0;
  KernelOutput dx, dz;
  if (output_mask[0] || output_mask[3]) dx = make_kernel_output(data, plan);
  if (output_mask[3]) dz = make_kernel_output(data, plan);
  // The parameter gradients in the parameters' dtype, written by the kernel
  // where it can (channel_values.cuh): a small layer's call is mostly host time.
  const auto grad_dtype = param_grad_dtype(mean, gamma, beta);
  const ChannelResult dg = output_mask[1] ? channel_result(plan, grad_dtype, data) : ChannelResult{};
  const ChannelResult db = output_mask[2] ? channel_result(plan, grad_dtype, data) : ChannelResult{};

  if (e.channels > 0 && (need_pass || output_mask[1] || output_mask[2])) {
    const at::Tensor x = to_kernel_layout(data, plan);
    const at::Tensor y = from_output ? at::Tensor() : to_kernel_layout(dst, plan);
    const at::Tensor r = to_kernel_layout(residual, plan);
    const at::Tensor dy = to_kernel_layout(diff_dst, plan);
    const ChannelValues var_v = channel_values(variance, plan, data);
    const ChannelValues gamma_v = channel_values(gamma, plan, data);
    // The kernel centres x on the mean, or (from_output) u on beta, with
    // unit = gamma * rstd (coefficient_kernels.cuh).
    const at::Tensor centre_k = to_kernel_channels(from_output ? beta : OptionalTensor(mean), plan, acc, 0, data);
    at::Tensor unit;
    if (from_output) {
      unit = at::rsqrt(at::add(to_kernel_channels(variance, plan, at::kDouble, 0, data), epsilon));
      if (gamma.has_value()) unit = at::mul(unit, optional_channels(gamma, plan, data));
    }
    // silu's gate needs the forward's coefficients.
    ChannelValues mean_v, beta_v;
    if (checked.kind == act::Kind::silu) {
      mean_v = channel_values(mean, plan, data);
      beta_v = channel_values(beta, plan, data);
    }
    // The pass's dy_scale, x_scale and bias, then silu's forward mean, scale and bias.
    const int64_t vectors = (need_pass ? 3 : 0) + (checked.kind == act::Kind::silu ? 3 : 0);
    const at::Tensor scratch = vectors > 0 ? channel_vectors(plan, data, acc, vectors) : at::Tensor();
    TBG_DISPATCH_DATA_DTYPE(data.scalar_type(), "batch_norm_act_backward_cuda", [&] {
      using A = Acc<scalar_t>;
      const int64_t C = e.channels;
      A* const dy_scale = need_pass ? scratch.mutable_data_ptr<A>() : nullptr;
      A* const fwd_mean =
          checked.kind == act::Kind::silu ? scratch.mutable_data_ptr<A>() + (need_pass ? 3 * C : 0) : nullptr;
      auto args = backward_coefficient_args(centre_k.const_data_ptr<A>(), var_v.in, gamma_v.in, epsilon, C, M,
                                            training, dy_scale, dg.out, db.out);
      args.unit = optional_data(unit);
      scalar_t* dz_out = output_mask[3] ? dz.buffer.mutable_data_ptr<scalar_t>() : nullptr;
      const A slope = static_cast<A>(negative_slope);

      auto run = [&](const auto& ep) {
        Partials<GradSums<double>> partials;  // alive until the kernels are queued
        if (need_sums && M > 0) {
          scalar_t* dst = need_pass ? dx.buffer.mutable_data_ptr<scalar_t>() : nullptr;
          if (persistent_backward<scalar_t>(x, dy, centre_k, dst, e, args, ep)) return;
          partials = grad_sum_partials<scalar_t>(x, dy, centre_k, e, &args, ep);
        }
        if (!partials.finished) backward_coefficients(args);
        if (need_pass) {
          const math::AffineArrays<A> coef{centre_k.const_data_ptr<A>(), dy_scale, dy_scale + C, dy_scale + 2 * C};
          apply_affine<scalar_t, true>(x, dy.const_data_ptr<scalar_t>(), dx.buffer, e, coef, ep);
        }
      };
      act::dispatch_activation(checked.kind, [&](auto activation_type) {
        using Act = decltype(activation_type);
        if constexpr (Act::kGradFromOutput) {
          if constexpr (Act::kKind == act::Kind::identity || Act::kKind == act::Kind::leaky_relu) {
            if (from_output) {
              OutputGateEpilogue<scalar_t, Act, true> ep{};
              ep.dz = dz_out;
              ep.r = data_or_null<scalar_t>(r);
              ep.slope = slope;
              run(ep);
              return;
            }
          }
          OutputGateEpilogue<scalar_t, Act, false> ep{};
          ep.dz = dz_out;
          ep.y = data_or_null<scalar_t>(y);
          ep.slope = slope;
          run(ep);
        } else {
          const math::AffineArrays<A> forward{fwd_mean, nullptr, fwd_mean + C, fwd_mean + 2 * C};
          frozen_forward_coefficients<A>(mean_v.in, var_v.in, gamma_v.in, beta_v.in, epsilon, e.channels, forward);
          InputGateEpilogue<scalar_t, Act> ep{};
          ep.dz = dz_out;
          ep.forward = forward;
          ep.r = data_or_null<scalar_t>(r);
          ep.slope = slope;
          run(ep);
        }
      });
    });
    if (need_pass && output_mask[0]) finish_kernel_output(dx, plan);
    if (need_pass && output_mask[3]) finish_kernel_output(dz, plan);
  }
  const auto param_grad = [&](bool wanted, const ChannelResult& grad) {
    return wanted ? grad.finish(plan, grad_dtype, data) : at::Tensor();
  };
  return act_backward_outputs(output_mask, dx.result, param_grad(output_mask[1], dg), param_grad(output_mask[2], db),
                              dz.result, data, grad_dtype);
}

}  // namespace torch_bn_grad::cuda
