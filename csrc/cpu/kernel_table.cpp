// Picks the kernels compiled for the running CPU, once: the copy
// at::get_cpu_capability() names (ATEN_CPU_CAPABILITY honoured, as by ATen's
// own kernels), the plain, fused and masked operators' alike; DEFAULT where
// that copy was not compiled (setup.py, TORCH_BN_GRAD_CPU_ISA).
#include "cpu/kernels/kernel_table.h"
#include "cpu/kernels/act_kernel_table.h"
#include "cpu/kernels/masked_kernel_table.h"

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

// The copies setup.py compiled: DEFAULT always, the others as it names them
// (TORCH_BN_GRAD_CPU_<ISA>).
#if defined(TORCH_BN_GRAD_CPU_AVX2)
#define TBG_AVX2_COPY(table) &table##_AVX2
#else
#define TBG_AVX2_COPY(table) nullptr
#endif
#if defined(TORCH_BN_GRAD_CPU_AVX512)
#define TBG_AVX512_COPY(table) &table##_AVX512
#else
#define TBG_AVX512_COPY(table) nullptr
#endif
#define TBG_COMPILED_COPIES(table) &table##_DEFAULT, TBG_AVX2_COPY(table), TBG_AVX512_COPY(table)

}  // namespace

const KernelTable& kernel_table() {
  static const KernelTable& table = for_running_cpu<KernelTable>(TBG_COMPILED_COPIES(kernel_table));
  return table;
}

const ActKernelTable& act_kernel_table() {
  static const ActKernelTable& table = for_running_cpu<ActKernelTable>(TBG_COMPILED_COPIES(act_kernel_table));
  return table;
}

const MaskedKernelTable& masked_kernel_table() {
  static const MaskedKernelTable& table = for_running_cpu<MaskedKernelTable>(TBG_COMPILED_COPIES(masked_kernel_table));
  return table;
}

}  // namespace torch_bn_grad::cpu

const char* torch_bn_grad::cpu_kernel_isa() { return cpu::kernel_table().isa; }

const char* torch_bn_grad::compiled_cpu_kernel_isas() {
  return "DEFAULT"
#if defined(TORCH_BN_GRAD_CPU_AVX2)
         ",AVX2"
#endif
#if defined(TORCH_BN_GRAD_CPU_AVX512)
         ",AVX512"
#endif
      ;
}
