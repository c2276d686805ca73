// The running statistics' buffers after an update below autograd.
#pragma once

#include <torch/csrc/autograd/variable.h>

#include "library/operators.h"

namespace torch_bn_grad {

// In-place ops bump their outputs' version counters (a graph that saved them
// then refuses to run backward): the running statistics' buffers, after an
// update below autograd.
inline void bump_versions(const OptionalTensor& running_mean, const OptionalTensor& running_var) {
  if (running_mean.has_value()) torch::autograd::impl::bump_version(*running_mean);
  if (running_var.has_value()) torch::autograd::impl::bump_version(*running_var);
}

}  // namespace torch_bn_grad
