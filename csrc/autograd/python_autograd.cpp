// Autograd kernels whose formula is written in Python (the backward operator's
// double backward and jvp, the split stages': torch_bn_grad/_library/autograd_kernel.py),
// behind a check in C++. A call that records nothing (grad mode off or no
// input requiring grad, and no forward-mode tangent) goes below autograd here;
// through a Python kernel it would pay the interpreter and the argument
// conversion on every call, most of a small call's time. A call that records
// runs the Python `record` function with the operator's arguments.
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/library.h>

#include <memory>
#include <string>

#include "autograd/forward_ad.h"
#include "module_functions.h"

namespace torch_bn_grad {
namespace {

namespace py = pybind11;

// Whether autograd has anything to do with these arguments: record a node
// (grad mode on and a tensor requiring grad) or carry a tangent.
bool records(c10::ArrayRef<c10::IValue> args) {
  const bool grad_mode = at::GradMode::is_enabled();
  for (const c10::IValue& a : args) {
    if (!a.isTensor()) continue;
    const at::Tensor& t = a.toTensor();
    if (!t.defined()) continue;
    if ((grad_mode && t.requires_grad()) || has_tangent(t)) return true;
  }
  return false;
}

class PythonAutogradKernel final : public c10::OperatorKernel {
 public:
  // Holds a reference to `record` for the life of the process: the kernel
  // may be destroyed at exit, after the interpreter, where none may drop.
  explicit PythonAutogradKernel(PyObject* record) : record_(record) { Py_INCREF(record_); }

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
    const size_t n = op.schema().arguments().size();
    if (!records(torch::jit::last(*stack, n))) {
      at::AutoDispatchBelowAutograd below_autograd;
      op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
      return;
    }
    py::gil_scoped_acquire gil;
    py::tuple args(n);
    for (size_t i = 0; i < n; ++i) args[i] = torch::jit::toPyObject(std::move((*stack)[stack->size() - n + i]));
    torch::jit::drop(*stack, n);
    const py::object out = py::reinterpret_borrow<py::object>(record_)(*args);
    const auto& returns = op.schema().returns();
    if (returns.size() == 1) {
      torch::jit::push(*stack, torch::jit::toIValue(out, returns[0].type()));
      return;
    }
    const py::tuple outs = out.cast<py::tuple>();
    TORCH_CHECK(outs.size() == returns.size(), op.schema().name(), ": the autograd formula returned ", outs.size(),
                " values, expected ", returns.size());
    for (size_t i = 0; i < returns.size(); ++i) torch::jit::push(*stack, torch::jit::toIValue(outs[i], returns[i].type()));
  }

 private:
  PyObject* record_;
};

}  // namespace

void register_python_autograd(const std::string& op_name, PyObject* record) {
  // Registrations live as long as their Library; this one lives for the
  // process (never destroyed, for the same reason as `record`).
  static auto* const library =
      new torch::Library(torch::Library::IMPL, "torch_bn_grad", c10::DispatchKey::Autograd, __FILE__, __LINE__);
  library->impl(op_name.c_str(),
                torch::CppFunction::makeFromBoxedFunctor(std::make_unique<PythonAutogradKernel>(record)));
}

}  // namespace torch_bn_grad
