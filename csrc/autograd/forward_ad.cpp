#include "autograd/forward_ad.h"

#include "autograd/channel_algebra.h"

#include <torch/library.h>

namespace torch_bn_grad {

at::Tensor tangent_of(const std::optional<at::Tensor>& t) {
  // ATen's autograd kernels read level 0: torch.func levels wrap it.
  return t.has_value() && t->defined() ? t->_fw_grad(/*level=*/0) : at::Tensor();
}

bool has_tangent(const std::optional<at::Tensor>& t) { return tangent_of(t).defined(); }

at::Tensor primal_of(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->_fw_primal(/*level=*/0) : at::Tensor();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_forward_jvp(
    const at::Tensor& src_in, const std::optional<at::Tensor>& gamma_in, const at::Tensor& mean_used,
    const at::Tensor& variance_used, bool training, double epsilon, c10::string_view data_format,
    const std::optional<at::Tensor>& src_t, const std::optional<at::Tensor>& gamma_t,
    const std::optional<at::Tensor>& beta_t, const std::optional<at::Tensor>& mean_t,
    const std::optional<at::Tensor>& variance_t) {
  // The formulas read primals: a tangent may not carry a tangent of its own.
  const at::Tensor x = primal_of(src_in), gamma = primal_of(gamma_in);
  const at::Tensor t_src = src_t.value_or(at::Tensor()), t_gamma = gamma_t.value_or(at::Tensor());
  const at::Tensor t_beta = beta_t.value_or(at::Tensor()), t_mean = mean_t.value_or(at::Tensor());
  const at::Tensor t_variance = variance_t.value_or(at::Tensor());
  const auto acc = accumulation_dtype(x);
  const auto per_channel = [&](const at::Tensor& stats) { return broadcastable(stats.to(acc), x, data_format); };
  const at::Tensor centred = x.to(acc) - per_channel(mean_used);
  const at::Tensor rstd = (variance_used.to(acc) + epsilon).rsqrt();
  at::Tensor tm, tv;  // tangents of the statistics used
  if (training) {
    if (t_src.defined()) {
      const c10::Scalar count(per_channel_count(x, mean_used));
      tm = sum_to_stats(t_src.to(acc), mean_used, data_format) / count;
      const at::Tensor t_centred = t_src.to(acc) - broadcastable(tm, x, data_format);
      tv = sum_to_stats(centred * t_centred, mean_used, data_format) * 2 / count;
    }
  } else {
    tm = to_dtype(t_mean, acc);
    tv = to_dtype(t_variance, acc);
  }
  // t_x_hat = (t_x - t_mean) r - x_hat r^2 t_variance / 2, x_hat = (x - mean) r.
  at::Tensor t_centred = to_dtype(t_src, acc);
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
  if (t_dst.defined()) t_dst = t_dst.to(x.scalar_type()).expand_as(x);
  return {t_dst, to_dtype(tm, mean_used.scalar_type()), to_dtype(tv, variance_used.scalar_type())};
}

void set_tangent(const at::Tensor& output, const at::Tensor& tangent) {
  if (tangent.defined()) output._set_fw_grad(tangent, /*level=*/0, /*is_inplace_op=*/false);
}

TORCH_LIBRARY_IMPL(torch_bn_grad, CompositeImplicitAutograd, m) {
  m.impl("batch_norm_forward_jvp", &batch_norm_forward_jvp);
}

}  // namespace torch_bn_grad
