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

// The layout of the fused forward's sign bits of dst (cpu/kernels/sign_bits.h):
// the kernel's element order cut into lines (a plane row of `inner`
// elements, or a row of `channels` when inner == 1), each line starting on a
// byte, so that threads writing different lines never share a byte. A line's
// bits past its end are padding (zero).
struct SignBitsLines {
  int64_t line;    // elements of a line
  int64_t padded;  // bits a line takes, a multiple of 8
  int64_t lines;

  explicit constexpr SignBitsLines(const Extent& e)
      : line(e.inner > 1 ? e.inner : e.channels),
        padded(ceil_div(line, 8) * 8),
        lines(line > 0 ? e.outer * e.channels * e.inner / line : 0) {}
  constexpr int64_t bytes() const { return lines * padded / 8; }
};

}  // namespace torch_bn_grad
