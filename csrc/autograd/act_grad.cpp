#include "autograd/act_grad.h"

#include "autograd/channel_algebra.h"

namespace torch_bn_grad {

at::Tensor times_act_grad(const at::Tensor& dy, const ActArgs& a, const at::Tensor& x, const at::Tensor& y,
                          const at::Tensor& r, const at::Tensor& m, const at::Tensor& v, const at::Tensor& g,
                          const at::Tensor& b) {
  if (a.activation == "identity") return dy;
  if (a.activation == "relu") return dy * y.detach().gt(0);
  if (a.activation == "leaky_relu") return at::where(y.detach().gt(0), dy, dy * a.slope);
  TORCH_CHECK(a.activation == "silu", "batch_norm_act: no derivative formula for activation ", a.activation);
  const auto acc = accumulation_dtype(x);
  at::Tensor scale = (v.to(acc) + a.epsilon).rsqrt();
  if (g.defined()) scale = scale * g.to(acc);
  at::Tensor z = (x.to(acc) - broadcastable(m.to(acc), x, a.data_format)) * broadcastable(scale, x, a.data_format);
  if (b.defined()) z = z + broadcastable(b.to(acc), x, a.data_format);
  if (r.defined()) z = z + r.to(acc);
  const at::Tensor s = z.sigmoid();
  return (dy.to(acc) * (s * (1 + z * (1 - s)))).to(dy.scalar_type());
}

}  // namespace torch_bn_grad
