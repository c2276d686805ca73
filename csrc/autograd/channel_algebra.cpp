#include "autograd/channel_algebra.h"

#include <ATen/TensorSubclassLikeUtils.h>
#include <ATen/core/grad_mode.h>

#include <cstdint>
#include <vector>

#include "dtypes.h"
#include "config/cuda_variants.h"
#include "cpu/kernels/kernel_table.h"

namespace torch_bn_grad {

at::ScalarType accumulation_dtype(const at::Tensor& src) { return accumulation_dtype(src.scalar_type()); }

namespace {

// Whether nothing would record `t`'s cast: no grad mode where it requires
// grad, no forward-mode tangent, no tracing, functorch or Python wrapper,
// no dispatch mode.
bool cast_is_unrecorded(const at::Tensor& t) {
  if (at::isTensorSubclassLike(t)) return false;
  if (t.unsafeGetTensorImpl()->autograd_meta() == nullptr) return true;
  return !(at::GradMode::is_enabled() && t.requires_grad()) && !t._fw_grad(/*level=*/0).defined();
}

// Whether plain_cast may stand in for Tensor::to: a contiguous CPU vector
// of per-channel values whose cast nothing records, between float32 and
// float64, float16 or bfloat16 (pairs whose every value passes float64
// exactly and narrows once, as Tensor::to rounds it).
bool plain_cast_applies(const at::Tensor& t, at::ScalarType dtype) {
  constexpr int64_t kMaxValues = int64_t{1} << 16;
  const auto narrow_or_wide = [](at::ScalarType d) { return is_data_dtype(d) && d != at::kFloat; };
  const at::ScalarType from = t.scalar_type();
  const bool pair = (from == at::kFloat && narrow_or_wide(dtype)) || (dtype == at::kFloat && narrow_or_wide(from));
  return pair && t.is_cpu() && t.layout() == at::kStrided && cast_is_unrecorded(t) &&
         t.is_contiguous() && t.numel() <= kMaxValues;
}

// Tensor::to's values through the CPU operators' own per-channel
// conversions (channel_convert.h), without the dispatcher's copy, whose cost
// per call a half-precision module's backward would pay three or four times
// (gamma, fused: and beta, to float32; the gradients back).
at::Tensor plain_cast(const at::Tensor& t, at::ScalarType dtype) {
  std::vector<double> values(static_cast<size_t>(t.numel()));
  cpu::kernel_table().widen_channels(t, values.data());
  at::Tensor out = at::empty(t.sizes(), t.options().dtype(dtype));
  cpu::kernel_table().narrow_channels(values.data(), out);
  return out;
}

}  // namespace

at::Tensor plus(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined()) return b;
  if (!b.defined()) return a;
  return a + b;
}

at::Tensor to_dtype(const at::Tensor& t, std::optional<at::ScalarType> dtype) {
  if (!t.defined() || !dtype.has_value() || t.scalar_type() == *dtype) return t;
  return plain_cast_applies(t, *dtype) ? plain_cast(t, *dtype) : t.to(*dtype);
}

at::ScalarType backward_param_dtype(const at::Tensor& param, const at::Tensor& mean) {
  if (!param.defined()) return mean.scalar_type();
  if (param.is_cuda() && !cuda_variant_on(CudaVariant::kParamDtypeGrads)) return mean.scalar_type();
  return param.scalar_type();
}

at::Tensor broadcastable(const at::Tensor& stats, const at::Tensor& src, c10::string_view data_format) {
  if (stats.dim() == src.dim() || data_format != "NCX") return stats;  // NXC: channels are the last dim
  std::vector<c10::SymInt> shape(src.dim(), 1);
  shape[1] = stats.sym_numel();
  return stats.reshape_symint(shape);
}

at::Tensor sum_to_stats(const at::Tensor& values, const at::Tensor& stats, c10::string_view data_format) {
  std::vector<int64_t> dims;
  if (stats.dim() == values.dim()) {  // the broadcast form: its 1-dims are reduced
    for (int64_t d = 0; d < values.dim(); ++d)
      if (stats.sym_size(d) == 1) dims.push_back(d);
    return dims.empty() ? values : values.sum(dims, /*keepdim=*/true);
  }
  const int64_t channel_dim = data_format == "NCX" ? 1 : values.dim() - 1;
  for (int64_t d = 0; d < values.dim(); ++d)
    if (d != channel_dim) dims.push_back(d);
  return values.sum(dims);
}

c10::SymInt per_channel_count(const at::Tensor& src, const at::Tensor& stats) {
  return (src.sym_numel() / stats.sym_numel().max(1)).max(1);
}

}  // namespace torch_bn_grad
