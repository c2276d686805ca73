// The memory plan's conversions (declared in batch_norm_args.h): data tensors
// to and from the kernels' contiguous [outer, channels, inner] layout, and
// per-channel tensors to and from the kernels' float64 vectors. The common
// cases (identity permutation, contiguous vectors) make no views and no
// TensorIterator calls: on small layers those cost more than the copies.
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>

#include <algorithm>
#include <vector>

#include "args/batch_norm_args.h"
#include "cpu/kernels/kernel_table.h"

namespace torch_bn_grad {
namespace {
// Whether t.permute(permutation) would be contiguous, worked out from the
// strides (making the view would cost a sizeable share of a small operator).
bool permuted_contiguous(const at::Tensor& t, const std::vector<int64_t>& permutation) {
  if (t.numel() == 0) return true;
  int64_t expected = 1;
  for (auto d = permutation.rbegin(); d != permutation.rend(); ++d) {
    const int64_t size = t.size(*d);
    if (size == 1) continue;
    if (t.stride(*d) != expected) return false;
    expected *= size;
  }
  return true;
}
}  // namespace

at::Tensor to_kernel_layout(const at::Tensor& t, const ChannelPlan& plan) {
  if (permuted_contiguous(t, plan.permutation)) return t;
  return t.permute(plan.permutation).contiguous();
}

at::Tensor to_kernel_layout(const std::optional<at::Tensor>& t, const ChannelPlan& plan) {
  return t.has_value() ? to_kernel_layout(*t, plan) : at::Tensor();
}

at::Tensor empty_output(c10::IntArrayRef sizes, c10::IntArrayRef strides, const at::Tensor& like,
                        c10::Allocator* allocator) {
  if (allocator == nullptr) return at::empty_strided(sizes, strides, like.options());
  return at::detail::empty_strided_generic(sizes, strides, allocator, c10::DispatchKeySet(c10::DispatchKey::CPU),
                                           like.scalar_type());
}

KernelOutput make_kernel_output(const at::Tensor& src, const ChannelPlan& plan, c10::Allocator* allocator) {
  KernelOutput out;
  if (allocator == nullptr) {
    out.result = at::empty_like(src);
  } else {
    const auto strides = src.is_non_overlapping_and_dense() ? src.strides().vec()
                                                            : at::infer_dense_strides(src.sizes(), src.strides());
    out.result = empty_output(src.sizes(), strides, src, allocator);
  }
  if (permuted_contiguous(out.result, plan.permutation)) {
    out.buffer = out.result;
    return out;
  }
  out.buffer = at::empty(out.result.permute(plan.permutation).sizes(), src.options());
  return out;
}

void finish_kernel_output(KernelOutput& out, const ChannelPlan& plan) {
  if (out.buffer.is_same(out.result)) return;
  out.result.permute(plan.permutation).copy_(out.buffer);
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

// The CPU operators' per-channel values. The common case, a contiguous
// vector in kernel order, is converted by the CPU kernels' vector loop
// (TensorIterator's set-up costs more than the copy of a few channels).
void load_kernel_channels(const std::optional<at::Tensor>& t, const ChannelPlan& plan, double fill,
                          const at::Tensor& like, double* out) {
  if (!t.has_value()) {
    std::fill_n(out, plan.channels, fill);
    return;
  }
  if (plan.kept_kernel == plan.kept_logical && t->is_contiguous()) {
    cpu::kernel_table().widen_channels(*t, out);
    return;
  }
  const at::Tensor v = to_kernel_channels(t, plan, at::kDouble, fill, like);
  std::copy_n(v.const_data_ptr<double>(), plan.channels, out);
}

// The CUDA operators' per-channel tensors (and the CPU's permuted forms).
at::Tensor to_kernel_channels(const std::optional<at::Tensor>& t, const ChannelPlan& plan,
                              at::ScalarType dtype, double fill, const at::Tensor& like) {
  if (!t.has_value()) return at::full({plan.channels}, fill, like.options().dtype(dtype));
  if (plan.kept_kernel == plan.kept_logical) {
    // The common case, as it is: three dispatcher calls fewer (a small layer's call is mostly host time).
    if (t->dim() == 1 && t->scalar_type() == dtype && t->is_contiguous()) return *t;
    return t->reshape({plan.channels}).to(dtype).contiguous();
  }
  return t->reshape(sizes_of(like, plan.kept_logical))
      .permute(kernel_from_logical(plan))
      .to(dtype)
      .contiguous()
      .view({plan.channels});
}

// Rounded as Tensor.to rounds (once, to the nearest: narrow_channels).
at::Tensor kernel_channels_result(const double* v, const ChannelPlan& plan, at::ScalarType dtype,
                                  const at::Tensor& like) {
  const auto options = at::TensorOptions().dtype(dtype).device(at::kCPU);
  if (plan.kept_kernel != plan.kept_logical) {
    at::Tensor copy = at::empty({plan.channels}, options.dtype(at::kDouble));
    std::copy_n(v, plan.channels, copy.mutable_data_ptr<double>());
    return from_kernel_channels(copy, plan, dtype, like);
  }
  at::Tensor out = at::empty(plan.stats_shape, options);
  cpu::kernel_table().narrow_channels(v, out);
  return out;
}

at::Tensor from_kernel_channels(const at::Tensor& v, const ChannelPlan& plan, at::ScalarType dtype,
                                const at::Tensor& like) {
  if (plan.kept_kernel == plan.kept_logical) {
    if (v.scalar_type() == dtype && v.sizes().equals(plan.stats_shape)) return v;  // contiguous, made by the caller
    return v.reshape(plan.stats_shape).to(dtype).contiguous();
  }
  const auto to_logical = kernel_from_logical(plan);
  std::vector<int64_t> inverse(to_logical.size());
  for (size_t i = 0; i < to_logical.size(); ++i) inverse[to_logical[i]] = static_cast<int64_t>(i);
  return v.view(sizes_of(like, plan.kept_kernel)).permute(inverse).to(dtype).contiguous().reshape(plan.stats_shape);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> act_backward_outputs(
    std::array<bool, 4> output_mask, const at::Tensor& diff_src, const at::Tensor& diff_gamma,
    const at::Tensor& diff_beta, const at::Tensor& diff_residual, const at::Tensor& data,
    at::ScalarType grad_dtype) {
  return {output_mask[0] ? diff_src : at::empty({0}, data.options()),
          output_mask[1] ? diff_gamma : at::empty({0}, data.options().dtype(grad_dtype)),
          output_mask[2] ? diff_beta : at::empty({0}, data.options().dtype(grad_dtype)),
          output_mask[3] ? diff_residual : at::empty({0}, data.options())};
}

}  // namespace torch_bn_grad
