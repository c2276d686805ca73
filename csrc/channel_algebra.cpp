#include "channel_algebra.h"

#include <vector>

namespace torch_bn_grad {

at::ScalarType accumulation_dtype(const at::Tensor& src) {
  const auto t = src.scalar_type();
  return (t == at::kHalf || t == at::kBFloat16) ? at::kFloat : t;
}

at::Tensor to_dtype(const at::Tensor& t, std::optional<at::ScalarType> dtype) {
  return (t.defined() && dtype.has_value() && t.scalar_type() != *dtype) ? t.to(*dtype) : t;
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
