// Naming the per-ISA copies of the kernels' entry points. The kernel
// sources are compiled once per instruction set with CPU_CAPABILITY naming it
// (setup.py), as ATen's are; each copy of an entry point that the generic
// code calls carries the instruction set in its name (kernel_table_AVX2).
#pragma once

// In a per-ISA source: `name`'s copy for this instruction set, and the
// instruction set's name as a string.
#define TBG_ISA_PASTE(name, isa) name##_##isa
#define TBG_ISA_EXPAND(name, isa) TBG_ISA_PASTE(name, isa)
#define TBG_ISA_COPY(name) TBG_ISA_EXPAND(name, CPU_CAPABILITY)
#define TBG_ISA_STR(isa) #isa
#define TBG_ISA_EXPAND_STR(isa) TBG_ISA_STR(isa)
#define TBG_ISA_NAME TBG_ISA_EXPAND_STR(CPU_CAPABILITY)
