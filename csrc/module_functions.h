// What the Python module `torch_bn_grad._C` exposes besides the operators
// (python_module.cpp): process-wide state of the backends, declared here without any
// backend's headers. The definitions live with the backend they describe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace torch_bn_grad {

// Which compiled copy of the CPU kernels runs: "DEFAULT", "AVX2" or "AVX512"
// (cpu/kernel_table.cpp).
const char* cpu_kernel_isa();
// The compiled copies of the CPU kernels, comma-separated, DEFAULT first.
const char* compiled_cpu_kernel_isas();

// The smallest forward and backward passes (bytes of their operands) the CPU
// kernels run in channel runs (cpu/cache_geometry.h); INT64_MAX: never.
struct ChannelRunThresholds {
  int64_t forward_bytes;
  int64_t backward_bytes;
};
ChannelRunThresholds cpu_channel_runs_min_pass_bytes();

// The CPU output cache (cpu/output_cache.h) and its counters.
struct OutputCacheStats {
  int64_t limit_bytes;   // most idle bytes kept
  int64_t idle_bytes;    // freed blocks waiting for reuse
  int64_t idle_blocks;
  int64_t hits;          // outputs served from an idle block
  int64_t misses;        // cacheable outputs that needed a new block
};

OutputCacheStats output_cache_stats();
// Frees idle blocks beyond the new limit.
void set_output_cache_limit(int64_t bytes);
// Frees every idle block (blocks in use are unaffected).
void empty_output_cache();

// The CUDA variants (config/cuda_variants.h): every name, those on, and the
// set on (replacing the previous one; an unknown name raises c10::ValueError
// and changes nothing).
std::vector<std::string> cuda_variant_names();
std::vector<std::string> cuda_variants_on();
void set_cuda_variants(const std::vector<std::string>& names);

// Makes the Autograd kernel of operator `op_name` (of this library) skip
// autograd in C++ when a call records nothing, and otherwise call the Python
// callable `record` with the operator's arguments (python_autograd.cpp). The
// caller holds the GIL. (`_object` is Python.h's PyObject, left undeclared.)
void register_python_autograd(const std::string& op_name, struct _object* record);

}  // namespace torch_bn_grad
