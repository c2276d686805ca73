// What the CPU's caches mean for the order of the kernels' passes, decided
// once per process (cache_geometry.cpp). Declared outside the per-ISA
// kernels, which all call the one definition.
#pragma once

#include <cstdint>

namespace torch_bn_grad::cpu {

// The operator whose passes are ordered.
enum class RunPass { kForward, kBackward };

// The smallest pass of `pass`, in bytes of its operands (inputs and output),
// that kernels/partition.h's channel_run_channels takes in channel runs:
// TORCH_BN_GRAD_CHANNEL_RUNS_MB for both if set, else derived from the L3
// (INT64_MAX: never).
int64_t channel_runs_min_pass_bytes(RunPass pass);

}  // namespace torch_bn_grad::cpu
