// Zeroed block counters for the last_block_coefficients variant
// (last_block.cuh), one allocation per device and stream, kept for the
// process: the kernels leave their counters zeroed, so a call needs neither
// an allocation nor a fill. Streams run their kernels in order, so kernels
// of one stream share its counters; those of two streams never do.
#pragma once

#include <cstdint>

namespace torch_bn_grad::cuda {

// The most counters a kernel takes (gridDim.x); larger grids take the
// coefficient kernel.
constexpr int64_t kMaxStreamCounters = 1 << 16;

// `count` zeroed counters on the current device and stream, or null where
// there are none to give: more than kMaxStreamCounters, or a stream being
// captured into a CUDA graph (a graph would keep the pointer past the
// workspace's reallocation, and allocating would break the capture), where
// the caller takes the default path.
unsigned* stream_counters(int64_t count);

}  // namespace torch_bn_grad::cuda
