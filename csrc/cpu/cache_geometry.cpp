// The caches' effect on the pass order (see cache_geometry.h).
#include "cpu/cache_geometry.h"

#if __has_include(<unistd.h>)
#include <unistd.h>
#endif

#include <algorithm>
#include <fstream>
#include <limits>
#include <string>

#include "cpu/environment.h"
#include "module_functions.h"

namespace torch_bn_grad::cpu {
namespace {

// The size of the L3 that CPU 0 shares, as Linux describes it
// (/sys/devices/system/cpu/cpu0/cache/index*/: the cache topology the
// kernel read from CPUID); 0 when there is no such description.
int64_t l3_bytes_from_sysfs() {
  const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index";
  for (int i = 0; i < 8; ++i) {
    std::ifstream level_file(dir + std::to_string(i) + "/level");
    int level = 0;
    if (!(level_file >> level)) break;
    if (level != 3) continue;
    std::ifstream size_file(dir + std::to_string(i) + "/size");
    int64_t size = 0;
    std::string unit;
    if (!(size_file >> size) || size <= 0) return 0;
    size_file >> unit;  // "K" (what Linux writes), "M", or none
    if (unit == "K") return size << 10;
    if (unit == "M") return size << 20;
    return unit.empty() ? size : 0;
  }
  return 0;
}

// The size of one L3: Linux's description of CPU 0's, else the C library's
// figure; 0 when neither is known. The C library can report the whole
// package's L3 instead of the part a core shares: 320 MB on an AMD EPYC VM
// (Zen 4) whose cores share a CCD's 32 MB, which made it a server mesh's.
int64_t l3_bytes() {
  if (const int64_t bytes = l3_bytes_from_sysfs(); bytes > 0) return bytes;
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
// * AMD Zen 4 VM (a CCD's 32 MB L3, the C library says 320 MB), two sets of
//   two processes each way: backward 32x256x14x14 1.10x / 1.15x, forward
//   32x1024x14x14 1.05x / 1.12x.
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

// The L3's kind where the vendor decides it whatever its size: an Intel
// core with AVX512 is a Xeon Scalable's (Skylake-SP onwards; the few client
// chips with AVX512 have a ring instead), a mesh; an AMD core's L3 is its
// CCD's, which it reads fast, even at 96 MB (3D V-Cache). The size alone took
// Cascade Lake's 35.8 MB for a fast one.
enum class L3Kind { kBySize, kMesh, kFast };
L3Kind l3_kind_of_vendor() {
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (__builtin_cpu_is("intel") && __builtin_cpu_supports("avx512f")) return L3Kind::kMesh;
  if (__builtin_cpu_is("amd")) return L3Kind::kFast;
#endif
  return L3Kind::kBySize;
}
constexpr int64_t kMinPassBytes = int64_t{8} << 20;
constexpr int64_t kUnknownBackwardMinPassBytes = int64_t{32} << 20;
constexpr int64_t kNever = std::numeric_limits<int64_t>::max();

int64_t min_pass_bytes_for_caches(RunPass pass) {
  const int64_t l3 = l3_bytes();
  const bool forward = pass == RunPass::kForward;
  if (l3 == 0) return forward ? kNever : kUnknownBackwardMinPassBytes;
  const L3Kind kind = l3_kind_of_vendor();
  if (kind == L3Kind::kMesh || (kind == L3Kind::kBySize && l3 > kFastL3MaxBytes)) return kMinPassBytes;
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
