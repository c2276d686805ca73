// The operator schemas (one TORCH_LIBRARY block for every backend) and the
// Python module that loads them.
#include <Python.h>
#include <torch/library.h>

#include "cpu/kernels/kernel_table.h"

namespace {

// `torch_bn_grad._C.cpu_kernel_isa()`: which compiled copy of the CPU kernels runs.
PyObject* cpu_kernel_isa(PyObject*, PyObject*) {
  return PyUnicode_FromString(torch_bn_grad::cpu::kernel_table().isa);
}

PyMethodDef methods[] = {
    {"cpu_kernel_isa", cpu_kernel_isa, METH_NOARGS,
     "Instruction set of the CPU kernels in use (DEFAULT, AVX2 or AVX512)."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

extern "C" PyObject* PyInit__C() {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  return PyModule_Create(&module);
}

// Masked outputs of batch_norm_backward come back as empty tensors (the Python
// wrapper turns them into None), so every return is a plain Tensor.
TORCH_LIBRARY(torch_bn_grad, m) {
  m.def(
      "batch_norm_forward(Tensor src, Tensor? gamma, Tensor? beta, Tensor? mean, Tensor? variance, "
      "float epsilon, str data_format) -> (Tensor dst, Tensor mean, Tensor variance)");
  m.def(
      "batch_norm_backward(Tensor src, Tensor diff_dst, Tensor mean, Tensor variance, Tensor? gamma, "
      "float epsilon, str data_format, bool training, bool[3] output_mask) "
      "-> (Tensor diff_src, Tensor diff_gamma, Tensor diff_beta)");
}
