// A caching allocator for the large outputs of the CPU operators.
//
// A training loop asks for the same output sizes at every step. A fresh large
// allocation is mapped anew by malloc, and the kernel faults and zeroes every
// page on first touch: that costs as much as the whole batch-norm pass (with
// THP_MEM_ALLOC_ENABLE=1 and the common `defrag=madvise` setting, several
// times more). Output blocks of at least kMinCachedBytes that the caller frees
// are kept, up to a byte limit, and handed to the next output of the same
// rounded size, so steady-state steps write into memory that is already mapped.
//
// Blocks come from c10's CPU allocator (alignment, THP advice and profiler
// accounting unchanged). The cache is thread-safe: autograd may free an output
// on any thread. Limit: TORCH_BN_GRAD_OUTPUT_CACHE_MB at start-up (0 turns the
// cache off), or set_output_cache_limit() at run time.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>

#include <cstdint>

#include "module_functions.h"

namespace torch_bn_grad::cpu {

// The allocator of the CPU operators' outputs. Its counters and limit are
// reached through module_functions.h.
c10::Allocator* output_allocator();

}  // namespace torch_bn_grad::cpu
