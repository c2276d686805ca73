// Settings from the environment (see environment.h).
#include "cpu/environment.h"

#include <c10/util/Exception.h>

#include <cstdlib>

namespace torch_bn_grad::cpu {

int64_t megabytes_from_environment(const char* name, int64_t fallback) {
  const char* mb = std::getenv(name);
  if (mb == nullptr || *mb == '\0') return fallback;
  char* end = nullptr;
  const long long value = std::strtoll(mb, &end, 10);
  TORCH_CHECK_VALUE(end != mb && *end == '\0' && value >= 0, name,
                    ": expected a non-negative integer (megabytes), got '", mb, "'");
  return static_cast<int64_t>(value) << 20;
}

}  // namespace torch_bn_grad::cpu
