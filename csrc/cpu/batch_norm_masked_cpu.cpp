// CPU masked operators (batch_norm_masked_forward / _backward, and the fused
// batch_norm_masked_act_forward / _backward): check, lay
// the data out (masked_layout.h), find the valid positions once, then the
// masked kernels (cpu/kernels/batch_norm_masked_kernels.cpp), handing them the
// per-channel formulas of batch_norm_math.h in float64 as their finish.
#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "dtypes.h"
#include "args/batch_norm_args.h"
#include "args/masked_layout.h"
#include "cpu/kernels/masked_kernel_table.h"
#include "cpu/output_cache.h"
#include "library/signatures.h"
#include "math/batch_norm_math.h"

namespace torch_bn_grad::cpu {

namespace {

// The valid positions of a mask laid out as `layout` reads it: their count
// per channel, the first one, and (planes form) the runs along each plane.
struct ValidPositions {
  at::Tensor mask;  // contiguous bool, [outer, inner]
  std::vector<int64_t> run_offsets;
  std::vector<int64_t> runs;
  int64_t count = 0;
  int64_t first_outer = 0;
  int64_t first_inner = 0;

  MaskedView view(const MaskedLayout& layout) const {
    return {layout.extent,  mask.const_data_ptr<bool>(), run_offsets.data(), runs.data(), layout.rows, count,
            first_outer, first_inner};
  }
};

ValidPositions valid_positions(const at::Tensor& mask, const MaskedLayout& layout) {
  ValidPositions p;
  p.mask = mask.contiguous();
  const bool* m = p.mask.const_data_ptr<bool>();
  const Extent& e = layout.extent;
  bool found = false;
  if (layout.rows) {
    for (int64_t o = 0; o < e.outer; ++o) {
      if (!m[o]) continue;
      if (!found) p.first_outer = o;
      found = true;
      ++p.count;
    }
    return p;
  }
  p.run_offsets.reserve(e.outer + 1);
  p.run_offsets.push_back(0);
  for (int64_t o = 0; o < e.outer; ++o) {
    const bool* row = m + o * e.inner;
    for (int64_t i = 0; i < e.inner;) {
      if (!row[i]) {
        ++i;
        continue;
      }
      const int64_t begin = i;
      while (i < e.inner && row[i]) ++i;
      p.runs.push_back(begin);
      p.runs.push_back(i);
      p.count += i - begin;
      if (!found) {
        p.first_outer = o;
        p.first_inner = begin;
        found = true;
      }
    }
    p.run_offsets.push_back(static_cast<int64_t>(p.runs.size() / 2));
  }
  return p;
}

// A per-channel tensor as float64 values (`fill` when absent).
std::vector<double> channel_values(const std::optional<at::Tensor>& t, const ChannelPlan& plan, double fill,
                                   const at::Tensor& like) {
  std::vector<double> v(plan.channels);
  load_kernel_channels(t, plan, fill, like, v.data());
  return v;
}

at::Tensor count_tensor(int64_t count) { return at::scalar_tensor(static_cast<double>(count), at::kDouble); }

// A channel's forward coefficients (scale, shift about its mean) from float64 values.
struct ForwardChannels {
  std::vector<double> mean, variance, gamma, beta;
  double epsilon;
  MaskedChannelAffine operator()(int64_t c) const {
    const auto f = math::forward_coefficients(variance[c], gamma[c], beta[c], epsilon);
    return {mean[c], {0.0, f.scale, f.shift}};
  }
};

using ForwardResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Both forward operators: batch norm over the valid positions, then `act`'s
// epilogue (residual, activation) in the same pass.
ForwardResult masked_forward(const ChannelPlan& plan, const at::Tensor& src, const at::Tensor& mask,
                             const std::optional<at::Tensor>& gamma, const std::optional<at::Tensor>& beta,
                             const std::optional<at::Tensor>& mean, const std::optional<at::Tensor>& variance,
                             double epsilon, const std::optional<at::Tensor>& residual, act::Kind kind,
                             double negative_slope) {
  const MaskedLayout layout = masked_layout(src);
  const ValidPositions valid = valid_positions(mask, layout);
  const MaskedView v = valid.view(layout);
  const bool frozen = mean.has_value();
  const auto stats_dtype = frozen ? mean->scalar_type() : accumulation_dtype(src.scalar_type());
  const MaskedAct act{residual.has_value() ? to_masked_layout(*residual, layout) : at::Tensor(), kind,
                      negative_slope};

  // Frozen: the given statistics; batch statistics: filled in by the kernels' finish.
  ForwardChannels k{channel_values(mean, plan, 0.0, src), channel_values(variance, plan, 0.0, src),
                    channel_values(gamma, plan, 1.0, src), channel_values(beta, plan, 0.0, src), epsilon};
  at::Tensor dst = masked_output(src, layout, output_allocator());
  if (!frozen && valid.count > 0) {
    masked_kernel_table().forward(layout.data, dst, v, [&](int64_t c, const math::Moments<double>& m) {
      k.mean[c] = m.mean;
      k.variance[c] = math::variance_of(m);
      return k(c);
    }, act);
  } else if (src.numel() > 0) {
    masked_kernel_table().forward_affine(layout.data, dst, v, k, act);
  }
  if (frozen) return {dst, mean->clone(), variance->clone(), count_tensor(valid.count)};
  return {dst, kernel_channels_result(k.mean.data(), plan, stats_dtype, src),
          kernel_channels_result(k.variance.data(), plan, stats_dtype, src), count_tensor(valid.count)};
}

// Both backward operators past their gate: the sums of dy (in `layout`'s
// form, src's) over the valid positions and the pass into diff_src.
std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_backward(
    const ChannelPlan& plan, const at::Tensor& src, const MaskedLayout& layout, const ValidPositions& valid,
    const at::Tensor& dy,
    const at::Tensor& mean, const at::Tensor& variance, const std::optional<at::Tensor>& gamma, double epsilon,
    bool training, std::array<bool, 3> output_mask, at::ScalarType grad_dtype) {
  const int64_t C = plan.channels;
  const MaskedView v = valid.view(layout);
  const std::vector<double> mean_d = channel_values(mean, plan, 0.0, src),
                            var_d = channel_values(variance, plan, 0.0, src),
                            gamma_d = channel_values(gamma, plan, 1.0, src);

  std::vector<double> diff_gamma(C), diff_beta(C);
  const double count = static_cast<double>(valid.count);
  // A channel's parameter gradients (kept) and its pass's coefficients.
  auto finish = [&](int64_t c, const math::GradSums<double>& sums) -> MaskedChannelAffine {
    const double rstd = math::rstd_of(var_d[c], epsilon);
    const auto p = math::parameter_grads(rstd, sums);
    diff_gamma[c] = p.diff_gamma;
    diff_beta[c] = p.diff_beta;
    return {mean_d[c], math::backward_coefficients(rstd, gamma_d[c], sums, count, training)};
  };
  at::Tensor diff_src = output_mask[0] ? masked_output(src, layout, output_allocator()) : at::Tensor();
  const bool needs_sums = output_mask[1] || output_mask[2] || (training && output_mask[0]);
  if (needs_sums && valid.count > 0) {
    masked_kernel_table().backward(layout.data, dy, diff_src, v, mean_d.data(), finish);
  } else {
    std::vector<MaskedChannelAffine> k(C);
    for (int64_t c = 0; c < C; ++c) k[c] = finish(c, math::GradSums<double>{0.0, 0.0});
    if (output_mask[0] && src.numel() > 0) {
      masked_kernel_table().backward_affine(layout.data, dy, diff_src, v, [&](int64_t c) { return k[c]; });
    }
  }
  return {output_mask[0] ? diff_src : at::empty({0}, src.options()),
          output_mask[1] ? kernel_channels_result(diff_gamma.data(), plan, grad_dtype, src)
                         : at::empty({0}, mean.options().dtype(grad_dtype)),
          output_mask[2] ? kernel_channels_result(diff_beta.data(), plan, grad_dtype, src)
                         : at::empty({0}, mean.options().dtype(grad_dtype))};
}

}  // namespace

Outputs4 batch_norm_masked_forward_cpu(TBG_PARAMS(batch_norm_masked_forward)) {
  const ChannelPlan plan = check_masked_forward_args(src, mask, gamma, beta, mean, variance, epsilon);
  return masked_forward(plan, src, mask, gamma, beta, mean, variance, epsilon, std::nullopt, act::Kind::identity,
                        0.0);
}

Outputs4 batch_norm_masked_act_forward_cpu(TBG_PARAMS(batch_norm_masked_act_forward)) {
  const ActPlan p = check_masked_act_forward_args(src, mask, gamma, beta, mean, variance, residual, epsilon,
                                                  activation, negative_slope);
  return masked_forward(p.plan, src, mask, gamma, beta, mean, variance, epsilon, residual, p.kind, negative_slope);
}

Outputs3 batch_norm_masked_backward_cpu(TBG_PARAMS(batch_norm_masked_backward)) {
  const ChannelPlan plan = check_masked_backward_args(src, mask, diff_dst, mean, variance, gamma, epsilon);
  const MaskedLayout layout = masked_layout(src);
  const ValidPositions valid = valid_positions(mask, layout);
  return masked_backward(plan, src, layout, valid, to_masked_layout(diff_dst, layout), mean, variance, gamma, epsilon,
                         training, output_mask, param_grad_dtype(mean, gamma));
}

// The fused backward: dz = diff_dst * act'(z) at valid positions, 0 at padded
// ones (which is also diff_residual), then the plain backward on dz.
Outputs4 batch_norm_masked_act_backward_cpu(TBG_PARAMS(batch_norm_masked_act_backward)) {
  const ActPlan p = check_masked_act_backward_args(src, mask, dst, residual, diff_dst, mean, variance, gamma, beta,
                                                   epsilon, activation, negative_slope);
  const MaskedLayout layout = masked_layout(src);
  const ValidPositions valid = valid_positions(mask, layout);
  const bool from_output = p.kind != act::Kind::silu;
  const MaskedAct act{!from_output && residual.has_value() ? to_masked_layout(*residual, layout) : at::Tensor(),
                      p.kind, negative_slope};
  at::Tensor dz = masked_output(src, layout, output_allocator());
  if (src.numel() > 0) {
    const ForwardChannels k{channel_values(mean, p.plan, 0.0, src), channel_values(variance, p.plan, 0.0, src),
                            channel_values(gamma, p.plan, 1.0, src), channel_values(beta, p.plan, 0.0, src),
                            epsilon};
    const at::Tensor y = from_output && dst.has_value() ? to_masked_layout(*dst, layout) : at::Tensor();
    masked_kernel_table().gate(layout.data, y, to_masked_layout(diff_dst, layout), dz, valid.view(layout),
                               k, act);
  }
  auto [diff_src, diff_gamma, diff_beta] = masked_backward(
      p.plan, src, layout, valid, dz, mean, variance, gamma, epsilon, training,
      {output_mask[0], output_mask[1], output_mask[2]}, param_grad_dtype(mean, gamma, beta));
  return {diff_src, diff_gamma, diff_beta, output_mask[3] ? dz : at::empty({0}, src.options())};
}

}  // namespace torch_bn_grad::cpu
