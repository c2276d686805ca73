// Settings the CPU operators read from the environment, once, at first use.
#pragma once

#include <cstdint>

namespace torch_bn_grad::cpu {

// The variable `name` as a non-negative whole number of megabytes, in bytes;
// `fallback` when it is unset or empty. Any other value is a ValueError that
// names the variable and what it holds.
int64_t megabytes_from_environment(const char* name, int64_t fallback);

}  // namespace torch_bn_grad::cpu
