// Picks the kernels compiled for the running CPU, once.
#include "cpu/kernels/kernel_table.h"
#include "cpu/kernels/act_kernel_table.h"

#include <string>

#include <ATen/Version.h>

#include "module_functions.h"

namespace torch_bn_grad::cpu {

const KernelTable& kernel_table() {
  static const KernelTable& table = []() -> const KernelTable& {
#if defined(__x86_64__) || defined(_M_X64)
    // Honours ATEN_CPU_CAPABILITY, like ATen's own kernels.
    const std::string capability = at::get_cpu_capability();
    if (capability == "AVX512") return kernel_table_AVX512();
    if (capability == "AVX2") return kernel_table_AVX2();
#endif
    return kernel_table_DEFAULT();
  }();
  return table;
}

}  // namespace torch_bn_grad::cpu

const char* torch_bn_grad::cpu_kernel_isa() { return cpu::kernel_table().isa; }

namespace torch_bn_grad::cpu {

const ActKernelTable& act_kernel_table() {
  static const ActKernelTable& table = []() -> const ActKernelTable& {
#if defined(__x86_64__) || defined(_M_X64)
    const std::string isa = kernel_table().isa;  // the same copy as the plain kernels'
    if (isa == "AVX512") return act_kernel_table_AVX512();
    if (isa == "AVX2") return act_kernel_table_AVX2();
#endif
    return act_kernel_table_DEFAULT();
  }();
  return table;
}

}  // namespace torch_bn_grad::cpu
