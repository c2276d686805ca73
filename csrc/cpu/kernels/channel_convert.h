// The CPU operators' per-channel tensors to and from the kernels' float64
// vectors (channel_layout.cpp's fast paths), a vector of channels at a time.
// Compiled for the baseline ISA there, a scalar float32 loop converts two
// channels an instruction through a store and reload on the stack: on a
// 2x4096 float32 backward its three loads are a sixth of the operator's time
// (perf, 1 thread), which these vector loops avoid.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/TypeCast.h>

#include <algorithm>
#include <cstdint>

#include "dtypes.h"
#include "cpu/kernels/channel_finish.h"

namespace torch_bn_grad::cpu {
namespace CPU_CAPABILITY {
namespace {  // internal linkage: see vec_io.h

// out[k] = t[k] for a contiguous vector of any floating dtype (every value
// exact in float64).
void widen_channels(const at::Tensor& t, double* out) {
  const int64_t n = t.numel();
  if (t.scalar_type() == at::kFloat) {
    const float* in = t.const_data_ptr<float>();
    int64_t k = 0;
    for (; k + kLanes <= n; k += kLanes) NarrowedLanes(in + k).widened().store(out + k);
    for (; k < n; ++k) out[k] = static_cast<double>(in[k]);
    return;
  }
  TBG_DISPATCH_DATA_DTYPE(t.scalar_type(), "widen_channels", [&] {
    const scalar_t* in = t.const_data_ptr<scalar_t>();
    for (int64_t k = 0; k < n; ++k) out[k] = static_cast<double>(in[k]);
  });
}

// out[k] = v[k] rounded once, to the nearest, to out's dtype (c10::convert,
// as Tensor.to rounds), out a contiguous vector of any floating dtype.
void narrow_channels(const double* v, const at::Tensor& out) {
  const int64_t n = out.numel();
  if (out.scalar_type() == at::kFloat) {
    float* dst = out.mutable_data_ptr<float>();
    int64_t k = 0;
    for (; k + kLanes <= n; k += kLanes) NarrowedLanes(VecD::loadu(v + k)).store(dst + k);
    for (; k < n; ++k) dst[k] = c10::convert<float>(v[k]);
    return;
  }
  TBG_DISPATCH_DATA_DTYPE(out.scalar_type(), "narrow_channels", [&] {
    scalar_t* dst = out.mutable_data_ptr<scalar_t>();
    for (int64_t k = 0; k < n; ++k) dst[k] = c10::convert<scalar_t>(v[k]);
  });
}

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace torch_bn_grad::cpu
