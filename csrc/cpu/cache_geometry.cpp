// The caches' effect on the pass order (see cache_geometry.h).
#include "cpu/cache_geometry.h"

#include <unistd.h>

#include <algorithm>

#include "cpu/environment.h"
#include "module_functions.h"

namespace torch_bn_grad::cpu {
namespace {

// The size of one L3 as the C library reports it; 0 when it does not.
int64_t l3_bytes() {
#ifdef _SC_LEVEL3_CACHE_SIZE
  const long bytes = sysconf(_SC_LEVEL3_CACHE_SIZE);
  return bytes > 0 ? static_cast<int64_t>(bytes) : 0;
#else
  return 0;
#endif
}

// Channel runs keep a run's operands in the L2 between its reduction and its
// elementwise pass; the whole-array pass reads them a second time from
// wherever they are, which costs little when they fit in an L3 that a core
// reads at near its L2's speed (an AMD CCD's or a client chip's, 64 MB or
// less) and as much as memory where the L3 is a server mesh's (hundreds of
// MB shared by a socket). Time in runs over the whole-array pass, float32
// backward, 2 threads: on an AMD Zen 5 VM (32 MB L3) 32x256x14x14 (a 19 MB
// pass) 1.2x, 32x128x28x28 (38 MB) level, 32x512x28x28 (154 MB)
// 0.76x-0.85x; on an Intel Xeon VM (480 MB L3) 32x256x14x14 0.80x-0.84x,
// 16x128x28x28 (19 MB) 0.78x-0.80x, 32x128x14x14 (9.6 MB) 0.75x-0.90x,
// 16x256x14x14 (9.6 MB) 0.82x-0.98x. No pass under 8 MB takes the runs (not
// measured: there a 2-core machine's L2s hold most of the operands anyway).
constexpr int64_t kFastL3MaxBytes = int64_t{64} << 20;
constexpr int64_t kMinPassBytes = int64_t{8} << 20;
constexpr int64_t kUnknownMinPassBytes = int64_t{32} << 20;

int64_t min_pass_bytes_for_caches() {
  const int64_t l3 = l3_bytes();
  if (l3 == 0) return kUnknownMinPassBytes;
  return l3 <= kFastL3MaxBytes ? std::max(l3, kMinPassBytes) : kMinPassBytes;
}

}  // namespace

int64_t channel_runs_min_pass_bytes() {
  static const int64_t bytes = megabytes_from_environment("TORCH_BN_GRAD_CHANNEL_RUNS_MB", min_pass_bytes_for_caches());
  return bytes;
}

}  // namespace torch_bn_grad::cpu

int64_t torch_bn_grad::cpu_channel_runs_min_pass_bytes() { return cpu::channel_runs_min_pass_bytes(); }
