// The caches' effect on the pass order (see cache_geometry.h).
#include "cpu/cache_geometry.h"

#if __has_include(<unistd.h>)
#include <unistd.h>
#endif

#include <algorithm>
#include <limits>

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

// Channel runs keep a run's inputs in the L2 between its reduction and its
// elementwise pass; the whole-array pass in memory order reads them a second
// time from wherever they are. That costs little where they fit in an L3 that
// a core reads at near its L2's speed (an AMD CCD's or a client chip's, 64 MB
// or less), and as much as memory where the L3 is a server mesh's (tens to
// hundreds of MB shared by a socket); from memory, the memory-order pass
// streams better than the runs' rows of a few planes.
//
// Time in runs over the whole-array pass, 2 threads, float32 unless named:
// * AMD Zen 5 VM (32 MB L3): backward 32x256x14x14 (a 19 MB pass) 1.2x,
//   32x128x28x28 (38 MB) level, 32x512x28x28 (154 MB) 0.76x-0.85x; forward
//   32x1024x14x14 (51 MB) 1.15x.
// * Intel Xeon VM (480 MB L3): backward 32x256x14x14 0.80x-0.84x,
//   16x128x28x28 (19 MB) 0.78x-0.80x, 32x128x14x14 (9.6 MB) 0.75x-0.90x,
//   16x256x14x14 (9.6 MB) 0.82x-0.98x; forward 32x1024x14x14 0.83x-0.87x,
//   32x128x28x28 (25 MB) 0.80x-0.83x, 32x256x14x14 (13 MB) 0.85x-0.98x,
//   bfloat16 32x1024x14x14 0.91x-0.93x, 32x128x28x28 0.84x-0.90x, but
//   16x512x14x14 (6.4 MB) 1.13x-1.24x.
// * Intel Xeon VM of another kind (Cascade Lake, 35.8 MB L3, a mesh's
//   too), two sets of four rounds, each a process with the runs and one
//   without: backward 16x128x28x28 0.84x / 0.92x, 32x128x14x14 0.89x /
//   0.89x, 32x1024x14x14 0.88x / 0.99x, bfloat16 32x128x28x28 0.76x /
//   0.90x; forward 16x128x28x28 0.86x / 0.86x, 32x1024x14x14 0.83x /
//   0.86x, 32x128x28x28 0.89x / 0.88x, bfloat16 32x128x28x28 0.94x /
//   0.71x; 32x256x14x14 level (0.82x-1.09x, float32 and bfloat16).
// No pass under 8 MB takes the runs: there a 2-core machine's L2s hold much
// of the operands for either order.
constexpr int64_t kFastL3MaxBytes = int64_t{64} << 20;

// Whether the L3 is a server mesh's whatever its size: an Intel core with
// AVX512 is a Xeon Scalable's (Skylake-SP onwards; the few client chips
// with AVX512 have a ring instead). The size alone took Cascade Lake's
// 35.8 MB for a fast one.
bool intel_with_avx512() {
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  return __builtin_cpu_is("intel") && __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}
constexpr int64_t kMinPassBytes = int64_t{8} << 20;
constexpr int64_t kUnknownBackwardMinPassBytes = int64_t{32} << 20;
constexpr int64_t kNever = std::numeric_limits<int64_t>::max();

int64_t min_pass_bytes_for_caches(RunPass pass) {
  const int64_t l3 = l3_bytes();
  const bool forward = pass == RunPass::kForward;
  if (l3 == 0) return forward ? kNever : kUnknownBackwardMinPassBytes;
  if (l3 > kFastL3MaxBytes || intel_with_avx512()) return kMinPassBytes;  // a mesh's
  return forward ? kNever : std::max(l3, kMinPassBytes);
}

int64_t from_environment_or_caches(RunPass pass) {
  return megabytes_from_environment("TORCH_BN_GRAD_CHANNEL_RUNS_MB", min_pass_bytes_for_caches(pass));
}

}  // namespace

int64_t channel_runs_min_pass_bytes(RunPass pass) {
  static const int64_t forward = from_environment_or_caches(RunPass::kForward);
  static const int64_t backward = from_environment_or_caches(RunPass::kBackward);
  return pass == RunPass::kForward ? forward : backward;
}

}  // namespace torch_bn_grad::cpu

torch_bn_grad::ChannelRunThresholds torch_bn_grad::cpu_channel_runs_min_pass_bytes() {
  return {cpu::channel_runs_min_pass_bytes(cpu::RunPass::kForward),
          cpu::channel_runs_min_pass_bytes(cpu::RunPass::kBackward)};
}
