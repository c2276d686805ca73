#include "autograd/forward_ad.h"

#include "autograd/channel_algebra.h"

namespace torch_bn_grad {

at::Tensor tangent_of(const std::optional<at::Tensor>& t) {
  // ATen's autograd kernels read level 0: torch.func levels wrap it.
  return t.has_value() && t->defined() ? t->_fw_grad(/*level=*/0) : at::Tensor();
}

bool has_tangent(const std::optional<at::Tensor>& t) { return tangent_of(t).defined(); }

at::Tensor primal_of(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->_fw_primal(/*level=*/0) : at::Tensor();
}

namespace {

// batch_norm_forward_jvp's formulas, over every position (valid undefined) or
// over a masked batch norm's valid positions (`valid`: the mask broadcast
// against src; `count`: their number per channel, a 0-dim tensor). Padded
// positions' values and tangents are never read: t_dst is 0 there.
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_jvp(
    const at::Tensor& src_in, const std::optional<at::Tensor>& gamma_in, const at::Tensor& mean_used,
    const at::Tensor& variance_used, bool training, double epsilon, c10::string_view data_format,
    const at::Tensor& valid, const at::Tensor& count, const std::optional<at::Tensor>& src_t,
    const std::optional<at::Tensor>& gamma_t, const std::optional<at::Tensor>& beta_t,
    const std::optional<at::Tensor>& mean_t, const std::optional<at::Tensor>& variance_t) {
  // The formulas read primals: a tangent may not carry a tangent of its own.
  const at::Tensor x = primal_of(src_in), gamma = primal_of(gamma_in);
  const at::Tensor t_gamma = gamma_t.value_or(at::Tensor());
  const at::Tensor t_beta = beta_t.value_or(at::Tensor()), t_mean = mean_t.value_or(at::Tensor());
  const at::Tensor t_variance = variance_t.value_or(at::Tensor());
  const auto acc = accumulation_dtype(x);
  const auto per_channel = [&](const at::Tensor& stats) { return broadcastable(stats.to(acc), x, data_format); };
  const auto at_valid = [&](const at::Tensor& t) { return valid.defined() && t.defined() ? at::where(valid, t, 0) : t; };
  const at::Tensor centred = at_valid(x.to(acc) - per_channel(mean_used));
  const at::Tensor t_src = at_valid(to_dtype(src_t.value_or(at::Tensor()), acc));
  const at::Tensor rstd = (variance_used.to(acc) + epsilon).rsqrt();
  at::Tensor tm, tv;  // tangents of the statistics used
  if (training) {
    if (t_src.defined()) {
      // A masked batch without valid positions has constant statistics: count 1 keeps them finite.
      const auto mean_of = [&](const at::Tensor& values) {
        const at::Tensor sums = sum_to_stats(values, mean_used, data_format);
        return valid.defined() ? sums / count.clamp_min(1).to(acc)
                               : sums / c10::Scalar(per_channel_count(x, mean_used));
      };
      tm = mean_of(t_src);
      const at::Tensor t_centred = at_valid(t_src - broadcastable(tm, x, data_format));
      tv = mean_of(centred * t_centred) * 2;
    }
  } else {
    tm = to_dtype(t_mean, acc);
    tv = to_dtype(t_variance, acc);
  }
  // t_x_hat = (t_x - t_mean) r - x_hat r^2 t_variance / 2, x_hat = (x - mean) r.
  at::Tensor t_centred = t_src;
  if (tm.defined()) t_centred = plus(t_centred, -broadcastable(tm, x, data_format));
  at::Tensor t_x_hat;
  if (t_centred.defined()) t_x_hat = t_centred * broadcastable(rstd, x, data_format);
  if (tv.defined()) t_x_hat = plus(t_x_hat, centred * broadcastable(rstd.pow(3) * tv * -0.5, x, data_format));
  at::Tensor t_dst;
  if (t_x_hat.defined()) {
    t_dst = gamma.defined() ? t_x_hat * per_channel(gamma) : t_x_hat;
  }
  if (t_gamma.defined()) {
    t_dst = plus(t_dst, centred * broadcastable(rstd * t_gamma.to(acc), x, data_format));
  }
  if (t_beta.defined()) t_dst = plus(t_dst, per_channel(t_beta));
  if (t_dst.defined()) t_dst = at_valid(t_dst.to(x.scalar_type()).expand_as(x));
  return {t_dst, to_dtype(tm, mean_used.scalar_type()), to_dtype(tv, variance_used.scalar_type())};
}

}  // namespace

// mean and variance: the statistics the forward used.
Outputs3 batch_norm_forward_jvp(TBG_PARAMS(batch_norm_forward_jvp)) {
  return forward_jvp(src, gamma, mean, variance, training, epsilon, data_format, at::Tensor(), at::Tensor(), src_t,
                     gamma_t, beta_t, mean_t, variance_t);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_masked_forward_jvp(
    const at::Tensor& src, const at::Tensor& valid, const at::Tensor& count, const std::optional<at::Tensor>& gamma,
    const at::Tensor& mean_used, const at::Tensor& variance_used, bool training, double epsilon,
    const std::optional<at::Tensor>& src_t, const std::optional<at::Tensor>& gamma_t,
    const std::optional<at::Tensor>& beta_t, const std::optional<at::Tensor>& mean_t,
    const std::optional<at::Tensor>& variance_t) {
  return forward_jvp(src, gamma, mean_used, variance_used, training, epsilon, "NCX", valid, count, src_t, gamma_t,
                     beta_t, mean_t, variance_t);
}

void set_tangent(const at::Tensor& output, const at::Tensor& tangent) {
  if (tangent.defined()) output._set_fw_grad(tangent, /*level=*/0, /*is_inplace_op=*/false);
}

}  // namespace torch_bn_grad
