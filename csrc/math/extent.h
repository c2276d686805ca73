// The shape every kernel sees: a contiguous [outer, channels, inner] array
// (see ChannelPlan in batch_norm_args.h), and the one integer helper that
// partitioning it needs. Plain C++, included by the CPU and the CUDA code.
#pragma once

#include <cstdint>

namespace torch_bn_grad {

struct Extent {
  int64_t outer;
  int64_t channels;
  int64_t inner;

  // Elements per channel, the count of each channel's statistics.
  constexpr int64_t reduced() const { return outer * inner; }
};

// ceil(a / b) for a >= 0, b > 0.
constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Bytes of the fused forward's sign bits of dst (cpu/kernels/sign_bits.h):
// one bit an element, in the kernel's element order, eight to a byte.
constexpr int64_t sign_bits_bytes(const Extent& e) { return ceil_div(e.outer * e.channels * e.inner, 8); }

}  // namespace torch_bn_grad
