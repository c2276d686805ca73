// The memory plan's conversions (declared in batch_norm_args.h): data tensors
// to and from the kernels' contiguous [outer, channels, inner] layout, and
// per-channel tensors to and from the kernels' float64 vectors. The common
// cases (identity permutation, contiguous vectors) make no views and no
// TensorIterator calls: on small layers those cost more than the copies.
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>

#include <algorithm>
#include <vector>

#include "batch_norm_args.h"

namespace torch_bn_grad {
namespace {
bool is_identity(const std::vector<int64_t>& permutation) {
  for (size_t i = 0; i < permutation.size(); ++i)
    if (permutation[i] != static_cast<int64_t>(i)) return false;
  return true;
}
}  // namespace

// The identity permutation of a contiguous tensor is the tensor itself: no view
// is made (a view costs about a microsecond, a tenth of a small operator).
at::Tensor to_kernel_layout(const at::Tensor& t, const ChannelPlan& plan) {
  if (is_identity(plan.permutation) && t.is_contiguous()) return t;
  return t.permute(plan.permutation).contiguous();
}

KernelOutput make_kernel_output(const at::Tensor& src, const ChannelPlan& plan, c10::Allocator* allocator) {
  KernelOutput out;
  if (allocator == nullptr) {
    out.result = at::empty_like(src);
  } else {
    const auto strides = src.is_non_overlapping_and_dense() ? src.strides().vec()
                                                            : at::infer_dense_strides(src.sizes(), src.strides());
    out.result = at::detail::empty_strided_generic(src.sizes(), strides, allocator, c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                   src.scalar_type());
  }
  if (is_identity(plan.permutation) && out.result.is_contiguous()) {
    out.buffer = out.result;
    return out;
  }
  auto view = out.result.permute(plan.permutation);
  out.buffer = view.is_contiguous() ? view : at::empty(view.sizes(), src.options());
  return out;
}

void finish_kernel_output(KernelOutput& out, const ChannelPlan& plan) {
  if (out.buffer.is_same(out.result)) return;
  auto view = out.result.permute(plan.permutation);
  if (!view.is_same(out.buffer) && view.data_ptr() != out.buffer.data_ptr()) view.copy_(out.buffer);
}

namespace {
std::vector<int64_t> sizes_of(const at::Tensor& like, const std::vector<int64_t>& dims) {
  std::vector<int64_t> s;
  for (int64_t d : dims) s.push_back(like.size(d));
  return s;
}
// Position of each kernel-order kept dim within the logical order.
std::vector<int64_t> kernel_from_logical(const ChannelPlan& plan) {
  std::vector<int64_t> perm;
  for (int64_t d : plan.kept_kernel) {
    perm.push_back(std::find(plan.kept_logical.begin(), plan.kept_logical.end(), d) -
                   plan.kept_logical.begin());
  }
  return perm;
}
}  // namespace

at::Tensor to_kernel_channels(const std::optional<at::Tensor>& t, const ChannelPlan& plan,
                              at::ScalarType dtype, double fill, const at::Tensor& like) {
  if (!t.has_value()) {
    at::Tensor v = at::empty({plan.channels}, like.options().dtype(dtype));
    if (dtype == at::kDouble) std::fill_n(v.mutable_data_ptr<double>(), plan.channels, fill);
    else v.fill_(fill);
    return v;
  }
  if (plan.kept_kernel == plan.kept_logical && t->is_contiguous() && t->is_cpu()) {
    // The common case, a contiguous vector, converted by a plain loop
    // (TensorIterator's set-up costs more than the copy of a few channels).
    if (t->scalar_type() == dtype) return t->dim() == 1 ? *t : t->view({plan.channels});
    if (dtype == at::kDouble) {
      at::Tensor v = at::empty({plan.channels}, like.options().dtype(dtype));
      double* out = v.mutable_data_ptr<double>();
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t->scalar_type(), "to_kernel_channels", [&] {
        const scalar_t* in = t->const_data_ptr<scalar_t>();
        for (int64_t k = 0; k < plan.channels; ++k) out[k] = static_cast<double>(in[k]);
      });
      return v;
    }
  }
  if (plan.kept_kernel == plan.kept_logical) return t->reshape({plan.channels}).to(dtype).contiguous();
  return t->reshape(sizes_of(like, plan.kept_logical))
      .permute(kernel_from_logical(plan))
      .to(dtype)
      .contiguous()
      .view({plan.channels});
}

at::Tensor from_kernel_channels(const at::Tensor& v, const ChannelPlan& plan, at::ScalarType dtype,
                                const at::Tensor& like) {
  if (plan.kept_kernel == plan.kept_logical && v.is_cpu() && v.scalar_type() == at::kDouble && v.is_contiguous()) {
    if (dtype == at::kDouble) return v.view(plan.stats_shape);
    at::Tensor out = at::empty(plan.stats_shape, v.options().dtype(dtype));
    const double* in = v.const_data_ptr<double>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "from_kernel_channels", [&] {
      // c10::convert rounds as Tensor.to does (once, to the nearest).
      scalar_t* dst = out.mutable_data_ptr<scalar_t>();
      for (int64_t k = 0; k < plan.channels; ++k) dst[k] = c10::convert<scalar_t>(in[k]);
    });
    return out;
  }
  if (plan.kept_kernel == plan.kept_logical) return v.reshape(plan.stats_shape).to(dtype).contiguous();
  const auto to_logical = kernel_from_logical(plan);
  std::vector<int64_t> inverse(to_logical.size());
  for (size_t i = 0; i < to_logical.size(); ++i) inverse[to_logical[i]] = static_cast<int64_t>(i);
  return v.view(sizes_of(like, plan.kept_kernel)).permute(inverse).to(dtype).contiguous().reshape(plan.stats_shape);
}

at::ScalarType accumulate_type(at::ScalarType data) {
  return data == at::kDouble ? at::kDouble : at::kFloat;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> act_backward_outputs(
    std::array<bool, 4> output_mask, const at::Tensor& diff_src, const at::Tensor& diff_gamma_k,
    const at::Tensor& diff_beta_k, const at::Tensor& diff_residual, const ChannelPlan& plan,
    const at::Tensor& data, const at::Tensor& mean) {
  const auto stats_dtype = mean.scalar_type();
  return {output_mask[0] ? diff_src : at::empty({0}, data.options()),
          output_mask[1] ? from_kernel_channels(diff_gamma_k, plan, stats_dtype, data) : at::empty({0}, mean.options()),
          output_mask[2] ? from_kernel_channels(diff_beta_k, plan, stats_dtype, data) : at::empty({0}, mean.options()),
          output_mask[3] ? diff_residual : at::empty({0}, data.options())};
}

}  // namespace torch_bn_grad
