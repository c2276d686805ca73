// Every kernel registered with the dispatcher, one TORCH_LIBRARY_IMPL per
// dispatch key, read off TBG_OPERATORS (library/operators.h): a new operator's
// kernels are registered by its row there.
#include <torch/library.h>

#include "library/operators.h"

namespace torch_bn_grad {

#define TBG_IMPL_CPU(name, schema, returns, cpu_key, ...) TBG_IF_CPU_##cpu_key(m.impl(schema, &cpu::name##_cpu);)
#define TBG_IMPL_CUDA(name, schema, returns, cpu_key, cuda_key, ...) \
  TBG_IF_CUDA_##cuda_key(m.impl(schema, &cuda::name##_cuda);)
#define TBG_IMPL_AUTOGRAD(name, schema, returns, cpu_key, cuda_key, autograd_key, ...) \
  TBG_IF_Autograd_##autograd_key(m.impl(schema, &name##_autograd);)
#define TBG_IMPL_IMPLICIT(name, schema, returns, cpu_key, cuda_key, autograd_key, composite_key) \
  TBG_IF_Implicit_##composite_key(m.impl(schema, &name);)
#define TBG_IMPL_EXPLICIT(name, schema, returns, cpu_key, cuda_key, autograd_key, composite_key) \
  TBG_IF_Explicit_##composite_key(m.impl(schema, &name);)

TORCH_LIBRARY_IMPL(torch_bn_grad, CPU, m) { TBG_OPERATORS(TBG_IMPL_CPU) }

#ifdef TORCH_BN_GRAD_WITH_CUDA
TORCH_LIBRARY_IMPL(torch_bn_grad, CUDA, m) { TBG_OPERATORS(TBG_IMPL_CUDA) }
#endif

TORCH_LIBRARY_IMPL(torch_bn_grad, Autograd, m) { TBG_OPERATORS(TBG_IMPL_AUTOGRAD) }

// Formulas made of other operators, for every backend and for autograd
// (differentiable at:: operators); the gradient of batch_norm_forward, its
// forward-mode tangents.
TORCH_LIBRARY_IMPL(torch_bn_grad, CompositeImplicitAutograd, m) { TBG_OPERATORS(TBG_IMPL_IMPLICIT) }

// Composites below autograd for every backend: the running-statistics update
// and the training forwards followed by it (their Autograd kernels are above).
TORCH_LIBRARY_IMPL(torch_bn_grad, CompositeExplicitAutograd, m) { TBG_OPERATORS(TBG_IMPL_EXPLICIT) }

}  // namespace torch_bn_grad
