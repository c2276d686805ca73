#include "args/masked_layout.h"

#include <ATen/ATen.h>
#include <c10/util/strides.h>

#include <numeric>
#include <vector>

#include "args/batch_norm_args.h"

namespace torch_bn_grad {
namespace {

// (0, 2, ..., rank - 1, 1): src's dims with the channel dim last.
std::vector<int64_t> channels_last_order(int64_t rank) {
  std::vector<int64_t> order{0};
  for (int64_t d = 2; d < rank; ++d) order.push_back(d);
  order.push_back(1);
  return order;
}

bool permutes_rows(const MaskedLayout& layout) { return layout.rows && layout.extent.outer != layout.data.size(0); }

}  // namespace

MaskedLayout masked_layout(const at::Tensor& src) {
  const int64_t n = src.size(0), c = src.size(1);
  const int64_t s = n * c == 0 ? 1 : src.numel() / (n * c);
  if (s == 1) return {src.contiguous(), {n, c, 1}, true};
  if (src.is_contiguous()) return {src, {n, c, s}, false};
  if (src.permute(channels_last_order(src.dim())).is_contiguous()) return {src, {n * s, c, 1}, true};
  return {src.contiguous(), {n, c, s}, false};
}

at::Tensor to_masked_layout(const at::Tensor& t, const MaskedLayout& layout) {
  if (!permutes_rows(layout)) return t.contiguous();
  // The channels-last view made contiguous: t's own data when its strides fit.
  const at::Tensor p = t.permute(channels_last_order(t.dim()));
  return p.is_contiguous() ? t : p.contiguous();
}

at::Tensor masked_output(const at::Tensor& src, const MaskedLayout& layout, c10::Allocator* allocator) {
  // The form's sizes, contiguous, viewed back in src's dim order.
  std::vector<int64_t> order(src.dim());
  std::iota(order.begin(), order.end(), 0);
  if (permutes_rows(layout)) order = channels_last_order(src.dim());
  std::vector<int64_t> sizes, inverse(order.size());
  for (size_t i = 0; i < order.size(); ++i) {
    sizes.push_back(src.size(order[i]));
    inverse[order[i]] = static_cast<int64_t>(i);
  }
  return empty_output(sizes, c10::contiguous_strides(sizes), src, allocator).permute(inverse);
}

}  // namespace torch_bn_grad
