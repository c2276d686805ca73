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

namespace torch_bn_grad::cpu {

struct OutputCacheStats {
  int64_t limit_bytes;   // most idle bytes kept
  int64_t idle_bytes;    // freed blocks waiting for reuse
  int64_t idle_blocks;
  int64_t hits;          // outputs served from an idle block
  int64_t misses;        // cacheable outputs that needed a new block
};

// The allocator of the CPU operators' outputs.
c10::Allocator* output_allocator();

OutputCacheStats output_cache_stats();
// Frees idle blocks beyond the new limit.
void set_output_cache_limit(int64_t bytes);
// Frees every idle block (blocks in use are unaffected).
void empty_output_cache();

}  // namespace torch_bn_grad::cpu
