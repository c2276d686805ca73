// How the masked operators see their data: src (N, C, *X) as a contiguous
// [outer, channels, inner] array in one of two forms, and the mask (N, *X) as
// a contiguous [outer, inner] array in the same element order.
// * planes: NCX data (contiguous): [N, C, S], S = prod(X) > 1;
// * rows: channels-last data (channel dim innermost, the others in order, as
//   a channels_last tensor or an (N, L, C) tensor transposed to (N, C, L)),
//   and any data with S == 1: [N * S, C, 1].
// Other strides are copied into the planes form.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>

#include "math/extent.h"

namespace torch_bn_grad {

struct MaskedLayout {
  at::Tensor data;  // src's data in the chosen form (src itself when its strides fit)
  Extent extent;
  bool rows;
};

MaskedLayout masked_layout(const at::Tensor& src);
// A tensor of src's shape (diff_dst) with its data in `layout`'s form.
at::Tensor to_masked_layout(const at::Tensor& t, const MaskedLayout& layout);
// An uninitialized output of src's shape whose data is in `layout`'s form
// (so it keeps src's memory format where src's strides fit); its memory from
// `allocator` (a CPU allocator: the operators' output cache) when given.
at::Tensor masked_output(const at::Tensor& src, const MaskedLayout& layout, c10::Allocator* allocator = nullptr);

}  // namespace torch_bn_grad
