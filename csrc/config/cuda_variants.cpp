// The CUDA variants' registry (cuda_variants.h) and its module functions.
#include "config/cuda_variants.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "module_functions.h"

namespace torch_bn_grad {
namespace {

constexpr const char* kNames[] = {
#define TBG_CUDA_VARIANT_NAME(id, name) name,
    TBG_CUDA_VARIANTS(TBG_CUDA_VARIANT_NAME)
#undef TBG_CUDA_VARIANT_NAME
};
constexpr int kCount = static_cast<int>(sizeof(kNames) / sizeof(kNames[0]));
static_assert(kCount <= 32, "cuda_variants: one bit a variant");

// Bit i: variant i on.
std::atomic<uint32_t> on_bits{0};

}  // namespace

bool cuda_variant_on(CudaVariant variant) {
  return (on_bits.load(std::memory_order_relaxed) >> static_cast<int>(variant)) & 1u;
}

std::vector<std::string> cuda_variant_names() { return {std::begin(kNames), std::end(kNames)}; }

std::vector<std::string> cuda_variants_on() {
  std::vector<std::string> names;
  for (int i = 0; i < kCount; ++i)
    if ((on_bits.load(std::memory_order_relaxed) >> i) & 1u) names.emplace_back(kNames[i]);
  return names;
}

void set_cuda_variants(const std::vector<std::string>& names) {
  uint32_t bits = 0;
  for (const auto& name : names) {
    int found = -1;
    for (int i = 0; i < kCount; ++i)
      if (name == kNames[i]) found = i;
    if (found < 0) {
      std::string known;
      for (const char* k : kNames) known += (known.empty() ? "" : ", ") + std::string(k);
      TORCH_CHECK_VALUE(false, "cuda_variants: unknown variant '", name, "'; expected names among: ", known);
    }
    bits |= 1u << found;
  }
  on_bits.store(bits, std::memory_order_relaxed);
}

}  // namespace torch_bn_grad
