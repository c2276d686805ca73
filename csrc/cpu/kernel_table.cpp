// Picks the kernels compiled for the running CPU, once: the copy
// at::get_cpu_capability() names (ATEN_CPU_CAPABILITY honoured, as by ATen's
// own kernels), the plain, fused and masked operators' alike. Where that copy
// was not compiled (setup.py, TORCH_BN_GRAD_CPU_ISA): the highest compiled one
// below it, else the lowest above it that the CPU runs (with a warning: a
// build for the building CPU alone has no DEFAULT copy), else an error that
// says how to build one.
#include "cpu/kernels/kernel_table.h"
#include "cpu/kernels/act_kernel_table.h"
#include "cpu/kernels/masked_kernel_table.h"

#include <array>
#include <string>

#include <ATen/Version.h>
#include <c10/util/Exception.h>

#include "module_functions.h"

namespace torch_bn_grad::cpu {
namespace {

// The copies, lowest first, named as at::get_cpu_capability() names them.
constexpr std::array<const char*, 3> kIsaNames{"DEFAULT", "AVX2", "AVX512"};

// Which copies setup.py compiled (TORCH_BN_GRAD_CPU_<ISA>).
#if defined(TORCH_BN_GRAD_CPU_DEFAULT)
#define TBG_DEFAULT_COPY(table) &table##_DEFAULT
#else
#define TBG_DEFAULT_COPY(table) nullptr
#endif
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
#define TBG_COMPILED_COPIES(table) {TBG_DEFAULT_COPY(table), TBG_AVX2_COPY(table), TBG_AVX512_COPY(table)}

template <typename Table>
using TableCopy = const Table& (*)();
template <typename Table>
using TableCopies = std::array<TableCopy<Table>, 3>;

// Whether copy `i` was compiled (every table has the same copies).
bool compiled(size_t i) {
  static constexpr TableCopies<KernelTable> copies = TBG_COMPILED_COPIES(kernel_table);
  return copies[i] != nullptr;
}

// Whether the hardware runs copy `i`, whatever ATEN_CPU_CAPABILITY says
// (the instructions each copy is compiled with: cpu_build.py).
bool hardware_runs(size_t i) {
#if defined(__x86_64__) || defined(_M_X64)
  if (i == 1) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (i == 2)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#endif
  return i == 0;
}

// The index of the copy every table uses, decided once.
size_t chosen_copy() {
  static const size_t chosen = [] {
    const std::string capability = at::get_cpu_capability();
    size_t asked = 0;
    for (size_t i = 0; i < kIsaNames.size(); ++i)
      if (capability == kIsaNames[i]) asked = i;
    for (size_t i = asked + 1; i-- > 0;)
      if (compiled(i)) return i;
    for (size_t i = asked + 1; i < kIsaNames.size(); ++i) {
      if (compiled(i) && hardware_runs(i)) {
        TORCH_WARN_ONCE("torch_bn_grad: the CPU kernels were not compiled for ", capability,
                        " (at::get_cpu_capability(), which ATEN_CPU_CAPABILITY sets); running the ",
                        kIsaNames[i], " copy. Build with TORCH_BN_GRAD_CPU_ISA=all for every copy.");
        return i;
      }
    }
    TORCH_CHECK(false, "torch_bn_grad: the CPU kernels were compiled for ", compiled_cpu_kernel_isas(),
                " only, which this CPU does not run (it runs ", capability,
                "); rebuild here, or with TORCH_BN_GRAD_CPU_ISA=all for every CPU");
  }();
  return chosen;
}

template <typename Table>
const Table& for_running_cpu(const TableCopies<Table>& copies) {
  return copies[chosen_copy()]();
}

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
  // The names, comma-separated, lowest first.
  static const std::string names = [] {
    std::string s;
    for (size_t i = 0; i < cpu::kIsaNames.size(); ++i)
      if (cpu::compiled(i)) s += (s.empty() ? "" : ",") + std::string(cpu::kIsaNames[i]);
    return s;
  }();
  return names.c_str();
}
