// The Python module `_C`: importing it loads the library (its schemas,
// library/schemas.cpp, and kernels register as the shared object loads), and
// its functions are module_functions.h's.
#include <Python.h>
#include <c10/util/Exception.h>

#include <exception>
#include <limits>
#include <string>
#include <vector>

#include "module_functions.h"

namespace {

// Runs f, a module function's body, turning a C++ exception into the Python
// one it stands for (a bad environment setting is a ValueError) instead of
// letting it unwind through the interpreter, which would abort the process.
template <typename F>
PyObject* raising_python_errors(const F& f) {
  try {
    return f();
  } catch (const c10::ValueError& e) {
    PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

// `torch_bn_grad._C.cpu_kernel_isa()`: which compiled copy of the CPU kernels runs.
PyObject* cpu_kernel_isa(PyObject*, PyObject*) {
  return PyUnicode_FromString(torch_bn_grad::cpu_kernel_isa());
}

// `torch_bn_grad._C.compiled_cpu_kernel_isas()`: the compiled copies, comma-separated.
PyObject* compiled_cpu_kernel_isas(PyObject*, PyObject*) {
  return PyUnicode_FromString(torch_bn_grad::compiled_cpu_kernel_isas());
}

// `cpu_channel_runs_min_pass_bytes()`: from which pass size (bytes of its operands) the CPU forward and
// backward run in channel runs, as a dict; None: never.
PyObject* cpu_channel_runs_min_pass_bytes(PyObject*, PyObject*) {
  return raising_python_errors([]() -> PyObject* {
    const auto t = torch_bn_grad::cpu_channel_runs_min_pass_bytes();
    auto value = [](int64_t bytes) -> PyObject* {
      if (bytes == std::numeric_limits<int64_t>::max()) Py_RETURN_NONE;
      return PyLong_FromLongLong(static_cast<long long>(bytes));
    };
    PyObject* forward = value(t.forward_bytes);
    PyObject* backward = value(t.backward_bytes);
    PyObject* dict = Py_BuildValue("{sOsO}", "forward", forward, "backward", backward);
    Py_XDECREF(forward);
    Py_XDECREF(backward);
    return dict;
  });
}

// `output_cache_info()`: the CPU output cache's counters, as a dict.
PyObject* output_cache_info(PyObject*, PyObject*) {
  return raising_python_errors([] {
    const auto s = torch_bn_grad::output_cache_stats();
    return Py_BuildValue("{sLsLsLsLsL}", "limit_bytes", static_cast<long long>(s.limit_bytes), "idle_bytes",
                         static_cast<long long>(s.idle_bytes), "idle_blocks", static_cast<long long>(s.idle_blocks),
                         "hits", static_cast<long long>(s.hits), "misses", static_cast<long long>(s.misses));
  });
}

PyObject* set_output_cache_limit(PyObject*, PyObject* arg) {
  const long long bytes = PyLong_AsLongLong(arg);
  if (bytes == -1 && PyErr_Occurred()) return nullptr;
  if (bytes < 0) {
    PyErr_Format(PyExc_ValueError, "set_output_cache_limit: expected nbytes >= 0, got %lld", bytes);
    return nullptr;
  }
  return raising_python_errors([bytes]() -> PyObject* {
    torch_bn_grad::set_output_cache_limit(bytes);
    Py_RETURN_NONE;
  });
}

PyObject* empty_output_cache(PyObject*, PyObject*) {
  return raising_python_errors([]() -> PyObject* {
    torch_bn_grad::empty_output_cache();
    Py_RETURN_NONE;
  });
}

// `register_python_autograd(op_name, record)`: see module_functions.h.
PyObject* register_python_autograd(PyObject*, PyObject* args) {
  const char* op_name = nullptr;
  PyObject* record = nullptr;
  if (!PyArg_ParseTuple(args, "sO:register_python_autograd", &op_name, &record)) return nullptr;
  if (!PyCallable_Check(record)) {
    PyErr_Format(PyExc_TypeError, "register_python_autograd: expected a callable record, got %s",
                 Py_TYPE(record)->tp_name);
    return nullptr;
  }
  return raising_python_errors([&]() -> PyObject* {
    torch_bn_grad::register_python_autograd(op_name, record);
    Py_RETURN_NONE;
  });
}

// A tuple of str from `names`.
PyObject* str_tuple(const std::vector<std::string>& names) {
  PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(names.size()));
  if (tuple == nullptr) return nullptr;
  for (size_t i = 0; i < names.size(); ++i) {
    PyObject* name = PyUnicode_FromString(names[i].c_str());
    if (name == nullptr) {
      Py_DECREF(tuple);
      return nullptr;
    }
    PyTuple_SET_ITEM(tuple, static_cast<Py_ssize_t>(i), name);
  }
  return tuple;
}

// `cuda_variant_names()` and `cuda_variants_on()`: tuples of names (config/cuda_variants.h).
PyObject* cuda_variant_names(PyObject*, PyObject*) {
  return raising_python_errors([] { return str_tuple(torch_bn_grad::cuda_variant_names()); });
}

PyObject* cuda_variants_on(PyObject*, PyObject*) {
  return raising_python_errors([] { return str_tuple(torch_bn_grad::cuda_variants_on()); });
}

// `set_cuda_variants(names)`: a tuple or list of str, the variants on from now on.
PyObject* set_cuda_variants(PyObject*, PyObject* arg) {
  PyObject* seq = PySequence_Fast(arg, "set_cuda_variants: expected a sequence of str");
  if (seq == nullptr) return nullptr;
  std::vector<std::string> names;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
    const char* name = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(seq, i));
    if (name == nullptr) {
      Py_DECREF(seq);
      return nullptr;
    }
    names.emplace_back(name);
  }
  Py_DECREF(seq);
  return raising_python_errors([&]() -> PyObject* {
    torch_bn_grad::set_cuda_variants(names);
    Py_RETURN_NONE;
  });
}

PyMethodDef methods[] = {
    {"cpu_kernel_isa", cpu_kernel_isa, METH_NOARGS,
     "Instruction set of the CPU kernels in use (DEFAULT, AVX2 or AVX512)."},
    {"compiled_cpu_kernel_isas", compiled_cpu_kernel_isas, METH_NOARGS,
     "Instruction sets the CPU kernels were compiled for, comma-separated."},
    {"cpu_channel_runs_min_pass_bytes", cpu_channel_runs_min_pass_bytes, METH_NOARGS,
     "Smallest forward and backward passes (bytes of their operands) the CPU kernels run in channel runs."},
    {"output_cache_info", output_cache_info, METH_NOARGS, "Counters of the CPU output cache."},
    {"set_output_cache_limit", set_output_cache_limit, METH_O, "Most idle bytes the CPU output cache keeps."},
    {"empty_output_cache", empty_output_cache, METH_NOARGS, "Frees the CPU output cache's idle blocks."},
    {"register_python_autograd", register_python_autograd, METH_VARARGS,
     "Autograd kernel of an operator: below autograd in C++ when nothing is recorded, else a Python callable."},
    {"cuda_variant_names", cuda_variant_names, METH_NOARGS, "Every CUDA variant's name."},
    {"cuda_variants_on", cuda_variants_on, METH_NOARGS, "The CUDA variants on."},
    {"set_cuda_variants", set_cuda_variants, METH_O, "Turns on exactly the named CUDA variants."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

extern "C" PyObject* PyInit__C() {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  return PyModule_Create(&module);
}
