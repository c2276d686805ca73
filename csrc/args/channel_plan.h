// How an operator's data becomes the kernels' [outer, channels, inner] array
// (ChannelPlan, batch_norm_args.h): which dims of src are per-channel, and an
// order of its dims in which those form one run. Used by the argument checks.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <vector>

#include "args/batch_norm_args.h"

namespace torch_bn_grad {

// Which dims of src are per-channel (kept), from a reference per-channel tensor
// `ref` (the broadcast form when it has src's rank) or, without one, from
// data_format; sets the per-channel tensors' shape. ValueError naming `ref_name`
// when ref fits neither form.
std::vector<bool> kept_dims(const char* op, const at::Tensor& src, const at::Tensor* ref,
                            const char* ref_name, c10::string_view data_format,
                            std::vector<int64_t>& stats_shape);

// The plan for `kept`: src's non-unit dims ordered so that the kept ones form one
// run, in src's memory order where it allows (the kernels then read the storage as it is).
ChannelPlan build_plan(const at::Tensor& src, const std::vector<bool>& kept, std::vector<int64_t> stats_shape);

}  // namespace torch_bn_grad
