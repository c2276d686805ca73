// Picks the kernels compiled for the running CPU, once: the copy
// at::get_cpu_capability() names (ATEN_CPU_CAPABILITY honoured, as by ATen's
// own kernels), the plain and the fused operators' alike.
#include "cpu/kernels/kernel_table.h"
#include "cpu/kernels/act_kernel_table.h"

#include <string>

#include <ATen/Version.h>

#include "module_functions.h"

namespace torch_bn_grad::cpu {
namespace {

template <typename Table>
using TableCopy = const Table& (*)();

// The copy of `Table` for the running CPU among the compiled ones (null: not
// compiled for this architecture).
template <typename Table>
const Table& for_running_cpu(TableCopy<Table> default_copy, TableCopy<Table> avx2, TableCopy<Table> avx512) {
  const std::string capability = at::get_cpu_capability();
  if (avx512 != nullptr && capability == "AVX512") return avx512();
  if (avx2 != nullptr && capability == "AVX2") return avx2();
  return default_copy();
}

#if defined(__x86_64__) || defined(_M_X64)
#define TBG_COMPILED_COPIES(table) &table##_DEFAULT, &table##_AVX2, &table##_AVX512
#else
#define TBG_COMPILED_COPIES(table) &table##_DEFAULT, nullptr, nullptr
#endif

}  // namespace

const KernelTable& kernel_table() {
  static const KernelTable& table = for_running_cpu<KernelTable>(TBG_COMPILED_COPIES(kernel_table));
  return table;
}

const ActKernelTable& act_kernel_table() {
  static const ActKernelTable& table = for_running_cpu<ActKernelTable>(TBG_COMPILED_COPIES(act_kernel_table));
  return table;
}

}  // namespace torch_bn_grad::cpu

const char* torch_bn_grad::cpu_kernel_isa() { return cpu::kernel_table().isa; }
